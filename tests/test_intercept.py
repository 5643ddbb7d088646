"""The interceptor on the tiny model: targeting, manifest, determinism, telemetry, no retrace."""

import dataclasses
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqn_jax.faults.intercept import FaultPlan, Injection, fault_trial, step_key, summarize_stats
from aqn_jax.faults.sites import SiteSelector
from aqn_jax.faults.transforms import (
    Deadzone,
    Noise,
    NoisyLinear,
    NormWeightNoise,
    Quantize,
    Scale,
    TransformBase,
)
from aqn_jax.forward import trace_manifest
from aqn_jax.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

from conftest import random_params
from tolerance import bound, forward_path

CONFIG = Qwen2Config.tiny(num_hidden_layers=4)
MODEL = Qwen2ForCausalLM(CONFIG)
PARAMS = random_params(CONFIG, seed=0)
# MODEL's first 2 layers: half the draws to compile where 2 layers show what a test checks.
MODEL2 = Qwen2ForCausalLM(dataclasses.replace(CONFIG, num_hidden_layers=2))
PARAMS2 = {k: v for k, v in PARAMS.items() if k not in ("layers_2", "layers_3")}
IDS = np.random.RandomState(0).randint(0, CONFIG.vocab_size, size=(2, 12))


def run(
    plan,
    phase="train",
    key=None,
    values=None,
    params=PARAMS,
    capture=False,
    model=MODEL,
    manifest=None,
    lower_only=False,
):
    """Logits, fault stats and (optionally) every module's output, with the plan active; the
    trace's hits go into `manifest[phase]` when a dict is given (`lower_only`: the program is
    traced and lowered, not compiled or run; None returned). The key and the values are
    arguments of the program, not constants: runs that differ only in them share one compiled
    program (the session's persistent XLA cache), as the trainer's steps do."""
    key = step_key(0, 0, phase) if key is None else key

    def forward(params, key, values):
        with plan.apply(phase, key=key, values=values) as hits:
            out = model.apply(
                {"params": params},
                IDS,
                mutable=["fault_stats", "intermediates"] if capture else ["fault_stats"],
                capture_intermediates=capture,
            )
        if manifest is not None:
            manifest[phase] = hits
        return out

    values = {k: jnp.float32(v) for k, v in (values or {}).items()}
    if lower_only:
        jax.jit(forward).lower(params, key, values)
        return None
    logits, state = jax.jit(forward)(params, key, values)
    return np.asarray(logits), state


@functools.cache
def clean_run(capture=False):
    """`run` of the plain model (no injection), made once for the tests that compare with it
    (read only)."""
    return run(FaultPlan([]), capture=capture)


def layer_out(state, i):
    return np.asarray(state["intermediates"][f"layers_{i}"]["__call__"][0][0])


def inj(name, kinds, transform, layers="all", point="output", phases=("train",)):
    return Injection(name, SiteSelector(kinds, layers, point), transform, phases)


# --- manifest: exact targeting ------------------------------------------------------------------
@pytest.mark.parametrize(
    "kinds,layers,point,expected",
    [
        (("layer",), (2,), "output", ["layers_2/layer:output"]),
        (
            ("linear",),
            (1,),
            "input",
            [
                f"layers_1/{k}:input"
                for k in (
                    "q_proj",
                    "k_proj",
                    "v_proj",
                    "o_proj",
                    "gate_proj",
                    "up_proj",
                    "down_proj",
                )
            ],
        ),
        (
            ("rmsnorm",),
            "all",
            "output",
            [
                f"layers_{i}/{k}:output"
                for i in range(4)
                for k in ("input_layernorm", "post_attention_layernorm")
            ]
            + ["norm:output"],
        ),
        (
            ("rmsnorm",),
            (0, 3),
            "output",
            [
                "layers_0/input_layernorm:output",
                "layers_0/post_attention_layernorm:output",
                "layers_3/input_layernorm:output",
                "layers_3/post_attention_layernorm:output",
            ],
        ),
        (("attn", "mlp"), (3,), "output", ["layers_3/attn:output", "layers_3/mlp:output"]),
        (("down_proj",), "all", "output", [f"layers_{i}/down_proj:output" for i in range(4)]),
        (("lm_head",), "all", "input", ["lm_head:input"]),
        (("embed_tokens",), "all", "output", ["embed_tokens:output"]),
    ],
)
@pytest.mark.slow
def test_manifest_lists_exactly_the_selected_paths(kinds, layers, point, expected):
    plan = FaultPlan([inj("n", kinds, Noise("absolute_gaussian", Scale(0.0)), layers, point)])
    hits = trace_manifest(plan, MODEL, PARAMS, "train")
    assert sorted(hits["n"]) == sorted(expected)
    # A run's jitted forward records the same manifest: the hits are recorded as it traces
    # (compiling and executing it add none), so the run is lowered, not compiled.
    manifest = {}
    run(plan, manifest=manifest, lower_only=True)
    assert sorted(manifest["train"]["n"]) == sorted(expected)


