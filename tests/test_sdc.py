"""Bit-level faults (issue 44): hand-computed flips and stuck bits, the rate's statistics, the
fault kinds at module sites (manifest, telemetry, steps, permanent lanes), the backward
products, the MX/NVFP4 scale flip, ABFT and the config's errors."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from aqn_jax.faults import bits, formats
from aqn_jax.faults.bitfaults import (
    SDC_ATTEMPT,
    SDC_BIT,
    SDC_STEP,
    BitFault,
    Bits,
    BitsLinear,
    ScaleFlip,
    abft_check,
)
from aqn_jax.faults.config import check_bit_dtypes, fault_plan, faults_config
from aqn_jax.faults.intercept import FaultPlan, Injection, step_key, summarize_stats
from aqn_jax.faults.sites import SiteSelector
from aqn_jax.faults.transforms import TransformBase
from aqn_jax.forward import trace_manifest
from aqn_jax.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from aqn_jax.spec import step_spec

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
    hits = trace_manifest(plan, MODEL, PARAMS, "train")
    assert hits == {"bitflip": ["layers_1/down_proj:output"]}
    clean, _ = forward(FaultPlan())
    out, stats = forward(plan)
    assert stats["bitflip.flips/layers_1/mlp/down_proj"] == 3.0  # three elements, one bit each
    assert not np.array_equal(out, clean)
    # The bit as a traced value (one program for every bit): the same flips.
    traced = BitFault("flip", bits=(30,), count=3, traced_bit=True)
    plan_t = FaultPlan([Injection("bitflip", SiteSelector(("down_proj",), (1,)), Bits(traced))])
    np.testing.assert_array_equal(forward(plan_t, values={SDC_BIT: 30})[0], out)
    # Negative control: a zero rate flips nothing and leaves the logits bit for bit.
    zero = FaultPlan(
        [Injection("bitflip", SiteSelector(("down_proj",), (1,)), Bits(BitFault(rate=0.0)))]
    )
    out0, stats0 = forward(zero)
    np.testing.assert_array_equal(out0, clean)
    assert stats0["bitflip.flips/layers_1/mlp/down_proj"] == 0.0


@pytest.mark.slow
def test_steps_fire_on_the_first_attempt_only_and_permanent_lanes_stay():
    once = BitFault("flip", bits="sign", count=4, steps=(3,))
    plan = FaultPlan([Injection("bitflip", SiteSelector(("o_proj",), (0,)), Bits(once))])
    assert plan.value_names() == {SDC_STEP, SDC_ATTEMPT}
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
    assert summarize_stats(st)["bitflip.bwd_flips/layers_1/mlp/down_proj"] == 1.0
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


# --- a new bit-level kind: its transform and its builder ------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class LowFlip(TransformBase):
    """A throwaway bit-level kind's transform, written from `TransformBase` (not `Bits`): the
    bits `fault` selects flipped in the value; it says that it counts them."""

    fault: BitFault
    kind: str = "low_flip"
    counts_flips = True

    def __call__(self, x, ctx):
        mask = self.fault.mask(lambda: ctx.key, ctx.name, x.shape, x.dtype, ctx.values, ctx.site)
        y = bits.corrupt(x, mask, self.fault.mode)
        ctx.sow("flips", bits.changed_bits(x, y).astype(jnp.float32))
        return y

    def value_names(self):
        return self.fault.value_names()

    def describe(self):
        return f"{self.kind}({self.fault.describe()})"


class QuietFlip(LowFlip):
    """The negative control: the same flips (and the same `flips` it sows), but it says it
    does not count them."""

    counts_flips = False


class ScaleLike(LowFlip):
    """The negative control of the bit check: its bits are not the value's (`value_bits`)."""

    value_bits = False


@pytest.fixture
def throwaway_kinds():
    """Kinds low_flip, quiet_flip and scale_like, each registered in the one place a new kind
    takes besides its transform (its `@fault_kind` builder), and unregistered after."""
    from aqn_jax.faults import config as fconfig

    kinds = (("low_flip", LowFlip), ("quiet_flip", QuietFlip), ("scale_like", ScaleLike))
    for kind, transform in kinds:

        @fconfig.fault_kind(kind, fconfig.bit_section, bits=transform)
        def build(sec, num_layers, kind=kind):
            return fconfig.bit_injection(kind, sec, num_layers, "flip")

    yield fconfig
    for kind, _ in kinds:
        fconfig.FAULT_KINDS.unregister(kind)


def test_a_new_bit_kind_is_checked_against_the_dtype_as_the_others(throwaway_kinds):
    faults = faults_config()  # its section is there with the others'
    for kind in ("low_flip", "scale_like"):
        faults[kind].update(enabled=True, bits="(20,)", count=1)
    plan = fault_plan(faults, 2)
    assert [type(inj.transform) for inj in plan.injections] == [LowFlip, ScaleLike]
    check_bit_dtypes(faults, "float32", "float32")  # f32 has bit 20
    with pytest.raises(ValueError, match=r"config.faults.low_flip.bits=\(20,\).*bfloat16"):
        check_bit_dtypes(faults, "bfloat16", "float32")  # as bitflip's (the test above)
    # Negative control: scale_like's bits are not the value's; the bf16 check leaves it alone.
    faults.low_flip.enabled = False
    check_bit_dtypes(faults, "bfloat16", "float32")
    # The same property picks the points: a backward product for low_flip, not for scale_like.
    faults.low_flip.update(enabled=True, point="dx", phases=("train",))
    assert isinstance(fault_plan(faults, 2).injections[0].transform, BitsLinear)
    faults.low_flip.enabled = False
    faults.scale_like.update(point="dx", phases=("train",))
    with pytest.raises(ValueError, match=r"config.faults.scale_like.point='dx'; allowed"):
        fault_plan(faults, 2)


