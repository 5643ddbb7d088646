"""bf16 compute (`config.model.dtype='bfloat16'`, f32 master weights): the faults' semantics on
bf16 values, and the forward, the RL step's gradient and the sampler in bf16 against f32.

The faults compute their statistics in float32 (ops.deadzone_threshold, formats._Quantizer), so
on bf16 values the reference is the f32 computation on the same values upcast (exact), the
result cast back to bf16. Tiny shapes, every program jitted once."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from aqn_jax.aqn.config import AQN_SIGMA
from aqn_jax.aqn.plan import build_plan
from aqn_jax.faults import formats, ops
from aqn_jax.faults.config import fault_plan
from aqn_jax.models.qwen2 import Qwen2Config, Qwen2ForCausalLM, init_cache
from aqn_jax.rl import step as rl_step
from aqn_jax.rl.sampler import Sampler, SamplingParams
from aqn_jax.spec import step_spec

from conftest import load_config, random_params, shallow

BF16 = jnp.bfloat16


def bits(x) -> np.ndarray:
    """The bit patterns of a bf16 array (bitwise comparison; NaN == NaN)."""
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x, BF16), jnp.uint16))


def bf16_values(shape, seed=0, scale=1.0) -> jax.Array:
    """Random bf16 values spanning several octaves (log-normal magnitudes, random signs)."""
    rng = np.random.default_rng(seed)
    mag = np.exp(rng.normal(0.0, 1.5, shape)) * scale
    return jnp.asarray(np.where(rng.random(shape) < 0.5, -mag, mag), BF16)


# --- deadzone: max-fraction severity --------------------------------------------------------
def test_deadzone_threshold_is_not_rounded_to_bf16():
    # amax = 2 and threshold 0.14975: thr = 0.2995 in f32. bf16 has 8 significant bits, so in
    # [0.25, 0.5) its grid step is 2**-9: 0.2995 * 512 = 153.34 lies between 153/512 =
    # 0.298828125 and 154/512. A bf16-rounded threshold would be 153/512, and 153/512 < 153/512
    # is False; the f32 threshold flushes it (0.298828125 < 0.2995). 154/512 = 0.30078125
    # survives either way.
    x = jnp.asarray([2.0, -153 / 512, 154 / 512, 0.25, -1.0, 0.0, 0.3125, -0.296875], BF16)
    out = ops.deadzone(x, 0.14975)
    assert out.dtype == BF16
    expected = [2.0, 0.0, 154 / 512, 0.0, -1.0, 0.0, 0.3125, 0.0]
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    # Negative control: the same comparison against the bf16-rounded threshold keeps 153/512,
    # so the test above does tell the two semantics apart.
    thr_bf16 = jnp.asarray(np.float32(0.14975) * 2.0, BF16)
    assert float(thr_bf16) == 153 / 512
    assert not bool(jnp.abs(x[1]) < thr_bf16)


@pytest.mark.parametrize("granularity", ["tensor", "token", "block"])
def test_deadzone_on_bf16_equals_f32_on_the_same_values(granularity):
    x = bf16_values((4, 64), seed=1)
    kw = dict(granularity=granularity, block_size=16)
    fn = jax.jit(lambda v: ops.deadzone(v, 0.05, **kw))
    out, ref = fn(x), fn(x.astype(jnp.float32))
    assert out.dtype == BF16 and ref.dtype == jnp.float32
    # Exact: a flushed value is 0, a kept one is the input itself (f32 holds every bf16 value).
    np.testing.assert_array_equal(bits(out), bits(ref.astype(BF16)))
    flushed = float(jnp.mean(out == 0))
    assert 0.05 < flushed < 0.95, flushed  # not vacuous: some values flush, most do not all


# --- deadzone: quantile severity --------------------------------------------------------------
def test_quantile_threshold_on_bf16_is_the_kth_smallest():
    # 256 distinct bf16 magnitudes (consecutive bit patterns from 0.5 up), shuffled, random
    # signs: q = 0.75 flushes exactly the k = floor(0.75 * 256) = 192 smallest.
    pattern = np.arange(256, dtype=np.uint16) + np.uint16(0x3F00)  # 0x3F00 = bf16 0.5
    rng = np.random.default_rng(2)
    mags = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(pattern), BF16), np.float32)
    vals = rng.permutation(mags) * np.where(rng.random(256) < 0.5, -1, 1)
    x = jnp.asarray(vals.reshape(4, 64), BF16)
    fn = jax.jit(lambda v: ops.deadzone(v, 0.75, severity="quantile"))
    out = fn(x)
    assert int(jnp.sum(out == 0)) == 192
    thr = ops.deadzone_threshold(x, 0.75, severity="quantile")
    assert float(thr.reshape(())) == np.sort(mags)[192]  # exactly the 192nd (0-based) |x|
    np.testing.assert_array_equal(bits(out), bits(fn(x.astype(jnp.float32)).astype(BF16)))


def test_quantile_per_token_with_bf16_ties():
    # bf16's coarse grid makes ties: rows of 8 values with repeats. q = 0.5, k = 4: the
    # threshold is the 4th smallest |x| (0-based); values equal to it survive.
    x = jnp.asarray(
        [
            [0.5, -0.5, 0.25, 1.0, 0.5, -2.0, 0.125, 0.5],  # sorted: .125 .25 .5 .5 [.5] .5 1 2
            [3.0, 1.0, -1.0, 1.0, 0.75, -0.75, 0.75, 3.0],  # .75 .75 .75 1 [1] 1 3 3
        ],
        BF16,
    )
    out = ops.deadzone(x, 0.5, severity="quantile", granularity="token")
    expected = [
        [0.5, -0.5, 0.0, 1.0, 0.5, -2.0, 0.0, 0.5],  # only .125 and .25 are below 0.5
        [3.0, 1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 3.0],  # the three 0.75s are below 1.0
    ]
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    thr = ops.deadzone_threshold(x, 0.5, severity="quantile", granularity="token")
    np.testing.assert_array_equal(np.asarray(thr).ravel(), [0.5, 1.0])


def test_kth_smallest_of_bf16_values_equals_sort():
    x = bf16_values((3, 96), seed=3)
    a = jnp.abs(x).astype(jnp.float32)
    k = jnp.asarray([[0], [47], [95]])
    got = jax.jit(ops.kth_smallest_nonneg)(a, k)
    want = np.take_along_axis(np.sort(np.asarray(a), axis=-1), np.asarray(k), axis=-1)
    np.testing.assert_array_equal(np.asarray(got), want)


# --- MX / NVFP4 fake quantisation -------------------------------------------------------------
def test_mxfp4_block_on_bf16_hand_computed():
    # One block of 32 with amax 6: shared exponent floor(log2 6) - emax(e2m1) = 2 - 2 = 0, so
    # scale 1 and every element rounds to the FP4 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, ties away
    # from zero. bf16 inputs: 0.3 -> 0.30078125 and 0.74 -> 0.73828125, 0.24 -> 0.240234375.
    x = np.zeros(32, np.float32)
    x[:9] = [6.0, 0.3, 0.25, 0.74, 1.25, -2.5, 5.0, 0.24, -0.75]
    want = np.zeros(32, np.float32)
    want[:9] = [6.0, 0.5, 0.5, 0.5, 1.5, -3.0, 6.0, 0.0, -1.0]
    out = formats.quantize_mx(jnp.asarray(x, BF16), "mxfp4")
    assert out.dtype == BF16
    np.testing.assert_array_equal(np.asarray(out, np.float32), want)


@pytest.mark.parametrize("fmt", formats.MX_FORMATS)
def test_mx_on_bf16_equals_f32_and_is_exact_in_bf16(fmt):
    x = bf16_values((2, 64), seed=4)
    fn = jax.jit(lambda v: formats.quantize_mx(v, fmt))
    out, ref = fn(x), fn(x.astype(jnp.float32))
    # An MX value is an element-format value times a power of two: at most 8 significant bits
    # (mxint8: 127), so bf16 holds it exactly and the bf16 path loses nothing.
    ref_np = np.asarray(ref)
    np.testing.assert_array_equal(np.asarray(ref.astype(BF16), np.float32), ref_np)
    np.testing.assert_array_equal(bits(out), bits(ref.astype(BF16)))
    # Negative control: the quantiser changed values (it is not the identity on bf16).
    changed = float(np.mean(np.asarray(out, np.float32) != np.asarray(x, np.float32)))
    assert changed > 0.1 if fmt != "mxint8" else changed > 0.0, changed


def test_nvfp4_on_bf16_equals_f32_rounded_to_bf16():
    x = bf16_values((2, 64), seed=5)
    fn = jax.jit(formats.quantize_nvfp4)
    out, ref = fn(x), fn(x.astype(jnp.float32))
    assert out.dtype == BF16
    # NVFP4's dequantised value q * fp8 block scale * f32 tensor scale need not be a bf16
    # value: the bf16 path rounds the f32 result once, to nearest.
    np.testing.assert_array_equal(bits(out), bits(ref.astype(BF16)))
    assert float(np.mean(np.asarray(out, np.float32) != np.asarray(x, np.float32))) > 0.5


# --- the model and the RL step --------------------------------------------------------------
F32_CFG = Qwen2Config.tiny(num_hidden_layers=2)
BF16_CFG = dataclasses.replace(F32_CFG, dtype="bfloat16")
PARAMS = random_params(F32_CFG, seed=0)


def _logp(cfg, params, ids):
    logits = Qwen2ForCausalLM(cfg).apply({"params": params}, ids)
    return jax.nn.log_softmax(logits, axis=-1), logits


def test_bf16_forward_casts_matmul_inputs_and_keeps_f32_logits():
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 200, (2, 12)), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p: _logp(BF16_CFG, p, ids))(PARAMS)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2 * 7 + 2 * 2 + 1  # 7 linears + 2 attention products per layer, head
    for e in dots:
        assert {v.aval.dtype for v in e.invars} == {jnp.dtype(BF16)}, e
    # The 7 projections and the attention scores of each layer, and the head, accumulate in f32
    # (preferred_element_type); the probabilities x values product is the one that does not.
    f32_acc = [e for e in dots if e.params["preferred_element_type"] == jnp.float32]
    assert len(f32_acc) == 2 * 8 + 1
    logp16, logits16 = jax.jit(lambda p: _logp(BF16_CFG, p, ids))(PARAMS)
    logp32, logits32 = jax.jit(lambda p: _logp(F32_CFG, p, ids))(PARAMS)
    assert logits16.dtype == jnp.float32
    # Tolerance: bf16 keeps 8 significant bits (relative rounding 2**-9) at every matmul input
    # and every residual add of the 2 layers; measured here 0.043 x the logits' std (3.2) at
    # the worst of 2 x 12 x 256 logits, 0.027 nats mean log-prob error. Bounds: 0.1 x std and
    # 0.05 nats.
    dlogit = np.abs(np.asarray(logits16) - np.asarray(logits32))
    assert dlogit.max() < 0.1 * float(np.std(np.asarray(logits32))), dlogit.max()
    assert np.abs(np.asarray(logp16) - np.asarray(logp32)).mean() < 0.05
    assert dlogit.max() > 1e-4  # negative control: bf16 did change the numbers
    # f32 config: the same program in f32 has no bf16 anywhere.
    jaxpr32 = jax.make_jaxpr(lambda p: _logp(F32_CFG, p, ids))(PARAMS)
    assert "bf16" not in str(jaxpr32)


def _dot_precisions(fn, *args) -> list:
    """The `precision` of every dot_general in fn's jaxpr, nested jaxprs (custom_vjp, jit)
    included."""
    out = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                out.append(e.params["precision"])
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


def test_f32_products_ask_for_float32_on_every_backend():
    """XLA's DEFAULT precision lets a GPU multiply f32 operands in TF32 (an H100 put the f32
    logits 0.004-0.013 from transformers', bound 1e-4): every f32 product of the forward, its
    backward and the faulty matmul unit asks for HIGHEST. CPU computes the same bits either way,
    so this is checked on the program, not on the numbers. bf16 operands keep DEFAULT (their
    products are exact in the f32 accumulator): the negative control."""
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 200, (2, 12)), jnp.int32)

    def loss(cfg):
        return lambda p: _logp(cfg, p, ids)[0].mean()

    fwd32 = _dot_precisions(loss(F32_CFG), PARAMS)
    assert len(fwd32) == 2 * 7 + 2 * 2 + 1 and set(fwd32) == {highest}
    grad32 = _dot_precisions(jax.grad(loss(F32_CFG)), PARAMS)
    assert len(grad32) == 3 * len(fwd32) and set(grad32) == {highest}  # forward + 2 per dot
    x = jnp.ones((3, 4, 8), jnp.float32)
    w = jnp.ones((8, 5), jnp.float32)

    def faulty(x, w):
        return ops.noisy_linear(x, w, None, jax.random.key(0), 0.1).sum()

    unit = _dot_precisions(jax.grad(faulty, argnums=(0, 1)), x, w)
    assert len(unit) == 3 and set(unit) == {highest}  # y, dX, dW
    assert set(_dot_precisions(jax.grad(loss(BF16_CFG)), PARAMS)) == {None}


def _step_static(model_cfg, arm):
    config = shallow(load_config(arm))  # deadzone: the quantile deadzone at layer 1 of 3
    config.rollout.max_new_tokens = 6
    n = model_cfg.num_hidden_layers
    plan = build_plan(config.faults, config.aqn, n)
    hw = fault_plan(config.faults, n)
    return rl_step.static_from(step_spec(config), model_cfg, plan, hw, 4)


# Bounds on the cosine between the bf16 and the f32 actor gradient of one mini-batch. Clean
# device: measured 0.9992. Faulty device (75% of layer 1's output flushed): measured 0.89; the
# fault makes the loss itself this sensitive: the f32 gradient at the weights rounded to bf16
# (f32 compute) is at 0.92 from the f32 one, and 0.1% multiplicative weight noise gives 0.988
# (the flush set moves, 5-8% of tokens cross the PPO clip). Negative control: another batch.
@pytest.mark.parametrize(
    ("arm", "min_cos", "pg_tol"), [("clean", 0.99, 0.01), ("deadzone", 0.8, 0.1)]
)
@pytest.mark.slow
def test_rl_step_gradient_in_bf16_is_close_to_f32(arm, min_cos, pg_tol):
    cfg32 = Qwen2Config.tiny(num_hidden_layers=3)
    cfg16 = dataclasses.replace(cfg32, dtype="bfloat16")
    params = random_params(cfg32, seed=1)
    s32, s16 = _step_static(cfg32, arm), _step_static(cfg16, arm)
    rows, plen, new = 10, 8, s32.max_new

    def batch(seed):
        r = np.random.default_rng(seed)
        ids = r.integers(3, 200, (rows, plen + new)).astype(np.int32)
        rmask = np.ones((rows, new), np.int32)
        rmask[::3, 4:] = 0
        b = dict(
            ids=ids,
            mask=np.ones_like(ids),
            tokens=ids[:, plen:],
            rmask=rmask,
            advantages=np.repeat(r.normal(size=(rows, 1)), new, 1).astype(np.float32),
        )
        # Old and reference log-probs: the f32 policy on this device (the step's prepare
        # pass), so the PPO ratio starts at exactly 1 in f32.
        (lp, _), _ = rl_step.policy_logprobs(s32, params, b, jax.random.key(1), {AQN_SIGMA: 0.0})
        b.update(old_logp=lp, ref_logp=lp)
        return jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], b)

    def grads(static, mb):
        fn = jax.jit(
            lambda p, m: rl_step.minibatch_grads(
                static, p, m, jax.random.key(0), 0, {AQN_SIGMA: 0.0}
            )
        )
        g, mets, _ = fn(params, mb)
        return jnp.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(g)]), g, mets

    def cos(a, b):
        return float(jnp.dot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))

    b0 = batch(0)
    g32, _, m32 = grads(s32, b0)
    g16, tree16, m16 = grads(s16, b0)
    # f32 master weights: the gradient reaching the optimizer is f32 in bf16 compute too.
    assert {x.dtype for x in jax.tree_util.tree_leaves(tree16)} == {jnp.dtype(jnp.float32)}
    assert cos(g16, g32) > min_cos, cos(g16, g32)
    # The policy loss (about -0.43 here): measured |bf16 - f32| 0.002 clean, 0.049 faulty.
    assert abs(float(m16["pg_loss"]) - float(m32["pg_loss"])) < pg_tol
    # Negative control: another batch's f32 gradient is far from this one, so the bound
    # discriminates (a tolerance any gradient would meet proves nothing).
    g_other, _, _ = grads(s32, batch(1))
    assert cos(g_other, g32) < 0.5, cos(g_other, g32)


@pytest.mark.slow
def test_sampler_in_bf16_uses_a_bf16_cache_and_matches_its_teacher_forced_forward():
    cache = init_cache(BF16_CFG, 2, 8)
    assert {x.dtype for x in cache.k + cache.v} == {jnp.dtype(BF16)}
    weights16 = jax.tree_util.tree_map(lambda x: x.astype(BF16), PARAMS)  # generation weights
    ids = np.random.default_rng(1).integers(3, 200, (3, 8)).astype(np.int32)
    mask = np.ones_like(ids)
    sp = SamplingParams(max_new_tokens=5, eos_id=1, pad_id=0, temperature=1.0)
    out = Sampler(Qwen2ForCausalLM(BF16_CFG), sp, buckets=(8,))(
        weights16, ids, mask, jax.random.key(3)
    )
    assert int(out.response_mask.sum()) > 0
    full = np.concatenate([ids, out.tokens], axis=1)
    # The teacher-forced forward from the f32 master weights (each matmul casts its kernel to
    # bf16: the same values as the bf16 copy) gives the sampler's log-probs.
    logp, _ = jax.jit(lambda p, x: _logp(BF16_CFG, p, x))(PARAMS, full)
    tf = np.take_along_axis(np.asarray(logp[:, 7:-1]), out.tokens[..., None], -1)[..., 0]
    live = out.response_mask > 0
    diff = np.abs(tf - out.logprobs)[live]
    # Cached decode and the full forward order their bf16 roundings differently (one token at
    # a time vs the whole sequence): equal to a few hundredths of a nat, not bit for bit.
    assert diff.max() < 0.05, diff.max()
    # Negative control: the f32 forward's log-probs of the same tokens differ from bf16's by
    # more than the bf16-vs-bf16 gap above would allow to go unnoticed.
    logp32, _ = jax.jit(lambda p, x: _logp(F32_CFG, p, x))(PARAMS, full)
    tf32 = np.take_along_axis(np.asarray(logp32[:, 7:-1]), out.tokens[..., None], -1)[..., 0]
    assert np.abs(tf32 - out.logprobs)[live].max() > 1e-4