def test_all_layers_never_selects_embeddings_or_head_implicitly():
    plan = FaultPlan([inj("n", ("linear",), Noise("absolute_gaussian", Scale(0.0)))])
    hits = trace_manifest(plan, MODEL, PARAMS, "train")["n"]
    assert len(hits) == 7 * 4 and not any(h.startswith(("lm_head", "embed")) for h in hits)


def test_injection_that_matches_nothing_raises_before_running():
    # Layer 7 does not exist in a 4-layer model (validate() would say so; here the trace does).
    plan = FaultPlan([inj("ghost", ("layer",), Deadzone(0.1), layers=(7,))])
    with pytest.raises(ValueError, match="matched no module: ghost"):
        trace_manifest(plan, MODEL, PARAMS, "train")
    with pytest.raises(ValueError, match="injection 'ghost' layers=\\(7,\\) but the model has 4"):
        plan.validate(4)


def test_phase_gating():
    plan = FaultPlan([inj("dz", ("layer",), Deadzone(0.5), layers=(1,), phases=("rollout",))])
    clean, _ = clean_run()
    manifest = {}
    train, _ = run(plan, phase="train", manifest=manifest)
    rollout, _ = run(plan, phase="rollout", manifest=manifest)
    np.testing.assert_array_equal(train, clean)
    assert np.abs(rollout - clean).max() > 1e-3
    assert manifest["train"] == {} and manifest["rollout"]["dz"] == ["layers_1/layer:output"]


# --- transparency ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_zero_scales_give_the_plain_model_exactly():
    # Every transform at every kind it takes: the linears in one layer (each site is a draw of
    # its own to compile, and the claim is per site), the norms in every layer and the model's
    # final norm (a site outside the layers, which only "all" selects).
    plan = FaultPlan(
        [
            inj("rel", ("linear",), Noise("relative_gaussian", Scale(0.0)), (1,)),
            inj(
                "abs",
                ("rmsnorm",),
                Noise("absolute_gaussian", Scale(1.0, value="sigma")),
                point="input",
            ),
            inj("aqn", ("rmsnorm",), NormWeightNoise(Scale(1.0, value="sigma"))),
            inj("op", ("down_proj",), NoisyLinear(Scale(0.0)), (1,)),
        ]
    )
    clean, _ = clean_run()
    faulty, st = run(plan, values={"sigma": 0.0})
    # Every injected error is exactly zero ...
    stats = summarize_stats(st["fault_stats"])
    assert stats["rel.noise_rms_rel/mean"] == 0.0 and stats["abs.noise_rms_rel/mean"] == 0.0
    assert stats["aqn.noise_rms_rel/mean"] == 0.0
    # ... and the logits equal the plain model's up to float rounding: once a matmul's output
    # feeds the (zero) noise, XLA may fuse and accumulate it differently (two programs: f32
    # rounding along the forward, tests/tolerance.py; seen on AMD EPYC: <= 6.2e-6 on logits of
    # magnitude ~5, only with noise on linear outputs; bit-exact for the others).
    tol = bound(forward_path(CONFIG, IDS.shape[1]), np.abs(clean).max())
    np.testing.assert_allclose(faulty, clean, rtol=0, atol=tol)
    exact = FaultPlan([i for i in plan.injections if i.name != "rel"])
    np.testing.assert_array_equal(run(exact, values={"sigma": 0.0})[0], clean)


