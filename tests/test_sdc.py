"""Bit-level faults (issue 44): hand-computed flips and stuck bits, the rate's statistics, the
fault kinds at module sites (manifest, telemetry, steps, permanent lanes), the backward
products, the MX/NVFP4 scale flip, ABFT and the config's errors."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from aqn_jax.faults import bits, formats
from aqn_jax.faults.bitfaults import (
    SDC_ATTEMPT,
    SDC_STEP,
    BitFault,
    Bits,
    BitsLinear,
    ScaleFlip,
)
from aqn_jax.faults.config import check_bit_dtypes, fault_plan, faults_config
from aqn_jax.faults.intercept import FaultPlan, Injection, step_key, summarize_stats
from aqn_jax.faults.sites import SiteSelector
from aqn_jax.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

from conftest import random_params

CONFIG = Qwen2Config.tiny(num_hidden_layers=2)
MODEL = Qwen2ForCausalLM(CONFIG)
PARAMS = random_params(CONFIG, seed=0)
IDS = np.random.RandomState(0).randint(0, CONFIG.vocab_size, size=(2, 8))


def flip(x, *positions):
    x = jnp.asarray(x)
    mask = sum(1 << p for p in positions)
    return np.asarray(bits.apply_bits(x, jnp.asarray(mask, bits.uint_of(x.dtype))))


# --- hand-computed bits ----------------------------------------------------------------------
def test_f32_flips_by_hand():
    # 1.0 = 0x3F800000: bit 30 is the exponent's top bit (0 in 0x3F..), setting it gives
    # exponent 0xFF with a zero mantissa = +inf; bit 31 is the sign; bit 22 the mantissa's top
    # bit: 1 + 2^-1 = 1.5.
    assert flip(np.float32(1.0), 30) == np.inf
    assert flip(np.float32(1.0), 31) == -1.0
    assert flip(np.float32(1.0), 22) == 1.5
    assert flip(np.float32(1.0), 0) == np.float32(1.0) + np.finfo(np.float32).eps  # one ulp
    assert flip(np.float32(1.0), 23) == 0.5  # the exponent's lowest bit: 127 -> 126
    # A flip is its own inverse.
    x = np.float32(-3.25)
    assert flip(flip(x, 30, 7), 30, 7) == x


def test_bf16_flips_at_their_own_positions():
    # bf16 1.0 = 0x3F80: sign 15, exponent 14..7, mantissa 6..0.
    one = jnp.bfloat16(1.0)
    assert flip(one, 14) == np.inf
    assert flip(one, 15) == -1.0
    assert flip(one, 6) == 1.5
    assert flip(one, 0) == 1.0 + 2.0**-7  # bf16 has 7 stored mantissa bits
    assert flip(one, 7) == 0.5
    assert flip(one, 14).dtype == jnp.bfloat16
    assert bits.positions("exponent", jnp.bfloat16) == (14, 13, 12, 11, 10, 9, 8, 7)
    assert bits.positions("mantissa", jnp.float32) == tuple(range(22, -1, -1))
    with pytest.raises(ValueError, match=r"bits=\(16,\).*past the width of bfloat16"):
        bits.positions((16,), jnp.bfloat16)


def test_stuck_at_one_on_bit_30():
    # Forcing the exponent's top bit of an f32 lane: a normal |x| < 1 has exponent field
    # < 127 (top bit 0), so setting it adds 128 to the field: x * 2^128, still finite (field
    # <= 126 + 128 = 254); 0 (field 0) becomes field 128, mantissa 0: 2.0; |x| in [1, 2) has
    # field 127 -> 255: inf (mantissa 0) or NaN; |x| >= 2 already has the bit set: unchanged.
    x = np.array([0.75, -0.3, 0.0, 1.0, 1.5, 2.0, -7.0, 1e-3], np.float32)
    lanes = np.array([1, 1, 1, 1, 1, 1, 1, 0], np.uint32) << 30  # the last lane is healthy
    y = np.asarray(bits.apply_bits(jnp.asarray(x), jnp.asarray(lanes), "stuck1"))
    np.testing.assert_array_equal(y[:2], x[:2] * np.float32(2.0**64) * np.float32(2.0**64))
    assert np.all(np.isfinite(y[:2]))
    assert y[2] == 2.0
    assert y[3] == np.inf and np.isnan(y[4])
    np.testing.assert_array_equal(y[5:], x[5:])
    # stuck at 0 clears the bit: 2.0 (field 128) -> field 0: +0; 0.75 has it clear already.
    y0 = np.asarray(bits.apply_bits(jnp.asarray(x), jnp.asarray(lanes), "stuck0"))
    assert y0[5] == 0.0 and y0[0] == 0.75


# --- the masks -------------------------------------------------------------------------------
def test_rate_statistics_and_determinism():
    shape, pos, rate, draws = (32, 64), bits.positions("exponent", jnp.float32), 0.01, 16
    keys = jax.random.split(jax.random.key(7), draws)
    counts = jax.jit(
        jax.vmap(lambda k: bits.popcount(bits.draw_mask(k, shape, jnp.float32, pos, rate=rate)))
    )(keys)
    n = draws * 32 * 64 * len(pos)
    total = int(np.sum(counts))
    # Binomial(n, rate): mean n p = 2621, sd sqrt(n p (1 - p)) = 51; 6 sd fails w.p. ~2e-9.
    assert abs(total - n * rate) < 6 * np.sqrt(n * rate * (1 - rate)), total
    # Only the selected bits are ever set.
    m = bits.draw_mask(keys[0], shape, jnp.float32, pos, rate=0.5)
    assert int(np.bitwise_or.reduce(np.asarray(m).ravel())) == 0x7F800000
    # Deterministic for a key; a new step's key draws anew.
    k3, k4 = step_key(0, 3, "train"), step_key(0, 4, "train")
    a = bits.draw_mask(k3, shape, jnp.float32, pos, rate=rate)
    np.testing.assert_array_equal(a, bits.draw_mask(k3, shape, jnp.float32, pos, rate=rate))
    assert np.any(
        np.asarray(a) != np.asarray(bits.draw_mask(k4, shape, jnp.float32, pos, rate=rate))
    )


def test_count_is_exact_one_bit_per_element():
    m = np.asarray(bits.draw_mask(jax.random.key(1), (8, 16), jnp.bfloat16, (3, 9), count=5))
    assert m.dtype == np.uint16
    assert np.count_nonzero(m) == 5
    assert set(np.unique(m[m != 0])) <= {1 << 3, 1 << 9}
    # More than the tensor holds: every element, once.
    assert (
        np.count_nonzero(bits.draw_mask(jax.random.key(1), (3,), jnp.float32, (0,), count=9)) == 3
    )


# --- at module sites -------------------------------------------------------------------------
def program(plan, phase="train"):
    """The jitted forward of `plan`: (key, values) -> (logits, flat fault stats); one compile
    per plan, whatever the key and values."""

    @jax.jit
    def f(params, key, values):
        with plan.apply(phase, key=key, values=values):
            return MODEL.apply({"params": params}, IDS, mutable=["fault_stats"])

    def run(values=None, key=None):
        key = step_key(0, 1, phase) if key is None else key
        values = {k: jnp.float32(v) for k, v in (values or {}).items()}
        logits, state = f(PARAMS, key, values)
        return np.asarray(logits), summarize_stats(state)

    return run


def forward(plan, **kw):
    return program(plan)(**kw)


def test_bitflip_count_at_one_site_manifest_and_telemetry():
    fault = BitFault("flip", bits=(30,), count=3)
    plan = FaultPlan([Injection("bitflip", SiteSelector(("down_proj",), (1,)), Bits(fault))])
    hits = plan.trace_manifest(MODEL, PARAMS, "train")
    assert hits == {"bitflip": ["layers_1/down_proj:output"]}
    clean, _ = forward(FaultPlan())
    out, stats = forward(plan)
    assert stats["bitflip.flips/layers_1/mlp/down_proj"] == 3.0  # three elements, one bit each
    assert not np.array_equal(out, clean)
    # Negative control: a zero rate flips nothing and leaves the logits bit for bit.
    zero = FaultPlan(
        [Injection("bitflip", SiteSelector(("down_proj",), (1,)), Bits(BitFault(rate=0.0)))]
    )
    out0, stats0 = forward(zero)
    np.testing.assert_array_equal(out0, clean)
    assert stats0["bitflip.flips/layers_1/mlp/down_proj"] == 0.0


def test_steps_fire_on_the_first_attempt_only_and_permanent_lanes_stay():
    once = BitFault("flip", bits="sign", count=4, steps=(3,))
    plan = FaultPlan([Injection("bitflip", SiteSelector(("o_proj",), (0,)), Bits(once))])
    assert plan._value_names() == {SDC_STEP, SDC_ATTEMPT}
    site = "bitflip.flips/layers_0/self_attn/o_proj"
    run = program(plan)
    assert run(values={SDC_STEP: 3, SDC_ATTEMPT: 0})[1][site] == 4.0
    assert run(values={SDC_STEP: 3, SDC_ATTEMPT: 1})[1][site] == 0.0  # recomputed
    assert run(values={SDC_STEP: 2, SDC_ATTEMPT: 0})[1][site] == 0.0
    # Permanent: the same lanes whatever the step's key; a transient fault draws anew.
    sel = SiteSelector(("o_proj",), (0,))
    for fault, same in (
        (BitFault("stuck1", bits=(20,), count=2, permanent=True, lane_seed=5), True),
        (BitFault(bits=(20,), count=2), False),
    ):
        run = program(FaultPlan([Injection("bitflip", sel, Bits(fault))]))
        a, b = run(key=step_key(0, 1, "train"))[0], run(key=step_key(0, 9, "train"))[0]
        assert np.array_equal(a, b) == same


def test_backward_product_flip_changes_exactly_the_flipped_element():
    # dW of layer 1's down_proj with one element's exponent bit 23 flipped: against the same
    # program with a zero rate, exactly that element of the kernel's gradient differs, by the
    # flip (a factor 2 or 1/2), and every other gradient leaf is bit for bit the same.
    sel = SiteSelector(("down_proj",), (1,))
    key = step_key(0, 1, "train")

    def grads(fault):
        plan = FaultPlan([Injection("bitflip", sel, BitsLinear(fault, "dw"))])

        @jax.jit
        def g(params):
            def loss(p):
                with plan.apply("train", key=key):
                    logits, st = MODEL.apply({"params": p}, IDS, mutable=["fault_stats"])
                return jnp.mean(logits**2), st

            return jax.grad(loss, has_aux=True)(params)

        return g(PARAMS)

    (g0, _), (g1, st) = grads(BitFault(bits=(23,), rate=0.0)), grads(BitFault(bits=(23,), count=1))
    assert summarize_stats(st)["bitflip.flips/layers_1/mlp/down_proj"] == 1.0
    k0 = np.asarray(g0["layers_1"]["mlp"]["down_proj"]["kernel"])
    k1 = np.array(g1["layers_1"]["mlp"]["down_proj"]["kernel"])
    diff = np.argwhere(k0 != k1)
    assert len(diff) == 1
    i, j = diff[0]
    assert k1[i, j] == flip(k0[i, j], 23)
    k1[i, j] = k0[i, j]
    for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1), strict=True):
        if a.shape == k0.shape and np.array_equal(np.asarray(a), k0):
            continue
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mx_scale_flip_rescales_one_block():
    x = jax.random.normal(jax.random.key(2), (3, 64))
    for fmt, bs in (("mxfp4", 32), ("nvfp4", 16)):
        ref = formats.quantize_nvfp4(x) if fmt == "nvfp4" else formats.quantize_mx(x, fmt)
        xor = jnp.zeros(formats.scale_blocks(x.shape, fmt), jnp.int32)
        np.testing.assert_array_equal(formats.quantize_scale_fault(x, fmt, xor), ref)
        # The scale's bit 3: E8M0's 2^3 exponent step (a factor 2^±8); E4M3's lowest exponent
        # bit (a factor 2^±1, an exponent field of 0 <-> 1 excepted: none at these amaxes).
        out = np.asarray(formats.quantize_scale_fault(x, fmt, xor.at[1, 0].set(8)))
        ratio = out[1, :bs][ref[1, :bs] != 0] / np.asarray(ref)[1, :bs][ref[1, :bs] != 0]
        expect = (2.0**8, 2.0**-8) if fmt == "mxfp4" else (2.0, 0.5)
        assert len(set(ratio.tolist())) == 1 and ratio[0] in expect
        mask = np.ones_like(out, bool)
        mask[1, :bs] = False
        np.testing.assert_array_equal(out[mask], np.asarray(ref)[mask])


# --- the config ------------------------------------------------------------------------------
def bit_config(kind="bitflip", **fields):
    c = ml_collections.ConfigDict({"faults": faults_config()})
    c.faults[kind].enabled = True
    for k, v in fields.items():
        c.faults[kind][k] = v
    return c.faults


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(bits="mantissa_top", count=1), r"config.faults.bitflip.bits='mantissa_top'; allowed"),
        (dict(bits="(32,)", count=1), r"config.faults.bitflip.bits=\(32,\).*past the width"),
        (dict(rate=1.5), r"config.faults.bitflip.rate=1.5; must be in \[0, 1\]"),
        (dict(rate=0.1, count=1), r"config.faults.bitflip.rate=0.1, count=1: give exactly one"),
        (dict(), r"config.faults.bitflip.rate=None, count=None: give exactly one"),
        (dict(count=1, target="gradient"), r"config.faults.bitflip.phases=.*only in phase 'train'"),
        (dict(count=1, point="dw"), r"config.faults.bitflip.phases=.*only in phase 'train'"),
        (dict(count=1, target="wires"), r"config.faults.bitflip.target='wires'; allowed"),
        (dict(count=1, steps="(0,)"), r"config.faults.bitflip.steps='\(0,\)'; RL steps count"),
        (dict(count=1, steps="(2,)", permanent=True), r"config.faults.bitflip.steps=\(2,\) with"),
    ],
)
def test_bad_bit_fault_config_names_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        fault_plan(bit_config(**fields), 2)


def test_bit_positions_checked_against_the_dtype_and_other_kinds():
    faults = bit_config(bits="(20,)", count=1)
    check_bit_dtypes(faults, "float32", "float32")  # f32 has bit 20
    with pytest.raises(ValueError, match=r"config.faults.bitflip.bits=\(20,\).*bfloat16"):
        check_bit_dtypes(faults, "bfloat16", "float32")
    with pytest.raises(ValueError, match="config.faults.stuck_at.value=2"):
        fault_plan(bit_config("stuck_at", count=1, value=2), 2)
    with pytest.raises(ValueError, match="config.faults.mx_scale_flip.bits='sign'.*no sign"):
        fault_plan(bit_config("mx_scale_flip", count=1, bits="sign"), 2)
    plan = fault_plan(bit_config("mx_scale_flip", count=1, format="nvfp4", bits="sign"), 2)
    assert isinstance(plan.injections[0].transform, ScaleFlip)
    plan = fault_plan(bit_config(count=1, point="dx", phases=("train",)), 2)
    assert isinstance(plan.injections[0].transform, BitsLinear)
