"""Fake quantisation to the block-scaled low-precision formats: OCP MX v1.0 and NVIDIA NVFP4.

Why fake quantisation: to simulate a low-precision datapath during RL post-training we only
need the values that hardware would compute with, `q * scale`, in the model's own dtype; the
rest of the model then runs unchanged. Every function here returns that dequantised array, is
pure and jit-compatible, and takes its format choices as static Python arguments.

What is matched, exactly (tests/test_fault_formats.py checks it bit for bit against an
independent numpy transliteration of microsoft/microxcaling's algorithm):

* MX (`quantize_mx`): one shared power-of-two scale per block of `block_size` (32) contiguous
  elements along the contraction axis; elements rounded to nearest (ties away from zero, the
  microxcaling default, or to even), subnormals of the element format kept, saturating at the
  element format's largest normal. A NaN or Inf anywhere in a block makes the whole block NaN.
* NVFP4 (`quantize_nvfp4`): per-tensor float32 scale times a per-16-block float8_e4m3 scale,
  e2m1 elements, round half to even (NVIDIA Transformer Engine's recipe).

Where we differ from a reference on purpose:

* Exactness. floor(log2 amax) comes from the float32 exponent field and element rounding
  uses `lax.round` on an exactly scaled value, as microxcaling's C++/CUDA kernels do on the
  bits. Its pure-PyTorch path instead takes a float32 `log2`, which rounds up for an amax
  just below a power of two, and rounds with a float32 `floor(|a| + 0.5)`, which rounds the
  largest float below some half-steps the wrong way; we do not reproduce those two slips.
* float32 subnormals (|x| < 2**-126) are flushed to zero, in the inputs and in the outputs, on
  every backend. XLA CPU flushes them anyway, but not consistently (a multiply by 1.0 is
  folded away and keeps one), so we make it explicit and backend-independent. This only
  touches values below 1.2e-38. Zeros keep the sign of their input.
* NVFP4's per-tensor amax is taken over the finite values, so a NaN or Inf poisons only its
  own block (as in MX) instead of the whole tensor; and the tensor is first normalised by an
  exact power of two so that the per-tensor scale `amax / 2688` cannot underflow. Both are
  no-ops for finite tensors whose scales are normal float32 numbers.

Gradients: `grad="ste"` is the straight-through estimator (identity), which is what the
reference libraries use. `grad="mask"` passes no gradient to an element that was flushed to
zero while its input was non-zero: that is this project's (and the original system's) fault
model for deadzones, not a convention of quantisation libraries.

Pitfalls avoided (see docs/ARCHITECTURE.md): ml_dtypes float4/float6 casts turn NaN into 0 and
Inf into max, and only round half to even, so no element rounding here goes through a cast;
`jnp.exp2` is inexact on XLA CPU, so powers of two are built from their bits.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aqn_jax.registry import Registry


class FormatSpec(NamedTuple):
    """An element format, in OCP MX terms.

    ebits: exponent bits (0 for the MX int8 fixed-point format).
    mbits: explicit mantissa bits, i.e. without sign and implicit bit (microxcaling's `mbits`
        is this plus 2). For int8 the fraction bits of its 1.6 fixed-point value.
    emax: exponent of the largest normal; the MX shared scale is `2**(floor(log2 amax) - emax)`.
    max_normal: largest magnitude; quantisation saturates there.
    emin: exponent of the smallest normal, `1 - bias`; below it the format is subnormal
        (for int8, 0: its step is 2**-mbits everywhere).
    """

    ebits: int
    mbits: int
    emax: int
    max_normal: float
    emin: int

    @property
    def min_subnormal(self) -> float:
        """Smallest non-zero magnitude: one unit in the last place at exponent `emin`."""
        return 2.0 ** (self.emin - self.mbits)


def _fp_spec(ebits: int, mbits: int, emax: int, max_normal: float) -> FormatSpec:
    return FormatSpec(ebits, mbits, emax, max_normal, emin=2 - 2 ** (ebits - 1))


@dataclasses.dataclass(frozen=True)
class Format:
    """A block format (config.faults.quant.format, mx_scale_flip.format): its element format,
    the kernel that quantises it ('mx': one power-of-two scale per block; 'nvfp4': a float32
    tensor scale times an E4M3 block scale) and its block length (None: the config's
    block_size, an MX format's; an int: fixed by the format, the config's block_size unread)."""

    spec: FormatSpec
    kernel: str = "mx"
    block_size: int | None = None


# The block formats. A new one is one `FORMATS.register` (a new kernel also a `_KERNELS` entry).
FORMATS: Registry[Format] = Registry("format")
FORMATS.register("mxfp4", Format(_fp_spec(2, 1, 2, 6.0)))
FORMATS.register("mxfp6_e2m3", Format(_fp_spec(2, 3, 2, 7.5)))
FORMATS.register("mxfp6_e3m2", Format(_fp_spec(3, 2, 4, 28.0)))
FORMATS.register("mxfp8_e4m3", Format(_fp_spec(4, 3, 8, 448.0)))
FORMATS.register("mxfp8_e5m2", Format(_fp_spec(5, 2, 15, 57344.0)))
# Elements k / 64 with k in [-127, 127]: fixed point 1.6, no exponent.
FORMATS.register("mxint8", Format(FormatSpec(0, 6, 0, max_normal=127.0 / 64.0, emin=0)))
NVFP4_BLOCK_SIZE = 16
# NVFP4's elements are e2m1, like MXFP4's; its block scales are E4M3_SPEC.
FORMATS.register("nvfp4", Format(_fp_spec(2, 1, 2, 6.0), "nvfp4", NVFP4_BLOCK_SIZE))
E4M3_SPEC = FORMATS["mxfp8_e4m3"].spec

# The shipped MX formats' names, read once (the live table is FORMATS, `mx_format`).
MX_FORMATS = tuple(name for name, f in FORMATS.items() if f.kernel == "mx")


def mx_format(fmt: str, field: str = "fmt") -> Format:
    """The entry of MX format `fmt` (kernel 'mx'); else one line naming `field`, the value and
    the MX formats registered."""
    if fmt not in FORMATS or FORMATS[fmt].kernel != "mx":
        allowed = tuple(name for name, f in FORMATS.items() if f.kernel == "mx")
        raise ValueError(f"{field}={fmt!r}; allowed: {allowed}")
    return FORMATS[fmt]


MX_BLOCK_SIZE = 32
SCALE_RULES = Registry("scale_rule")  # MX's shared-scale rules (`_mx_shared_exponent`)
SCALE_RULES.register("floor", None)
SCALE_RULES.register("ceil", None)
# Element rounding: the name -> lax's rounding method.
ROUNDINGS: Registry[lax.RoundingMethod] = Registry("rounding")
ROUNDINGS.register("away", lax.RoundingMethod.AWAY_FROM_ZERO)
ROUNDINGS.register("even", lax.RoundingMethod.TO_NEAREST_EVEN)
GRADS = Registry("grad")  # the gradients of a fake quantisation (module docstring)
GRADS.register("ste", None)
GRADS.register("mask", None)

# MX's shared scale is an E8M0 number: exponents -127..127 (255 encodes NaN).
_SCALE_EMIN, _SCALE_EMAX = -127, 127
_F32_MIN_NORMAL = 2.0**-126
# NVFP4's per-tensor scale maps the tensor amax to (largest e4m3) * (largest e2m1).
_NVFP4_GLOBAL_RANGE = 448.0 * 6.0

# --------------------------------------------------------------------------------------------
# Exact float32 bit-level helpers
# --------------------------------------------------------------------------------------------


def _floor_log2(a: jax.Array) -> jax.Array:
    """floor(log2 a) for float32 a >= 0, exactly, read from the exponent field (int32).

    A float `log2` can round up to the next integer for a just below a power of two; the
    exponent field cannot. Only meaningful for normal a: zero (and flushed subnormals) give
    -127, Inf and NaN 128.
    """
    bits = lax.bitcast_convert_type(a, jnp.int32)
    return lax.shift_right_logical(bits, 23) - 127


def _mantissa_field(a: jax.Array) -> jax.Array:
    """The 23 trailing mantissa bits of float32 a >= 0 (int32), for exact ratio comparisons."""
    return lax.bitcast_convert_type(a, jnp.int32) & 0x7FFFFF


def _pow2(e: jax.Array) -> jax.Array:
    """2.0**e (float32) for int32 e in [-126, 127], exactly, built from its exponent field."""
    return lax.bitcast_convert_type(lax.shift_left(e + 127, 23), jnp.float32)


def _scale_by_pow2(v: jax.Array, e) -> jax.Array:
    """v * 2**e for float32 v that is normal, zero, Inf or NaN, and int32 e; exact.

    Done on the bits, by adding e to the exponent field: a result below the normal range is
    a zero of v's sign (the flush this module applies to every output anyway), one above it
    is an Inf of v's sign. Why not `v * 2.0**e`: `jnp.exp2` is inexact on XLA CPU, 2**-127
    (the smallest MX scale) is a subnormal that XLA flushes, and XLA may reassociate a chain
    of multiplications by broadcast factors; integer adds are immune to all three.
    """
    e = jnp.asarray(e, jnp.int32)
    bits = lax.bitcast_convert_type(v, jnp.int32)
    field = lax.shift_right_logical(bits, 23) & 0xFF
    new_field = field + e
    sign = bits & jnp.int32(-(2**31))
    zero = lax.bitcast_convert_type(sign, jnp.float32)
    inf = lax.bitcast_convert_type(sign | 0x7F800000, jnp.float32)
    scaled = lax.bitcast_convert_type(bits + lax.shift_left(e, 23), jnp.float32)
    out = jnp.where(new_field < 1, zero, jnp.where(new_field > 254, inf, scaled))
    out = jnp.where(field == 255, v, out)  # Inf and NaN unchanged
    return jnp.where(field == 0, zero, out)  # zero, and subnormals read as zero


def _ieee(op, x, y) -> jax.Array:
    """op(x, y) rounded once, as written, with no algebraic rewrite by XLA.

    XLA turns `a / broadcast(b)` into `a * broadcast(1 / b)` (also for non-constant b, e.g. a
    per-block or per-tensor scale), which is not correctly rounded, and may reassociate
    products with broadcast factors. An optimisation barrier on the materialised operands
    hides their structure, so the division or product is the IEEE one the references use.
    """
    x, y = lax.optimization_barrier(tuple(jnp.broadcast_arrays(x, y)))
    return op(x, y)


def _two_product(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(p, e) with p = fl(x y) and p + e = x y exactly (Dekker's product, no FMA needed), for
    finite x, y whose product neither overflows nor underflows.

    Each factor is split on its bits into a high half (the low 12 mantissa bits cleared) and the
    exact remainder, so every partial product is exact in float32; a multiply-add contraction
    of those cannot change a result. p is materialised (an optimisation barrier), so no backend
    fuses the inexact x y into the subtractions that follow (a GPU's FMA contraction would
    compute them from the exact product and break the identity).
    """

    def split(v):
        hi = lax.bitcast_convert_type(
            lax.bitcast_convert_type(v, jnp.int32) & jnp.int32(~0xFFF), jnp.float32
        )
        return hi, v - hi

    xh, xl = split(x)
    yh, yl = split(y)
    p = lax.optimization_barrier(x * y)
    e = ((xh * yh - p) + xh * yl + xl * yh) + xl * yl
    return p, e


