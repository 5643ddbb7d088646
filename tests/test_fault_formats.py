"""MX and NVFP4 fake quantisation (aqn_jax/faults/formats.py) against independent references.

The references below are numpy transliterations written from the public algorithms, not from
formats.py: MX follows microsoft/microxcaling (`_shared_exponents`, `_quantize_mx`,
`_quantize_elemwise_core`) computed in float64, where every step is exact; NVFP4 follows
NVIDIA Transformer Engine's recipe in float32 with ml_dtypes casts. They share no code with
the implementation, which works on float32 bits instead. Two documented choices of formats.py
are applied to the references too: float32 subnormals are flushed (as XLA does) and a zero
result carries the sign of its input (microxcaling gives +0 for an input of -0.0).
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from aqn_jax.faults import formats

FP32_MIN_NORMAL = 2.0**-126

# microxcaling `_get_format_params`: (ebits, mbits with sign and implicit bit, emax, max_norm).
MICROXCALING_PARAMS = {
    "mxfp4": (2, 3, 2, 6.0),
    "mxfp6_e2m3": (2, 5, 2, 7.5),
    "mxfp6_e3m2": (3, 4, 4, 28.0),
    "mxfp8_e4m3": (4, 5, 8, 448.0),
    "mxfp8_e5m2": (5, 4, 15, 57344.0),
    "mxint8": (0, 8, 0, 127.0 / 64.0),
}


# --------------------------------------------------------------------------------------------
# Independent references
# --------------------------------------------------------------------------------------------


def _ref_round(a, rounding):
    if rounding == "away":
        return np.sign(a) * np.floor(np.abs(a) + 0.5)
    return np.rint(a)


def _ref_floor_log2(a):
    """floor(log2 a) for finite a > 0 in float64 via frexp (a = m * 2**e, m in [0.5, 1))."""
    _, e = np.frexp(a)
    return (e - 1).astype(np.float64)


def _ref_quantize_elemwise(a, ebits, mbits, max_norm, rounding):
    """microxcaling `_quantize_elemwise_core` with saturate_normals=True, in float64."""
    if ebits > 0:
        private_exp = _ref_floor_log2(np.abs(a) + (a == 0))
        private_exp = np.maximum(private_exp, -(2 ** (ebits - 1)) + 2)
    else:
        private_exp = np.zeros_like(a)
    out = a / 2.0**private_exp * 2.0 ** (mbits - 2)
    out = _ref_round(out, rounding)
    out = out / 2.0 ** (mbits - 2) * 2.0**private_exp
    return np.clip(out, -max_norm, max_norm)


def _ftz(x):
    return np.where(np.abs(x) < FP32_MIN_NORMAL, np.copysign(0.0, x), x)


def ref_quantize_mx(x, fmt, *, block_size=32, scale_rule="floor", rounding="away"):
    """microxcaling `_quantize_mx` (shared_exp_method='max', scale_bits=8) along the last axis."""
    ebits, mbits, emax, max_norm = MICROXCALING_PARAMS[fmt]
    x64 = _ftz(np.asarray(x, np.float32).astype(np.float64))
    blocks = x64.reshape(-1, block_size)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.max(np.abs(blocks), axis=1, keepdims=True)  # NaN propagates
        finite = np.isfinite(amax)
        safe = np.where(finite, amax, 1.0)
        if scale_rule == "floor":
            shared = _ref_floor_log2(safe + FP32_MIN_NORMAL * (safe == 0)) - emax
        else:
            shared = np.ceil(np.log2((safe + FP32_MIN_NORMAL * (safe == 0)) / max_norm))
        shared = np.where(finite, shared, np.nan)
        shared[shared > 127] = np.nan
        shared[shared < -127] = -127
        out = _ref_quantize_elemwise(blocks / 2.0**shared, ebits, mbits, max_norm, rounding)
        out = _ftz(out * 2.0**shared)
        # The ceil rule can round an element near float32's max up to 2**128: Inf, as in XLA.
        out = np.where(out == 0, np.copysign(0.0, blocks), out).astype(np.float32)
    return out.reshape(x64.shape)


def ref_quantize_nvfp4(x):
    """TE NVFP4 in float32, blocks of 16 along the last axis, with ml_dtypes casts."""
    x = _ftz(np.asarray(x, np.float32)).astype(np.float32)
    blocks = x.reshape(-1, 16)
    finite = np.isfinite(blocks)
    gmax = np.max(np.where(finite, np.abs(blocks), np.float32(0)))
    if gmax == 0:
        out = np.zeros_like(blocks)
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            s_global = gmax / np.float32(448.0 * 6.0)
            bamax = np.max(np.where(finite, np.abs(blocks), np.float32(0)), axis=1, keepdims=True)
            s_block = np.clip(bamax / np.float32(6.0) / s_global, 0, 448)
            s_block = s_block.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
            scaled = np.clip(blocks / (s_block * s_global), -6, 6)
            q = scaled.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
            q = np.where(s_block == 0, np.float32(0), q)
            out = _ftz(q * s_block * s_global).astype(np.float32)
    out = np.where(out == 0, np.copysign(np.float32(0), blocks), out)
    out = np.where(np.all(finite, axis=1, keepdims=True), out, np.float32(np.nan))
    return out.reshape(x.shape)


def assert_bit_equal(actual, expected, err_msg=""):
    """Same float32 values, same sign of zero, NaN where expected is NaN."""
    actual = np.asarray(actual, np.float32)
    expected = np.asarray(expected, np.float32)
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(actual, expected, err_msg=err_msg)
    zeros = expected == 0
    np.testing.assert_array_equal(
        np.signbit(actual[zeros]), np.signbit(expected[zeros]), err_msg=err_msg
    )


# --------------------------------------------------------------------------------------------
# Test data
# --------------------------------------------------------------------------------------------


def _special_blocks(rng, block=32):
    """Blocks that exercise the corners: ties, powers of two, scale clamps, NaN/Inf, zeros."""
    rows = []

    def block_with_max(amax):
        row = rng.standard_normal(block) * amax / 4
        row[rng.integers(block)] = amax * rng.choice([-1, 1])
        return row

    rows.append(np.zeros(block))
    rows.append(-np.zeros(block))
    for k in (-120, -30, -3, 0, 1, 7, 40, 120):
        # Exact element ties of every format: multiples of 1/8 of a power of two.
        rows.append(rng.integers(-64, 65, block) * 2.0 ** (k - 3))
        rows.append(np.full(block, 0.25 * 2.0**k) * rng.choice([-1, 1], block))
        # amax one ulp below, at and above a power of two (floor log2 must not round).
        for amax in (np.nextafter(np.float32(2.0**k), np.float32(0)), 2.0**k):
            rows.append(block_with_max(amax))
        # amax at the ceil rule's boundaries max_norm * 2**k and one ulp above.
        for max_norm in (6.0, 7.5, 28.0, 448.0, 57344.0, 127 / 64):
            edge = max_norm * 2.0 ** (k - 4)
            if edge > float(np.finfo(np.float32).max):
                continue
            edge = np.float32(edge)
            rows.append(block_with_max(edge))
            rows.append(block_with_max(np.nextafter(edge, np.float32(np.inf))))
    # The largest float below half a step, at every step size: float32 `floor(a + 0.5)`
    # (microxcaling's PyTorch path) rounds it up; exact rounding must not.
    for k in (-40, 0, 3, 60):
        row = np.float32(np.nextafter(np.float32(0.5), np.float32(0))) * 2.0 ** -np.arange(32)
        rows.append(row * 2.0**k)
        rows[-1][0] = 2.0**k
    # Scale exponent clamped at -127: amax between 2**-126 and 2**-110, and fp32 subnormals.
    for k in (-126, -124, -120, -115, -110):
        rows.append(block_with_max(1.5 * 2.0**k))
    rows.append(rng.standard_normal(block) * 1e-40)
    rows.append(block_with_max(3.3e38))  # ceil rule: an element rounds up to 2**128, Inf
    rows.append(block_with_max(3.4e38))  # ceil rule, int8: scale above 2**127, NaN
    for bad in (np.nan, np.inf, -np.inf):
        row = rng.standard_normal(block)
        row[rng.integers(block)] = bad
        rows.append(row)
    return np.stack(rows)


N_HEAVY_ROWS = 2600


@functools.cache
def mx_test_data():
    """~105k float32 values, 32 per row: heavy-tailed, dyadic (many ties) and special blocks."""
    rng = np.random.default_rng(0)
    shape = (N_HEAVY_ROWS, 32)
    heavy = rng.standard_t(2, size=shape) * 10.0 ** rng.uniform(-30, 30, size=(shape[0], 1))
    heavy[rng.random(heavy.shape) < 0.02] = 0.0
    dyadic = rng.integers(-1024, 1025, size=(600, 32)) * 2.0 ** rng.integers(-110, 100, (600, 1))
    data = np.concatenate([heavy, dyadic, _special_blocks(rng)]).astype(np.float32)
    assert data.size >= 100_000
    return data


# --------------------------------------------------------------------------------------------
# MX: bit-exact against the reference
# --------------------------------------------------------------------------------------------


VARIANTS = [(rule, rounding) for rule in formats.SCALE_RULES for rounding in formats.ROUNDINGS]


@pytest.mark.parametrize("fmt", formats.MX_FORMATS)
def test_mx_matches_microxcaling_reference(fmt):
    """Every scale rule and rounding, under jit (the four in one program: one compilation)."""
    x = mx_test_data()
    quantize_all = jax.jit(
        lambda v: [
            formats.quantize_mx(v, fmt, scale_rule=rule, rounding=rounding)
            for rule, rounding in VARIANTS
        ]
    )
    for (rule, rounding), actual in zip(VARIANTS, quantize_all(x), strict=True):
        expected = ref_quantize_mx(x, fmt, scale_rule=rule, rounding=rounding)
        assert_bit_equal(actual, expected, err_msg=f"{fmt} {rule} {rounding}")
        if rule == "ceil":
            # The ceil rule never clips: each block's max lands within half a step of amax.
            heavy = slice(0, N_HEAVY_ROWS)
            amax = np.max(np.abs(x[heavy]), axis=1).astype(np.float64)
            top = np.max(np.abs(np.asarray(actual)[heavy]), axis=1)
            spec = formats.FORMATS[fmt].spec
            # fp: half a step of the top binade; int8: half of 1/64 at an element >= 127/128.
            rel_half_step = 2.0 ** -(spec.mbits + 1) if spec.ebits else 2.0**-7 / (127 / 128)
            assert np.all(np.abs(top - amax) <= rel_half_step * amax), (fmt, rounding)


# Non-negative values of each element format at scale 2**0, up to its max_normal.
ELEMENT_GRIDS = {
    "mxfp4": np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6]),
    "mxfp6_e2m3": np.concatenate(
        [np.arange(0, 2, 1 / 8), np.arange(2, 4, 1 / 4), np.arange(4, 8, 1 / 2)]
    ),
    "mxint8": np.arange(0, 128) / 64,
}


@pytest.mark.parametrize("fmt", list(ELEMENT_GRIDS))
def test_element_grids(fmt):
    """A fine sweep of one binade-aligned block hits exactly the format's grid, in both the
    reference and the implementation (guards against a mistake shared by the two)."""
    top = 2.0 ** (formats.FORMATS[fmt].spec.emax + 1)
    x = np.linspace(-top, top, 32 * 512, endpoint=False, dtype=np.float32).reshape(-1, 32)
    x[:, 0] = top * 0.99  # floor(log2 amax) = emax: scale 2**0 in every block
    expected = np.union1d(ELEMENT_GRIDS[fmt], -ELEMENT_GRIDS[fmt])
    np.testing.assert_array_equal(np.unique(ref_quantize_mx(x, fmt)), expected)
    np.testing.assert_array_equal(np.unique(np.asarray(formats.quantize_mx(x, fmt))), expected)


# --------------------------------------------------------------------------------------------
# MX: hand checks
# --------------------------------------------------------------------------------------------


def test_mxfp4_known_block():
    row = np.zeros(32, np.float32)
    row[:8] = [6, 3, 1.5, 0.75, 0.4, 0.3, 0.2, 0.1]
    tie = np.zeros(32, np.float32)
    tie[:2] = [6.0, 0.25]  # half the smallest subnormal, 0.5
    x = np.stack([row, -row, row / 8, tie])
    expected = np.array([6, 3, 1.5, 1, 0.5, 0.5, 0, 0], np.float32)
    for rounding in formats.ROUNDINGS:
        out = np.asarray(formats.quantize_mx(x, "mxfp4", rounding=rounding))
        np.testing.assert_array_equal(out[0, :8], expected)
        np.testing.assert_array_equal(out[1, :8], -expected)
        np.testing.assert_array_equal(out[2, :8], expected / 8)  # scale 2**-3, same grid
        np.testing.assert_array_equal(out[:3, 8:], 0)
        # The tie 0.25: away from zero -> 0.5, to even -> 0.
        assert out[3, 1] == {"away": 0.5, "even": 0.0}[rounding]


@pytest.mark.parametrize("rounding", formats.ROUNDINGS)
def test_mxfp4_flush_threshold_sweep(rounding):
    """With the floor rule an element flushes iff |v| < 2**(floor(log2 amax) - 4) (ties away)
    or |v| <= that (ties to even); the threshold lies in (amax/32, amax/16]."""
    amaxes = np.array([1.0, 1.3, 1.999, 2.0, 5.0, 7.9, 1.7e-20, 3.1e20, 2.0**-100], np.float32)
    fractions = np.linspace(0.5, 2.0, 151)
    rows, vs, ts = [], [], []
    for amax in amaxes:
        t = np.float32(2.0 ** (np.floor(np.log2(np.float64(amax))) - 4))
        assert amax / 32 < t <= amax / 16
        sweep = np.concatenate(
            [t * fractions, [np.nextafter(t, np.float32(0)), t, np.nextafter(t, np.float32(1))]]
        ).astype(np.float32)
        for sign in (1, -1):
            for v in sweep:
                row = np.zeros(32, np.float32)
                row[0], row[5] = amax, sign * v
                rows.append(row)
                vs.append(v)
                ts.append(t)
    x = np.stack(rows)
    out = np.asarray(formats.quantize_mx(x, "mxfp4", rounding=rounding))
    vs, ts = np.array(vs), np.array(ts)
    flushed = out[:, 5] == 0
    expected = vs < ts if rounding == "away" else vs <= ts
    np.testing.assert_array_equal(flushed, expected)
    threshold = np.asarray(formats.mx_flush_threshold(x[:, 0], "mxfp4"))
    np.testing.assert_array_equal(threshold, ts)


def test_floor_rule_clips_block_max_ceil_does_not():
    x = np.zeros((4, 32), np.float32)
    x[:, 0] = [7.9, np.nextafter(np.float32(8), np.float32(0)), 6.0, 4.0]
    floor = np.asarray(formats.quantize_mx(x, "mxfp4"))
    np.testing.assert_array_equal(floor[:, 0], [6, 6, 6, 4])  # clipped by up to 25%
    ceil = np.asarray(formats.quantize_mx(x, "mxfp4", scale_rule="ceil"))
    np.testing.assert_array_equal(ceil[:, 0], [8, 8, 6, 4])  # 7.9 / 2**1 -> 4, times 2**1
    # (More: the ceil rule's no-clipping check in test_mx_matches_microxcaling_reference.)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize(
    "fmt, scale_rule", [("mxfp4", "floor"), ("mxfp8_e4m3", "ceil"), ("mxint8", "ceil")]
)
def test_mx_nonfinite_poisons_only_its_block_and_zeros_stay_zero(fmt, scale_rule, bad):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 96)).astype(np.float32)
    x[0] = 0.0
    x[1, 64:] = 0.0
    quantize = functools.partial(formats.quantize_mx, fmt=fmt, scale_rule=scale_rule)
    clean = np.asarray(quantize(x))
    np.testing.assert_array_equal(clean[0], 0)  # no NaN from log2(0)
    np.testing.assert_array_equal(clean[1, 64:], 0)
    assert np.all(np.isfinite(clean))
    x[2, 40] = bad
    out = np.asarray(quantize(x))
    assert np.all(np.isnan(out[2, 32:64]))
    mask = np.ones_like(x, bool)
    mask[2, 32:64] = False
    np.testing.assert_array_equal(out[mask], clean[mask])


def test_mx_axis_and_block_size():
    rng = np.random.default_rng(3)
    x = rng.standard_t(3, (64, 5, 3)).astype(np.float32)
    along0 = formats.quantize_mx(x, "mxfp6_e3m2", axis=0, block_size=16)
    moved = formats.quantize_mx(np.moveaxis(x, 0, -1), "mxfp6_e3m2", block_size=16)
    np.testing.assert_array_equal(along0, np.moveaxis(np.asarray(moved), -1, 0))
    ref = ref_quantize_mx(np.moveaxis(x, 0, -1), "mxfp6_e3m2", block_size=16)
    assert_bit_equal(moved, ref)


def test_mx_argument_errors():
    x = jnp.ones((2, 48))
    with pytest.raises(ValueError, match=r"is 48, not a multiple of block_size=32"):
        formats.quantize_mx(x, "mxfp4")
    with pytest.raises(ValueError, match=r"fmt='mxfp3'.*allowed"):
        formats.quantize_mx(x, "mxfp3", block_size=16)
    with pytest.raises(ValueError, match=r"scale_rule='round'.*allowed"):
        formats.quantize_mx(x, "mxfp4", block_size=16, scale_rule="round")
    with pytest.raises(ValueError, match=r"rounding='down'.*allowed"):
        formats.quantize_mx(x, "mxfp4", block_size=16, rounding="down")
    with pytest.raises(ValueError, match=r"grad='none'.*allowed"):
        formats.quantize_mx(x, "mxfp4", block_size=16, grad="none")
    with pytest.raises(ValueError, match=r"block_size=0"):
        formats.quantize_mx(x, "mxfp4", block_size=0)
    with pytest.raises(ValueError, match=r"axis=2 is out of range"):
        formats.quantize_mx(x, "mxfp4", axis=2)
    with pytest.raises(TypeError, match=r"x.dtype=int32"):
        formats.quantize_mx(jnp.ones((2, 32), jnp.int32), "mxfp4")
    with pytest.raises(ValueError, match=r"is 20, not a multiple of block_size=16"):
        formats.quantize_nvfp4(jnp.ones((20,)))


def test_format_specs():
    for fmt in formats.MX_FORMATS:
        ebits, mbits, emax, max_norm = MICROXCALING_PARAMS[fmt]
        spec = formats.FORMATS[fmt].spec
        assert (spec.ebits, spec.mbits + 2, spec.emax, spec.max_normal) == (
            ebits,
            mbits,
            emax,
            max_norm,
        )
    assert formats.FORMATS["mxfp4"].spec.min_subnormal == 0.5
    assert formats.FORMATS["mxint8"].spec.min_subnormal == 1 / 64
    assert formats.FORMATS["mxfp8_e4m3"].spec.min_subnormal == 2.0**-9


# --------------------------------------------------------------------------------------------
# NVFP4
# --------------------------------------------------------------------------------------------


def _nvfp4_cases():
    rng = np.random.default_rng(4)
    n = 1000  # one shape for all cases: one compilation
    heavy = rng.standard_t(2, (n, 16)) * 10.0 ** rng.uniform(-4, 4, (n, 1))
    wide = rng.standard_t(2, (n, 16)) * 10.0 ** rng.uniform(-8, 2, (n, 1))
    dyadic = rng.integers(-96, 97, (n, 16)) * 2.0 ** rng.integers(-12, 3, (n, 1))
    poisoned = rng.standard_normal((n, 16))
    poisoned[3, 5], poisoned[10, 0], poisoned[20, 15] = np.nan, np.inf, -np.inf
    return {
        "heavy": heavy,
        "wide": wide,
        "dyadic": dyadic,
        "tiny": heavy * 1e-30,
        "huge": heavy * 1e30,
        "poisoned": poisoned,
        "zeros": np.zeros((n, 16)),
    }


_nvfp4_jit = jax.jit(formats.quantize_nvfp4)


def _division_operands(n=20000, seed=7):
    """Positive float32 a, b over the ranges NVFP4's divisions see (and the dyadic values whose
    ratios land on e2m1 ties), with their numpy (IEEE) quotients."""
    rng = np.random.default_rng(seed)
    a = np.concatenate(
        [
            rng.uniform(0, 2, n) * 2.0 ** rng.integers(-20, 1, n),
            rng.integers(1, 97, n) * 2.0 ** rng.integers(-12, 3, n),
        ]
    ).astype(np.float32)
    b = np.concatenate(
        [rng.uniform(1e-7, 448, n), rng.integers(1, 449, n) * 2.0 ** rng.integers(-9, 1, n) / 7]
    ).astype(np.float32)
    return a, b, a / b


def test_two_product_is_exact():
    a, b, _ = _division_operands()
    p, e = jax.jit(formats._two_product)(a, b)
    exact = a.astype(np.float64) * b.astype(np.float64)  # 48 bits: exact in float64
    got = np.asarray(p, np.float64) + np.asarray(e, np.float64)
    np.testing.assert_array_equal(got, exact)
    assert np.any(np.asarray(e) != 0)  # the low part is not vacuous: fl(a b) alone is inexact


@pytest.mark.parametrize("ulps", [-2, -1, 0, 1, 2])
def test_nearest_quotient_corrects_a_division_off_by_up_to_2_ulp(ulps):
    """XLA:GPU's f32 division is within 2 ulp, not correctly rounded (an H100 changed 48 of
    16,000 NVFP4 elements of the dyadic case by one e2m1 step). `_div` corrects the backend's
    quotient to the IEEE one: emulated here by shifting numpy's quotient by `ulps`."""
    a, b, ieee = _division_operands()
    q0 = (ieee.view(np.int32) + np.int32(ulps)).view(np.float32)
    assert ulps == 0 or not np.any(q0 == ieee)  # the approximation is really off
    got = np.asarray(jax.jit(formats._nearest_quotient)(a, b, q0))
    np.testing.assert_array_equal(got.view(np.int32), ieee.view(np.int32))
    np.testing.assert_array_equal(np.asarray(jax.jit(formats._div)(a, b)), ieee)
    # Non-finite quotients pass through; 0 / b stays 0.
    odd = np.asarray(
        formats._nearest_quotient(
            np.float32([0, 1, 0]), np.float32([0, 1e-30, 3]), np.float32([np.nan, np.inf, 0])
        )
    )
    assert np.isnan(odd[0]) and odd[1] == np.inf and odd[2] == 0


