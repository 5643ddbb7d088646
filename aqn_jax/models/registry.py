"""The model seam: what faults, SRDD, LoRA, the sampler and the planner need from a model
family, and the registry of families (`FAMILIES`, found by a checkpoint's `model_type` or a
preset's name).

Nothing outside `models/` imports a model file: the library builds a model with
`causal_lm(config)`, an empty KV cache with `init_cache(config, ...)`, reads fault sites with
`site_of(path, module)`, and sizes activations with `family_of(config).saved_layer_bytes`. A
family brings its own names: its presets, its fault-site kinds (`site_types`, `linear_kinds`,
`norm_kinds`, `model_kinds`) and so LoRA's targets. Adding a family is its model file, its HF
key table, and one `FAMILIES.register` (tunix's `models/<name>/{model,params}.py` plus one
registry line is the shape followed).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import flax.linen as nn

from aqn_jax.registry import Registry

from . import hf_mapping, qwen2


class ModelConfig(Protocol):
    """The fields of a family's config the library reads (HF names; frozen dataclass)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool
    param_dtype: str
    dtype: str
    remat: bool
    logprob_chunk: int


@dataclasses.dataclass(frozen=True)
class Family:
    """One decoder family.

    causal_lm: `(config, head='lm' | 'value') -> nn.Module`; called as
      `apply({'params': p}, ids_BT, attention_mask=, positions=, cache=, last_only=)`, returning
      float32 logits `[B, T, V]` (values `[B, T]` for the value head), and `(out, cache)` with a
      cache. Decoder layer i is the module named `layer_name(i)`, called as `(x, *rest)` and
      returning `(x, kv)` (SRDD re-runs it on probed inputs); param paths follow
      `checkpoint_keys`.
      `hidden=True` returns the final norm's output `[B, T, D]` instead of the logits.
    lm_head: `config -> nn.Module`, the head alone at the causal LM's param paths:
      `apply(variables, x_BTD)` -> float32 logits; its head module is the `lm_head` fault site.
    init_cache: `(config, batch_size, max_len) -> cache`, a pytree the model reads and returns.
    layer_name: `i -> str`, the name (top-level path entry) of decoder layer i; its params,
      intermediates and telemetry live under it.
    site_of: `path -> (kind, layer id | None) | None`, the fault-site kind at a module path.
    site_types: kind -> the module type found at that kind (a path match alone is not a site);
      its keys, in order, are the family's kinds. `layer` (the decoder layer) is every family's;
      `lm_head` and `embed_tokens` are read by the log-prob readout and the fault checks.
    linear_kinds: the decoder linears (group `linear`): LoRA's targets, the packed 4-bit base.
    norm_kinds: every norm weight, per layer and final (group `rmsnorm`): AQN's weight noise and
      LoRA's train_norms.
    model_kinds: the kinds without a layer id; `explicit_only` of them match only when named.
    presets: preset name -> `(**fields) -> config`, the random-init architectures.
    norm_with_weight: `(norm module, x, weight) -> y`, the norm's computation with another
      weight (AQN's weight noise).
    linear_operands / linear_product: the linear contract, the one statement of what a linear
      (a module of `linear_kinds`) computes, shared by the model and every fault that redoes or
      probes a linear (`faults/ops.noisy_linear`, `faults/bitfaults`: `BitsLinear`, `Abft`,
      `AbftBackward`); found for a module by `linear_of`. The family's Linear `__call__(x)` is
      exactly `linear_product(*linear_operands(module, x))`.
      `linear_operands(module, x) -> (x, kernel, bias | None, lora | None)`: the operands as
      the matmul unit reads them, from the module's own variables, x, kernel and bias in the
      compute dtype; kernel `[in, out]` is the matrix multiplied, so anything the family does
      to its stored weight (a scale, a transpose, a dequantisation) happens here,
      differentiably: gradients reach the params by autodiff through it; lora is the adapter
      (A `[in, r]`, B `[r, out]`, scale) of the `lora` collection or None.
      `linear_product(x, kernel, bias, lora) -> y` in x's dtype, pure and jit-friendly: it must
      be `x kernel (+ bias) (+ scale (x A) B)` up to its rounding (the dtypes, the accumulation
      and the order are the family's), since the faults' own backward products (noisy dX, dW,
      dA, dB; bit faults on dX, dW) and ABFT's checksums take that form. The faults call it
      with other operands (a corrupted kernel, a probed input) or inside a custom VJP.
      None (both): the family's linears take no op-level fault (`linear_of` refuses them).
    saved_layer_bytes / forward_layer_bytes: the activation model of one decoder layer per
      token, read by the memory planner.
    checkpoint_keys: `config -> {hf key: (flax path, transpose)}`, the HF key table.
    config_from_hf / config_to_hf: config.json <-> the family's config (`hf.py` reads and writes
      the safetensors around them).
    """

    model_types: tuple[str, ...]
    causal_lm: Callable[..., nn.Module]
    lm_head: Callable[[Any], nn.Module]
    init_cache: Callable[[Any, int, int], Any]
    layer_name: Callable[[int], str]
    site_of: Callable[[tuple[str, ...]], tuple[str, int | None] | None]
    site_types: Mapping[str, type]
    norm_with_weight: Callable[[nn.Module, Any, Any], Any]
    saved_layer_bytes: Callable[[Any, int, int], int]
    forward_layer_bytes: Callable[[Any, int, int, int], int]
    checkpoint_keys: Callable[[Any], dict]
    config_from_hf: Callable[[Mapping[str, Any], str], tuple[Any, list]]
    config_to_hf: Callable[[Any], dict]
    linear_kinds: tuple[str, ...]
    norm_kinds: tuple[str, ...]
    model_kinds: tuple[str, ...]
    explicit_only: tuple[str, ...]
    presets: Mapping[str, Callable[..., Any]]
    linear_operands: Callable[[nn.Module, Any], tuple] | None = None
    linear_product: Callable[..., Any] | None = None

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.site_types)

    @property
    def groups(self) -> dict[str, tuple[str, ...]]:
        """Group name (the config's vocabulary) -> this family's kinds."""
        return {"linear": self.linear_kinds, "rmsnorm": self.norm_kinds}


