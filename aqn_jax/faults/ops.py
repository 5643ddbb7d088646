"""Fault operators: pure array functions that model faulty hardware.

Each function here is usable alone, is jit-compatible, and takes its magnitude (`threshold`,
`scale`) as an ordinary argument, so a traced scalar works and a new value does not retrace.
Wiring them into a model (which modules, which layers, which phase) is the interceptors' job;
nothing here knows about modules or parameters.

Three families, following the hardware-error models of the original system (see
docs/ARCHITECTURE.md, "Hardware-error models of the original system"):

* Deadzone, the original system's stand-in for MXFP4's flush-to-zero: values with
  `|x| < threshold * amax` are set to exactly 0.
* Noise kinds: the error terms `relative_gaussian`, `absolute_gaussian`, `systematic_bias`.
* Noisy linear: the operator-level "noisy ops" of the original, relative error on the output of
  `y = x W` and on both products of its backward pass.

Fault model for gradients (this project's, shared with the original system; not a convention
of quantisation libraries, which use straight-through gradients): a flushed value passes no
gradient, and injected errors are constants, never differentiated through.

Axis letters (noisy linear): i / D input features, o / O output features, `...` any leading
axes (commonly B batch, T tokens), N those leading axes flattened into one.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from aqn_jax.models import registry
from aqn_jax.models.precision import dot_precision
from aqn_jax.registry import Registry

GRANULARITIES = ("tensor", "token", "block")
# How a deadzone's severity is stated: "amax", flush |x| < threshold * amax (the original
# system's; its strength depends on the model's outliers), or "quantile", flush the `threshold`
# fraction of smallest |x| (a severity that transfers between models).
DEADZONE_SEVERITIES = ("amax", "quantile")
DEADZONE_GRADS = ("mask", "ste")


# Noise kinds (`config.faults.noise.kind`): name -> `(x32, scale32, key) -> e32`, the error term
# in float32 (`noise_error`); `random` kinds draw from `key`.
@dataclasses.dataclass(frozen=True)
class NoiseKind:
    error: Callable[[jax.Array, jax.Array, jax.Array | None], jax.Array]
    random: bool = True  # draws from the key (one is required; scale must be >= 0)


NOISE_KINDS: Registry[NoiseKind] = Registry("config.faults.noise.kind")


def _noise_kind(name: str, random: bool = True):
    def register(error):
        NOISE_KINDS.register(name, NoiseKind(error, random))
        return error

    return register


@_noise_kind("relative_gaussian")
def _relative_gaussian(x32, scale, key):
    return jax.random.normal(key, x32.shape, jnp.float32) * jnp.abs(x32) * scale


@_noise_kind("absolute_gaussian")
def _absolute_gaussian(x32, scale, key):
    return jax.random.normal(key, x32.shape, jnp.float32) * scale


@_noise_kind("systematic_bias", random=False)
def _systematic_bias(x32, scale, key):
    return jnp.sign(x32) * scale


# Which tokens a tensor-wide statistic (a deadzone's amax or quantile, NVFP4's global scale)
# is taken over: "call", the tensor of the module call (the original system's: a
# whole padded sequence in training, one token per row in cached decoding); "causal", per row
# the tokens so far, padding excluded (decoding carries it, so it equals teacher forcing);
# "token", each token alone (what a block-scaled format does physically).
SCOPES = ("call", "causal", "token")


def _check_choice(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed values: {allowed}")


def _check_concrete_nonnegative(name: str, value) -> None:
    """Rejects a negative Python number; traced or array values are left to the caller."""
    if isinstance(value, numbers.Real) and not value >= 0:
        raise ValueError(f"{name}={value!r} must be a non-negative number")


# --------------------------------------------------------------------------------------------
# Deadzone
# --------------------------------------------------------------------------------------------


def deadzone_threshold(
    x: jax.Array,
    threshold,
    *,
    granularity: str = "tensor",
    block_size: int = 32,
    severity: str = "amax",
) -> jax.Array:
    """The flush threshold `threshold * amax`, float32, broadcastable to `x`.

    With severity="quantile", `threshold` is instead a fraction q in [0, 1) and the returned
    threshold is the k-th smallest |x| (0-based, k = floor(q * n)) of each set of n values, so
    that `|x| < thr` flushes exactly the k smallest when the values are distinct (ties at the
    threshold survive). Granularity "tensor" or "token" (the set is the tensor or a token's
    last axis).

    granularity picks the set of values amax is taken over:
      * "tensor": the whole tensor, the original system's semantics. This makes the fault
        batch-dependent: whether a token's value flushes depends on the largest value anywhere
        in the batch, so the same token can flush in one batch and survive in another.
      * "token": the last axis, i.e. per token of a [..., D] activation; batch-independent.
      * "block": contiguous blocks of `block_size` along the last axis, as block-scaled formats
        (MX, NVFP4) share one scale per block. Returned repeated to `x.shape`.

    amax is computed in float32 (a bfloat16 max is exact, but `threshold * amax` should not be
    rounded to bfloat16) and is a constant for differentiation: the threshold is a property of
    the hardware's scale, not a path for gradients.
    """
    _check_choice("granularity", granularity, GRANULARITIES)
    _check_choice("severity", severity, DEADZONE_SEVERITIES)
    _check_concrete_nonnegative("threshold", threshold)
    x = jnp.asarray(x)
    if granularity != "tensor" and x.ndim == 0:
        raise ValueError(
            f"granularity={granularity!r} needs an array with a last axis; got a scalar"
        )
    abs_x = jnp.abs(x.astype(jnp.float32))
    if severity == "quantile":
        return jax.lax.stop_gradient(_quantile_threshold(abs_x, threshold, granularity))
    if granularity == "tensor":
        amax = jnp.max(abs_x, keepdims=True)
    elif granularity == "token":
        amax = jnp.max(abs_x, axis=-1, keepdims=True)
    else:
        if not isinstance(block_size, numbers.Integral) or block_size <= 0:
            raise ValueError(f"block_size={block_size!r} must be a positive integer")
        d = x.shape[-1]
        if d % block_size:
            raise ValueError(
                f"block_size={block_size} does not divide the last axis of x (size {d}); "
                f"granularity='block' needs a last-axis size that is a multiple of block_size"
            )
        blocks = abs_x.reshape(*x.shape[:-1], d // block_size, block_size)
        amax = jnp.max(blocks, axis=-1, keepdims=True)
        amax = jnp.broadcast_to(amax, blocks.shape).reshape(x.shape)
    amax = jax.lax.stop_gradient(amax)
    return jnp.asarray(threshold, jnp.float32) * amax


def _quantile_threshold(abs_x: jax.Array, q, granularity: str) -> jax.Array:
    if isinstance(q, numbers.Real) and not q < 1:
        raise ValueError(f"threshold={q!r}: a quantile deadzone needs a fraction in [0, 1)")
    if granularity == "block":
        raise ValueError("severity='quantile' takes granularity 'tensor' or 'token', not 'block'")
    flat = abs_x.reshape(1, -1) if granularity == "tensor" else abs_x
    n = flat.shape[-1]
    # q may be traced (a per-layer 0/1 factor times q): k is computed, not a Python int.
    k = jnp.clip(jnp.floor(jnp.asarray(q, jnp.float32) * n).astype(jnp.int32), 0, n - 1)
    thr = kth_smallest_nonneg(flat, k)
    # k = 0 flushes nothing: the smallest value is never below itself.
    return thr.reshape((1,) * abs_x.ndim) if granularity == "tensor" else thr


def kth_smallest_nonneg(values: jax.Array, k) -> jax.Array:
    """The k-th smallest (0-based) of each row (last axis) of non-negative float32 `values`,
    shape [..., 1]: exactly `jnp.sort(values, axis=-1)[..., k]`, bit for bit (NaNs rank last).

    A binary search on the bit pattern instead of a sort: a non-negative float32 orders as its
    int32 bits, so the answer is the largest pattern t with at most k values below it, built
    from the top bit down in 31 passes of compare-and-count. On the embedded study's
    activations that is 16-20x faster than XLA:CPU's sort per tensor, 8x per token
    (bench/quantile.py)."""
    bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)
    k = jnp.asarray(k, jnp.int32)

    def bit(i, ans):
        cand = ans | jnp.left_shift(jnp.int32(1), 30 - i)
        below = jnp.sum(bits < cand, axis=-1, keepdims=True, dtype=jnp.int32)
        return jnp.where(below <= k, cand, ans)

    ans = jax.lax.fori_loop(0, 31, bit, jnp.zeros((*values.shape[:-1], 1), jnp.int32))
    return jax.lax.bitcast_convert_type(ans, jnp.float32)


def deadzone_flush_mask(
    x: jax.Array,
    threshold,
    *,
    granularity: str = "tensor",
    block_size: int = 32,
    sparsity_mask=None,
    severity: str = "amax",
) -> jax.Array:
    """Boolean array, True where an element flushes: `|x| < thr` and, if given, sparsity_mask.

    The comparison is strict so that threshold 0 flushes nothing (not even exact zeros, which
    would make no difference to the values but would cut their gradient under grad="mask").
    `sparsity_mask` (see `make_sparsity_mask`) marks the faulty lanes; it must broadcast to
    `x.shape` (a [D] mask applies the same lanes to every token).
    """
    x = jnp.asarray(x)
    thr = deadzone_threshold(
        x, threshold, granularity=granularity, block_size=block_size, severity=severity
    )
    return flush_below(x, thr, sparsity_mask=sparsity_mask)


def flush_below(x: jax.Array, thr: jax.Array, *, sparsity_mask=None) -> jax.Array:
    """Boolean array, True where `|x| < thr` (thr broadcastable to x, e.g. from
    `deadzone_threshold` or `causal_amax`) and, if given, sparsity_mask (see
    `deadzone_flush_mask`)."""
    x = jnp.asarray(x)
    flush = jnp.abs(x.astype(jnp.float32)) < thr
    if sparsity_mask is not None:
        sparsity_mask = jnp.asarray(sparsity_mask, jnp.bool_)
        try:
            shape = jnp.broadcast_shapes(sparsity_mask.shape, x.shape)
        except ValueError:
            shape = None
        if shape != x.shape:
            raise ValueError(
                f"sparsity_mask has shape {sparsity_mask.shape}, which does not broadcast to "
                f"x.shape={x.shape}; use a [{x.shape[-1] if x.ndim else ''}] mask over the "
                f"last axis"
            )
        flush = flush & sparsity_mask
    return flush


def causal_amax(
    x: jax.Array, token_mask: jax.Array, prior: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Per row, max |x| over that row's real tokens up to and including each token.

    x is `[B, T, ...]` (the tokens of one call), token_mask `[B, T]` (nonzero for real tokens;
    padding never enters the statistic), prior `[B]` the running max of the row's earlier
    tokens (cached decoding; None or 0 for a fresh sequence). Returns `(amax, running)`:
    amax float32 `[B, T, 1, ...]` broadcastable to x, and running `[B]`, the max after the
    call's last token, to pass as the next call's prior. Calling this on a sequence in one
    piece or token by token with the carried prior gives identical values (max is exact).
    A constant for differentiation, like `deadzone_threshold`.
    """
    x = jnp.asarray(x)
    if x.ndim < 2 or token_mask.shape != x.shape[:2]:
        raise ValueError(
            f"causal_amax: x.shape={x.shape} needs leading [B, T] axes equal to"
            f" token_mask.shape={tuple(token_mask.shape)}"
        )
    per_token = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=tuple(range(2, x.ndim)))
    per_token = jnp.where(token_mask > 0, per_token, 0.0)  # |x| >= 0: 0 is max's identity
    amax = jax.lax.cummax(per_token, axis=1)
    if prior is not None:
        amax = jnp.maximum(amax, jnp.asarray(prior, jnp.float32)[:, None])
    amax = jax.lax.stop_gradient(amax)
    return amax.reshape(amax.shape + (1,) * (x.ndim - 2)), amax[:, -1]


