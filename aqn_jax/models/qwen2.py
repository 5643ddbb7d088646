"""Qwen2 / Qwen2.5 decoder-only transformer in Flax Linen.

Computes what `transformers`' `Qwen2ForCausalLM` computes (the parity reference, see
tests/test_qwen2_parity.py). Modules only: no loss, optimizer, loop or fault logic live here.
Faults and AQN reach the model from outside through `nn.intercept_methods`; for that every
submodule is named after the HF checkpoint and the decoder layers are an unrolled loop, so a
module path such as `layers_15/mlp/down_proj` carries the layer index.

Axis letters used in names and einsums:
  B batch, T query positions, S key positions (cache slots), N query heads, K kv heads,
  G query heads per kv head (N // K), H head dim, D model dim, F mlp dim, V vocab.

Call contract:
  logits_BTV = model.apply({'params': p}, input_ids_BT, attention_mask=mask_BT)
  logits_BTV, cache = model.apply({'params': p}, ids_BT, attention_mask=mask_BT, cache=cache)
Logits are always float32.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from flax import errors as flax_errors

from aqn_jax.models.precision import DTYPES as _DTYPES
from aqn_jax.models.precision import dot_precision


def _dtype(name: str) -> Any:
    return _DTYPES[name]


MODEL_TYPES = ("qwen2", "llama", "mistral")


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """Architecture plus numerics of a Qwen2 model (field names follow HF's `Qwen2Config`).

    Presets: `Qwen2Config.preset(name)` with name in `PRESETS`, or the classmethods
    (`qwen2p5_1p5b()`, ...). Variants by `dataclasses.replace(cfg, dtype='bfloat16')`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads (HF's default)
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # The family: qwen2 (q/k/v projections with bias) | llama / mistral (the same decoder
    # without them). `model_type` is what the HF saver writes back.
    model_type: str = "qwen2"
    attention_bias: bool = True
    # Numerics: storage dtype of params and dtype of activations/matmuls. Softmax, RMSNorm
    # statistics, RoPE angles and logits are always computed in float32.
    param_dtype: str = "float32"
    dtype: str = "float32"
    # Rematerialise each decoder layer in the backward pass (saves activation memory).
    remat: bool = False
    # Positions per chunk of the log-prob readout (`aqn_jax/logprobs.py`): the head's float32
    # logits exist for rows x this many positions at a time, never for the whole sequence.
    logprob_chunk: int = 32

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"Qwen2Config.model_type={self.model_type!r}; allowed: {MODEL_TYPES}")
        if self.attention_bias != (self.model_type == "qwen2"):
            raise ValueError(
                f"Qwen2Config.attention_bias={self.attention_bias} with"
                f" model_type={self.model_type!r}; qwen2 has q/k/v biases, llama and mistral none"
            )
        for name in ("param_dtype", "dtype"):
            value = getattr(self, name)
            if value not in _DTYPES:
                raise ValueError(f"Qwen2Config.{name}={value!r}; allowed: {sorted(_DTYPES)}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "logprob_chunk",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Qwen2Config.{name}={value!r}; must be a positive int")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Qwen2Config.num_attention_heads={self.num_attention_heads} must be a multiple"
                f" of num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"Qwen2Config.hidden_size={self.hidden_size} is not divisible by"
                f" num_attention_heads={self.num_attention_heads}; set head_dim explicitly"
            )
        if self.resolved_head_dim % 2:
            raise ValueError(f"Qwen2Config.head_dim={self.resolved_head_dim} must be even (RoPE)")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    # --- presets -----------------------------------------------------------------------------
    @classmethod
    def qwen2p5_0p5b(cls, **kw) -> Qwen2Config:
        return cls.preset("qwen2p5_0p5b", **kw)

    @classmethod
    def qwen2p5_1p5b(cls, **kw) -> Qwen2Config:
        return cls.preset("qwen2p5_1p5b", **kw)

    @classmethod
    def qwen2p5_3b(cls, **kw) -> Qwen2Config:
        return cls.preset("qwen2p5_3b", **kw)

    @classmethod
    def qwen2p5_7b(cls, **kw) -> Qwen2Config:
        return cls.preset("qwen2p5_7b", **kw)

    @classmethod
    def tiny(cls, **kw) -> Qwen2Config:
        return cls.preset("tiny", **kw)

    @classmethod
    def preset(cls, name: str, **kw) -> Qwen2Config:
        if name not in _PRESETS:
            raise ValueError(f"model preset {name!r} is unknown; allowed: {sorted(_PRESETS)}")
        return cls(**{**_PRESETS[name], **kw})