@pytest.mark.slow  # the real prepare and update programs (~8 s cold)
def test_the_trainer_counts_a_new_bit_kinds_flips(throwaway_kinds):
    # One flip of bit 20 (a mantissa bit of f32: the run stays finite) per call at layer 1's
    # down_proj (low_flip) and the same at layer 2's (quiet_flip, which does not count). The
    # step's programs and the trainer's telemetry as `Trainer._train` and `Trainer.step`
    # compose them: sdc/injected = one flip per policy pass = prepare's chunks + the update's
    # passes (mini-batches x micro-batches each, ppo_epochs x mini-batches updates).
    from aqn_jax import parallel
    from aqn_jax.aqn.plan import build_plan
    from aqn_jax.rl import step as rl_step
    from aqn_jax.sdc import telemetry

    from conftest import load_config, shallow

    config = shallow(load_config("deadzone"))
    config.faults.deadzone.enabled = False
    for kind, layer in (("low_flip", "1"), ("quiet_flip", "2")):
        config.faults[kind] = throwaway_kinds.bit_section()
        config.faults[kind].update(
            enabled=True, sites=("down_proj",), layers=layer, bits="(20,)", count=1
        )
    config.rollout.max_new_tokens, config.rollout.n, config.data_batch.prompts = 6, 2, 2
    config.actor.mini_batch_prompts, config.actor.micro_batch_rows = 2, 2
    config.algo.use_kl_loss = False
    cfg = Qwen2Config.tiny(num_hidden_layers=3)
    plan = build_plan(config.faults, config.aqn, 3)
    hw = fault_plan(config.faults, 3)
    static = rl_step.static_from(step_spec(config), cfg, plan, hw, 4)
    assert static.sdc is not None and static.sdc.sites and "low_flip" in static.sdc.kinds
    assert "quiet_flip" not in static.sdc.kinds
    mesh = parallel.make_mesh(config.mesh, jax.devices()[:1])
    state, _ = rl_step.init_state(static, random_params(cfg), rl_step.shardings(static, mesh))
    r = np.random.default_rng(0)
    ids = r.integers(3, 200, (4, 8 + 6)).astype(np.int32)
    batch = dict(
        ids=ids, mask=np.ones_like(ids), tokens=ids[:, 8:], rmask=np.ones((4, 6), np.int32)
    )
    batch = jax.tree_util.tree_map(jnp.asarray, batch)
    key, values = jax.random.key(3), {"aqn_sigma": np.float32(0.0)}
    prepare = jax.jit(lambda *a: rl_step.prepare_step(static, *a))
    prep, train_stats = prepare(state, None, batch, jnp.asarray([1.0, 0.0, 0.0, 1.0]), key, values)
    upd = {**batch, "old_logp": prep["old_logp"], "advantages": prep["advantages"]}
    _, mets = jax.jit(lambda *a: rl_step.update_step(static, *a))(state, upd, key, values)
    mets = {k: float(v) for k, v in mets.items()}
    h = static.h
    passes = h.mini_batches * h.micro_batches
    mets.update(telemetry.train_counts(static.sdc, train_stats, mets, passes))
    m = {"response_length/max": 6.0, **mets}
    m.update(telemetry.sdc_metrics(static.sdc.kinds, m, {}, {}))
    expected = passes + static.updates * h.micro_batches  # prepare's chunks + update's passes
    assert expected == 4  # one epoch of one mini-batch of two micro-batches, and prepare's two
    assert m["sdc/injected_prepare"] == passes and m["sdc/injected_update"] == expected - passes
    assert m["sdc/injected"] == expected
    # Negative control: quiet_flip's flips were sown beside low_flip's (the same count), but
    # the telemetry leaves them out; counted as a kind that counts, they double the total.
    stats = summarize_stats(jax.device_get(train_stats))
    assert stats["quiet_flip.flips/layers_2/mlp/down_proj"] == 1.0
    both = telemetry.site_counts(train_stats, {"low_flip", "quiet_flip"})
    assert float(both["flips"]) * passes == 2 * m["sdc/injected_prepare"]


# --- ABFT ------------------------------------------------------------------------------------
def one_flip_per_row(y, bit_of_row, key):
    """y [N, O] with one element of each row flipped at bit `bit_of_row[i]` (column random)."""
    n, o = y.shape
    cols = jax.random.randint(key, (n,), 0, o)
    u = bits.uint_of(y.dtype)
    mask = jnp.zeros((n, o), u).at[jnp.arange(n), cols].set((1 << bit_of_row).astype(u))
    return bits.apply_bits(y, mask)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_abft_catches_flips_above_its_tolerance_and_claims_none_below(dtype):
    from aqn_jax.faults.ops import linear

    width = bits.layout(dtype)[0]
    kx, kw, kb, kc = jax.random.split(jax.random.key(3), 4)
    N, K, O = 512, 64, 128
    x = jax.random.normal(kx, (N, K)).astype(dtype)
    w = (jax.random.normal(kw, (K, O)) / 8).astype(dtype)
    b = jax.random.normal(kb, (O,)).astype(dtype)
    y = linear(x, w, b)  # the Linear module's expression
    flagged, resid, tol = abft_check(x, w, b, y)
    assert not np.any(flagged)  # clean: no false positive
    # Every bit position, N / width rows each; the planted change is |y' - y| per row.
    bit_of_row = jnp.arange(N) % width
    y2 = one_flip_per_row(y, bit_of_row, kc)
    flagged2, _, _ = abft_check(x, w, b, y2)
    with np.errstate(invalid="ignore"):  # inf - inf where a flip made an inf
        delta = np.abs(np.asarray(y2, np.float64) - np.asarray(y, np.float64)).sum(1)
    delta = np.where(np.isfinite(delta), delta, np.inf)
    tol = np.asarray(tol)
    # Above twice the tolerance a flip cannot hide behind rounding (|residual| <= tol): caught.
    # (bf16's tolerance is 2^-7 of the row's sum of |y|: its exponent flips of large elements.)
    above = delta > 2 * tol
    assert above.sum() > N // (4 if dtype == jnp.float32 else 16)
    assert np.all(np.asarray(flagged2)[above])
    # A change under the clean residual's headroom (tol - |residual|) is never claimed.
    below = delta < tol - np.asarray(resid)
    assert below.sum() > N // 8 and not np.any(np.asarray(flagged2)[below])
    # The lowest mantissa bit is always below: ABFT does not claim it.
    assert np.all(below[np.asarray(bit_of_row) == 0])


