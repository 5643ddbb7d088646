"""No field is silently ignored (issue 69, item 3): a name in a section that is off is checked as
if it were on, a command-line config.study_fault moves the arm's fault to the kind it names (and
a config.arm that differs from the config's is refused), and the GSM8K config's modifiers
combine only as its docstring says. Each refusal is one line naming the field, the value and
what is allowed, before the warm start, with nothing written; each has a valid neighbour that
the same checks accept (the negative control)."""

import json

import pytest

from conftest import launch_cli, load_config, tree_state
from conftest import set_fields as _set

# (id, bad fields on the clean arm's smoke: every fault and AQN off, the one line's text, the
# valid neighbour's fields)
OFF = [
    (
        "aqn_form",
        {"aqn.form": "bogus"},
        "config.aqn.form='bogus'; allowed: ('norm_weight', 'activation')",
        {"aqn.form": "norm_weight"},
    ),
    (
        "aqn_layers",
        {"aqn.layers": "bogus"},
        "config.aqn.layers='bogus'; expected 'all' | 'healthy' | 'srdd' | 'located', an int",
        {"aqn.layers": "(2,)"},
    ),
    (
        "aqn_schedule",
        {"aqn.schedule": "bogus"},
        "config.aqn.schedule='bogus'; allowed: ('qerl', 'epoch_aware', 'constant'",
        {"aqn.schedule": "cosine"},
    ),
    (
        "aqn_sites",
        {"aqn.sites": ("bogus",)},
        "config.aqn.sites=('bogus',): unknown module kind 'bogus'; allowed:",
        {"aqn.sites": ("mlp",)},
    ),
    (
        "aqn_epoch_sigmas",
        {"aqn.epoch_sigmas": (1.0,)},
        "config.aqn.epoch_sigmas=(1.0,); allowed: () or num_epochs + 1 = 3 sigmas > 0",
        {"aqn.epoch_sigmas": (0.05, 0.01, 0.0005)},
    ),
    (
        "aqn_warmup",
        {"aqn.warmup": "bogus"},
        "config.aqn.warmup='bogus'; allowed: ('every_epoch', 'first_epoch')",
        {"aqn.warmup": "first_epoch"},
    ),
    (
        "aqn_warmup_without_epoch_aware",
        {"aqn.schedule": "qerl", "aqn.warmup": "first_epoch"},
        "config.aqn.epoch_sigmas=() / config.aqn.warmup='first_epoch' apply to"
        " config.aqn.schedule='epoch_aware' only (schedule is 'qerl')",
        {"aqn.schedule": "qerl"},
    ),
    (
        "noise_kind",
        {"faults.noise.kind": "bogus"},
        "config.faults.noise.kind='bogus'; allowed: ('relative_gaussian', 'absolute_gaussian',",
        {"faults.noise.kind": "systematic_bias"},
    ),
    (
        "deadzone_scope",
        {"faults.deadzone.scope": "bogus"},
        "config.faults.deadzone.scope='bogus'; allowed: ('call', 'causal', 'token')",
        {"faults.deadzone.scope": "token"},
    ),
    (
        "deadzone_severity",
        {"faults.deadzone.severity": "bogus"},
        "config.faults.deadzone.severity='bogus'; allowed: ('amax', 'quantile')",
        {"faults.deadzone.severity": "amax"},
    ),
    (
        "deadzone_layers",
        {"faults.deadzone.layers": "4,x"},
        "config.faults.deadzone.layers='4,x'; expected 'all', an int, a tuple of ints or 'lo:hi'",
        # Off, a section's layers are checked for their form only: the default '15' stays
        # valid on the 8-layer model (it is checked against the model when the fault is on).
        {"faults.deadzone.layers": "15"},
    ),
    (
        "quant_format",
        {"faults.quant.format": "bogus"},
        "config.faults.quant.format='bogus'; allowed: ('mxfp4', 'mxfp6_e2m3',",
        {"faults.quant.format": "mxfp8_e4m3"},
    ),
    (
        "bitflip_target",
        {"faults.bitflip.target": "bogus"},
        "config.faults.bitflip.target='bogus'; allowed: ('activation', 'weight', 'gradient',",
        {"faults.bitflip.target": "weight"},
    ),
    (
        "stuck_at_phases",
        {"faults.stuck_at.phases": ("rollout", "bogus")},
        "config.faults.stuck_at.phases=('rollout', 'bogus'); allowed: subsets of",
        {"faults.stuck_at.phases": ("rollout",)},
    ),
    (
        "arm",
        {"arm": "bogus"},
        "config.arm='bogus'; allowed: ('clean', 'deadzone', 'global_aqn', 'targeted',",
        {"arm": "clean"},
    ),
    (
        "study_fault",
        {"study_fault": "bogus"},
        "config.study_fault='bogus'; allowed: ('deadzone', 'noise', 'quant',",
        {"study_fault": "noise"},
    ),
    (
        "sft_schedule_sft_off",
        {"sft.enabled": False, "sft.schedule": "bogus"},
        "config.sft.schedule='bogus'; allowed: ('constant', 'warmup_constant', 'cosine')",
        {"sft.enabled": False, "sft.schedule": "warmup_constant"},
    ),
    (
        "critic_schedule_without_gae",
        {"critic.schedule": "bogus"},
        "config.critic.schedule='bogus'; allowed: ('constant', 'warmup_constant', 'cosine')",
        {"critic.schedule": "cosine"},
    ),
]