_QWEN25_COMMON = dict(rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)
# Architectures of the public Qwen2.5 checkpoints (HF config.json of each).
_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2p5_0p5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        **_QWEN25_COMMON,
    ),
    "qwen2p5_1p5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        **_QWEN25_COMMON,
    ),
    "qwen2p5_3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        **_QWEN25_COMMON,
    ),
    "qwen2p5_7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        **_QWEN25_COMMON,
    ),
    # The embedded default: ~1.6M parameters, fast on a laptop CPU; vocab 256 holds the
    # character tokenizer of the synthetic arithmetic task. 8 layers so that a per-layer
    # diagnosis has interior layers to localise.
    "tiny": dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1e4,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    ),
}
PRESETS: tuple[str, ...] = tuple(_PRESETS)


# --- KV cache ---------------------------------------------------------------------------------
@flax.struct.dataclass
class KVCache:
    """Preallocated keys/values of every layer plus which slots hold real tokens.

    k, v: one `[B, K, S, H]` array per layer (heads first: the layout attention contracts).
    mask: `[B, S]` int32, 1 where a slot holds a non-padding token.
    end: int32 scalar, the number of slots written so far (the next write starts there; all
    sequences in the batch advance together, padding is masked, not skipped).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    mask: jax.Array
    end: jax.Array

    @property
    def max_len(self) -> int:
        return self.mask.shape[1]


def init_cache(config: Qwen2Config, batch_size: int, max_len: int) -> KVCache:
    """An empty cache of `max_len` slots in the compute dtype."""
    shape = (batch_size, config.num_key_value_heads, max_len, config.resolved_head_dim)
    zeros = tuple(jnp.zeros(shape, _dtype(config.dtype)) for _ in range(config.num_hidden_layers))
    return KVCache(
        k=zeros,
        v=tuple(jnp.zeros_like(z) for z in zeros),
        mask=jnp.zeros((batch_size, max_len), jnp.int32),
        end=jnp.zeros((), jnp.int32),
    )


# --- modules ----------------------------------------------------------------------------------
def _partitioned(init, names: Sequence[str | None]):
    return nn.with_logical_partitioning(init, tuple(names))


def _param(module: nn.Module, name: str, init, shape: tuple[int, ...], dtype) -> jax.Array:
    """`module.param(name, init, shape, dtype)`, minus Flax's check by tracing `init` at apply.

    When the param exists, Flax validates its shape with `jax.eval_shape` of the initializer
    (a traced threefry draw) on every access, on every apply: host time spent for nothing. The
    same check is done here on the array's own shape, with Flax's error. Where the param does
    not exist yet (init) it is `module.param` itself, so initial values are unchanged. A second
    read in the same call (a check-level fault redoing `linear_operands` after the module's own
    call) is a read too, where `module.param` would refuse the name as in use.
    """
    if not module.has_variable("params", name):
        return module.param(name, init, shape, dtype)
    value = nn.meta.unbox(module.get_variable("params", name))
    if tuple(value.shape) != tuple(shape):
        raise flax_errors.ScopeParamShapeError(
            name, module.scope.path_text, tuple(value.shape), tuple(shape)
        )
    return value


class Linear(nn.Module):
    """`y = x @ kernel (+ bias) (+ LoRA)`, kernel `[in, out]` (HF's `weight` is `[out, in]`).

    A module of its own (not `nn.Dense`) so that fault interceptors can select linears by exact
    type. Its computation is the family's linear contract (`registry.Family`): `__call__` is
    `linear_product(*linear_operands(self, x))`, and the faults that redo or probe a linear
    call the same two functions (through `registry.linear_of`), never its variables. Products
    accumulate in float32 (as GPU/TPU matmul units do) and are returned in `dtype`.
    """

    features: int
    use_bias: bool
    kernel_axes: tuple[str | None, str | None]
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return linear_product(*linear_operands(self, x))


def adapter(module: nn.Module) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """(A `[in, r]`, B `[r, out]`, scale) of a linear's LoRA adapter in the optional `lora`
    collection, or None. The adapters are variables the caller passes (`aqn_jax/forward.py`);
    this file only computes with them."""
    if not module.has_variable("lora", "a"):
        return None
    return tuple(nn.unbox(module.get_variable("lora", n)) for n in ("a", "b", "scale"))


def linear_operands(module: Linear, x: jax.Array):
    """(x, kernel `[in, out]`, bias | None, LoRA (A, B, scale) | None) of a `Linear` call, x,
    kernel and bias in the module's compute dtype: the operands `linear_product` multiplies.
    Creates the params at init (called from `Linear.__call__`); reads them at apply."""
    dtype = module.dtype
    kernel = _param(
        module,
        "kernel",
        _partitioned(nn.initializers.normal(stddev=0.02), module.kernel_axes),
        (x.shape[-1], module.features),
        module.param_dtype,
    )
    bias = None
    if module.use_bias:
        bias = _param(
            module,
            "bias",
            _partitioned(nn.initializers.zeros_init(), module.kernel_axes[1:]),
            (module.features,),
            module.param_dtype,
        ).astype(dtype)
    return x.astype(dtype), kernel.astype(dtype), bias, adapter(module)


def linear_product(
    x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, lora=None
) -> jax.Array:
    """`Linear`'s computation in x's dtype (`linear_operands` cast x, kernel and bias to it):
    `x kernel` accumulated in float32, then the bias, then the adapter.

    lora: (A, B, scale) adds `scale * (x A) B` in the factored form (PEFT's order: after the
    bias), so training never forms W + A B and autodiff gives dA and dB, not a full dW."""
    dtype = x.dtype
    y = jnp.einsum(
        "...i,io->...o",
        x,
        kernel.astype(dtype),
        preferred_element_type=jnp.float32,
        precision=dot_precision(dtype),
    ).astype(dtype)
    y = y if bias is None else y + bias.astype(dtype)
    return y if lora is None else y + lora_delta(x, lora, dtype)


def lora_delta(x: jax.Array, lora, dtype: Any) -> jax.Array:
    """`scale * (x A) B` in `dtype`, each product accumulated in float32."""
    a, b, scale = lora
    prec = dot_precision(dtype)
    h = jnp.einsum(
        "...i,ir->...r",
        x.astype(dtype),
        a.astype(dtype),
        preferred_element_type=jnp.float32,
        precision=prec,
    ).astype(dtype)
    d = jnp.einsum(
        "...r,ro->...o", h, b.astype(dtype), preferred_element_type=jnp.float32, precision=prec
    )
    return (scale * d).astype(dtype)


class LMHead(nn.Module):
    """Final projection to float32 logits `[B, T, V]`.

    Untied: owns `kernel` `[D, V]`. Tied: no params; multiplies by the embedding table passed
    in. A module in both cases so that the `lm_head` fault site exists for every checkpoint.
    Logits accumulate and stay in float32: the log-probs of sampled tokens feed the RL ratio,
    where bf16 rounding is visible.
    """

    vocab_size: int
    tied: bool
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_BTD: jax.Array, table_VD: jax.Array | None = None) -> jax.Array:
        x_BTD = x_BTD.astype(self.dtype)
        if self.tied:
            return jnp.einsum(
                "BTD,VD->BTV",
                x_BTD,
                table_VD.astype(self.dtype),
                preferred_element_type=jnp.float32,
                precision=dot_precision(self.dtype),
            )
        kernel_DV = _param(
            self,
            "kernel",
            _partitioned(nn.initializers.normal(stddev=0.02), ("embed", "vocab")),
            (x_BTD.shape[-1], self.vocab_size),
            self.param_dtype,
        )
        return jnp.einsum(
            "BTD,DV->BTV",
            x_BTD,
            kernel_DV.astype(self.dtype),
            preferred_element_type=jnp.float32,
            precision=dot_precision(self.dtype),
        )


class RMSNorm(nn.Module):
    """HF Qwen2RMSNorm: variance in float32, normalised value cast back to the input dtype, then
    multiplied by the weight; the cast order matters in bf16, so it is kept exactly."""

    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = _param(
            self,
            "weight",
            _partitioned(nn.initializers.ones_init(), ("norm",)),
            (x.shape[-1],),
            self.param_dtype,
        )
        return rms_norm(x, weight, self.eps, self.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, dtype: Any) -> jax.Array:
    """The computation of `RMSNorm`, shared with transforms that perturb its weight (AQN)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * normed.astype(x.dtype).astype(dtype)


def rope_cos_sin(positions_BT: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, ...]:
    """cos/sin `[B, T, H]` of rotate-half RoPE (HF's default rope), angles in float32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    emb_BTH = jnp.concatenate([freqs_BTh, freqs_BTh], axis=-1)
    return jnp.cos(emb_BTH), jnp.sin(emb_BTH)


def apply_rope(x_BTnH: jax.Array, cos_BTH: jax.Array, sin_BTH: jax.Array) -> jax.Array:
    """x·cos + rotate_half(x)·sin with rotate_half(x) = [-x2, x1]; computed in float32."""
    x = x_BTnH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = x * cos_BTH[:, :, None, :] + rotated * sin_BTH[:, :, None, :]
    return out.astype(x_BTnH.dtype)


class Qwen2Attention(nn.Module):
    """Grouped-query self-attention with q/k/v bias, RoPE, float32 softmax and an optional
    KV cache. Returns `(out_BTD, layer_kv)`; layer_kv is None without a cache."""

    config: Qwen2Config

    @nn.compact
    def __call__(self, x_BTD, positions_BT, key_mask_BS, query_slot_BT, kv=None):
        cfg = self.config
        N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.resolved_head_dim
        dt, pdt = _dtype(cfg.dtype), _dtype(cfg.param_dtype)
        lin = dict(dtype=dt, param_dtype=pdt)
        B, T, _ = x_BTD.shape
        q_BTNH = Linear(N * H, cfg.attention_bias, ("embed", "heads"), name="q_proj", **lin)(x_BTD)
        k_BTKH = Linear(K * H, cfg.attention_bias, ("embed", "kv_heads"), name="k_proj", **lin)(
            x_BTD
        )
        v_BTKH = Linear(K * H, cfg.attention_bias, ("embed", "kv_heads"), name="v_proj", **lin)(
            x_BTD
        )
        q_BTNH = q_BTNH.reshape(B, T, N, H)
        k_BTKH = k_BTKH.reshape(B, T, K, H)
        v_BTKH = v_BTKH.reshape(B, T, K, H)

        cos, sin = rope_cos_sin(positions_BT, H, cfg.rope_theta)
        q_BTNH = apply_rope(q_BTNH, cos, sin)
        k_BTKH = apply_rope(k_BTKH, cos, sin)

        # Heads-first layouts for the two attention products: XLA then runs them as plain
        # batched matmuls (1.6x faster on CPU than contracting the [B, T, ...] layouts).
        G = N // K
        q_BKGTH = q_BTNH.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)
        k_BKTH = k_BTKH.transpose(0, 2, 1, 3)
        v_BKTH = v_BTKH.transpose(0, 2, 1, 3)
        if kv is not None:
            # Write this chunk's keys/values at slots [end, end + T) and attend over all slots.
            cache_k, cache_v, end = kv
            k_BKSH = jax.lax.dynamic_update_slice(
                cache_k, k_BKTH.astype(cache_k.dtype), (0, 0, end, 0)
            )
            v_BKSH = jax.lax.dynamic_update_slice(
                cache_v, v_BKTH.astype(cache_v.dtype), (0, 0, end, 0)
            )
            kv = (k_BKSH, v_BKSH)
        else:
            k_BKSH, v_BKSH = k_BKTH, v_BKTH

        out_BKGTH = _attend(q_BKGTH, k_BKSH, v_BKSH, key_mask_BS, query_slot_BT, dt)
        out_BTKGH = out_BKGTH.transpose(0, 3, 1, 2, 4)
        out_BTD = Linear(cfg.hidden_size, False, ("heads", "embed"), name="o_proj", **lin)(
            out_BTKGH.reshape(B, T, N * H)
        )
        return out_BTD, kv


def _attend(q_BKGTH, k_BKSH, v_BKSH, key_mask_BS, query_slot_BT, dt):
    """softmax(q k^T / sqrt(H)) v over the allowed keys, scores and softmax in float32."""
    S, H = k_BKSH.shape[2], k_BKSH.shape[3]
    # Causal by slot index (a query sees keys written at or before its own slot) and only
    # real tokens: left padding is masked out as keys.
    allowed_BTS = (jnp.arange(S)[None, None, :] <= query_slot_BT[:, :, None]) & (
        key_mask_BS[:, None, :] > 0
    )
    # Scores and softmax in float32: bf16 logits of the softmax lose the small differences
    # that decide the attention pattern.
    scores_BKGTS = jnp.einsum(
        "BKGTH,BKSH->BKGTS",
        q_BKGTH,
        k_BKSH.astype(dt),
        preferred_element_type=jnp.float32,
        precision=dot_precision(dt),
    ) * (H**-0.5)
    # A large finite negative (not -inf) keeps fully masked rows (padding queries) finite.
    scores_BKGTS = jnp.where(allowed_BTS[:, None, None], scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(dt)
    return jnp.einsum(
        "BKGTS,BKSH->BKGTH", probs_BKGTS, v_BKSH.astype(dt), precision=dot_precision(dt)
    )


class Qwen2MLP(nn.Module):
    """SwiGLU without bias: down(silu(gate(x)) * up(x))."""

    config: Qwen2Config

    @nn.compact
    def __call__(self, x_BTD):
        cfg = self.config
        lin = dict(dtype=_dtype(cfg.dtype), param_dtype=_dtype(cfg.param_dtype))
        gate_BTF = Linear(cfg.intermediate_size, False, ("embed", "mlp"), name="gate_proj", **lin)(
            x_BTD
        )
        up_BTF = Linear(cfg.intermediate_size, False, ("embed", "mlp"), name="up_proj", **lin)(
            x_BTD
        )
        return Linear(cfg.hidden_size, False, ("mlp", "embed"), name="down_proj", **lin)(
            nn.silu(gate_BTF) * up_BTF
        )


class Qwen2DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h)).

    Returns `(out_BTD, layer_kv)`. The output is the residual stream after this layer (where
    the original system's deadzone fault sits)."""

    config: Qwen2Config

    @nn.compact
    def __call__(self, x_BTD, positions_BT, key_mask_BS, query_slot_BT, kv=None):
        cfg = self.config
        norm = dict(
            eps=cfg.rms_norm_eps, dtype=_dtype(cfg.dtype), param_dtype=_dtype(cfg.param_dtype)
        )
        attn_BTD, kv = Qwen2Attention(cfg, name="self_attn")(
            RMSNorm(name="input_layernorm", **norm)(x_BTD),
            positions_BT,
            key_mask_BS,
            query_slot_BT,
            kv,
        )
        h_BTD = x_BTD + attn_BTD
        out_BTD = h_BTD + Qwen2MLP(cfg, name="mlp")(
            RMSNorm(name="post_attention_layernorm", **norm)(h_BTD)
        )
        return out_BTD, kv


class Qwen2ForCausalLM(nn.Module):
    """The full model. Params: embed_tokens, layers_{i}, norm, lm_head (untied only).

    `head='value'` makes the PPO critic: the same backbone (same param paths, so it is
    initialised from the policy's backbone and fault sites are the same), with `value_head`
    (a [D, 1] linear with bias, float32) instead of the LM head; it returns values `[B, T]`.
    """

    config: Qwen2Config
    head: str = "lm"  # lm | value

    @nn.compact
    def __call__(
        self,
        input_ids_BT: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
        hidden: bool = False,
    ):
        """Logits `[B, T, V]` in float32, or `(logits, cache)` when a cache is given.

        attention_mask: `[B, T]`, 1 for real tokens, 0 for (left) padding; default all ones.
        positions: `[B, T]` RoPE positions. Default: the count of real tokens before each
          token (`cumsum(mask) - 1`, continuing from the cache), so a left-padded prompt gets the
          same positions as the unpadded one. This matches HF `generate`; HF's plain forward
          defaults to `arange(T)` instead, so parity tests pass positions to HF explicitly.
        cache: a `KVCache` from `init_cache`; this call's tokens are written at slots
          `[cache.end, cache.end + T)` and the updated cache is returned.
        last_only: logits of the last position only (`[B, 1, V]`): a prefill needs nothing
          else, and the lm_head over every prompt position is the largest matmul of a prefill.
        hidden: the final norm's output `[B, T, D]` (compute dtype) instead of the logits (with
          the cache when one is given): the log-prob readout applies the head itself, a chunk
          of positions at a time (`Qwen2Head`, `aqn_jax/logprobs.py`).
        """
        cfg = self.config
        dt, pdt = _dtype(cfg.dtype), _dtype(cfg.param_dtype)
        B, T = input_ids_BT.shape
        if attention_mask is None:
            attention_mask = jnp.ones((B, T), jnp.int32)
        attention_mask = attention_mask.astype(jnp.int32)

        if cache is None:
            start = jnp.zeros((), jnp.int32)
            key_mask_BS = attention_mask
            prior_tokens_B1 = jnp.zeros((B, 1), jnp.int32)
        else:
            start = cache.end
            key_mask_BS = jax.lax.dynamic_update_slice(cache.mask, attention_mask, (0, start))
            prior_tokens_B1 = jnp.sum(cache.mask, axis=1, keepdims=True)
        if positions is None:
            positions = jnp.maximum(prior_tokens_B1 + jnp.cumsum(attention_mask, axis=1) - 1, 0)
        query_slot_BT = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))

        embed = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dt,
            param_dtype=pdt,
            embedding_init=_partitioned(nn.initializers.normal(stddev=0.02), ("vocab", "embed")),
            name="embed_tokens",
        )
        x_BTD = embed(input_ids_BT)

        layer_cls = Qwen2DecoderLayer
        if cfg.remat:
            layer_cls = nn.remat(Qwen2DecoderLayer, prevent_cse=True)
        new_k, new_v = [], []
        for i in range(cfg.num_hidden_layers):
            kv = None if cache is None else (cache.k[i], cache.v[i], start)
            x_BTD, kv = layer_cls(cfg, name=f"layers_{i}")(
                x_BTD, positions, key_mask_BS, query_slot_BT, kv
            )
            if kv is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
        x_BTD = RMSNorm(cfg.rms_norm_eps, dtype=dt, param_dtype=pdt, name="norm")(x_BTD)
        if last_only:
            x_BTD = x_BTD[:, -1:]
        if self.head == "value":
            values = Linear(1, True, ("embed", None), jnp.float32, jnp.float32, name="value_head")(
                x_BTD.astype(jnp.float32)
            )[..., 0]
            return (
                values
                if cache is None
                else (
                    values,
                    KVCache(k=tuple(new_k), v=tuple(new_v), mask=key_mask_BS, end=start + T),
                )
            )
        if self.head != "lm":
            raise ValueError(f"head={self.head!r}; allowed: 'lm', 'value'")
        if hidden:
            if cache is None:
                return x_BTD
            return x_BTD, KVCache(k=tuple(new_k), v=tuple(new_v), mask=key_mask_BS, end=start + T)
        logits_BTV = _head(cfg, x_BTD, embed)
        if cache is None:
            return logits_BTV
        return logits_BTV, KVCache(k=tuple(new_k), v=tuple(new_v), mask=key_mask_BS, end=start + T)