@pytest.mark.slow
def test_abft_no_false_positive_over_200_clean_forwards_f32_and_bf16():
    # 200 clean forward passes of a one-layer tiny model (random token batches; one layer keeps
    # the compile short), ABFT on its 7 linears: no row is flagged in f32 or bf16 compute.
    import dataclasses

    from aqn_jax.faults.bitfaults import Abft

    plan = FaultPlan([Injection("abft", SiteSelector(("linear",), "all"), Abft())])
    params = random_params(dataclasses.replace(CONFIG, num_hidden_layers=1), seed=1)
    for dtype in ("float32", "bfloat16"):
        model = Qwen2ForCausalLM(dataclasses.replace(CONFIG, num_hidden_layers=1, dtype=dtype))

        @jax.jit
        def detected(params, keys, model=model):
            def one(key):
                ids = jax.random.randint(key, IDS.shape, 0, CONFIG.vocab_size)
                with plan.apply("train"):
                    _, st = model.apply({"params": params}, ids, mutable=["fault_stats"])
                leaves = jax.tree_util.tree_leaves_with_path(st)
                det = [v for p, v in leaves if "detected" in jax.tree_util.keystr(p)]
                rows = [v for p, v in leaves if "rows" in jax.tree_util.keystr(p)]
                return sum(jnp.sum(v) for v in det), sum(jnp.sum(v) for v in rows)

            return jax.lax.map(one, keys)

        det, rows = detected(params, jax.random.split(jax.random.key(11), 200))
        assert float(np.sum(rows)) == 200 * 7 * IDS.size  # 7 linears, every row of each
        assert float(np.sum(det)) == 0.0, dtype


# --- gradients and AdamW moments (optax) -----------------------------------------------------
def test_gradient_fault_flips_one_selected_element_and_recompute_draws_anew():
    import optax

    from aqn_jax.faults.bitfaults import TreeBits
    from aqn_jax.sdc.trees import tree_fault_flips, with_tree_faults

    # The MLPs of both layers (a small tree keeps the compile short); layer 1's are selected.
    params = {f"layers_{i}": {"mlp": PARAMS[f"layers_{i}"]["mlp"]} for i in (0, 1)}
    g = jax.tree_util.tree_map(lambda p: jnp.full(p.shape, 0.5, p.dtype), params)
    sel = SiteSelector(("mlp",), (1,))
    paths = TreeBits(BitFault(count=1), "gradient").paths(params, sel)
    assert paths == [f"layers_1/mlp/{k}/kernel" for k in ("down_proj", "gate_proj", "up_proj")]

    @functools.cache
    def program(fault):  # step and attempt are traced: one compile per fault
        opt = with_tree_faults(optax.identity(), [(TreeBits(fault, "gradient"), sel)], (), 0)
        values = lambda step, att: {SDC_STEP: jnp.float32(step), SDC_ATTEMPT: jnp.float32(att)}
        update = lambda st, step, att: opt.update(g, st, params, values=values(step, att))
        return opt.init(params), jax.jit(update)

    def corrupted(fault, step, attempt):
        st0, update = program(fault)
        u, st = update(st0, step, attempt)
        changed = {
            jax.tree_util.keystr(p): np.argwhere(np.asarray(a) != 0.5)
            for p, a in jax.tree_util.tree_leaves_with_path(u)
            if np.any(np.asarray(a) != 0.5)
        }
        return u, changed, int(tree_fault_flips(st))

    fault = BitFault(bits=(30,), count=1)
    u, changed, flips = corrupted(fault, 3, 0)
    # One element of each selected leaf: 0.5 with bit 30 set is 0.5 * 2^128.
    assert flips == 3 and len(changed) == 3
    assert all("layers_1" in k and "mlp" in k and len(v) == 1 for k, v in changed.items())
    k = np.asarray(u["layers_1"]["mlp"]["up_proj"]["kernel"])
    assert k.max() == np.float32(0.5) * np.float32(2.0**64) * np.float32(2.0**64)
    _, again, _ = corrupted(fault, 3, 1)  # the next attempt: a fresh draw
    assert any(not np.array_equal(again[k], changed[k]) for k in changed)
    once = BitFault(bits=(30,), count=1, steps=(3,))
    assert corrupted(once, 3, 0)[2] == 3 and corrupted(once, 3, 1)[2] == 0
    assert corrupted(once, 4, 0)[2] == 0


def test_a_recomputed_step_hands_its_attempt_to_a_transient_tree_fault():
    """The trainer's values for the update (`telemetry.step_values`) carry the attempt whenever
    the plan has a tree fault, not only a `steps` one: the optimizer keys its draw with it (the
    test above), so a recomputed step draws anew. Negative controls: a plan without a tree or
    `steps` fault gets no values (its programs unchanged); a `steps` fault its step and attempt."""
    from aqn_jax.faults.bitfaults import SDC_ATTEMPT, SDC_STEP
    from aqn_jax.sdc.guard import GuardSpec
    from aqn_jax.sdc.telemetry import sdc_spec, step_values

    def values(attempt, **fields):
        plan = fault_plan(bit_config(**fields), 2)
        return step_values(plan, sdc_spec(GuardSpec(), 1.0, plan, 10), 3, attempt)

    grad = dict(count=1, target="gradient", phases=("train",))
    assert values(0, **grad) == {SDC_STEP: 3.0, SDC_ATTEMPT: 0.0}
    assert values(2, **grad) == {SDC_STEP: 3.0, SDC_ATTEMPT: 2.0}  # the recompute's draw
    assert values(1, count=1) == {}  # a module fault on every step: nothing traced
    assert values(1, count=1, steps="(3,)") == {SDC_STEP: 3.0, SDC_ATTEMPT: 1.0}