@jax.custom_vjp
def _flush_mask_grad(x: jax.Array, flush: jax.Array) -> jax.Array:
    return jnp.where(flush, jnp.zeros((), x.dtype), x)


def _flush_mask_grad_fwd(x, flush):
    return _flush_mask_grad(x, flush), flush


def _flush_mask_grad_bwd(flush, g):
    # A flushed value is a constant 0: its gradient is cut, exactly where it flushed.
    return jnp.where(flush, jnp.zeros((), g.dtype), g), None


_flush_mask_grad.defvjp(_flush_mask_grad_fwd, _flush_mask_grad_bwd)


@jax.custom_vjp
def _flush_ste(x: jax.Array, flush: jax.Array) -> jax.Array:
    return jnp.where(flush, jnp.zeros((), x.dtype), x)


def _flush_ste_fwd(x, flush):
    return _flush_ste(x, flush), None


def _flush_ste_bwd(_, g):
    # Straight-through: the quantisation-library convention, gradient as if no flush happened.
    return g, None


_flush_ste.defvjp(_flush_ste_fwd, _flush_ste_bwd)


def deadzone(
    x: jax.Array,
    threshold,
    *,
    granularity: str = "tensor",
    block_size: int = 32,
    sparsity_mask=None,
    grad: str = "mask",
    severity: str = "amax",
) -> jax.Array:
    """Flushes to exactly 0 (in x's dtype) the elements where `deadzone_flush_mask` is True.

    grad="mask" zeroes the gradient exactly where a value flushed: this project's fault model
    (the original system's), not a quantisation-library convention. grad="ste" is the
    straight-through gradient (identity everywhere) that quantisation libraries use. Neither
    gives `threshold` a gradient: it only moves a hard comparison.
    """
    _check_choice("grad", grad, DEADZONE_GRADS)
    x = jnp.asarray(x)
    flush = deadzone_flush_mask(
        x,
        threshold,
        granularity=granularity,
        block_size=block_size,
        sparsity_mask=sparsity_mask,
        severity=severity,
    )
    return deadzone_apply(x, flush, grad=grad)


