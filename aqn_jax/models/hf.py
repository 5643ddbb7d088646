"""Hugging Face Qwen2 and Llama-family checkpoints <-> (Qwen2Config, Flax params), strictly.

A Llama (or Mistral without sliding window) decoder is the Qwen2 decoder without q/k/v biases:
`Qwen2Config(model_type='llama', attention_bias=False)`. Every field the port cannot honour is
named (rope_scaling, mlp_bias, attention_bias true on llama, pretraining_tp != 1, a mistral
sliding_window), and the saver writes back the family it read.

`load_hf_checkpoint` reads a local snapshot directory: `config.json` (every field is either
used, listed as harmless and ignored, or rejected with a ValueError naming it) and single or
sharded safetensors (bf16/f16/f32 storage). Every expected key must be present with its exact
shape; missing and unexpected keys raise, naming them. `save_hf_checkpoint` writes a directory
that `transformers.AutoModelForCausalLM.from_pretrained` loads. The key table lives in
`hf_mapping.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
from absl import logging
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from .hf_mapping import DERIVED_KEY_SUFFIXES, checkpoint_keys
from .qwen2 import Qwen2Config, Qwen2ForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

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
_STORAGE_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


# model_type -> (the HF architecture, whether q/k/v carry a bias).
FAMILIES = {
    "qwen2": ("Qwen2ForCausalLM", True),
    "llama": ("LlamaForCausalLM", False),
    "mistral": ("MistralForCausalLM", False),
}


def _family_checks(model_type: str) -> dict[str, tuple[Any, str]]:
    """_CHECKED_FIELDS plus the fields whose allowed state depends on the family."""
    checks = dict(_CHECKED_FIELDS)
    if model_type == "qwen2":
        checks["attention_bias"] = (bool, "true (Qwen2 q/k/v projections carry a bias)")
    else:
        checks["attention_bias"] = (
            lambda v: not v,
            f"false (a {model_type} decoder is ported as Qwen2's without q/k/v biases; an"
            " o_proj bias is not ported)",
        )
    if model_type == "mistral":
        checks["sliding_window"] = (lambda v: False, "null (sliding-window attention)")
    return checks


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> tuple[Qwen2Config, list]:
    """Qwen2Config from an HF config dict; returns (config, names of ignored fields)."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"{source}: model_type={model_type!r}; allowed: {sorted(FAMILIES)} (llama and"
            " mistral as the Qwen2 decoder without q/k/v biases)"
        )
    arch, bias = FAMILIES[model_type]
    archs = hf.get("architectures") or [arch]
    if arch not in archs:
        raise ValueError(f"{source}: architectures={archs}; expected {arch!r} for {model_type}")
    checks = _family_checks(model_type)
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
    if storage not in _NP_DTYPES:
        raise ValueError(f"{source}: dtype={storage!r}; allowed: {sorted(_NP_DTYPES)}")
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
        attention_bias=bias,
    )
    return config, ignored


def _first(token_id):
    # HF allows a list of eos ids (generation); the model config needs one.
    if isinstance(token_id, list | tuple):
        return token_id[0] if token_id else None
    return token_id


def config_to_hf(config: Qwen2Config) -> dict[str, Any]:
    """config.json content that transformers 4.4x and 5.x both load as this architecture."""
    hf = {
        "architectures": [FAMILIES[config.model_type][0]],
        "model_type": config.model_type,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "torch_dtype": config.param_dtype,
        "use_cache": True,
    }
    if config.model_type == "qwen2":
        hf["use_sliding_window"] = False
    else:
        hf.update(attention_bias=False, mlp_bias=False)
    if config.model_type == "llama":
        hf["pretraining_tp"] = 1
    if config.model_type == "mistral":
        hf["sliding_window"] = None
    hf.update({f: getattr(config, f) for f in _USED_FIELDS if f != "head_dim"})
    if config.head_dim is not None:
        hf["head_dim"] = config.head_dim
    return hf


def abstract_params(config: Qwen2Config) -> dict:
    """Param tree of ShapeDtypeStructs (no memory), from `jax.eval_shape` of init."""
    model = Qwen2ForCausalLM(config)
    ids = jax.ShapeDtypeStruct((1, 1), np.int32)
    shapes = jax.eval_shape(lambda ids: model.init(jax.random.key(0), ids), ids)
    return nn.unbox(shapes)["params"]