def _nearest_quotient(a: jax.Array, b: jax.Array, q0: jax.Array) -> jax.Array:
    """The float32 nearest to a / b (round to nearest: what an IEEE division returns) among q0
    and its 2 neighbours on each side, for a >= 0, b > 0 and an approximation q0 within 2 ulp.

    The candidate c with the smallest exact residual |a - c b| is the correctly rounded
    quotient: a - p is exact (Sterbenz: p = fl(c b) is within a factor 2 of a), and the quotient
    of two floats is never exactly halfway between two floats, so there are no ties. A
    non-finite q0 (0 / 0, or an overflow) is returned as it is.
    """

    def err(c):
        p, e = _two_product(c, b)
        return jnp.abs((a - p) - e)

    bits = lax.bitcast_convert_type(q0, jnp.int32)
    best, best_err = q0, err(q0)
    for step in (-2, -1, 1, 2):
        c = lax.bitcast_convert_type(jnp.clip(bits + step, 0, 0x7F7FFFFF), jnp.float32)
        c_err = err(c)
        better = c_err < best_err
        best, best_err = jnp.where(better, c, best), jnp.where(better, c_err, best_err)
    return jnp.where(jnp.isfinite(q0), best, q0)


def _div(a: jax.Array, b: jax.Array) -> jax.Array:
    """a / b correctly rounded on every backend, for a >= 0 and b > 0 (NVFP4's scales).

    XLA:GPU's float32 division is within 2 ulp but not correctly rounded: on an H100 it
    differed from numpy's in the last bit for 998 of 1,000 block scales and 2,566 of 16,000
    element ratios of `test_nvfp4_matches_te_reference[dyadic]`, and 48 elements (their ratios
    on an e2m1 tie, 3.4999998 vs 3.5) landed one grid step away from TE's reference. Off CPU
    the backend's quotient is corrected to the nearest float (`_nearest_quotient`, which
    doubles the cost of a quantisation); XLA:CPU's division is IEEE already (numpy's on all of
    the tests' operands), so CPU programs keep the plain division and their bits.
    """
    a, b = jnp.broadcast_arrays(a, b)
    q0 = _ieee(lax.div, a, b)
    return lax.platform_dependent(a, b, q0, cpu=lambda a, b, q0: q0, default=_nearest_quotient)


