"""config.faults / config.aqn -> FaultPlan: validation that names the field, the built plans,
and the AQN schedules (QeRL's ten values)."""

import json

import ml_collections
import numpy as np
import pytest

from aqn_jax.aqn.config import aqn_config, aqn_sigma
from aqn_jax.aqn.plan import build_plan
from aqn_jax.aqn.schedules import qerl_sigmas, sigma_at
from aqn_jax.faults.config import faults_config
from aqn_jax.faults.fields import parse_layers
from aqn_jax.faults.transforms import Deadzone, Noise, NoisyLinear, NormWeightNoise, Quantize
from aqn_jax.forward import trace_manifest
from aqn_jax.models.hf import abstract_params
from aqn_jax.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

NUM_LAYERS = 8


def make_config(**sections):
    c = ml_collections.ConfigDict()
    c.faults = faults_config()
    c.aqn = aqn_config()
    c.faults.deadzone.layers = "3"  # the default (15) is for the 28-layer 1.5B model
    c.update_from_flattened_dict({k.replace("__", "."): v for k, v in sections.items()})
    return c


# --- schedules ----------------------------------------------------------------------------------
def test_qerl_schedule_reproduces_reference_values():
    # REFERENCE.md: sigma_start 5e-2, sigma_end 5e-4, K = 10.
    expected = [0, 0.05, 0.0281, 0.0158, 0.00889, 0.005, 0.00281, 0.00158, 0.000889, 0.0005]
    got = qerl_sigmas(0.05, 0.0005, 10)
    np.testing.assert_allclose(got, expected, rtol=2e-3)
    # Exact form: 0.05 * 0.01 ** ((i - 1) / 8).
    np.testing.assert_allclose(got[1:], [0.05 * 0.01 ** ((i - 1) / 8) for i in range(1, 10)])
    # Steps split evenly into 10 intervals: 100 steps -> 10 per interval.
    per_step = [sigma_at("qerl", s, 100, 0.05, 0.0005, 10) for s in range(100)]
    assert per_step[:10] == [0.0] * 10
    assert per_step[10:20] == [got[1]] * 10 and per_step[99] == got[9]
    assert sigma_at("qerl", 100, 100, 0.05, 0.0005, 10) == got[9]  # capped at the last interval


def test_epoch_aware_schedule():
    # 2 epochs of 50 steps, 0.05 -> 0.0005: epoch 0 runs 0.05 -> 0.005, epoch 1 0.005 -> 0.0005,
    # each with its own sigma-0 warm-up interval.
    s = [
        sigma_at("epoch_aware", t, 100, 0.05, 0.0005, num_stages=5, num_epochs=2)
        for t in range(100)
    ]
    assert s[:10] == [0.0] * 10 and s[50:60] == [0.0] * 10
    np.testing.assert_allclose(s[10], 0.05)
    np.testing.assert_allclose(s[40], 0.005)
    np.testing.assert_allclose(s[60], 0.005)
    np.testing.assert_allclose(s[99], 0.0005)
    np.testing.assert_allclose(s[20], 0.05 * 0.1 ** (1 / 3))


def test_epoch_aware_schedule_with_the_seeds_boundaries():
    """The seed's statement (epoch 1: 0.05 -> 0.01, epoch 2: 0.01 -> 0.0005), 12 steps of 2
    epochs and 6 intervals: one sigma-0 warm-up step, then sigma > 0 at every step."""
    kw = dict(num_stages=6, num_epochs=2, epoch_sigmas=(0.05, 0.01, 0.0005), warmup="first_epoch")
    got = [sigma_at("epoch_aware", t, 12, 0.05, 0.0005, **kw) for t in range(12)]
    first = [0.0] + [0.05 * (0.01 / 0.05) ** (i / 4) for i in range(5)]  # QeRL's K - 2 = 4
    second = [0.01 * (0.0005 / 0.01) ** (i / 5) for i in range(6)]  # no warm-up: K - 1 = 5
    np.testing.assert_allclose(got, first + second, rtol=1e-12)
    assert got[5] == pytest.approx(0.01) and got[6] == pytest.approx(0.01) and min(got[1:]) > 0
    # Every epoch with its warm-up (the default): the same boundaries, a sigma-0 step at 6.
    every = [
        sigma_at("epoch_aware", t, 12, 0.05, 0.0005, 6, 2, epoch_sigmas=(0.05, 0.01, 0.0005))
        for t in range(12)
    ]
    np.testing.assert_allclose(every[:6], first, rtol=1e-12)
    assert every[6] == 0.0 and every[7] == pytest.approx(0.01)
    # The geometric boundaries (no epoch_sigmas) differ: epoch 1 ends at 0.005, not 0.01.
    geo = sigma_at("epoch_aware", 5, 12, 0.05, 0.0005, 6, 2, warmup="first_epoch")
    assert geo == pytest.approx(0.005)
    for bad, message in (
        (dict(kw, warmup="never"), r"config.aqn.warmup='never'; allowed: \('every_epoch'"),
        (dict(kw, epoch_sigmas=(0.05, 0.01)), r"epoch_sigmas=\(0.05, 0.01\); allowed: \(\)"),
        (dict(kw, epoch_sigmas=(0.05, 0.0, 1e-3)), "num_epochs \\+ 1 = 3 sigmas > 0"),
    ):
        with pytest.raises(ValueError, match=message):
            sigma_at("epoch_aware", 0, 12, 0.05, 0.0005, **bad)
    with pytest.raises(ValueError, match="apply to config.aqn.schedule='epoch_aware' only"):
        sigma_at("qerl", 0, 12, 0.05, 0.0005, 6, 2, epoch_sigmas=(0.05, 0.01, 0.0005))