def deadzone_apply(x: jax.Array, flush: jax.Array, *, grad: str = "mask") -> jax.Array:
    """Flush x where the given bool mask is True, with the `grad` backward of `deadzone`.

    For callers that compute the mask themselves (the interceptor reuses one threshold across
    a deadzone -> noise -> deadzone chain and reports the flushed fraction).
    """
    _check_choice("grad", grad, DEADZONE_GRADS)
    apply = _flush_mask_grad if grad == "mask" else _flush_ste
    return apply(x, flush)


def make_sparsity_mask(seed: int, size: int, fraction: float) -> np.ndarray:
    """A fixed bool [size] mask with True at `round(fraction * size)` positions.

    Drawn once per run with numpy (`default_rng(seed).permutation`, first n positions), so it
    does not depend on JAX's PRNG or on the step: the same hardware lanes stay faulty for the
    whole run. It is applied over the LAST axis of x (hardware lanes / hidden units) and so is
    the same for every token. Python's `round` rounds halves to even.
    """
    if not isinstance(size, numbers.Integral) or size < 0:
        raise ValueError(f"size={size!r} must be a non-negative integer")
    if not isinstance(fraction, numbers.Real) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction={fraction!r} must be a number in [0, 1]")
    n = int(round(fraction * size))
    mask = np.zeros(size, dtype=bool)
    mask[np.random.default_rng(seed).permutation(size)[:n]] = True
    return mask