def _flush_subnormals(x: jax.Array) -> jax.Array:
    """float32 subnormals to zero of the same sign (see the module docstring)."""
    return jnp.where(jnp.abs(x) < _F32_MIN_NORMAL, jnp.copysign(jnp.zeros_like(x), x), x)


def _round_to_element(a: jax.Array, spec: FormatSpec, rounding: str) -> jax.Array:
    """Nearest value of the element format to a >= 0 (float32), saturated at max_normal.

    Arithmetic, not a dtype cast, so that ties can go away from zero and NaN stays NaN: the
    value's exponent clamped below at the format's emin (which keeps its subnormals) sets
    the step 2**(p - mbits); scaling by the inverse step is exact, `lax.round` rounds the
    integer count of steps exactly, and scaling back is exact.
    """
    # p - mbits lies in [emin - mbits, emax + 1 - mbits] (within [-17, 16]) for the a that
    # reach here, so both powers of two are normal and each product is one exact multiply
    # by an elementwise factor (no broadcast that XLA could reassociate).
    p = jnp.clip(_floor_log2(a), spec.emin, spec.emax + 1)
    steps = lax.round(a * _pow2(spec.mbits - p), ROUNDINGS[rounding])
    return jnp.minimum(steps * _pow2(p - spec.mbits), jnp.float32(spec.max_normal))