def test_nvfp4_program_corrects_its_divisions_off_cpu_only():
    """The quantiser exported for a GPU or TPU carries `_nearest_quotient` (its split's mask,
    the int32 constant -4096); the CPU program keeps the plain IEEE division (same bits, half
    the cost)."""
    from jax import export

    x = np.ones((4, 16), np.float32)
    text = {
        p: export.export(jax.jit(formats.quantize_nvfp4), platforms=[p])(x).mlir_module()
        for p in ("cpu", "cuda", "tpu")
    }
    assert "-4096" not in text["cpu"]
    assert "-4096" in text["cuda"] and "-4096" in text["tpu"]


@pytest.mark.parametrize("case", list(_nvfp4_cases()))
def test_nvfp4_matches_te_reference(case):
    x = _nvfp4_cases()[case].astype(np.float32)
    actual = _nvfp4_jit(x)
    assert_bit_equal(actual, ref_quantize_nvfp4(x))


def test_nvfp4_second_deadzone():
    """A block flushes entirely when e4m3(block_amax / 6 / s_global) rounds to 0, i.e. when
    block_amax <= global_amax * 2**-10 / 448: the exact tie flushes too (half to even)."""
    gmax = np.float32(2688.0)  # s_global = 1 exactly, so the boundary is exactly 6 * 2**-10
    bound = np.float32(6 * 2.0**-10)
    assert bound == gmax * 2.0**-10 / 448
    above = np.float32(bound * (1 + 2.0**-20))
    x = np.zeros((4, 16), np.float32)
    x[0, 0] = gmax
    x[1, :3] = [bound, bound / 2, -bound / 3]
    x[2, :3] = [above, above / 2, -above / 3]
    x[3, :2] = [np.nextafter(bound, np.float32(0)), 1e-6]
    out = np.asarray(formats.quantize_nvfp4(x))
    np.testing.assert_array_equal(out[1], 0)  # at the bound: s_block ties to 0
    np.testing.assert_array_equal(out[3], 0)
    # Just above: s_block = 2**-9, elements on the e2m1 grid times 2**-9 (3, 1.5 -> 2, -1).
    np.testing.assert_array_equal(out[2, :3], np.array([3, 1.5, -1], np.float32) * 2.0**-9)
    assert_bit_equal(out, ref_quantize_nvfp4(x))

    # Away from the exact tie, for a general global amax, the bound holds to rounding.
    rng = np.random.default_rng(5)
    for gmax in rng.uniform(0.1, 1e3, 20).astype(np.float32):
        bound = gmax * 2.0**-10 / 448
        x = np.zeros((3, 16), np.float32)
        x[0, 0], x[1, 0], x[2, 0] = gmax, bound * 0.999, bound * 1.001
        out = np.asarray(formats.quantize_nvfp4(x))
        assert out[1, 0] == 0 and out[2, 0] != 0