# --------------------------------------------------------------------------------------------
# Noise kinds
# --------------------------------------------------------------------------------------------


def _after(key: jax.Array, x: jax.Array) -> jax.Array:
    """`key`, made to depend on x's data so that XLA draws from it only once x exists.

    A key that depends on no data lets XLA:CPU's scheduler compute every site's random counters
    at the program's start and hold them all (8 bytes per element of every noisy tensor in the
    model): at 0.5B, batch 32 x 256 prompt tokens, the noise sampler's prefill asked for 40 GB.
    `optimization_barrier` does not survive XLA:CPU's pipeline, so the dependence is a select
    the compiler cannot fold: the same key unless x's first element is NaN (then another, still
    deterministic, key; the output there is NaN-poisoned either way)."""
    first = jnp.ravel(x)[0] if x.size else jnp.zeros((), jnp.float32)
    data = jax.random.key_data(key)
    data = jnp.where(first == first, data, data ^ jnp.uint32(1))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))


def noise_error(kind: str, x: jax.Array, scale, key: jax.Array | None) -> jax.Array:
    """The error term e of `kind` for x, in x's dtype.

    relative_gaussian `randn * |x| * scale`; absolute_gaussian `randn * scale`; systematic_bias
    `sign(x) * scale` (key unused, may be None). randn is drawn in float32 with
    `jax.random.normal(key, x.shape, jnp.float32)` and e computed in float32, then cast.

    e is wrapped in stop_gradient: the fault model treats an injected error as a constant, so
    the gradient of `x + e` with respect to x is exactly 1 (relative noise would otherwise
    leak `randn * sign(x) * scale` into the gradient).
    """
    noise = NOISE_KINDS.get(kind)
    if noise.random:
        _check_concrete_nonnegative("scale", scale)
        if key is None:
            raise ValueError(f"key=None but kind={kind!r} draws random numbers; pass a PRNG key")
    x = jnp.asarray(x)
    if key is not None:
        key = _after(key, x)
    x32 = x.astype(jnp.float32)
    scale = jnp.asarray(scale, jnp.float32)
    e = noise.error(x32, scale, key)
    return jax.lax.stop_gradient(e.astype(x.dtype))