# --------------------------------------------------------------------------------------------
# MX
# --------------------------------------------------------------------------------------------


def _mx_shared_exponent(amax: jax.Array, spec: FormatSpec, scale_rule: str) -> jax.Array:
    """Unclamped exponent of the MX shared scale for block amax (float32, finite, >= 0).

    "floor" (OCP MX v1.0, microxcaling): floor(log2 amax) - emax; the block max can land up
    to 2**(emax + 1) and is clipped to max_normal, by up to 25% for fp4.
    "ceil" (NVIDIA TE MXFP8, torchao RCEIL): ceil(log2(amax / max_normal)), the smallest
    scale that fits the block max without clipping. Computed exactly from exponents and
    mantissa fields: with amax = 1.ma * 2**ea and max_normal = 1.mm * 2**em the ratio lies in
    (1/2, 1] * 2**(ea - em) when ma <= mm and in (1, 2) * 2**(ea - em) otherwise.
    """
    e_amax = _floor_log2(amax)
    if scale_rule == "floor":
        return e_amax - spec.emax
    max_bits = int(np.float32(spec.max_normal).view(np.int32))
    e_max, mant_max = (max_bits >> 23) - 127, max_bits & 0x7FFFFF
    return e_amax - e_max + (_mantissa_field(amax) > mant_max).astype(jnp.int32)