def test_simple_schedules():
    assert sigma_at("constant", 7, 10, 0.02, 0.0) == 0.02
    np.testing.assert_allclose(sigma_at("linear", 5, 10, 0.04, 0.0), 0.02)
    np.testing.assert_allclose(sigma_at("cosine", 0, 10, 0.04, 0.0), 0.04)
    np.testing.assert_allclose(sigma_at("cosine", 5, 10, 0.04, 0.0), 0.02)
    np.testing.assert_allclose(sigma_at("cosine", 10, 10, 0.04, 0.0), 0.0, atol=1e-12)
    cfg = make_config(aqn__enabled=True)
    assert aqn_sigma(cfg.aqn, 15, 100) == pytest.approx(0.05)
    assert aqn_sigma(make_config().aqn, 15, 100) == 0.0


# --- layers -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value,expected",
    [
        (5, (5,)),
        ("5", (5,)),
        ("(3,5)", (3, 5)),
        ("3,5", (3, 5)),
        ((5, 3), (3, 5)),
        ("2:5", (2, 3, 4)),
        ("all", "all"),
        (range(1, 3), (1, 2)),
    ],
)
def test_parse_layers(value, expected):
    assert parse_layers(value, "f", NUM_LAYERS) == expected


@pytest.mark.parametrize("value", [8, "(1,9)", -1, "x", ()])
def test_parse_layers_rejects(value):
    with pytest.raises(ValueError, match="config.faults.deadzone.layers="):
        parse_layers(value, "config.faults.deadzone.layers", NUM_LAYERS)