def add_noise(kind: str, x: jax.Array, scale, key: jax.Array | None) -> jax.Array:
    """`x + noise_error(kind, x, scale, key)`; gradient w.r.t. x is the identity."""
    x = jnp.asarray(x)
    return x + noise_error(kind, x, scale, key)


# --------------------------------------------------------------------------------------------
# Noisy linear (operator level)
# --------------------------------------------------------------------------------------------


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, lora=None) -> jax.Array:
    """The linear product on bare arrays: the first registered family's `linear_product`
    (`registry.linear_product()`, Qwen2's), not a copy of it. A fault at a module calls the
    module's own family's (`registry.linear_of`)."""
    return registry.linear_product()(x, w, b, lora)


def _relative_error_f32(v: jax.Array, scale: jax.Array, key: jax.Array) -> jax.Array:
    return jax.random.normal(key, v.shape, jnp.float32) * jnp.abs(v) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _noisy_linear(forward: bool, backward: bool, product, x, w, b, key, scale, lora=None):
    y = product(x, w, b, lora)
    if forward:
        y = y + noise_error("relative_gaussian", y, scale, jax.random.fold_in(key, 0))
    return y


def _noisy_linear_fwd(forward, backward, product, x, w, b, key, scale, lora=None):
    out = _noisy_linear(forward, backward, product, x, w, b, key, scale, lora)
    return out, (x, w, b, key, scale, lora)


