"""Qwen2's Hugging Face adapter: the table between HF checkpoint keys and our Flax param paths
(Llama: the same table without the q/k/v bias rows), and the translation of config.json to and
from `Qwen2Config` (every field the port cannot honour is refused, naming it).

One row per tensor kind: `(hf_key, flax_path, transpose)`, with `{i}` standing for the layer
index. `transpose` is True for linear weights, which HF stores as `[out, in]` (torch
`nn.Linear.weight`) and we store as `kernel [in, out]`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from aqn_jax.registry import Registry

from .precision import DTYPES as _DTYPES
from .qwen2 import Qwen2Config

# Per-model tensors.
GLOBAL_ROWS: tuple[tuple[str, str, bool], ...] = (
    ("model.embed_tokens.weight", "embed_tokens/embedding", False),
    ("model.norm.weight", "norm/weight", False),
)
# Only when tie_word_embeddings is false.
UNTIED_ROWS: tuple[tuple[str, str, bool], ...] = (("lm_head.weight", "lm_head/kernel", True),)
# Per decoder layer.
LAYER_ROWS: tuple[tuple[str, str, bool], ...] = (
    ("model.layers.{i}.input_layernorm.weight", "layers_{i}/input_layernorm/weight", False),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers_{i}/self_attn/q_proj/kernel", True),
    ("model.layers.{i}.self_attn.q_proj.bias", "layers_{i}/self_attn/q_proj/bias", False),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers_{i}/self_attn/k_proj/kernel", True),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers_{i}/self_attn/k_proj/bias", False),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers_{i}/self_attn/v_proj/kernel", True),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers_{i}/self_attn/v_proj/bias", False),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers_{i}/self_attn/o_proj/kernel", True),
    (
        "model.layers.{i}.post_attention_layernorm.weight",
        "layers_{i}/post_attention_layernorm/weight",
        False,
    ),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers_{i}/mlp/gate_proj/kernel", True),
    ("model.layers.{i}.mlp.up_proj.weight", "layers_{i}/mlp/up_proj/kernel", True),
    ("model.layers.{i}.mlp.down_proj.weight", "layers_{i}/mlp/down_proj/kernel", True),
)
# Keys some older checkpoints carry that hold derived buffers, not parameters; dropped.
DERIVED_KEY_SUFFIXES: tuple[str, ...] = (".rotary_emb.inv_freq",)


def checkpoint_keys(config: Qwen2Config) -> dict[str, tuple[tuple[str, ...], bool]]:
    """Every HF key this config's checkpoint must hold -> (flax path as a tuple, transpose)."""
    rows = list(GLOBAL_ROWS)
    if not config.tie_word_embeddings:
        rows += UNTIED_ROWS
    table = {hf: (tuple(path.split("/")), t) for hf, path, t in rows}
    layer_rows = [r for r in LAYER_ROWS if config.attention_bias or not r[0].endswith(".bias")]
    for i in range(config.num_hidden_layers):
        for hf, path, t in layer_rows:
            table[hf.format(i=i)] = (tuple(path.format(i=i).split("/")), t)
    return table


# config.json fields that map onto Qwen2Config.
_USED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "tie_word_embeddings",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
# Fields that do not change what the model computes (bookkeeping, init, generation defaults,
# or switches checked below to be in their supported state).
_HARMLESS_FIELDS = frozenset(
    {
        "architectures",
        "model_type",
        "initializer_range",
        "use_cache",
        "transformers_version",
        "max_window_layers",  # only used when use_sliding_window is true
        "sliding_window",  # likewise
        "torch_dtype",
        "dtype",
        "_name_or_path",
        "_model_name_or_path",  # what a GGUF load writes
        "unk_token_id",  # tokenizer bookkeeping
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "torchscript",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "tokenizer_class",
        "pruned_heads",
        "tie_encoder_decoder",
        "use_return_dict",
    }
)
# Fields accepted only in one state: (field, predicate, what is allowed).
_CHECKED_FIELDS: dict[str, tuple[Any, str]] = {
    "hidden_act": (lambda v: v == "silu", "'silu'"),
    "use_sliding_window": (lambda v: not v, "false (sliding-window attention is not ported)"),
    "rope_scaling": (lambda v: False, "null (only the default RoPE is ported)"),
    "attention_dropout": (lambda v: float(v) == 0.0, "0.0"),
    "mlp_bias": (lambda v: not v, "false (the MLP projections carry no bias)"),
    "pretraining_tp": (lambda v: int(v) == 1, "1 (tensor-parallel slicing of pretraining)"),
    "use_mrope": (lambda v: not v, "false (multimodal RoPE is not ported)"),
    "layer_types": (
        lambda v: all(t == "full_attention" for t in v),
        "only 'full_attention' entries",
    ),
    "rope_theta": (lambda v: float(v) > 0, "a positive float"),
    "rope_parameters": (
        lambda v: (
            isinstance(v, Mapping)
            and v.get("rope_type", "default") == "default"
            and float(v.get("partial_rotary_factor", 1.0)) == 1.0
            and set(v) <= {"rope_type", "rope_theta", "partial_rotary_factor"}
        ),
        "{'rope_type': 'default', 'rope_theta': ...} (only the default RoPE is ported)",
    ),
}