@pytest.mark.slow
def test_moment_fault_and_the_range_check():
    from aqn_jax.faults.bitfaults import TreeBits
    from aqn_jax.rl import optim
    from aqn_jax.sdc import trees

    params = {"layers_0": {"self_attn": {"q_proj": PARAMS["layers_0"]["self_attn"]["q_proj"]}}}
    g = jax.tree_util.tree_map(lambda p: jnp.full(p.shape, 1e-3, p.dtype), params)
    bound = trees.moment_bound(1.0, 10)
    in_range_of = jax.jit(lambda st: trees.moments_in_range(st, bound))
    sel = SiteSelector(("q_proj",), (0,))
    for fault, in_range in (
        (BitFault(bits=(30,), rate=0.0), True),  # negative control
        (BitFault(bits=(30,), count=1), False),  # |mu| * 2^128 > 1: out of range
        (BitFault(bits="sign", count=1), False),  # a negative nu
    ):
        opt = trees.with_tree_faults(
            optim.adamw(1e-3, grad_clip=1.0), (), [(TreeBits(fault, "optimizer"), sel)], 0
        )
        values = {SDC_STEP: jnp.float32(0)}  # the key of step 0, attempt 0 (no `steps` fault)
        update = jax.jit(functools.partial(opt.update, values=values))
        _, st = update(g, opt.init(params), params)
        assert bool(in_range_of(st)) == in_range
        assert int(trees.tree_fault_flips(st)) == (0 if in_range else 4)  # q_proj kernel + bias


def test_bad_guard_config_names_the_field():
    from aqn_jax.sdc.config import sdc_config
    from aqn_jax.sdc.guard import guard_spec

    for field, value, match in (
        ("guard", "retry", r"config.sdc.guard='retry'; allowed"),
        ("max_recomputes", -1, r"config.sdc.max_recomputes=-1; must be >= 0"),
        ("window", 2, r"config.sdc.window=2; must be >= 5"),
    ):
        c = sdc_config()
        c[field] = value
        with pytest.raises(ValueError, match=match):
            guard_spec(c)


def test_guard_verdicts():
    from aqn_jax.sdc.guard import Guard, GuardSpec, robust_z

    rng = np.random.RandomState(0)
    history = list(1.0 + 0.01 * rng.randn(12))
    # log-MAD of ~1% noise is below the 5% floor: z = log(x) / 0.05.
    assert robust_z(np.exp(0.3), [1.0] * 8) == pytest.approx(6.0)
    guard = Guard(GuardSpec("recompute", z=6.0))
    for v in history:
        guard.accept({"actor/grad_norm": v, "sdc/update_rms": v * 1e-4})
    ok = {"actor/pg_loss": 0.1, "actor/grad_norm": 1.05, "sdc/update_rms": 1.05e-4}
    assert guard.verdict(ok) is None
    assert "anomaly" in guard.verdict({**ok, "actor/grad_norm": 3.0})
    assert "non-finite actor/grad_norm" in guard.verdict({**ok, "actor/grad_norm": np.inf})
    assert "moment" in guard.verdict({**ok, "sdc/moments_ok": 0.0})
    assert "ABFT" in guard.verdict({**ok, "sdc/detected_abft_train": 2.0})
    skip = Guard(GuardSpec("skip"))
    for v in history:
        skip.accept({"actor/grad_norm": v})
    assert skip.verdict({**ok, "actor/grad_norm": 3.0}) is None  # skip acts on non-finite only
    assert skip.verdict({**ok, "actor/pg_loss": np.nan}).startswith("non-finite")
    # The rollout: a non-finite log-prob of a live response token rejects it in both modes; one
    # on a masked (padding) position does not; ABFT rows in the rollout only with recompute.
    logp, rmask = np.full((2, 3), -0.5, np.float32), np.array([[1, 1, 0], [1, 0, 0]])
    assert guard.rollout_verdict(logp, rmask, 0.0) is None
    logp[1, 2] = np.nan  # padding
    assert guard.rollout_verdict(logp, rmask, 0.0) is None
    logp[0, 1] = np.nan
    assert "1 response token" in guard.rollout_verdict(logp, rmask, 0.0)
    assert "1 response token" in skip.rollout_verdict(logp, rmask, 0.0)
    assert "ABFT flagged 3 rows" in guard.rollout_verdict(np.zeros((2, 3)), rmask, 3.0)
    assert skip.rollout_verdict(np.zeros((2, 3)), rmask, 3.0) is None