FAMILIES: Registry[Family] = Registry("model_type")
# Llama and Mistral checkpoints are Qwen2's decoder without q/k/v biases (`attention_bias`).
FAMILIES.register(
    "qwen2",
    Family(
        model_types=qwen2.MODEL_TYPES,
        causal_lm=qwen2.Qwen2ForCausalLM,
        lm_head=qwen2.Qwen2Head,
        init_cache=qwen2.init_cache,
        layer_name="layers_{}".format,
        site_of=qwen2.site_of,
        site_types=qwen2.SITE_TYPES,
        norm_with_weight=qwen2.norm_with_weight,
        saved_layer_bytes=qwen2.saved_layer_bytes,
        forward_layer_bytes=qwen2.forward_layer_bytes,
        checkpoint_keys=hf_mapping.checkpoint_keys,
        config_from_hf=hf_mapping.config_from_hf,
        config_to_hf=hf_mapping.config_to_hf,
        linear_kinds=qwen2.LINEAR_KINDS,
        norm_kinds=qwen2.NORM_KINDS,
        model_kinds=qwen2.MODEL_KINDS,
        explicit_only=qwen2.EXPLICIT_ONLY,
        presets={p: functools.partial(qwen2.Qwen2Config.preset, p) for p in qwen2.PRESETS},
        linear_operands=qwen2.linear_operands,
        linear_product=qwen2.linear_product,
    ),
)


def _families() -> list[Family]:
    return [family for _, family in FAMILIES.items()]


def _union(names) -> tuple[str, ...]:
    """The names of every family in registration order, each once."""
    return tuple(dict.fromkeys(n for family_names in names for n in family_names))


def kinds() -> tuple[str, ...]:
    """Every registered family's fault-site kinds (the names a site selector accepts)."""
    return _union(f.kinds for f in _families())


def linear_kinds() -> tuple[str, ...]:
    return _union(f.linear_kinds for f in _families())


def norm_kinds() -> tuple[str, ...]:
    return _union(f.norm_kinds for f in _families())


def model_kinds() -> tuple[str, ...]:
    return _union(f.model_kinds for f in _families())


def explicit_only() -> tuple[str, ...]:
    return _union(f.explicit_only for f in _families())


def groups() -> dict[str, tuple[str, ...]]:
    """Group name -> the kinds of every family in that group."""
    names = _union(f.groups for f in _families())
    return {g: _union(f.groups.get(g, ()) for f in _families()) for g in names}