def mx_encode(x, spec: FormatSpec, scale_rule: str, rounding: str):
    """MX encoding of float32 blocks x[..., n_blocks, block]: (element magnitudes (values of
    the element format), negative sign bits, shared exponents [..., n_blocks, 1] clamped to
    E8M0's range, poisoned blocks). `mx_decode` of the first three is the kernel's output."""
    finite = jnp.isfinite(x)
    x = _flush_subnormals(x)
    mag = jnp.where(finite, jnp.abs(x), 0.0)
    amax = jnp.max(mag, axis=-1, keepdims=True)
    e = _mx_shared_exponent(amax, spec, scale_rule)
    # An E8M0 scale above 2**127 does not exist: NaN, as for NaN/Inf inputs.
    poisoned = (e > _SCALE_EMAX) | ~jnp.all(finite, axis=-1, keepdims=True)
    e = jnp.clip(e, _SCALE_EMIN, _SCALE_EMAX)
    q = _round_to_element(_scale_by_pow2(mag, -e), spec, rounding)
    return q, jnp.signbit(x), e, poisoned


def mx_decode(q: jax.Array, negative: jax.Array, e: jax.Array) -> jax.Array:
    """float32 values of MX elements (magnitudes `q`, signs, shared exponents `e`)."""
    out = _scale_by_pow2(q, e)  # flushes results below the float32 normal range
    return jnp.where(negative, -out, out)


def _mx_kernel(x, spec: FormatSpec, scale_rule: str, rounding: str):
    """MX fake quantisation of float32 blocks x[..., n_blocks, block] -> (out, keep_grad)."""
    q, negative, e, poisoned = mx_encode(x, spec, scale_rule, rounding)
    out = mx_decode(q, negative, e)
    keep = (out != 0) | (x == 0) | poisoned
    return jnp.where(poisoned, jnp.nan, out), keep


def quantize_mx(
    x: jax.Array,
    fmt: str,
    *,
    axis: int = -1,
    block_size: int = MX_BLOCK_SIZE,
    scale_rule: str = "floor",
    rounding: str = "away",
    grad: str = "ste",
) -> jax.Array:
    """MX fake quantisation of x: quantise to `fmt`, return the dequantised values (x's dtype).

    fmt: one of MX_FORMATS. Blocks are `block_size` contiguous elements along `axis` (the
    contraction axis of the matmul the tensor feeds), whose length must be a multiple of
    block_size. scale_rule: "floor" (OCP / microxcaling) or "ceil" (TE MXFP8 / torchao
    RCEIL), see `_mx_shared_exponent`. rounding: "away" (ties away from zero, microxcaling's
    default) or "even". grad: "ste" or "mask" (see the module docstring). Computed in float32.
    Corners of the ceil rule at float32's top: an element within half a step of 2**128
    rounds up to Inf, and an int8 block with amax > 127/64 * 2**127 needs a scale above
    2**127, so it is NaN like a poisoned block.

    An element flushes to zero when it rounds below half the element format's smallest
    subnormal relative to its block's scale; `mx_flush_threshold` gives that bound.
    """
    mx_format(fmt)
    SCALE_RULES.check(scale_rule)
    ROUNDINGS.check(rounding)
    return _apply(
        _Quantizer("mx", fmt, axis, block_size, scale_rule, rounding, grad), jnp.asarray(x)
    )