def test_recovery_attempts_keys_skip_and_rollback():
    # `Recovery` with a fake rollout and train function (host only): the order of the attempts,
    # their fault keys, what a rejected attempt leaves in the counts, skip, and the rollback.
    from types import SimpleNamespace

    from aqn_jax.sdc.guard import GuardSpec, RollbackNeeded
    from aqn_jax.sdc.recovery import ATTEMPT_TAG, Recovery

    out = SimpleNamespace(fault_stats={})
    good = {"rmask": np.ones((2, 3)), "sampler_logp": np.zeros((2, 3))}
    nan = {"rmask": np.ones((2, 3)), "sampler_logp": np.full((2, 3), np.nan)}
    seen = []

    def fakes(bad_rollouts=(), bad_updates=()):
        def rollout(a):
            seen.append(("rollout", a))
            return out, nan if a in bad_rollouts else good

        def train(rows, a):
            seen.append(("train", a))
            loss = np.inf if a in bad_updates else 1.0
            return SimpleNamespace(mets={"actor/pg_loss": loss, "sdc/injected_update": 2.0})

        return rollout, train

    # recompute: attempt 0's rollout is non-finite (generated again), attempt 1's update is
    # non-finite (recomputed on the same rows), attempt 2 is accepted.
    rec = Recovery(GuardSpec("recompute", max_recomputes=2), seed=0)
    got = rec.step(5, *fakes(bad_rollouts=(0,), bad_updates=(1,)))
    assert seen == [("rollout", 0), ("rollout", 1), ("train", 1), ("train", 2)]
    assert got.rows is good and got.train.mets["actor/pg_loss"] == 1.0 and not got.skipped
    assert got.counts["sdc/recomputed"] == 2.0 and got.counts["sdc/injected_rejected"] == 2.0
    assert got.counts["sdc/rolled_back"] == 0.0
    # The keys: attempt 0 is the step's, attempt n folds ATTEMPT_TAG + n.
    kd = jax.random.key_data
    np.testing.assert_array_equal(kd(rec.fault_key(5, "train")), kd(step_key(0, 5, "train")))
    want = jax.random.fold_in(step_key(0, 5, "train"), ATTEMPT_TAG + 2)
    np.testing.assert_array_equal(kd(rec.fault_key(5, "train", 2)), kd(want))
    assert not np.array_equal(kd(rec.fault_key(5, "train", 1)), kd(want))
    # skip: the bad update is dropped, nothing recomputed.
    seen.clear()
    got = Recovery(GuardSpec("skip"), seed=0).step(5, *fakes(bad_updates=(0,)))
    assert seen == [("rollout", 0), ("train", 0)] and got.skipped
    assert got.counts["sdc/guard_skipped"] == 1.0 and got.counts["sdc/recomputed"] == 0.0
    # No guard (negative control): one rollout, one train, no counts, whatever the metrics.
    seen.clear()
    got = Recovery(GuardSpec(), seed=0).step(5, *fakes(bad_updates=(0,)))
    assert seen == [("rollout", 0), ("train", 0)] and got.counts == {} and not got.skipped
    # Rollback: past max_recomputes; without a checkpoint the loop's first state; the step
    # then starts past the failed attempts; failing again raises naming the bit faults.
    rec = Recovery(GuardSpec("recompute", max_recomputes=1), seed=0, note="bitflip(bits=(30,))")
    with pytest.raises(RollbackNeeded) as e:
        rec.step(3, *fakes(bad_updates=(0, 1)))
    assert rec.rollback(e.value, lambda: None, ("s0", "d0", 1)) == ("s0", "d0", 1)
    assert rec.rollback(RollbackNeeded(4, "x"), lambda: ("s2", "d2", 3), ()) == ("s2", "d2", 3)
    seen.clear()
    got = rec.step(3, *fakes())
    assert seen == [("rollout", 2), ("train", 2)] and got.counts["sdc/rolled_back"] == 1.0
    with pytest.raises(RollbackNeeded) as e:
        rec.step(3, *fakes(bad_updates=(2, 3)))
    with pytest.raises(FloatingPointError, match=r"RL step 3: .*again.*bitflip\(bits=\(30,\)\)"):
        rec.rollback(e.value, lambda: None, ())