@pytest.mark.parametrize("bad,message,good", [c[1:] for c in OFF], ids=[c[0] for c in OFF])
def test_a_bad_name_in_a_section_that_is_off_is_refused(tmp_path, bad, message, good):
    from aqn_jax.checks import check_train
    from aqn_jax.launch import run

    work, cache = tmp_path / "run", tmp_path / "cache"
    work.mkdir()
    (work / "notes.txt").write_text("an earlier run's file")
    before = tree_state(work)
    config = _set(load_config("clean", "smoke"), **bad)
    assert not config.aqn.enabled and not any(s.enabled for s in config.faults.values())
    config.sft.cache_dir = str(cache)
    with pytest.raises(ValueError) as e:
        run(config, str(work))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert tree_state(work) == before  # no config.json, no .lock
    assert not cache.exists()  # refused before the warm start
    check_train(_set(load_config("clean", "smoke"), **good))  # the valid neighbour


def test_the_seed_study_presets_aqn_settings_pass_on_its_arms_without_aqn():
    """epoch_sigmas / warmup are checked with AQN off too: the seed study's own values (its
    faulty arm runs with AQN off) stay accepted."""
    from aqn_jax.aqn.config import check_aqn
    from aqn_jax.jobs.compare import run_config

    config = load_config("qwen2p5_coder_0p5b_gsm8k", "seed_study,arith")
    for arm in (*config.compare.arms, "clean"):
        rc = run_config(config, arm, 0, "/nonexistent", None)
        check_aqn(rc.aqn)
        assert rc.aqn.enabled == (arm != "deadzone" and arm != "clean")


def _after(name, arg, **given):
    """`configs/<name>.py:<arg>` with the command line's `given` fields (dotted keys), as
    launch.main finishes it: set, then `experiment.after_overrides`."""
    from aqn_jax.experiment import after_overrides

    config = _set(load_config(name, arg), **given)
    after_overrides(config, load_config(name, arg), given)
    return config


def test_study_fault_on_the_command_line_moves_the_arms_fault():
    """--config.study_fault on an arm config is what the arm would have been built on: the same
    config as apply_arm on a base whose study_fault was set first."""
    from aqn_jax.experiment import apply_arm, base_config

    for arm in ("deadzone", "global_aqn", "clean"):
        moved = _after(arm, "smoke", study_fault="noise")
        want = base_config("smoke")
        want.study_fault = "noise"
        assert moved.to_dict() == apply_arm(want, arm).to_dict()
        assert moved.faults.noise.enabled == (arm != "clean") and not moved.faults.deadzone.enabled
    # A section's `enabled` given on the command line too keeps the value given: both faults.
    both = _after("deadzone", "smoke", study_fault="noise", **{"faults.deadzone.enabled": True})
    assert both.faults.deadzone.enabled and both.faults.noise.enabled
    # The GSM8K config's arms too (its faulty arm's deadzone at layer 15 switched off).
    gsm = _after("qwen2p5_coder_0p5b_gsm8k", "deadzone,arith", study_fault="noise")
    assert gsm.faults.noise.enabled and not gsm.faults.deadzone.enabled
    # Negative control: the same value as the config's moves nothing.
    same = _after("deadzone", "smoke", study_fault="deadzone")
    assert same.to_dict() == load_config("deadzone", "smoke").to_dict()