# --- validation names the field -------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            {"faults__deadzone__enabled": True, "faults__deadzone__layers": "9"},
            r"config.faults.deadzone.layers='9' but the model has 8 layers",
        ),
        (
            {"faults__deadzone__enabled": True, "faults__deadzone__threshold": 1.5},
            r"config.faults.deadzone.threshold=1.5; must be in \(0, 1\)",
        ),
        (
            {"faults__deadzone__enabled": True, "faults__deadzone__threshold": 0.0},
            r"threshold=0.0; must be in \(0, 1\)",
        ),
        (
            {
                "faults__deadzone__enabled": True,
                "faults__deadzone__severity": "quantile",
                "faults__deadzone__quantile": 1.0,
            },
            r"config.faults.deadzone.quantile=1.0; must be in \(0, 1\)",
        ),
        (
            {
                "faults__deadzone__enabled": True,
                "faults__deadzone__severity": "quantile",
                "faults__deadzone__quantile": 0.0,
            },
            r"config.faults.deadzone.quantile=0.0; must be in \(0, 1\)",
        ),
        (  # a field the chosen severity ignores is checked too (it ran with rc 0)
            {
                "faults__deadzone__enabled": True,
                "faults__deadzone__severity": "quantile",
                "faults__deadzone__threshold": 1.5,
            },
            r"config.faults.deadzone.threshold=1.5; must be in \(0, 1\) \(of amax; checked with"
            r" severity='quantile' too\)",
        ),
        (  # and with the fault off
            {"faults__deadzone__enabled": False, "faults__deadzone__quantile": 2.0},
            r"config.faults.deadzone.quantile=2.0; must be in \(0, 1\)",
        ),
        ({"faults__noise__enabled": False, "faults__noise__scale": -1.0}, r"noise.scale=-1.0"),
        (  # an empty selection is not "out of range"
            {"faults__deadzone__enabled": True, "faults__deadzone__layers": "()"},
            r"config.faults.deadzone.layers='\(\)' selects no layer; expected 'all'",
        ),
        (
            {"faults__deadzone__enabled": True, "faults__deadzone__severity": "percent"},
            r"config.faults.deadzone.severity='percent'; allowed: \('amax', 'quantile'\)",
        ),
        (
            {
                "faults__deadzone__enabled": True,
                "faults__deadzone__severity": "quantile",
                "faults__deadzone__granularity": "block",
            },
            r"config.faults.deadzone.granularity='block'; severity='quantile' allows",
        ),
        (
            {"faults__deadzone__enabled": True, "faults__deadzone__site": "mlpp"},
            r"config.faults.deadzone.site=\('mlpp',\).*unknown module kind 'mlpp'",
        ),
        (
            {"faults__deadzone__enabled": True, "faults__deadzone__granularity": "row"},
            r"config.faults.deadzone.granularity='row'",
        ),
        (
            {"faults__deadzone__enabled": True, "faults__deadzone__phases": ("rollout", "warmup")},
            r"config.faults.deadzone.phases=\('rollout', 'warmup'\)",
        ),
        (
            {"faults__noise__enabled": True, "faults__noise__scale": -0.1},
            r"config.faults.noise.scale=-0.1; must be >= 0",
        ),
        (
            {"faults__noise__enabled": True, "faults__noise__kind": "uniform"},
            r"config.faults.noise.kind='uniform'",
        ),
        (
            {
                "faults__noise__enabled": True,
                "faults__noise__backward": True,
                "faults__noise__sites": ("rmsnorm",),
            },
            r"config.faults.noise.sites has non-linear kinds",
        ),
        (
            {"faults__quant__enabled": True, "faults__quant__format": "mxfp3"},
            r"config.faults.quant.format='mxfp3'",
        ),
        (
            {"faults__quant__enabled": True, "faults__quant__scale_rule": "round"},
            r"config.faults.quant.scale_rule='round'",
        ),
        ({"aqn__enabled": True, "aqn__layers": "healthy"}, r"config.aqn.layers='healthy'"),
        ({"aqn__enabled": True, "aqn__layers": "srdd"}, r"config.aqn.layers='srdd'"),
        ({"aqn__enabled": True, "aqn__sigma_start": -1.0}, r"config.aqn.sigma_start=-1.0"),
        ({"aqn__enabled": True, "aqn__schedule": "step"}, r"config.aqn.schedule='step'"),
        ({"aqn__enabled": True, "aqn__form": "weights"}, r"config.aqn.form='weights'"),
        ({"aqn__enabled": True, "aqn__phases": ("train", "test")}, r"config.aqn.phases="),
        ({"aqn__order": "sideways"}, r"config.aqn.order='sideways'"),
    ],
)
def test_bad_fields_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        cfg = make_config(**overrides)
        build_plan(cfg.faults, cfg.aqn, NUM_LAYERS)


# --- built plans ----------------------------------------------------------------------------------
def test_targeted_aqn_between_deadzones_is_the_original_deadzone_matmul():
    cfg = make_config(
        faults__deadzone__enabled=True,
        faults__deadzone__layers="3",
        aqn__enabled=True,
        aqn__layers="(3,)",
    )
    plan = build_plan(cfg.faults, cfg.aqn, NUM_LAYERS)
    assert [i.name for i in plan.injections] == ["deadzone", "aqn", "deadzone_after_aqn"]
    dz, aqn, again = plan.injections
    assert isinstance(dz.transform, Deadzone) and not dz.transform.reuse_threshold
    assert isinstance(aqn.transform, Noise) and aqn.transform.kind == "relative_gaussian"
    assert again.transform.reuse_threshold and again.phases == ("rollout",)
    assert dz.phases == ("rollout", "train", "eval") and aqn.phases == ("rollout",)
    assert aqn.sites.layers == (3,) and dz.sites.layers == (3,)


def test_healthy_and_global_aqn_layers():
    base = dict(faults__deadzone__enabled=True, faults__deadzone__layers="(2,5)", aqn__enabled=True)

    def plan(**overrides):
        cfg = make_config(**base, **overrides)
        return build_plan(cfg.faults, cfg.aqn, NUM_LAYERS)

    healthy = plan(aqn__layers="healthy")
    assert healthy.injections[1].sites.layers == (0, 1, 3, 4, 6, 7)
    glob = plan(aqn__layers="all", aqn__order="after_fault")
    assert [i.name for i in glob.injections] == ["deadzone", "aqn"]
    assert glob.injections[1].sites.layers == "all"
    before = plan(aqn__order="before_fault")
    assert [i.name for i in before.injections] == ["aqn", "deadzone"]


def test_srdd_sigma_map_becomes_layer_scales():
    cfg = make_config(aqn__enabled=True, aqn__layers="srdd", aqn__form="norm_weight")
    plan = build_plan(cfg.faults, cfg.aqn, NUM_LAYERS, srdd_sigmas={4: 0.075, 6: 0.025})
    (aqn,) = plan.injections
    assert isinstance(aqn.transform, NormWeightNoise)
    assert aqn.sites.layers == (4, 6) and aqn.sites.kinds == (
        "input_layernorm",
        "post_attention_layernorm",
        "norm",
    )
    assert aqn.transform.scale.layer_scales == {4: pytest.approx(1.5), 6: pytest.approx(0.5)}


