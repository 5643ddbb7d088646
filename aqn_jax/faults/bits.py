"""Bit-level faults on stored values: flips (XOR) and stuck bits (OR / AND-NOT) of a value's
own bits, through `lax.bitcast_convert_type` (the pattern of AQT's `fp_numerics.py`).

A float of width W stores, from the most significant bit: the sign (bit W-1), the exponent
and the mantissa (bit 0 = the mantissa's least significant bit):

  float32   sign 31, exponent 30..23, mantissa 22..0
  bfloat16  sign 15, exponent 14..7,  mantissa 6..0
  float16   sign 15, exponent 14..10, mantissa 9..0

A fault's bits are a field ('sign', 'exponent', 'mantissa', 'all') or explicit positions. Which
elements and bits are hit is a mask of the value's unsigned integer type (`draw_mask`):
  rate   each selected bit of each element flips with probability `rate` (a bit-error rate);
  count  exactly `count` elements (all of them if fewer) each get one of the selected bits,
         chosen uniformly.
The caller picks the key: a transient fault draws from its (seed, step, attempt, phase, site)
key at the tensor's shape; a permanent one from a fixed key at its lanes' shape (`lane_key`).

Gradients pass straight through a corrupted value (`corrupt`): the fault is in the stored
number, not in the function the backward differentiates.
"""

from __future__ import annotations

import ast
import functools
import math
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BIT_FIELDS = ("sign", "exponent", "mantissa", "all")
MODES = ("flip", "stuck0", "stuck1")
# dtype -> (width, exponent bits, mantissa bits)
_LAYOUTS = {
    np.dtype(jnp.float32): (32, 8, 23),
    np.dtype(jnp.bfloat16): (16, 8, 7),
    np.dtype(jnp.float16): (16, 5, 10),
    # Block scales of the MX / NVFP4 formats (`mx_scale_flip`): E8M0 has no sign and no
    # mantissa; E4M3's sign bit is 7.
    np.dtype(jnp.float8_e8m0fnu): (8, 8, 0),
    np.dtype(jnp.float8_e4m3fn): (8, 4, 3),
}
_UINTS = {32: jnp.uint32, 16: jnp.uint16, 8: jnp.uint8}
_UNSIGNED = (np.dtype(jnp.float8_e8m0fnu),)
# `count` mode draws distinct elements (top-k of uniforms) up to this many elements; above it,
# with replacement (a collision then costs one flip, with probability ~ count^2 / 2n).
_DISTINCT_MAX = 1 << 24


def layout(dtype) -> tuple[int, int, int]:
    """(width, exponent bits, mantissa bits) of a float dtype with bit faults."""
    dt = np.dtype(dtype)
    if dt not in _LAYOUTS:
        raise ValueError(
            f"bit faults act on float32, bfloat16 and float16 values (and MX/NVFP4 block"
            f" scales); got dtype {dt.name}"
        )
    return _LAYOUTS[dt]


def uint_of(dtype):
    """The unsigned integer type of `dtype`'s width (its storage)."""
    return _UINTS[layout(dtype)[0]]


def field_positions(field: str, dtype) -> tuple[int, ...]:
    """The bit positions of a named field of `dtype`, most significant first."""
    width, ebits, mbits = layout(dtype)
    ranges = {
        "sign": () if np.dtype(dtype) in _UNSIGNED else (width - 1,),
        "exponent": tuple(range(mbits + ebits - 1, mbits - 1, -1)),
        "mantissa": tuple(range(mbits - 1, -1, -1)),
        "all": tuple(range(width - 1, -1, -1)),
    }
    return ranges[field]