def _weight_files(path: str) -> dict[str, str]:
    """HF key -> safetensors file, for a single-file or an index-sharded checkpoint."""
    single = os.path.join(path, SINGLE_FILE)
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(single):
        with _NamedSafetensors(single) as f:
            return dict.fromkeys(f.keys(), single)
    if os.path.isfile(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e!r})") from e
        files = {k: os.path.join(path, v) for k, v in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{index} names {os.path.basename(file)}, which is missing")
        return files
    raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


class _NamedSafetensors:
    """safe_open whose errors (a truncated or garbage file) name the file."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        try:
            self._cm = safe_open(self.path, "numpy")
            self._f = self._cm.__enter__()
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{self.path}: not a readable safetensors file ({e})") from e
        return self

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_slice(self, key):
        return self._f.get_slice(key)

    def get_tensor(self, key):
        try:
            return self._f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{self.path}: tensor {key} is unreadable ({e})") from e


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def load_hf_checkpoint(path: str, dtype: str | None = None) -> tuple[Qwen2Config, dict]:
    """Read a local HF Qwen2 / Llama snapshot into (Qwen2Config, params), params as numpy arrays.

    dtype: None keeps the checkpoint's storage dtype (config.json `torch_dtype`/`dtype`) as
    both param and compute dtype; 'float32' / 'bfloat16' / 'float16' casts on load.
    Host numpy arrays (not device arrays) so that callers can place them with their own
    shardings without a second copy on the default device.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"HF checkpoint directory {path!r} does not exist")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path!r} has no config.json")
    with open(config_path) as f:
        try:
            hf_config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path}: invalid JSON ({e})") from e
    config, ignored = config_from_hf(hf_config, source=config_path)
    if dtype is not None:
        if dtype not in _NP_DTYPES:
            raise ValueError(f"dtype={dtype!r}; allowed: {sorted(_NP_DTYPES)} or None")
        config = dataclasses.replace(config, param_dtype=dtype, dtype=dtype)
    logging.info("%s: ignored harmless config fields %s", config_path, sorted(ignored))

    expected = checkpoint_keys(config)
    files = _weight_files(path)
    derived = [k for k in files if k.endswith(DERIVED_KEY_SUFFIXES)]
    tied_head = config.tie_word_embeddings and "lm_head.weight" in files
    unexpected = sorted(
        set(files) - set(expected) - set(derived) - ({"lm_head.weight"} if tied_head else set())
    )
    missing = sorted(set(expected) - set(files))
    if missing or unexpected:
        raise ValueError(
            f"{path}: checkpoint keys do not match the config ({config.num_hidden_layers} layers,"
            f" tie_word_embeddings={config.tie_word_embeddings}): missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''} ({len(missing)}), unexpected"
            f" {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
        )

    shapes = abstract_params(config)
    target = _NP_DTYPES[config.param_dtype]
    params: dict = {}
    by_file: dict[str, list[str]] = {}
    for key in sorted(expected):
        by_file.setdefault(files[key], []).append(key)
    if tied_head:
        by_file.setdefault(files["lm_head.weight"], []).append("lm_head.weight")
    tied_copy = None
    for file, keys in by_file.items():
        with _NamedSafetensors(file) as f:
            for key in keys:
                storage = f.get_slice(key).get_dtype()
                if storage not in _STORAGE_DTYPES:
                    raise ValueError(
                        f"{file}: tensor {key} has dtype {storage}; allowed:"
                        f" {sorted(_STORAGE_DTYPES)} (quantised checkpoints are not supported)"
                    )
                value = f.get_tensor(key)
                if key == "lm_head.weight" and tied_head:
                    tied_copy = value
                    continue
                flax_path, transpose = expected[key]
                if transpose:
                    value = value.T
                want = _lookup(shapes, flax_path).shape
                if value.shape != want:
                    shown = value.T.shape if transpose else value.shape
                    want_hf = tuple(reversed(want)) if transpose else want
                    raise ValueError(
                        f"{file}: tensor {key} has shape {shown}; the config implies {want_hf}"
                    )
                _set(params, flax_path, np.ascontiguousarray(value.astype(target, copy=False)))
    if tied_copy is not None:
        embedding = params["embed_tokens"]["embedding"]
        if tied_copy.shape != embedding.shape or not np.array_equal(
            tied_copy.astype(target), embedding
        ):
            raise ValueError(
                f"{path}: tie_word_embeddings is true but lm_head.weight differs from"
                " model.embed_tokens.weight"
            )
    return config, params


def _lookup(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def save_hf_checkpoint(
    path: str, config: Qwen2Config, params: Mapping, max_shard_bytes: int = 4 * 2**30
) -> None:
    """Write config.json + safetensors (sharded with an index above max_shard_bytes).

    Tensors keep the params' dtype; config.json's torch_dtype says config.param_dtype.
    """
    params = nn.unbox(params)
    if "params" in params and "embed_tokens" not in params:
        params = params["params"]
    shapes = abstract_params(config)
    tensors: dict[str, np.ndarray] = {}
    for key, (flax_path, transpose) in checkpoint_keys(config).items():
        try:
            value = np.asarray(jax.device_get(_lookup(params, flax_path)))
        except KeyError as e:
            raise ValueError(f"params lack {'/'.join(flax_path)} (HF key {key})") from e
        want = _lookup(shapes, flax_path).shape
        if value.shape != want:
            raise ValueError(
                f"params {'/'.join(flax_path)} has shape {value.shape}; expected {want}"
            )
        tensors[key] = np.ascontiguousarray(value.T if transpose else value)

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(config), f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    metadata = {"format": "pt"}  # transformers refuses safetensors without a format tag
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SINGLE_FILE), metadata=metadata)
        return
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.nbytes for t in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