def _noisy_linear_bwd(forward, backward, product, res, g):
    # The gradients of the contract's form, x w + b + s (x A) B (`registry.Family`).
    x, w, b, key, scale, lora = res
    # Flatten the leading axes so dW and db sum over all of them (B and T for [B, T, D]).
    x_ND = x.reshape(-1, x.shape[-1])
    g_NO = g.reshape(-1, g.shape[-1])
    prec = dot_precision(jnp.promote_types(g.dtype, w.dtype))
    dx = jnp.einsum("...o,io->...i", g, w, preferred_element_type=jnp.float32, precision=prec)
    dw = jnp.einsum("ni,no->io", x_ND, g_NO, preferred_element_type=jnp.float32, precision=prec)
    dlora = None
    if lora is not None:
        # y += s (x A) B: dX += s (g Bᵀ) Aᵀ, dA = s xᵀ (g Bᵀ), dB = s (x A)ᵀ g, on the same unit.
        a, bl, s = lora
        gb = jnp.einsum("no,ro->nr", g_NO, bl, preferred_element_type=jnp.float32, precision=prec)
        xa = jnp.einsum("ni,ir->nr", x_ND, a, preferred_element_type=jnp.float32, precision=prec)
        dx = dx + s * jnp.einsum("...r,ir->...i", gb.reshape(*g.shape[:-1], -1), a, precision=prec)
        da = s * jnp.einsum("ni,nr->ir", x_ND, gb, precision=prec)
        dbl = s * jnp.einsum("nr,no->ro", xa, g_NO, precision=prec)
        if backward:
            da = da + _relative_error_f32(da, scale, jax.random.fold_in(key, 3))
            dbl = dbl + _relative_error_f32(dbl, scale, jax.random.fold_in(key, 4))
        dlora = (da.astype(a.dtype), dbl.astype(bl.dtype), None)
    if backward:
        # Each product gets error relative to itself, as a faulty matmul unit would produce.
        dx = dx + _relative_error_f32(dx, scale, jax.random.fold_in(key, 1))
        dw = dw + _relative_error_f32(dw, scale, jax.random.fold_in(key, 2))
    db = None if b is None else jnp.sum(g_NO.astype(jnp.float32), axis=0).astype(b.dtype)
    return dx.astype(x.dtype), dw.astype(w.dtype), db, None, None, dlora


_noisy_linear.defvjp(_noisy_linear_fwd, _noisy_linear_bwd)


def noisy_linear(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None,
    key: jax.Array,
    scale,
    *,
    forward: bool = True,
    backward: bool = True,
    lora=None,
    product: Callable | None = None,
) -> jax.Array:
    """`y = x W (+ b)` on a faulty matmul unit: relative error on y, dX and dW.

    lora: a LoRA adapter (A, B, scale) computed by the same unit: y includes `scale (x A) B`
    (after the bias, as the model's Linear), dX its term, and dA, dB get their own relative
    error (folds 3 and 4).

    product: the linear's computation `(x, w, b, lora) -> y`, its family's `linear_product`
    (`registry.linear_of(module)`; the operands from its `linear_operands`), so with scale 0
    this is bit-identical to the module; None: the first registered family's (Qwen2's:
    `einsum("...i,io->...o", x, w, preferred_element_type=float32)` cast to x's dtype, plus
    `b` cast to x's dtype, then the adapter).

    forward: y gets `randn * |y| * scale` (key folded with 0).
    backward: dX = g Wᵀ gets `randn * |dX| * scale` (fold 1) and dW = xᵀ g, summed over all
    leading axes, gets `randn * |dW| * scale` (fold 2); db = sum of g has no error. The errors
    are computed in float32 and the gradients cast back to the dtypes of x, w, b. key and scale
    get no gradient. With both flags False (or scale 0) gradients are those of plain autodiff.
    """
    x, w = jnp.asarray(x), jnp.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"w must be a [D, O] matrix; got w.shape={w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"x.shape={x.shape} does not match w.shape={w.shape}: x's last axis must equal "
            f"w's first ({w.shape[0]})"
        )
    if b is not None:
        b = jnp.asarray(b)
        if b.shape != (w.shape[1],):
            raise ValueError(
                f"b.shape={b.shape} must be ({w.shape[1]},) to match w.shape={w.shape}"
            )
    if key is None:
        raise ValueError("key=None: noisy_linear draws its errors from key; pass a PRNG key")
    _check_concrete_nonnegative("scale", scale)
    scale = jnp.asarray(scale, jnp.float32)
    product = registry.linear_product() if product is None else product
    return _noisy_linear(bool(forward), bool(backward), product, x, w, b, key, scale, lora)