def presets() -> dict[str, Callable[..., Any]]:
    """Preset name -> its config maker, over every family (the first family's name wins)."""
    out: dict[str, Callable[..., Any]] = {}
    for family in _families():
        for name, make in family.presets.items():
            out.setdefault(name, make)
    return out


def model_types() -> list[str]:
    """Every registered `model_type`, sorted."""
    return sorted(t for f in _families() for t in f.model_types)


def family_of_type(model_type: str | None) -> Family | None:
    """The family that ports `model_type`, or None."""
    for family in _families():
        if model_type in family.model_types:
            return family
    return None


def family_of(config: ModelConfig) -> Family:
    """The family of a model config, by its `model_type`."""
    family = family_of_type(config.model_type)
    if family is None:
        raise ValueError(f"model_type={config.model_type!r}; allowed: {model_types()}")
    return family


def causal_lm(config: ModelConfig, head: str = "lm") -> nn.Module:
    """The model of `config` (head 'lm': logits; 'value': the PPO critic)."""
    return family_of(config).causal_lm(config, head=head)


def lm_head(config: ModelConfig) -> nn.Module:
    """The LM head of `config`'s model alone (the log-prob readout's, `aqn_jax/logprobs.py`)."""
    return family_of(config).lm_head(config)


def init_cache(config: ModelConfig, batch_size: int, max_len: int) -> Any:
    """An empty KV cache of `max_len` slots for `batch_size` rows."""
    return family_of(config).init_cache(config, batch_size, max_len)


def layer_name(config: ModelConfig, i: int) -> str:
    """The name of decoder layer `i` of `config`'s model (its top-level path entry)."""
    return family_of(config).layer_name(i)


def is_causal_lm(module: nn.Module) -> bool:
    """Whether `module` is a registered family's whole model (a call's root)."""
    return any(isinstance(module, f.causal_lm) for f in _families())


def site_of(path: tuple[str, ...], module: nn.Module) -> tuple[str, int | None] | None:
    """(kind, layer id) of a module call, checked against the module's type; None when the
    module is no fault site of any family."""
    for family in _families():
        site = family.site_of(path)
        if site is not None and isinstance(module, family.site_types[site[0]]):
            return site
    return None


def sites_of_param(path: tuple[str, ...]) -> list[tuple[str, int | None]]:
    """The sites (kind, layer id) that hold the parameter at `path` (a param tree path, its last
    entry the param's name), innermost first: `layers_3/mlp/down_proj/kernel` is held by
    down_proj, mlp and layer of layer 3. Faults on trees (weights, gradients, optimizer
    moments) select their leaves by these."""
    out = []
    for family in _families():
        for end in range(len(path) - 1, 0, -1):
            site = family.site_of(tuple(path[:end]))
            if site is not None and site not in out:
                out.append(site)
    return out


def norm_with_weight(module: nn.Module, x: Any, weight: Any) -> Any:
    """The norm `module`'s computation on `x` with `weight` instead of its own."""
    for family in _families():
        if isinstance(module, tuple(family.site_types[k] for k in family.norm_kinds)):
            return family.norm_with_weight(module, x, weight)
    raise TypeError(f"{type(module).__name__} is no registered family's norm module")


def linear_of(module: nn.Module) -> tuple[Callable, Callable]:
    """(linear_operands, linear_product) of the family whose linear type `module` is (by exact
    type first, then by isinstance): the computation a fault redoing or probing this linear
    calls, `product(*operands(module, x))` being the module's own output."""
    families = _families()
    for exact in (True, False):
        for family in families:
            types = tuple(family.site_types[k] for k in family.linear_kinds)
            if (type(module) in types) if exact else isinstance(module, types):
                if family.linear_operands is None or family.linear_product is None:
                    continue
                return family.linear_operands, family.linear_product
    raise TypeError(
        f"{type(module).__name__} is no registered family's linear with a linear contract"
        " (`Family.linear_operands` / `linear_product`): op-level linear faults cannot redo it"
    )


def linear_product(module: nn.Module | None = None) -> Callable:
    """The linear product of `module`'s family (`linear_of`); None: the first registered
    family's (Qwen2's), the product `ops.noisy_linear` computes on bare arrays."""
    if module is not None:
        return linear_of(module)[1]
    for family in _families():
        if family.linear_product is not None:
            return family.linear_product
    raise TypeError("no registered family gives a linear_product")