@pytest.mark.slow
def test_params_and_init_unchanged():
    # The norm-weight noise (an op-level transform reading the params) at one layer's norms.
    plan = FaultPlan([inj("aqn", ("rmsnorm",), NormWeightNoise(Scale(0.5)), (0,))])
    before = jax.tree_util.tree_map(np.array, PARAMS)
    _, state = run(plan)
    assert set(state) == {"fault_stats"}  # no params returned as mutated
    chex.assert_trees_all_equal(PARAMS, before)
    # Init of MODEL2 (its every initializer is a random draw to compile; the plan's sites are in
    # its layer 0), traced inside / outside the plan.
    init_fn = jax.jit(lambda key: MODEL2.init(key, IDS))
    with plan.apply("train", key=jax.random.key(0)):
        init = init_fn(jax.random.key(3))  # inactive during init
    plain = jax.jit(lambda key: MODEL2.init(key, IDS))(jax.random.key(3))
    chex.assert_trees_all_equal(nn.unbox(init), nn.unbox(plain))


# --- deadzone semantics ---------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.slow
def test_deadzone_at_layer_k_leaves_earlier_layers_untouched(k):
    plan = FaultPlan([inj("dz", ("layer",), Deadzone(0.2), layers=(k,))])
    _, clean = clean_run(capture=True)
    _, faulty = run(plan, capture=True)
    for i in range(k):
        np.testing.assert_array_equal(layer_out(faulty, i), layer_out(clean, i))
    h = layer_out(clean, k)
    # Hand check of layer k's output: flushed exactly where |h| < 0.2 * max|h| of the tensor.
    expected = np.where(np.abs(h) < 0.2 * np.abs(h).max(), 0.0, h)
    np.testing.assert_array_equal(layer_out(faulty, k), expected)
    stats = summarize_stats(faulty["fault_stats"])
    np.testing.assert_allclose(
        stats[f"dz.flushed/layers_{k}"], np.mean(np.abs(h) < 0.2 * np.abs(h).max()), rtol=1e-6
    )
    assert 0.0 < stats[f"dz.flushed/layers_{k}"] < 1.0
    assert np.abs(layer_out(faulty, 3) - layer_out(clean, 3)).max() > 1e-3


@pytest.mark.parametrize("granularity", ["tensor", "token"])
@pytest.mark.slow
def test_quantile_deadzone_flushes_the_stated_fraction_through_the_interceptor(granularity):
    q = 0.6
    dz = Deadzone(q, severity="quantile", granularity=granularity)
    _, clean = clean_run(capture=True)
    _, faulty = run(FaultPlan([inj("dz", ("layer",), dz, layers=(2,))]), capture=True)
    h = np.abs(layer_out(clean, 2))
    # By hand: the floor(q n) smallest |h| of the tensor, or of each token's D values.
    rows = h.reshape(1, -1) if granularity == "tensor" else h.reshape(-1, h.shape[-1])
    k = int(np.floor(q * rows.shape[1]))
    thr = np.sort(rows, axis=1)[:, k : k + 1]
    expected = np.where((rows < thr).reshape(h.shape), 0.0, layer_out(clean, 2))
    np.testing.assert_array_equal(layer_out(faulty, 2), expected)
    flushed = summarize_stats(faulty["fault_stats"])["dz.flushed/layers_2"]
    assert flushed == pytest.approx(k * rows.shape[0] / h.size, abs=1e-6)
    assert "quantile=0.6" in dz.describe()