def parse_bits(bits: Any, field: str = "bits") -> str | tuple[int, ...]:
    """A bit field name, or explicit positions as a sorted tuple of ints (from an int, a tuple,
    or their string form '30', '(30, 22)', '30,22'); raises naming `field`."""
    if isinstance(bits, str):
        text = bits.strip()
        if text in BIT_FIELDS:
            return text
        try:
            bits = ast.literal_eval(text)
        except (ValueError, SyntaxError) as e:
            raise ValueError(
                f"{field}={text!r}; allowed: {BIT_FIELDS} or bit positions (0 = the least"
                " significant), e.g. 30 or (30, 22)"
            ) from e
    if isinstance(bits, int) and not isinstance(bits, bool):
        bits = (bits,)
    try:
        out = tuple(sorted({int(b) for b in bits}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field}={bits!r}; allowed: {BIT_FIELDS} or bit positions") from e
    if not out or any(isinstance(b, bool) for b in bits):
        raise ValueError(f"{field}={bits!r}; allowed: {BIT_FIELDS} or bit positions")
    return out


def positions(bits: str | tuple[int, ...], dtype, field: str = "bits") -> tuple[int, ...]:
    """The positions `bits` (a field or explicit positions) select in `dtype`; a position past
    the dtype's width raises naming `field`."""
    if isinstance(bits, str):
        pos = field_positions(bits, dtype)
        if not pos:
            raise ValueError(f"{field}={bits!r}: {np.dtype(dtype).name} has no {bits} bits")
        return pos
    width = layout(dtype)[0]
    bad = [b for b in bits if not 0 <= b < width]
    if bad:
        raise ValueError(
            f"{field}={tuple(bits)}: bit position(s) {bad} past the width of"
            f" {np.dtype(dtype).name} ({width} bits: 0..{width - 1})"
        )
    return tuple(bits)


def _bit_weights(pos: tuple[int, ...], dtype) -> np.ndarray:
    return np.array([1 << p for p in pos], dtype=np.dtype(uint_of(dtype)))


def draw_mask(key, shape, dtype, pos: tuple[int, ...], *, rate=None, count=None) -> jax.Array:
    """The fault mask (in `dtype`'s unsigned type, of `shape`): `rate` per (element, bit) or
    `count` elements with one bit each (see the module docstring). `rate` may be traced."""
    if (rate is None) == (count is None):
        raise ValueError("draw_mask: give exactly one of rate and count")
    u = uint_of(dtype)
    weights = jnp.asarray(_bit_weights(pos, dtype))
    if rate is not None:
        hits = jax.random.bernoulli(key, jnp.asarray(rate, jnp.float32), (*shape, len(pos)))
        # Distinct powers of two: their sum is their OR.
        return jnp.sum(jnp.where(hits, weights, jnp.zeros((), u)), axis=-1, dtype=u)
    n = math.prod(shape)
    k = min(int(count), n)
    k_elem, k_bit = jax.random.split(key)
    if n <= _DISTINCT_MAX:  # the k largest of n uniforms: a uniform k-subset, one pass
        idx = jax.lax.top_k(jax.random.uniform(k_elem, (n,)), k)[1]
    else:
        idx = jax.random.randint(k_elem, (k,), 0, n)
    which = jax.random.randint(k_bit, (k,), 0, len(pos))
    return jnp.zeros((n,), u).at[idx].set(weights[which]).reshape(shape)


def lane_key(seed: int, tag: str) -> jax.Array:
    """The fixed key of a permanent fault's lanes at one site (`tag`: the site's path)."""
    return jax.random.fold_in(jax.random.key(seed), zlib.crc32(tag.encode()) & 0x7FFFFFFF)


def popcount(mask: jax.Array) -> jax.Array:
    """The number of set bits in `mask` (int32 total)."""
    return jnp.sum(lax.population_count(mask).astype(jnp.int32))


def apply_bits(x: jax.Array, mask: jax.Array, mode: str = "flip") -> jax.Array:
    """x with the bits of `mask` (broadcast to x) flipped ('flip'), forced to 0 ('stuck0') or
    to 1 ('stuck1'); nothing else changes."""
    u = uint_of(x.dtype)
    xb = lax.bitcast_convert_type(x, u)
    mask = jnp.broadcast_to(mask.astype(u), x.shape)
    if mode == "flip":
        out = xb ^ mask
    elif mode == "stuck1":
        out = xb | mask
    elif mode == "stuck0":
        out = xb & ~mask
    else:
        raise ValueError(f"mode={mode!r}; allowed: {MODES}")
    return lax.bitcast_convert_type(out, x.dtype)


def changed_bits(x: jax.Array, y: jax.Array) -> jax.Array:
    """How many bits differ between x and y (same dtype): the flips that fired."""
    u = uint_of(x.dtype)
    return popcount(lax.bitcast_convert_type(x, u) ^ lax.bitcast_convert_type(y, u))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def corrupt(x: jax.Array, mask: jax.Array, mode: str = "flip") -> jax.Array:
    """`apply_bits` with a straight-through gradient (d out / d x = 1)."""
    return apply_bits(x, mask, mode)


def _corrupt_fwd(x, mask, mode):
    return apply_bits(x, mask, mode), None


def _corrupt_bwd(mode, _, g):
    return g, None


corrupt.defvjp(_corrupt_fwd, _corrupt_bwd)