def mx_flush_threshold(amax, fmt: str = "mxfp4", *, scale_rule: str = "floor") -> jax.Array:
    """Flush bound of an MX block with max magnitude `amax` (float32, amax's shape).

    An element v of that block quantises to zero iff |v| < threshold with rounding "away",
    iff |v| <= threshold with rounding "even" (the tie at the threshold goes to zero). For
    MXFP4 with the floor rule the threshold is 2**(floor(log2 amax) - 4), between amax/32
    and amax/16. Why: deadzone fault models and diagnostics need the real format's bound.
    """
    mx_format(fmt)
    SCALE_RULES.check(scale_rule)
    return _mx_flush_threshold(jnp.asarray(amax, jnp.float32), fmt, scale_rule)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _mx_flush_threshold(amax: jax.Array, fmt: str, scale_rule: str) -> jax.Array:
    spec = FORMATS[fmt].spec
    finite = jnp.isfinite(amax)
    amax = jnp.where(finite, _flush_subnormals(jnp.abs(amax)), 0.0)
    e = _mx_shared_exponent(amax, spec, scale_rule)
    threshold = jnp.full(amax.shape, spec.min_subnormal / 2, jnp.float32)
    threshold = _scale_by_pow2(threshold, jnp.clip(e, _SCALE_EMIN, _SCALE_EMAX))
    return jnp.where(finite & (e <= _SCALE_EMAX), threshold, jnp.nan)  # NaN blocks: no bound


# --------------------------------------------------------------------------------------------
# NVFP4
# --------------------------------------------------------------------------------------------


def nvfp4_encode(x):
    """NVFP4 encoding of float32 blocks x[..., n_blocks, 16]: (e2m1 magnitudes, negative sign
    bits, e4m3 block scales [..., n_blocks, 1] (as float32), the float32 global scale and the
    power-of-two normaliser k (scalars), poisoned blocks). `nvfp4_decode` of the first five
    is the kernel's output.

    Follows TE's recipe in this order of float32 operations: s_global = amax / 2688,
    s_block = e4m3(block_amax / 6 / s_global), q = e2m1(min(|x| / (s_block * s_global), 6)),
    out = q * s_block * s_global. Working on magnitudes and restoring the sign is the same
    thing, since both roundings are symmetric. A block whose s_block rounds to 0 (block amax
    <= global amax * 2**-10 / 448, roughly: NVFP4's second deadzone) flushes entirely.
    """
    elem = FORMATS["nvfp4"].spec
    finite = jnp.isfinite(x)
    x = _flush_subnormals(x)
    mag = jnp.where(finite, jnp.abs(x), 0.0)
    gmax = jnp.max(mag)
    # Exact power-of-two normalisation to gmax in [1, 2): keeps s_global normal for tiny
    # tensors and changes nothing otherwise (every step is equivariant under it).
    k = jnp.clip(_floor_log2(gmax), -126, 127)
    mag = _scale_by_pow2(mag, -k)
    s_global = _div(_scale_by_pow2(gmax, -k), jnp.float32(_NVFP4_GLOBAL_RANGE))
    block_amax = jnp.max(mag, axis=-1, keepdims=True)
    r = _div(_div(block_amax, jnp.float32(6.0)), s_global)
    s_block = _round_to_element(r, E4M3_SPEC, "even")
    denom = s_block * s_global
    live = denom > 0  # False for an all-zero tensor and for blocks in the second deadzone
    ratio = _div(mag, jnp.where(live, denom, 1.0))
    q = _round_to_element(jnp.minimum(ratio, jnp.float32(elem.max_normal)), elem, "even")
    poisoned = ~jnp.all(finite, axis=-1, keepdims=True)
    return q, jnp.signbit(x), s_block, s_global, k, poisoned


def nvfp4_decode(q, negative, s_block, s_global, k) -> jax.Array:
    """float32 values of NVFP4 elements (e2m1 magnitudes `q`, signs, e4m3 block scales, the
    global scale and normaliser of `nvfp4_encode`)."""
    live = s_block * s_global > 0
    # q * s_block is exact (2 and 4 significant bits); then one rounding by s_global.
    out = _ieee(lax.mul, jnp.where(live, q * s_block, 0.0), s_global)
    out = _scale_by_pow2(out, k)  # flushes results below the float32 normal range
    return jnp.where(negative, -out, out)


def _nvfp4_kernel(x, _spec: FormatSpec, _scale_rule: str, _rounding: str):
    """NVFP4 fake quantisation of float32 blocks x[..., n_blocks, 16] -> (out, keep_grad);
    see `nvfp4_encode` for the exact arithmetic."""
    q, negative, s_block, s_global, k, poisoned = nvfp4_encode(x)
    out = nvfp4_decode(q, negative, s_block, s_global, k)
    keep = (out != 0) | (x == 0) | poisoned
    return jnp.where(poisoned, jnp.nan, out), keep