@pytest.mark.slow
def test_deadzone_noise_deadzone_composition_and_rescue_telemetry():
    """AQN before the deadzone can rescue: |s| < thr but |s + n| >= thr survives."""
    noise = Noise("absolute_gaussian", Scale(1.0, value="sigma"))
    dz = Deadzone(0.3)
    key = step_key(0, 5, "rollout")
    _, clean = clean_run(capture=True)
    s = layer_out(clean, 1)
    thr = 0.3 * np.abs(s).max()

    before = FaultPlan(
        [
            inj("aqn", ("layer",), noise, (1,), phases=("rollout",)),
            inj("dz", ("layer",), dz, (1,), phases=("rollout",)),
        ]
    )
    _, st = run(before, phase="rollout", key=key, values={"sigma": 0.5}, capture=True)
    out = layer_out(st, 1)
    noisy = s + (out - s)  # where not flushed, out = s + n exactly
    survived = out != 0
    stats = summarize_stats(st["fault_stats"])
    rescued = np.mean((np.abs(s) < np.abs(s).max() * 0.3) & survived)
    # With noise first, the threshold is computed on s + n; rescued counts |s| < thr' & survived.
    thr_noisy = 0.3 * np.abs(noisy[survived]).max()
    np.testing.assert_allclose(
        stats["dz.rescued/layers_1"], np.mean((np.abs(s) < thr_noisy) & survived), rtol=1e-6
    )
    assert stats["dz.rescued/layers_1"] > 0 and rescued > 0

    # The original DeadzoneMatMul: deadzone, noise, deadzone again with the first threshold.
    between = FaultPlan(
        [
            inj("dz", ("layer",), dz, (1,), phases=("rollout",)),
            inj(
                "aqn",
                ("layer",),
                Noise("relative_gaussian", Scale(1.0, value="sigma")),
                (1,),
                phases=("rollout",),
            ),
            inj(
                "dz2",
                ("layer",),
                dataclasses.replace(dz, reuse_threshold=True),
                (1,),
                phases=("rollout",),
            ),
        ]
    )
    _, st = run(between, phase="rollout", key=key, values={"sigma": 0.5}, capture=True)
    out = layer_out(st, 1)
    assert np.all(out[np.abs(s) < thr] == 0)  # relative noise cannot revive a flushed zero
    assert np.all((out == 0) | (np.abs(out) >= thr * (1 - 1e-6)))
    stats = summarize_stats(st["fault_stats"])
    assert stats["dz2.rescued/layers_1"] == 0.0
    assert stats["dz2.flushed/layers_1"] >= stats["dz.flushed/layers_1"]
    np.testing.assert_allclose(stats["aqn.noise_rms_rel/layers_1"], 0.5, rtol=0.1)


# --- randomness -----------------------------------------------------------------------------------
def _site_noise(key, sigma=1.0):
    """Noise added at gate_proj and up_proj of layer 0 (same input, same shape)."""
    plan = FaultPlan(
        [inj("n", ("gate_proj", "up_proj"), Noise("absolute_gaussian", Scale(sigma)), (0,))]
    )
    _, clean = clean_run(capture=True)
    _, noisy = run(plan, key=key, capture=True)
    get = lambda st, k: np.asarray(st["intermediates"]["layers_0"]["mlp"][k]["__call__"][0])  # noqa: E731
    return (
        get(noisy, "gate_proj") - get(clean, "gate_proj"),
        get(noisy, "up_proj") - get(clean, "up_proj"),
    )


def test_noise_is_a_function_of_seed_step_phase_and_site():
    g1, u1 = _site_noise(step_key(0, 3, "train"))
    g2, u2 = _site_noise(step_key(0, 3, "train"))
    np.testing.assert_array_equal(g1, g2)  # same (seed, step, phase) -> identical
    np.testing.assert_array_equal(u1, u2)
    assert np.corrcoef(g1.ravel(), u1.ravel())[0, 1] < 0.05  # different sites -> different
    g3, _ = _site_noise(step_key(0, 4, "train"))
    g4, _ = _site_noise(step_key(0, 3, "rollout"))
    g5, _ = _site_noise(step_key(1, 3, "train"))
    for other in (g3, g4, g5):
        assert np.abs(other - g1).max() > 0.1
    np.testing.assert_allclose(g1.std(), 1.0, rtol=0.05)


@pytest.mark.slow
def test_new_sigma_does_not_retrace():
    traces = []
    plan = FaultPlan([inj("aqn", ("rmsnorm",), NormWeightNoise(Scale(1.0, value="sigma")))])

    @jax.jit
    def forward(params, sigma):
        traces.append(1)
        with plan.apply("train", key=step_key(0, 0, "train"), values={"sigma": sigma}):
            return MODEL.apply({"params": params}, IDS)

    outs = [np.asarray(forward(PARAMS, jnp.float32(s))) for s in (0.0, 0.01, 0.05, 0.0)]
    assert len(traces) == 1
    np.testing.assert_array_equal(outs[0], outs[3])
    assert (
        np.abs(outs[1] - outs[0]).max() > 0
        and np.abs(outs[2] - outs[0]).max() > np.abs(outs[1] - outs[0]).max()
    )