def _head(cfg: Qwen2Config, x_BTD: jax.Array, embed: nn.Embed) -> jax.Array:
    """float32 logits of the final hidden states: the `lm_head` module (the fault site), over
    the embedding table when tied."""
    dt, pdt = _dtype(cfg.dtype), _dtype(cfg.param_dtype)
    head = LMHead(
        cfg.vocab_size, cfg.tie_word_embeddings, dtype=dt, param_dtype=pdt, name="lm_head"
    )
    return head(x_BTD, embed.embedding if cfg.tie_word_embeddings else None).astype(jnp.float32)


class Qwen2Head(nn.Module):
    """The LM head alone, at the causal LM's param paths (`lm_head`, and `embed_tokens` when
    tied): `apply(variables of the causal LM, x_BTD)` -> float32 logits. The log-prob readout
    calls it on a chunk of positions at a time, so the `lm_head` fault site is this call."""

    config: Qwen2Config

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        cfg = self.config
        embed = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=_dtype(cfg.dtype),
            param_dtype=_dtype(cfg.param_dtype),
            name="embed_tokens",
        )
        return _head(cfg, x_BTD, embed)


# --- what the library needs from this family (registered in `models/registry.py`) ------------
# This family's fault-site names (`faults/sites.py` reads them from the registry).
LINEAR_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYER_NORM_KINDS = ("input_layernorm", "post_attention_layernorm")
NORM_KINDS = (*LAYER_NORM_KINDS, "norm")
MODEL_KINDS = ("norm", "embed_tokens", "lm_head")
EXPLICIT_ONLY = ("embed_tokens", "lm_head")
# Module kind -> the module type at that kind: fault sites are matched by path and checked by
# type (exact targeting). The order is the kinds' order.
SITE_TYPES: dict[str, type] = {
    "layer": Qwen2DecoderLayer,
    "attn": Qwen2Attention,
    "mlp": Qwen2MLP,
    **dict.fromkeys(LINEAR_KINDS, Linear),
    **dict.fromkeys(LAYER_NORM_KINDS, RMSNorm),
    "norm": RMSNorm,
    "embed_tokens": nn.Embed,
    "lm_head": LMHead,
}
_LAYER_RE = re.compile(r"^layers_(\d+)$")
_SUBMODULE_KINDS = {
    ("self_attn",): "attn",
    ("mlp",): "mlp",
    **{("self_attn", k): k for k in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{("mlp", k): k for k in ("gate_proj", "up_proj", "down_proj")},
    ("input_layernorm",): "input_layernorm",
    ("post_attention_layernorm",): "post_attention_layernorm",
}


def site_of(path: tuple[str, ...]) -> tuple[str, int | None] | None:
    """(kind, layer id) of the module at a Flax path, None when no kind lives there: the layers
    are an unrolled loop (`layers_{i}`), so the layer id is read from the path."""
    if len(path) == 1 and path[0] in MODEL_KINDS:
        return path[0], None
    if path and (m := _LAYER_RE.match(path[0])):
        kind = "layer" if len(path) == 1 else _SUBMODULE_KINDS.get(tuple(path[1:]))
        return None if kind is None else (kind, int(m.group(1)))
    return None


def norm_with_weight(module: RMSNorm, x: jax.Array, weight: jax.Array) -> jax.Array:
    """`module`'s computation with another weight vector (AQN's weight noise)."""
    return rms_norm(x, weight, module.eps, module.dtype)


def _per_shard(n: int, tensor: int) -> int:
    """Heads (or MLP columns) on one of `tensor` shards, rounded up."""
    return -(-n // tensor)


def saved_layer_bytes(config: Qwen2Config, tensor: int, keys: int) -> int:
    """Bytes one decoder layer saves per token for its backward over `keys` key positions, with
    heads and the MLP split `tensor` ways:
    (6 D + 3 (N + K) H / t + 4 I / t) * itemsize + 3 (N / t) * keys * 4 (float32 scores,
    probabilities and their mask, materialised by `Qwen2Attention`)."""
    c = config
    heads = _per_shard(c.num_attention_heads, tensor)
    kv_heads = _per_shard(c.num_key_value_heads, tensor)
    elements = (
        6 * c.hidden_size
        + 3 * (heads + kv_heads) * c.resolved_head_dim
        + 4 * _per_shard(c.intermediate_size, tensor)
    )
    return elements * jnp.dtype(c.dtype).itemsize + 3 * heads * keys * 4


def forward_layer_bytes(config: Qwen2Config, tensor: int, keys: int, score_copies: int) -> int:
    """Bytes of one decoder layer's forward working set per token over `keys` key positions:
    3 (I / t) * itemsize + score_copies * (N / t) * keys * 4."""
    mlp = 3 * _per_shard(config.intermediate_size, tensor) * jnp.dtype(config.dtype).itemsize
    return mlp + score_copies * _per_shard(config.num_attention_heads, tensor) * keys * 4