def quantize_nvfp4(x: jax.Array, *, axis: int = -1, grad: str = "ste") -> jax.Array:
    """NVFP4 fake quantisation of x (blocks of 16 along `axis`); dequantised, in x's dtype.

    grad: "ste" or "mask" (see the module docstring). An all-zero tensor stays zero; a NaN
    or Inf makes its own block NaN. See `_nvfp4_kernel` for the exact arithmetic.
    """
    return _apply(
        _Quantizer("nvfp4", "nvfp4", axis, NVFP4_BLOCK_SIZE, "floor", "even", grad),
        jnp.asarray(x),
    )


# --------------------------------------------------------------------------------------------
# Blocking and gradients, shared by both
# --------------------------------------------------------------------------------------------

_KERNELS = {"mx": _mx_kernel, "nvfp4": _nvfp4_kernel}


@dataclasses.dataclass(frozen=True)
class _Quantizer:
    """Static description of one fake quantiser (hashable: a nondiff argument of custom_vjp)."""

    kind: str
    fmt: str
    axis: int
    block_size: int
    scale_rule: str
    rounding: str
    grad: str

    def __post_init__(self):
        GRADS.check(self.grad)
        if (
            not isinstance(self.block_size, int)
            or isinstance(self.block_size, bool)
            or self.block_size < 1
        ):
            raise ValueError(f"block_size={self.block_size!r} must be a positive int")

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(dequantised x in x's dtype, bool mask of elements that pass gradient with 'mask')."""
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"x.dtype={x.dtype} is not supported; allowed: floating dtypes")
        if not -x.ndim <= self.axis < x.ndim:
            raise ValueError(f"axis={self.axis} is out of range for x of shape {x.shape}")
        n = x.shape[self.axis]
        if n % self.block_size:
            raise ValueError(
                f"the length of axis {self.axis} of x (shape {x.shape}) is {n}, not a multiple"
                f" of block_size={self.block_size}; allowed: lengths divisible by block_size"
            )
        moved = jnp.moveaxis(x.astype(jnp.float32), self.axis, -1)
        blocks = moved.reshape(*moved.shape[:-1], n // self.block_size, self.block_size)
        spec = FORMATS[self.fmt].spec
        out, keep = _KERNELS[self.kind](blocks, spec, self.scale_rule, self.rounding)
        out = jnp.moveaxis(out.reshape(moved.shape), -1, self.axis).astype(x.dtype)
        keep = jnp.moveaxis(keep.reshape(moved.shape), -1, self.axis)
        return out, keep


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fake_quantize(quantizer: _Quantizer, x: jax.Array) -> jax.Array:
    return quantizer(x)[0]


def _fake_quantize_fwd(quantizer: _Quantizer, x: jax.Array):
    out, keep = quantizer(x)
    return out, (keep if quantizer.grad == "mask" else None)


def _fake_quantize_bwd(quantizer: _Quantizer, keep, g):
    if keep is None:  # straight-through
        return (g,)
    return (jnp.where(keep, g, jnp.zeros_like(g)),)


_fake_quantize.defvjp(_fake_quantize_fwd, _fake_quantize_bwd)

# One compiled program per quantiser (a no-op inside an outer jit): called eagerly, dozens of
# small ops would each be dispatched and compiled on their own.
_apply = jax.jit(_fake_quantize, static_argnums=0)


# --------------------------------------------------------------------------------------------
# A corrupted block scale (GoldenEye's metadata fault)
# --------------------------------------------------------------------------------------------


def check_block_size(fmt: str, block_size) -> int:
    """The block length of `fmt` (a format's fixed one, NVFP4's; else `block_size`, which must
    be a positive int: raises `block_size=...`, for the caller to prefix with its section)."""
    fixed = FORMATS.get(fmt).block_size
    if fixed is not None:
        return fixed
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(
            f"block_size={block_size!r}; allowed: a positive int dividing the last axis of the"
            f" tensors quantised (OCP MX: {MX_BLOCK_SIZE})"
        )
    return block_size


def scale_blocks(x_shape, fmt: str, block_size: int = MX_BLOCK_SIZE) -> tuple[int, ...]:
    """The shape of the block scales of a tensor of `x_shape` quantised along its last axis."""
    bs = FORMATS.get(fmt, "fmt").block_size or block_size
    if x_shape[-1] % bs:
        raise ValueError(
            f"the last axis of x (shape {tuple(x_shape)}) is not a multiple of the {fmt} block"
            f" size {bs}"
        )
    return (*x_shape[:-1], x_shape[-1] // bs)


def quantize_scale_fault(
    x: jax.Array,
    fmt: str,
    scale_xor: jax.Array,
    *,
    block_size: int = MX_BLOCK_SIZE,
    scale_rule: str = "floor",
    rounding: str = "away",
) -> jax.Array:
    """x fake-quantised along its last axis (`quantize_mx` / `quantize_nvfp4`, fmt one of
    MX_FORMATS or 'nvfp4') with each block's stored scale XOR `scale_xor` (ints 0..255 of
    shape `scale_blocks(x.shape, fmt, block_size)`), read back by the decoder: one flipped
    scale bit rescales a whole block by a power of two (MX's E8M0; code 255 is NaN) or to
    another E4M3 value (NVFP4; its sign bit flips the block's signs, 0x7F/0xFF are NaN). A zero
    mask gives the plain fake quantisation bit for bit. The gradient is straight-through."""
    entry = FORMATS.get(fmt, "fmt")
    bs = entry.block_size or block_size
    quantizer = _Quantizer(entry.kernel, fmt, -1, bs, scale_rule, rounding, "ste")
    xor = jnp.asarray(scale_xor, jnp.int32)
    if tuple(xor.shape) != scale_blocks(x.shape, fmt, bs):
        raise ValueError(
            f"scale_xor.shape={tuple(xor.shape)}; x of shape {tuple(x.shape)} has block scales"
            f" {scale_blocks(x.shape, fmt, bs)}"
        )
    return _apply_scale_fault(quantizer, jnp.asarray(x), xor)


def _scale_fault_kernel(quantizer: _Quantizer, blocks: jax.Array, xor: jax.Array) -> jax.Array:
    """The encoder's output decoded with corrupted scales (`xor`: [..., n_blocks, 1])."""
    if quantizer.kind == "mx":
        spec = FORMATS[quantizer.fmt].spec
        q, negative, e, poisoned = mx_encode(blocks, spec, quantizer.scale_rule, quantizer.rounding)
        code = (e + 127) ^ xor  # the stored E8M0 code (exponent biased by 127)
        return jnp.where(poisoned | (code == 255), jnp.nan, mx_decode(q, negative, code - 127))
    q, negative, s_block, s_global, k, poisoned = nvfp4_encode(blocks)
    code = lax.bitcast_convert_type(s_block.astype(jnp.float8_e4m3fn), jnp.uint8)
    read = lax.bitcast_convert_type(code ^ xor.astype(jnp.uint8), jnp.float8_e4m3fn)
    live = s_block * s_global > 0  # a block the encoder flushed stays zero
    out = _ieee(lax.mul, jnp.where(live, q * read.astype(jnp.float32), 0.0), s_global)
    out = _scale_by_pow2(out, k)
    return jnp.where(poisoned, jnp.nan, jnp.where(negative, -out, out))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scale_faulted(quantizer: _Quantizer, x: jax.Array, xor: jax.Array) -> jax.Array:
    n = x.shape[-1]
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], n // quantizer.block_size, -1)
    out = _scale_fault_kernel(quantizer, blocks, xor[..., None])
    return out.reshape(x.shape).astype(x.dtype)


def _scale_faulted_fwd(quantizer, x, xor):
    return _scale_faulted(quantizer, x, xor), None


def _scale_faulted_bwd(quantizer, _, g):
    return g, None


_scale_faulted.defvjp(_scale_faulted_fwd, _scale_faulted_bwd)
# One compiled program per quantiser, as `_apply`.
_apply_scale_fault = jax.jit(_scale_faulted, static_argnums=0)