# --- AQN on RMSNorm weights (QeRL) ----------------------------------------------------------------
@pytest.mark.slow
def test_norm_weight_noise_is_one_vector_per_norm_redrawn_per_step():
    sigma = 0.05
    plan = FaultPlan([inj("aqn", ("input_layernorm",), NormWeightNoise(Scale(sigma)), (0,))])
    _, clean = clean_run(capture=True)
    get = lambda st: np.asarray(st["intermediates"]["layers_0"]["input_layernorm"]["__call__"][0])  # noqa: E731
    w = PARAMS["layers_0"]["input_layernorm"]["weight"]
    draws = []
    for step in (0, 1):
        _, st = run(plan, key=step_key(0, step, "train"), capture=True)
        # out = (w + sigma n) * normed(x) and clean = w * normed(x): the ratio gives n per token.
        n = (get(st) / get(clean) - 1.0) * w / sigma
        np.testing.assert_allclose(n, np.broadcast_to(n[0, 0], n.shape), atol=2e-4)  # one vector
        draws.append(n[0, 0])
    for n in draws:
        assert abs(n.mean()) < 0.3 and 0.8 < n.std() < 1.2
    assert np.corrcoef(draws[0], draws[1])[0, 1] < 0.3  # redrawn each step, not accumulated


# --- remat and op-level transforms ----------------------------------------------------------------
@pytest.mark.slow
def test_remat_model_gets_the_same_faults():
    # MODEL2 (2 layers, both rematerialised), with value noise on one attention and one MLP
    # linear of each, not all seven: each site is a draw compiled in the forward and again in
    # the remat recompute. The deadzone in layer 0, the op-level fault in layer 1.
    plan = FaultPlan(
        [
            inj("dz", ("layer",), Deadzone(0.1), (0,)),
            inj("n", ("q_proj", "down_proj"), Noise("relative_gaussian", Scale(0.05))),
            inj("op", ("down_proj",), NoisyLinear(Scale(0.05)), (1,)),
        ]
    )
    remat = Qwen2ForCausalLM(dataclasses.replace(MODEL2.config, remat=True))

    def loss(params, model):
        with plan.apply("train", key=step_key(0, 0, "train")):
            logits = model.apply({"params": params}, IDS)
        return jnp.mean(logits[..., 0]), logits

    a = jax.jit(jax.value_and_grad(lambda p: loss(p, MODEL2), has_aux=True))(PARAMS2)
    b = jax.jit(jax.value_and_grad(lambda p: loss(p, remat), has_aux=True))(PARAMS2)
    # Two programs (remat recomputes the forward in the backward; the random faults draw the
    # same keys): the loss, a mean of logits, within the forward's f32 rounding at the logits'
    # scale; the gradients within twice that path plus a weight gradient's sum over the tokens,
    # at the largest gradient's scale (tests/tolerance.py).
    n = forward_path(MODEL2.config, IDS.shape[1]) + IDS.size
    (loss_a, logits), (loss_b, _) = a[0], b[0]
    np.testing.assert_allclose(loss_a, loss_b, rtol=0, atol=bound(n, np.abs(logits).max()))
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(a[1]))
    chex.assert_trees_all_close(a[1], b[1], rtol=0, atol=bound(2 * n, scale))


@pytest.mark.slow
def test_deadzone_gradient_mask_in_the_model():
    """grad='mask' zeroes the gradient through flushed lanes of layer 1's output."""

    def loss(params, grad):
        plan = FaultPlan([inj("dz", ("layer",), Deadzone(0.99, grad=grad), (3,))])
        with plan.apply("train"):
            return jnp.sum(MODEL.apply({"params": params}, IDS))

    g_mask = jax.jit(jax.grad(loss), static_argnums=1)(PARAMS, "mask")
    g_ste = jax.jit(jax.grad(loss), static_argnums=1)(PARAMS, "ste")
    # threshold 0.99: almost everything in layer 3's output flushes; with 'mask' almost no
    # gradient reaches layer 3's MLP (its output only reaches the loss through layer 3's output).
    mask_norm = np.linalg.norm(g_mask["layers_3"]["mlp"]["down_proj"]["kernel"])
    ste_norm = np.linalg.norm(g_ste["layers_3"]["mlp"]["down_proj"]["kernel"])
    assert mask_norm < 0.05 * ste_norm