def test_nvfp4_zeros_and_first_deadzone():
    np.testing.assert_array_equal(formats.quantize_nvfp4(jnp.zeros((3, 32))), 0)
    x = np.zeros(16, np.float32)
    x[:4] = [6.0, 0.25, 0.2, 0.3]  # s_block * s_global ~ 1: e2m1 grid, 0.25 ties to 0
    out = np.asarray(formats.quantize_nvfp4(x))
    assert out[1] == 0 and out[2] == 0 and out[3] != 0


# --------------------------------------------------------------------------------------------
# Gradients, jit, dtypes
# --------------------------------------------------------------------------------------------


def _grad(fn, x, w):
    return np.asarray(jax.grad(lambda v: jnp.sum(fn(v) * w))(x))


@pytest.mark.parametrize(
    "quantize",
    [
        functools.partial(formats.quantize_mx, fmt="mxfp4"),
        functools.partial(formats.quantize_mx, fmt="mxint8", scale_rule="ceil"),
        formats.quantize_nvfp4,
    ],
    ids=["mxfp4", "mxint8_ceil", "nvfp4"],
)
def test_gradients(quantize):
    rng = np.random.default_rng(6)
    x = (rng.standard_t(2, (8, 64)) * 10.0 ** rng.uniform(-3, 3, (8, 1))).astype(np.float32)
    x[0, :5] = 0.0
    x[:, 1] = x[:, 0] * 1e-4  # a flushed element in every block
    w = rng.standard_normal(x.shape).astype(np.float32)
    x, w = jnp.asarray(x), jnp.asarray(w)

    np.testing.assert_array_equal(_grad(quantize, x, w), w)  # ste: identity

    masked = functools.partial(quantize, grad="mask")
    out = np.asarray(masked(x))
    flushed = (out == 0) & (np.asarray(x) != 0)
    assert flushed.sum() >= 8
    np.testing.assert_array_equal(_grad(masked, x, w), np.where(flushed, 0.0, w))