def test_study_fault_and_arm_on_the_command_line_are_refused_where_they_cannot_hold():
    with pytest.raises(ValueError) as e:  # AQN placed by the fault's layers: noise has none
        _after("targeted", "smoke", study_fault="noise")
    assert str(e.value) == (
        "config.study_fault='noise'; allowed with arm 'targeted' (AQN placed by the fault's"
        " layers): ('deadzone',)"
    )
    with pytest.raises(ValueError) as e:
        _after("targeted", "smoke", arm="global_aqn")
    assert str(e.value).startswith(
        "config.arm='global_aqn': it records the arm this config was built as and sets"
        " nothing; allowed: 'targeted'"
    )
    # A config whose faults its arm did not set: nothing to move with study_fault.
    from aqn_jax.experiment import after_overrides

    built = _set(load_config("deadzone", "smoke"), **{"faults.deadzone.enabled": False})
    config = _set(load_config("deadzone", "smoke"), **{"faults.deadzone.enabled": False})
    config.study_fault = "noise"
    with pytest.raises(ValueError, match=r"^config.study_fault='noise': this config's faults"):
        after_overrides(config, built, {"study_fault": "noise"})
    # Negative controls: the config's own arm given again; job compare (it applies its arms
    # after the flags) takes study_fault as it is.
    assert _after("targeted", "smoke", arm="targeted").arm == "targeted"
    noise = _after("compare", "noise_study,smoke", study_fault="noise")
    assert noise.to_dict() == load_config("compare", "noise_study,smoke").to_dict()


def _one_error(proc, workdir, message):
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert message in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
    assert not workdir.exists()  # nothing written, the workdir not even made


def test_study_fault_from_the_command_line_reaches_the_run(tmp_path):
    """From the command line: the deadzone arm with --config.study_fault=noise runs the noise
    (its layers are checked against the model, as a fault that is on: '99' refused), where the
    clean arm leaves the noise off (the same layers pass, and the next check refuses)."""
    work = tmp_path / "w"
    flags = ("--config.study_fault=noise", "--config.faults.noise.layers=99")
    proc = launch_cli("--config=configs/deadzone.py:smoke", *flags, workdir=work)
    _one_error(proc, work, "error: config.faults.noise.layers='99' but the model has 8 layers")
    big = "--config.trainer.val_size=1000"  # refused after the faults are checked
    proc = launch_cli("--config=configs/clean.py:smoke", *flags, big, workdir=work)
    _one_error(proc, work, "error: config.trainer.val_size=1000; must be <= the 8 problems")
    proc = launch_cli("--config=configs/targeted.py:smoke", flags[0], workdir=work)
    _one_error(proc, work, "error: config.study_fault='noise'; allowed with arm 'targeted'")
    proc = launch_cli("--config=configs/deadzone.py:smoke", "--config.arm=clean", workdir=work)
    _one_error(proc, work, "error: config.arm='clean': it records the arm this config was built")


GSM8K = "qwen2p5_coder_0p5b_gsm8k"
REFUSED_ARGS = [
    ("deadzone,arith,short", "; ',arith' with ',short': the modifiers do not combine"),
    ("study,gpu,arith", "; ',gpu' with ',arith': the modifiers do not combine"),
    ("study,gpu", "; ',gpu' is the lent GPU's learning run of a train arm (job train); job"),
    ("seed_study,gpu,smoke", "; ',gpu' is the lent GPU's learning run of a train arm"),
    ("evaluate,gpu", "job 'evaluate' sets its own shapes"),
    ("deadzone,arith,arith", "; ',arith' given twice; allowed: each once"),
]


@pytest.mark.parametrize("arg,message", REFUSED_ARGS, ids=[a for a, _ in REFUSED_ARGS])
def test_gsm8k_modifiers_combine_only_as_documented(arg, message):
    with pytest.raises(ValueError) as e:
        load_config(GSM8K, arg)
    text = str(e.value)
    assert text.startswith(f"--config=configs/{GSM8K}.py:{arg};") and message in text, text
    assert "\n" not in text


def test_gsm8k_documented_combinations_load():
    """The negative controls: every combination the repository's commands use."""
    for arg in (
        "deadzone",
        "deadzone,arith",
        "study,arith",
        "study,arith,smoke",
        "seed_study,arith",
        "seed_study,arith,smoke",
        "study",
        "severity",
        "severity,arith",
        "evaluate",
        "evaluate,short",
        "deadzone,short",
        "deadzone,gpu",
        "clean,gpu",
        "deadzone,gpu,smoke",
    ):
        config = load_config(GSM8K, arg)
        json.loads(config.to_json())
    assert load_config(GSM8K, "seed_study,arith").model.dtype == "float32"
    assert load_config(GSM8K, "deadzone,gpu").model.dtype == "bfloat16"