def test_noise_forward_backward_modes():

    def plan(**overrides):
        cfg = make_config(**overrides)
        return build_plan(cfg.faults, cfg.aqn, NUM_LAYERS)

    fwd = plan(faults__noise__enabled=True)
    assert isinstance(fwd.injections[0].transform, Noise)
    both = plan(faults__noise__enabled=True, faults__noise__backward=True)
    t = both.injections[0].transform
    assert isinstance(t, NoisyLinear) and t.forward and t.backward
    bwd = plan(
        faults__noise__enabled=True, faults__noise__backward=True, faults__noise__forward=False
    )
    assert not bwd.injections[0].transform.forward
    q = plan(faults__quant__enabled=True).injections[0]
    assert isinstance(q.transform, Quantize) and q.sites.point == "input"


def test_every_default_arm_matches_modules_on_the_tiny_model():
    """The plans the experiments use hit exactly the modules they name."""
    config = Qwen2Config.tiny()
    params = abstract_params(config)
    model = Qwen2ForCausalLM(config)
    cfg = make_config(
        faults__deadzone__enabled=True,
        faults__deadzone__layers="5",
        faults__noise__enabled=True,
        faults__noise__backward=True,
        faults__quant__enabled=True,
        aqn__enabled=True,
        aqn__layers="healthy",
    )
    plan = build_plan(cfg.faults, cfg.aqn, NUM_LAYERS)
    rollout = trace_manifest(plan, model, params, "rollout")
    assert rollout["deadzone"] == ["layers_5/layer:output"]
    assert rollout["deadzone_after_aqn"] == ["layers_5/layer:output"]
    assert len(rollout["aqn"]) == 7 and "layers_5/layer:output" not in rollout["aqn"]
    assert len(rollout["noise"]) == 7 * 8 and len(rollout["quant"]) == 7 * 8
    train = trace_manifest(plan, model, params, "train")
    assert set(train) == {"deadzone", "noise", "quant"}  # AQN is rollout-only by default
    manifest = json.loads(plan.manifest_json({"rollout": rollout, "train": train}))
    assert manifest["hits"]["rollout"]["deadzone"] == ["layers_5/layer:output"]
    assert manifest["hits"]["train"]["deadzone"] == ["layers_5/layer:output"]


def test_a_new_fault_kind_is_its_section_and_one_builder():
    # The device is a loop over `FAULT_KINDS`: a new kind (here a systematic bias on layer 2's
    # MLP outputs) is its config section plus one builder; fault_plan lists it after the
    # built-in kinds, and build_plan places AQN against the deadzone as before.
    from aqn_jax.faults import config as fault_cfg
    from aqn_jax.faults.intercept import Injection
    from aqn_jax.faults.sites import SiteSelector
    from aqn_jax.faults.transforms import Scale

    def bias(section, num_layers):
        if not section.enabled:
            return []
        layers = parse_layers(section.layers, "config.faults.bias.layers", num_layers)
        noise = Noise("systematic_bias", Scale(float(section.scale)))
        return [Injection("bias", SiteSelector(("mlp",), layers, "output"), noise)]

    def section():
        return ml_collections.ConfigDict({"enabled": False, "layers": "2", "scale": 0.1})

    fault_cfg.fault_kind("bias", section)(bias)
    try:
        cfg = make_config(faults__deadzone__enabled=True, aqn__enabled=True, aqn__layers="(3,)")
        assert cfg.faults.bias == section()  # its section is there with the others'
        cfg.faults.bias.enabled = True
        device = fault_cfg.fault_plan(cfg.faults, NUM_LAYERS)
        assert [i.name for i in device.injections] == ["deadzone", "bias"]
        assert device.injections[1].sites.layers == (2,)
        full = build_plan(cfg.faults, cfg.aqn, NUM_LAYERS)
        names = ["deadzone", "aqn", "deadzone_after_aqn", "bias"]
        assert [i.name for i in full.injections] == names
        cfg.faults.bias.enabled = False  # negative control: off adds nothing
        device = fault_cfg.fault_plan(cfg.faults, NUM_LAYERS)
        assert [i.name for i in device.injections] == ["deadzone"]
        with pytest.raises(ValueError, match="config.faults.bias.layers"):
            cfg.faults.bias.enabled, cfg.faults.bias.layers = True, "9"
            fault_cfg.fault_plan(cfg.faults, NUM_LAYERS)
    finally:
        fault_cfg.FAULT_KINDS.unregister("bias")