def test_mask_gradient_in_poisoned_block_passes():
    x = jnp.zeros((1, 32)).at[0, 0].set(jnp.nan).at[0, 1].set(1e-6).at[0, 2].set(1.0)
    out, vjp = jax.vjp(lambda v: formats.quantize_mx(v, "mxfp4", grad="mask"), x)
    assert np.all(np.isnan(out))
    np.testing.assert_array_equal(vjp(jnp.ones_like(x))[0], 1.0)


def test_low_precision_inputs():
    """bf16 in, bf16 out (the values are those of the float32 computation, rounded to bf16),
    under jit, with bf16 gradients; float16 keeps its dtype too."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_t(2, (4, 64)), jnp.bfloat16)
    quantize = functools.partial(formats.quantize_mx, fmt="mxfp8_e4m3")
    out = jax.jit(quantize)(x)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, quantize(x.astype(jnp.float32)).astype(jnp.bfloat16))
    assert formats.quantize_nvfp4(x).dtype == jnp.bfloat16
    g = jax.grad(lambda v: jnp.sum(formats.quantize_mx(v, "mxfp4", grad="mask")))(x)
    assert g.dtype == jnp.bfloat16
    assert formats.quantize_mx(x.astype(jnp.float16), "mxfp4").dtype == jnp.float16