@pytest.mark.slow
def test_mxfp4_on_all_linear_inputs_reports_error():
    plan = FaultPlan([inj("q", ("linear",), Quantize("mxfp4"), point="input")])
    logits, st = run(plan)
    stats = summarize_stats(st["fault_stats"])
    clean, _ = clean_run()
    assert np.abs(logits - clean).max() > 1e-3
    assert 0.01 < stats["q.rel_err/mean"] < 0.5
    assert len([k for k in stats if k.startswith("q.rel_err/layers_")]) == 28


# --- a transform is a function: a new fault needs no change to the interceptor -----------------
class _ScaleBy(TransformBase):
    """A fault the interceptor has never seen: x * factor, reporting the site and a key draw
    (`TransformBase` gives the protocol's defaults: any kind, no traced value)."""

    level = "value"

    def __init__(self, factor):
        self.factor = factor

    def __call__(self, x, ctx):
        ctx.sow("mean_abs", jnp.mean(jnp.abs(x)))
        ctx.sow("key_draw", jax.random.uniform(ctx.key))
        return x * self.factor

    def describe(self):
        return f"scale_by({self.factor})"


class _ZeroOp(TransformBase):
    """An op-level fault the interceptor has never seen: the module's output replaced by 0."""

    level = "op"

    def __call__(self, module, args, ctx):
        ctx.sow("hit", jnp.float32(1.0))
        return jnp.zeros(args[0].shape[:-1] + (module.features,), args[0].dtype)

    def describe(self):
        return "zero_op"


def test_a_new_transform_is_one_function_object():
    plan = FaultPlan(
        [inj("x3", ("layer",), _ScaleBy(3.0), (1,)), inj("z", ("o_proj",), _ZeroOp(), (2,))]
    )
    _, clean = clean_run(capture=True)
    manifest = {}
    _, faulty = run(plan, capture=True, manifest=manifest)
    np.testing.assert_array_equal(layer_out(faulty, 0), layer_out(clean, 0))
    np.testing.assert_array_equal(layer_out(faulty, 1), 3.0 * layer_out(clean, 1))
    o_proj = np.asarray(faulty["intermediates"]["layers_2"]["self_attn"]["o_proj"]["__call__"][0])
    np.testing.assert_array_equal(o_proj, 0.0)
    stats = summarize_stats(faulty["fault_stats"])
    np.testing.assert_allclose(
        stats["x3.mean_abs/layers_1"], np.abs(layer_out(clean, 1)).mean(), rtol=1e-6
    )
    assert (
        0.0 <= stats["x3.key_draw/layers_1"] < 1.0 and stats["z.hit/layers_2/self_attn/o_proj"] == 1
    )
    assert manifest["train"] == {
        "x3": ["layers_1/layer:output"],
        "z": ["layers_2/o_proj:output"],
    }


@pytest.mark.slow
def test_fault_trial_redraws_noise_and_restores_the_outer_trial():
    plan = FaultPlan([inj("n", ("layer",), Noise("absolute_gaussian", Scale(0.5)), (1,))])
    dz = FaultPlan([inj("dz", ("layer",), Deadzone(0.3), (1,))])
    plain, _ = run(plan)
    with fault_trial(0):
        zero, _ = run(plan)
        with fault_trial(1):
            one, _ = run(plan)
            dz_one, _ = run(dz)
        zero_again, _ = run(plan)
    after, _ = run(plan)
    np.testing.assert_array_equal(zero, zero_again)  # the inner trial ended
    np.testing.assert_array_equal(plain, after)  # outside any trial: keys unchanged
    assert np.abs(zero - one).max() > 1e-3 and np.abs(plain - zero).max() > 1e-3
    np.testing.assert_array_equal(dz_one, run(dz)[0])  # a deterministic fault: no redraw