# --- the guard, end to end ---------------------------------------------------------------------
@pytest.mark.slow  # two smoke runs of the shallow model, and the session's clean one
@pytest.mark.xdist_group("clean_smoke")  # conftest.clean_smoke, with test_train's clean arm
def test_guard_recomputes_a_planted_gradient_flip_and_the_control_diverges(
    sft_cache, tmp_path, clean_smoke
):
    # Step 1's backward pass gets bit 30 (the f32 exponent's top bit) set in every element of
    # layer 1's down_proj dX, the gradient flowing back into the MLP: each |dX| < 1 becomes
    # |dX| 2^128, the parameter gradients below it exceed 1.8e19 and their squares overflow:
    # the gradient norm is inf. Without a guard the run stops on the non-finite step, naming the
    # step and the fault (the negative control); with config.sdc.guard=recompute the step is
    # recomputed with the next attempt's draw (the planted flip fires on the first attempt
    # only) and the run ends with the clean run's metrics: the same computations on the same
    # inputs, the programs differing by the fault's masked-off XOR, the guard's extra
    # reductions and no donation (asserted to float32 rounding, rtol 1e-5; measured bitwise).
    from aqn_jax.launch import run
    from aqn_jax.metrics import read_metrics

    from conftest import load_config, shallow

    def config(**over):
        c = load_config("clean", "smoke")
        c.sft.cache_dir = sft_cache
        return shallow(c, **over)

    planted = {
        "faults.bitflip.enabled": True,
        "faults.bitflip.sites": ("down_proj",),
        "faults.bitflip.layers": "1",
        "faults.bitflip.point": "dx",
        "faults.bitflip.phases": ("train",),
        "faults.bitflip.bits": "(30,)",
        "faults.bitflip.rate": 1.0,
        "faults.bitflip.steps": "(1,)",
    }
    with pytest.raises(
        FloatingPointError,
        match=r"RL step 1: a bit fault fired in this step .*non-finite .*bitflip",
    ):
        run(config(**planted), str(tmp_path / "control"))
    run(config(**planted, **{"sdc.guard": "recompute"}), str(tmp_path / "guarded"))
    # The clean run: config() with nothing planted, run once for the session (conftest).
    guarded, clean = read_metrics(str(tmp_path / "guarded")), read_metrics(str(clean_smoke[0]))
    assert guarded[1]["sdc/recomputed"] == 1.0 and guarded[2]["sdc/recomputed"] == 0.0
    # Every flip that fired counts: all of the rejected attempt's, none of the accepted one's.
    assert guarded[1]["sdc/injected"] == guarded[1]["sdc/injected_rejected"] > 0
    for g, c in zip(guarded, clean, strict=True):
        for k, v in c.items():
            if k.startswith("timing_s"):
                continue
            np.testing.assert_allclose(g[k], v, rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.slow  # one smoke run of the shallow model, and the session's clean one
@pytest.mark.xdist_group("clean_smoke")
def test_guard_regenerates_a_rollout_with_a_planted_exponent_flip(sft_cache, tmp_path, clean_smoke):
    # Step 1's rollout gets bit 30 (the f32 exponent's top bit) flipped in one element of layer
    # 1's down_proj output in every forward call: |x| < 1 becomes 2^128 |x| (|x| >= 1: inf or
    # NaN). The next RMSNorm's mean of squares overflows, so the stream is zeroed (finite,
    # uniform logits: garbage tokens) or NaN (NaN log-probs). Either way the step's update
    # would learn from a corrupted rollout; the guard used to see only the update, and the
    # vulnerability grid's weight/e7 and rollout/e7 cells diverged 2/2 with it on. Now the
    # rollout verdict rejects it (ABFT flags the corrupted row of down_proj's output, or the
    # log-probs are non-finite; tests/test_sdc.py::test_guard_verdicts has both) and the
    # rollout is generated again with the next attempt's draw from the same prompts and
    # sampling key: the clean run's tokens, and then its metrics (the same bound as the
    # gradient test above: ABFT only reads the products).
    from aqn_jax.launch import run
    from aqn_jax.metrics import read_metrics

    from conftest import load_config, shallow

    c = load_config("clean", "smoke")
    c.sft.cache_dir = sft_cache
    planted = {
        "faults.bitflip.enabled": True,
        "faults.bitflip.sites": ("down_proj",),
        "faults.bitflip.layers": "1",
        "faults.bitflip.phases": ("rollout",),
        "faults.bitflip.bits": "(30,)",
        "faults.bitflip.count": 1,
        "faults.bitflip.steps": "(1,)",
        "sdc.guard": "recompute",
        "sdc.abft": True,
    }
    run(shallow(c, **planted), str(tmp_path / "guarded"))
    guarded, clean = read_metrics(str(tmp_path / "guarded")), read_metrics(str(clean_smoke[0]))
    assert [r.get("sdc/recomputed") for r in guarded[1:]] == [1.0, 0.0]
    # The rejected rollout's flips count (sdc/injected_rollout: one per forward call, at least
    # the prefill's), and its flagged rows; the accepted rollouts had none.
    assert guarded[1]["sdc/injected_rollout"] >= 1.0 and guarded[2]["sdc/injected_rollout"] == 0
    assert guarded[1]["sdc/detected_abft_rollout"] >= 1.0
    assert guarded[2]["sdc/detected_abft_rollout"] == 0 and guarded[2]["sdc/detected_abft"] == 0
    for g, c in zip(guarded, clean, strict=True):
        for k, v in c.items():
            if k.startswith("timing_s"):
                continue
            np.testing.assert_allclose(g[k], v, rtol=1e-5, atol=1e-7, err_msg=k)


# --- the vulnerability study's pieces ----------------------------------------------------------
def test_study_bit_labels_outcomes_and_wilson(tmp_path):
    from aqn_jax.jobs.vulnerability import bit_position
    from aqn_jax.study import sdc as study

    assert [bit_position(b, "float32") for b in ("sign", "e7", "e0", "m1", "m2")] == [
        31,
        30,
        23,
        22,
        21,
    ]
    assert [bit_position(b, "bfloat16") for b in ("sign", "e7", "e0", "m1")] == [15, 14, 7, 6]
    with pytest.raises(ValueError, match="'e8'; allowed"):
        bit_position("e8", "float32")
    # Wilson 95% for 8/10: centre (0.8 + 1.92/10) / 1.384, half-width 1.96 sqrt(0.016 +
    # 0.0096) / 1.384: [0.4902, 0.9433].
    lo, hi = study.wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    clean = [{"step": 1, "actor/grad_norm": 1.0, "actor/pg_loss": 0.1, "val-core/acc": 0.5}]
    row = dict(clean[0])
    assert study.classify([row], clean, 128, False) == "masked"
    assert study.classify([{**row, "actor/grad_norm": 3.0}], clean, 128, False) == "spike_recover"
    spike = {**row, "sdc/grad_norm": float("inf")}  # the norm the optimizer received
    assert study.classify([spike], clean, 128, False) == "spike_recover"
    assert study.classify([{**row, "actor/pg_loss": 9.0}], clean, 128, False) == "masked"
    # 0.5 of 128: the Wilson interval's lower end is 0.415; 0.40 is below it, 0.42 above.
    assert study.classify([{**row, "val-core/acc": 0.40}], clean, 128, False) == "degraded"
    assert study.classify([{**row, "val-core/acc": 0.42}], clean, 128, False) == "masked"
    assert study.classify([row], clean, 128, True) == "diverged"
    summary = study.cell_summary(["masked", "degraded", "diverged", "spike_recover"])
    assert summary["bad_share"] == 0.5 and summary["ci"] == list(study.wilson(2, 4))
    result = {
        "model": "tiny", "dtype": "float32", "steps": 3, "fire_step": 2, "count": 1,
        "trials": 4, "seeds": [0, 1, 2, 3], "val_size": 128, "bits": ["e7"],
        "sites": ["mlp_fwd"], "cells": {"mlp_fwd/e7": summary}, "wall_s": 1.0,
    }  # fmt: skip
    md = study.write_report(str(tmp_path), result)
    assert "| e7 | 0.50 [" in (tmp_path / md).read_text()
    saved = json.loads((tmp_path / "vulnerability.json").read_text())
    assert saved["cells"]["mlp_fwd/e7"]["n"] == 4
    assert (tmp_path / "vulnerability.png").stat().st_size > 0


@pytest.mark.slow
def test_weight_fault_on_the_forward_seam():
    # A weight fault acts on the weights as the forward reads them: count=2 elements of layer
    # 0's down_proj kernel get the sign bit flipped, the logits move, the flips are reported
    # under fault_stats/weights, and the stored params are untouched.
    from aqn_jax.faults.bitfaults import TreeBits
    from aqn_jax.forward import forward as seam

    sel = SiteSelector(("down_proj",), (0,))
    plan = FaultPlan([Injection("bitflip", sel, TreeBits(BitFault(bits="sign", count=2)))])
    assert trace_manifest(plan, MODEL, PARAMS, "eval") == {
        "bitflip": ["layers_0/mlp/down_proj/kernel"]
    }
    before = jax.tree_util.tree_map(np.array, PARAMS)

    @jax.jit
    def run(params, key):
        return seam(MODEL, params, IDS, plan=plan, key=key, mutable=["fault_stats"])

    out, st = run(PARAMS, step_key(0, 1, "eval"))
    clean = MODEL.apply({"params": PARAMS}, IDS)
    assert float(st["fault_stats"]["weights"]["bitflip.flips"][0]) == 2.0
    assert not np.array_equal(np.asarray(out), np.asarray(clean))
    for a, b in zip(
        jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(PARAMS), strict=True
    ):
        np.testing.assert_array_equal(a, np.asarray(b))
    # The fault's own draw applied to the params outside the seam: the same logits, up to the
    # float32 rounding of two programs (the flip fused into the forward or not): sums of at
    # most 256 terms, ~256 * 2^-24 = 1.5e-5 relative, on logits of ~10.
    flipped, n = TreeBits(BitFault(bits="sign", count=2)).apply(
        PARAMS, sel, jax.random.fold_in(step_key(0, 1, "eval"), 0), {}, tag="w/"
    )
    assert int(n) == 2
    by_hand = np.asarray(MODEL.apply({"params": flipped}, IDS))
    np.testing.assert_allclose(np.asarray(out), by_hand, rtol=2e-5, atol=2e-4)
    assert np.abs(np.asarray(out) - np.asarray(clean)).max() > 1e-2  # far above that


@pytest.mark.slow  # two more smoke runs, on the guard's programs compiled by the test above
def test_guard_skip_and_rollback_paths(sft_cache, tmp_path):
    # The same planted dX flip at step 1. guard=skip: the update is dropped (the state before
    # the step is kept, the step counts) and the run goes on. guard=recompute with
    # max_recomputes=0: the step fails at once and the job rolls back to the loop's first
    # state (no checkpoint yet); the redone step starts past the failed attempt, so the planted
    # flip does not fire again and the run ends with sdc/rolled_back on that step.
    from aqn_jax.launch import run
    from aqn_jax.metrics import read_metrics

    from conftest import load_config, shallow

    planted = {
        "faults.bitflip.enabled": True,
        "faults.bitflip.sites": ("down_proj",),
        "faults.bitflip.layers": "1",
        "faults.bitflip.point": "dx",
        "faults.bitflip.phases": ("train",),
        "faults.bitflip.bits": "(30,)",
        "faults.bitflip.rate": 1.0,
        "faults.bitflip.steps": "(1,)",
    }

    def go(name, **over):
        c = load_config("clean", "smoke")
        c.sft.cache_dir = sft_cache
        run(shallow(c, **planted, **over), str(tmp_path / name))
        return read_metrics(str(tmp_path / name))

    skipped = go("skip", **{"sdc.guard": "skip"})
    assert [r.get("sdc/guard_skipped") for r in skipped[1:]] == [1.0, 0.0]
    assert "actor/grad_norm" not in skipped[1]  # the rejected attempt's inf, dropped
    rolled = go("rollback", **{"sdc.guard": "recompute", "sdc.max_recomputes": 0})
    rows = {int(r["step"]): r for r in rolled}  # the redone step's row is the later one
    assert rows[1]["sdc/rolled_back"] == 1.0 and rows[1]["sdc/recomputed"] == 0.0
    assert rows[2]["sdc/rolled_back"] == 0.0
    assert all(np.isfinite(v) for k, v in rows[2].items() if not k.startswith("timing"))


def test_injected_rollout_is_the_total_over_the_rollouts_forward_calls():
    # One element flipped per call at each of two tensors (down_proj of layers 0 and 1): the
    # sampler's prefill and each decode step are one call, and a step's rollout ran
    # 1 + (its longest response) calls, so sdc/injected_rollout = 2 x (1 + longest response).
    from aqn_jax.rl.sampler import Sampler, SamplingParams
    from aqn_jax.sdc.telemetry import sdc_kinds, sdc_metrics

    fault = BitFault("flip", bits=(3,), count=1)  # a low mantissa bit: decoding goes on
    plan = FaultPlan([Injection("bitflip", SiteSelector(("down_proj",), (0, 1)), Bits(fault))])
    sp = SamplingParams(max_new_tokens=6, eos_id=1, pad_id=0, temperature=0.0)
    out = Sampler(MODEL, sp, plan, buckets=(IDS.shape[1],))(
        PARAMS, IDS, np.ones_like(IDS), jax.random.key(0)
    )
    longest = int(out.response_mask.sum(1).max())
    # The sampler's per-call means: one flip per tensor in every call.
    stats = summarize_stats(out.fault_stats)
    per_call = [float(v) for k, v in stats.items() if k.startswith("bitflip.flips/layers_")]
    assert per_call == [1.0, 1.0], stats
    m = sdc_metrics(sdc_kinds(plan), {"response_length/max": float(longest)}, out.fault_stats, {})
    assert m["sdc/injected_rollout"] == 2 * (1 + longest)
    assert m["sdc/detected_abft_rollout"] == 0.0  # no ABFT in this plan


# --- ABFT on the backward products (config.sdc.abft_backward) --------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_backward_abft_catches_flips_above_its_tolerance_and_claims_none_below(dtype):
    # dX = g Wᵀ and dW = xᵀ g as autodiff forms them for the Linear's expression, one flip per
    # row of each at every bit position in turn; the same derived tolerance as the forward's
    # (inner dimension O for dX, the N tokens for dW).
    from aqn_jax.faults import bitfaults
    from aqn_jax.faults.ops import linear

    backward_checks = jax.jit(bitfaults.backward_checks)

    width = bits.layout(dtype)[0]
    kx, kw, kg, kc = jax.random.split(jax.random.key(5), 4)
    N, K, O = 512, 64, 128
    x = jax.random.normal(kx, (N, K)).astype(dtype)
    w = (jax.random.normal(kw, (K, O)) / 8).astype(dtype)
    g = jax.random.normal(kg, (N, O)).astype(dtype)
    _, vjp = jax.vjp(lambda x, w: linear(x, w, None), x, w)
    dx, dw = vjp(g)
    assert jax.jit(bitfaults.backward_detections)(x, w, g, dx, dw).tolist() == [0.0, 0.0]
    for which in (0, 1):  # dX (N rows), dW (K rows)
        y = (dx, dw)[which]
        (_, resid, tol) = backward_checks(x, w, g, dx, dw)[which]
        bit_of_row = jnp.arange(y.shape[0]) % width
        y2 = one_flip_per_row(y, bit_of_row, kc)
        planted = (y2, dw) if which == 0 else (dx, y2)
        flagged = np.asarray(backward_checks(x, w, g, *planted)[which][0])
        with np.errstate(invalid="ignore"):  # inf - inf where a flip made an inf
            delta = np.abs(np.asarray(y2, np.float64) - np.asarray(y, np.float64)).sum(1)
        delta = np.where(np.isfinite(delta), delta, np.inf)
        above = delta > 2 * np.asarray(tol)  # a change rounding cannot reach: caught
        assert above.sum() >= y.shape[0] // (4 if dtype == jnp.float32 else 32), which
        assert np.all(flagged[above]), which
        below = delta < np.asarray(tol) - np.asarray(resid)  # within the clean headroom
        assert below.sum() > y.shape[0] // 8 and not np.any(flagged[below]), which
        assert np.all(below[np.asarray(bit_of_row) == 0])  # the lowest mantissa bit: never


ONE_LAYER = Qwen2Config.tiny(num_hidden_layers=1)


def _backward_abft_probe(plan, params, model, ids, step):
    """The probe's gradient ([layers, linear kinds, (dX, dW)]: rows flagged) of one
    differentiated pass of `model` under `plan` at RL step `step` (what
    `sdc/telemetry.abft_accumulate` does)."""
    from aqn_jax.faults.bitfaults import abft_probe, backward_probe

    values = {SDC_STEP: jnp.float32(step), SDC_ATTEMPT: jnp.float32(0)}

    def loss(pp):
        with backward_probe(pp[1]), plan.apply("train", key=step_key(0, 1, "train"), values=values):
            logits = model.apply({"params": pp[0]}, ids)
        return jnp.mean(logits.astype(jnp.float32) ** 2)

    probe = abft_probe(model.config.num_hidden_layers)
    return jax.grad(loss)((params, probe))[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.slow
def test_backward_abft_flags_the_corrupted_product_at_its_site_and_no_clean_row(dtype):
    # One program (the fault's `steps` are traced): at step 1 the exponent's top bit of one of the
    # one-layer model's down_proj dW elements flips (count=1), at step 2 of its o_proj dX;
    # backward ABFT on every linear. Step 1: exactly that product's one row is flagged, nothing
    # elsewhere (dW does not flow on); step 2: that site's dX. Then 200 clean passes (step 3,
    # random token batches): no row flagged in any linear's dX or dW.
    import dataclasses

    from aqn_jax.faults.bitfaults import PRODUCTS
    from aqn_jax.faults.config import with_abft
    from aqn_jax.faults.sites import LINEAR_KINDS

    top = bits.layout(dtype)[0] - 2  # the exponent's top bit: 30 (f32), 14 (bf16)
    flip = lambda s: BitFault(bits=(top,), count=1, steps=(s,))  # noqa: E731
    faults = [
        Injection("bitflip_dw", SiteSelector(("down_proj",), (0,)), BitsLinear(flip(1), "dw")),
        Injection("bitflip_dx", SiteSelector(("o_proj",), (0,)), BitsLinear(flip(2), "dx")),
    ]
    plan = with_abft(FaultPlan(faults), forward=False, backward=True)
    model = Qwen2ForCausalLM(dataclasses.replace(ONE_LAYER, dtype=dtype))
    params = random_params(ONE_LAYER, seed=1)

    @jax.jit
    def counts(params, keys, steps):
        def one(ks):
            ids = jax.random.randint(ks[0], IDS.shape, 0, CONFIG.vocab_size)
            return _backward_abft_probe(plan, params, model, ids, ks[1])

        return jax.lax.map(one, (keys, steps))

    steps = jnp.asarray([1, 2] + [3] * 200, jnp.float32)
    out = np.asarray(counts(params, jax.random.split(jax.random.key(12), len(steps)), steps))
    down, o = LINEAR_KINDS.index("down_proj"), LINEAR_KINDS.index("o_proj")
    dx, dw = PRODUCTS.index("dx"), PRODUCTS.index("dw")
    assert out[0, 0, down, dw] == 1 and out[0].sum() == 1
    assert out[1, 0, o, dx] >= 1
    assert out.shape == (202, 1, 7, 2) and out[2:].sum() == 0.0
    if dtype == "float32":  # outside a differentiated pass: the module's own computation
        np.testing.assert_array_equal(
            program(with_abft(FaultPlan(), forward=False, backward=True))()[0],
            program(FaultPlan())()[0],
        )