@dataclasses.dataclass(frozen=True)
class HfFamily:
    """A `model_type` this adapter ports as Qwen2's decoder: its HF architecture, whether its
    q/k/v projections carry a bias, the config.json fields whose allowed state is the family's
    (`checks`: field -> (predicate, what is allowed), on top of _CHECKED_FIELDS) and the ones
    `config_to_hf` writes for it (`writes`, in order)."""

    architecture: str
    attention_bias: bool
    checks: Mapping[str, tuple[Any, str]]
    writes: Mapping[str, Any]


# A new model_type is one `HF_FAMILIES.register` here (and the model's MODEL_TYPES).
HF_FAMILIES: Registry[HfFamily] = Registry("model_type")


def _no_qkv_bias(model_type: str) -> tuple[Any, str]:
    return (
        lambda v: not v,
        f"false (a {model_type} decoder is ported as Qwen2's without q/k/v biases; an o_proj"
        " bias is not ported)",
    )


HF_FAMILIES.register(
    "qwen2",
    HfFamily(
        "Qwen2ForCausalLM",
        True,
        {"attention_bias": (bool, "true (Qwen2 q/k/v projections carry a bias)")},
        {"use_sliding_window": False},
    ),
)
# Llama and Mistral: Qwen2's decoder without q/k/v biases.
HF_FAMILIES.register(
    "llama",
    HfFamily(
        "LlamaForCausalLM",
        False,
        {"attention_bias": _no_qkv_bias("llama")},
        {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
    ),
)
HF_FAMILIES.register(
    "mistral",
    HfFamily(
        "MistralForCausalLM",
        False,
        {
            "attention_bias": _no_qkv_bias("mistral"),
            "sliding_window": (lambda v: False, "null (sliding-window attention)"),
        },
        {"attention_bias": False, "mlp_bias": False, "sliding_window": None},
    ),
)


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> tuple[Qwen2Config, list]:
    """Qwen2Config from an HF config dict of model_type qwen2, llama or mistral; returns
    (config, names of ignored fields)."""
    model_type = hf.get("model_type")
    family = HF_FAMILIES.get(model_type, f"{source}: model_type")
    arch = family.architecture
    archs = hf.get("architectures") or [arch]
    if arch not in archs:
        raise ValueError(f"{source}: architectures={archs}; expected {arch!r} for {model_type}")
    checks = {**_CHECKED_FIELDS, **family.checks}
    ignored = []
    for name, value in hf.items():
        if name in checks:
            ok, allowed = checks[name]
            if value is None:  # null: the field's default, which is the supported state
                continue
            try:
                passed = ok(value)
            except (TypeError, ValueError):
                passed = False
            if not passed:
                raise ValueError(
                    f"{source}: {name}={value!r} is not supported by the aqn_jax port of"
                    f" {model_type}; allowed: {allowed}"
                )
        elif name in _HARMLESS_FIELDS:
            ignored.append(name)
        elif name not in _USED_FIELDS:
            raise ValueError(
                f"{source}: unknown field {name}={value!r}; the aqn_jax {model_type} port"
                f" understands {sorted(_USED_FIELDS + tuple(checks))} and ignores"
                f" {sorted(_HARMLESS_FIELDS)}"
            )
    missing = [f for f in _USED_FIELDS[:6] if f not in hf]
    if missing:
        raise ValueError(f"{source}: required fields missing: {missing}")
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    storage = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if storage not in _DTYPES:
        raise ValueError(f"{source}: dtype={storage!r}; allowed: {sorted(_DTYPES)}")
    kw = {f: hf[f] for f in _USED_FIELDS if f in hf}
    kw["eos_token_id"] = _first(kw.get("eos_token_id"))
    kw["bos_token_id"] = _first(kw.get("bos_token_id"))
    kw["pad_token_id"] = _first(kw.get("pad_token_id"))
    config = Qwen2Config(
        **kw,
        rope_theta=float(theta),
        param_dtype=storage,
        dtype=storage,
        model_type=model_type,
        attention_bias=family.attention_bias,
    )
    return config, ignored


def _first(token_id):
    # HF allows a list of eos ids (generation); the model config needs one.
    if isinstance(token_id, list | tuple):
        return token_id[0] if token_id else None
    return token_id


def config_to_hf(config: Qwen2Config) -> dict[str, Any]:
    """config.json content that transformers 4.4x and 5.x both load as this architecture."""
    family = HF_FAMILIES.get(config.model_type)
    hf = {
        "architectures": [family.architecture],
        "model_type": config.model_type,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "torch_dtype": config.param_dtype,
        "use_cache": True,
    }
    hf.update(family.writes)
    hf.update({f: getattr(config, f) for f in _USED_FIELDS if f != "head_dim"})
    if config.head_dim is not None:
        hf["head_dim"] = config.head_dim
    return hf
