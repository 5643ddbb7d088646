"""One-line refusals before any work, and nothing written (issue 50): each bad value below is
refused by `launch.run` naming the field, the value and what is allowed, before the warm start
(no SFT cache made), leaving the workdir byte-identical; its valid neighbour passes the same
checks (a negative control)."""

import pytest

from conftest import launch_cli, load_config, shallow, tree_state
from conftest import set_fields as _set


def _scale_flip(**over):
    return {"faults.mx_scale_flip.enabled": True, "faults.mx_scale_flip.count": 1, **over}


def _bitflip(**over):
    return {"faults.bitflip.enabled": True, "faults.bitflip.count": 1, **over}


# (id, config name and arg, bad fields, the one line's text, the valid neighbour's fields)
CASES = [
    (
        "mx_scale_flip_block_0",
        ("base", "smoke"),
        _scale_flip(**{"faults.mx_scale_flip.block_size": 0}),
        "config.faults.mx_scale_flip.block_size=0; allowed: a positive int",
        _scale_flip(**{"faults.mx_scale_flip.block_size": 32}),
    ),
    (
        "mx_scale_flip_block_7",
        ("base", "smoke"),
        _scale_flip(**{"faults.mx_scale_flip.block_size": 7}),
        "config.faults.mx_scale_flip.block_size=7: blocks of 7 do not divide the 128 lanes of"
        " q_proj's input (the last axis); allowed: a block size dividing 128",
        _scale_flip(**{"faults.mx_scale_flip.block_size": 64}),
    ),
    (
        "bitflip_steps_negative",
        ("base", "smoke"),
        _bitflip(**{"faults.bitflip.steps": "(-3,)"}),
        "config.faults.bitflip.steps='(-3,)'; RL steps count from 1; allowed: 'all', a step",
        _bitflip(**{"faults.bitflip.steps": "(3,)"}),
    ),
    (
        "lora_rank_above_the_narrowest",
        ("qerl", "nvfp4_lora,smoke"),
        {"lora.rank": 100000},
        "config.lora.rank=100000 exceeds min(in, out) = 64 of layers_0/self_attn/k_proj (128 x"
        " 64), the narrowest targeted linear; allowed: 1..64",
        {"lora.rank": 64},
    ),
    (
        "qerl_float16",
        ("qerl", "nvfp4_lora,smoke"),
        {"model.param_dtype": "float16", "model.dtype": "float16"},
        "config.model.param_dtype='float16': training in float16 overflows",
        {"model.param_dtype": "bfloat16", "model.dtype": "bfloat16"},
    ),
    (
        "clip_ratio_low_negative",
        ("base", "smoke"),
        {"algo.clip_ratio_low": -0.5},
        "config.algo.clip_ratio_low=-0.5; must be in [0, 1)",
        {"algo.clip_ratio_low": 0.0},
    ),
    (
        "clip_ratio_high_negative",
        ("base", "smoke"),
        {"algo.clip_ratio_high": -1.0},
        "config.algo.clip_ratio_high=-1.0; must be >= 0 and finite",
        {"algo.clip_ratio_high": 0.28},
    ),
    (
        "clip_ratio_low_nan",
        ("base", "smoke"),
        {"algo.clip_ratio_low": float("nan")},
        "config.algo.clip_ratio_low=nan; must be in [0, 1)",
        {"algo.clip_ratio_low": 0.1},
    ),
    (
        "clip_ratio_c_nan",
        ("base", "smoke"),
        {"algo.clip_ratio_c": float("nan")},
        "config.algo.clip_ratio_c=nan; must be > 1 and finite (dual-clip)",
        {"algo.clip_ratio_c": 10.0},
    ),
    (
        "gspo_clip_with_ppo",
        ("base", "smoke"),
        {"algo.gspo.clip_ratio_low": 5.0},
        "config.algo.gspo.clip_ratio_low=5.0: GSPO's sequence-ratio clip below 1, which"
        " config.algo.policy_loss='ppo' does not use; allowed: 0.0003 (the default)",
        {"algo.gspo.clip_ratio_low": 5e-4, "algo.policy_loss": "gspo"},
    ),
    (
        "dual_clip_with_gspo",
        ("base", "smoke"),
        {"algo.policy_loss": "gspo", "algo.clip_ratio_c": 0.5},
        "config.algo.clip_ratio_c=0.5: PPO's dual clip (GSPO has none), which"
        " config.algo.policy_loss='gspo' does not use; allowed: 3.0 (the default)",
        {"algo.policy_loss": "gspo"},
    ),
    (
        "ppo_clip_with_gspo",
        ("base", "smoke"),
        {"algo.policy_loss": "gspo", "algo.clip_ratio_low": -3.0},
        "config.algo.clip_ratio_low=-3.0: PPO's ratio clip below 1, which"
        " config.algo.policy_loss='gspo' does not use; allowed: 0.2 (the default)",
        {"algo.policy_loss": "ppo", "algo.clip_ratio_low": 0.1},
    ),
    (
        "grpo_greedy",
        ("base", "smoke"),
        {"rollout.temperature": 0.0},
        "config.rollout.temperature=0 samples greedily: the rollout.n=5 samples of a prompt are"
        " one answer, so config.algo.estimator='grpo' (it compares them) has no signal in any"
        " group; allowed: temperature > 0",
        {"rollout.temperature": 0.7},
    ),
    (
        "val_size_above_the_test_split",
        ("base", "smoke"),
        {"trainer.val_size": 1000},
        "config.trainer.val_size=1000; must be <= the 8 problems of the test split",
        {"trainer.val_size": 8},
    ),
    (
        "instruction_none",
        ("base", "smoke"),
        {"data.instruction": "None"},
        "config.data.instruction='None' would append the text 'None' to every question;"
        " allowed: '' (verl's instruction) or the instruction's text",
        {"data.instruction": " Answer after ####."},
    ),
    (
        "instruction_unencodable",
        ("base", "smoke"),
        {"data.instruction": " Réponds: 日本語 🙂"},
        "config.data.instruction=' Réponds: 日本語 🙂': the tokenizer cannot encode 'é日本語🙂'",
        {"data.instruction": " Reponds: ####"},
    ),
    (
        "shots_take_the_train_split",
        ("base", "smoke"),
        {"data.shots": 8, "data.train_size": 8},
        "config.data.shots=8 takes the first 8 train problems for every prompt, leaving 0 to"
        " train on; must leave >= config.data_batch.prompts=4",
        {
            "data.shots": 1,
            "data.train_size": 5,
            "rollout.max_prompt_len": 128,
            "rollout.prompt_buckets": (128,),
        },
    ),
    (
        "param_dtype_float16",
        ("base", "smoke"),
        {"model.param_dtype": "float16"},
        "allowed for training: ['float32', 'bfloat16'] (the evaluate job takes float16)",
        {"model.param_dtype": "bfloat16"},
    ),
    (
        "param_dtype_auto",
        ("base", "smoke"),
        {"model.param_dtype": "auto"},
        "config.model.param_dtype='auto'; allowed for training: ['float32', 'bfloat16']",
        {"model.param_dtype": "float32", "model.dtype": "auto"},
    ),
    (
        "vulnerability_no_bits",
        ("vulnerability", "smoke"),
        {"vulnerability.bits": ()},
        "config.vulnerability.bits=(); allowed: a non-empty tuple",
        {"vulnerability.bits": ("e7",)},
    ),
    (
        "vulnerability_count",
        ("vulnerability", "smoke"),
        {"vulnerability.count": 0},
        "config.vulnerability.count=0; must be an int >= 1",
        {"vulnerability.count": 2},
    ),
    (
        "vulnerability_layers",
        ("vulnerability", "smoke"),
        {"vulnerability.layers": "99"},
        "config.vulnerability.layers='99' but the model has 8 layers",
        {"vulnerability.layers": "7"},
    ),
]


def _check(config):
    """The job's checks alone (what runs before the warm start)."""
    if config.job == "vulnerability":
        from aqn_jax.jobs.vulnerability import check_study

        return check_study(config)
    from aqn_jax.checks import check_train

    return check_train(config)


@pytest.mark.parametrize("name,bad,message,good", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_in_one_line_writing_nothing(tmp_path, name, bad, message, good):
    from aqn_jax.launch import run

    work, cache = tmp_path / "run", tmp_path / "cache"
    work.mkdir()
    (work / "notes.txt").write_text("an earlier run's file")
    before = tree_state(work)
    config = _set(load_config(*name), **bad)
    config.sft.cache_dir = str(cache)
    with pytest.raises(ValueError) as e:
        run(config, str(work))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert tree_state(work) == before  # no config.json, no .lock
    assert not cache.exists()  # refused before the warm start
    # Negative control: the valid neighbour passes the same checks.
    _check(_set(load_config(*name), **good))


def test_a_late_format_check_is_one_line_from_the_command_line(tmp_path):
    work = tmp_path / "run"
    work.mkdir()
    (work / "notes.txt").write_text("an earlier run's file")
    before = tree_state(work)
    proc = launch_cli(
        "--config=configs/base.py:smoke",
        "--config.faults.mx_scale_flip.enabled=True",
        "--config.faults.mx_scale_flip.count=1",
        "--config.faults.mx_scale_flip.block_size=7",
        f"--config.sft.cache_dir={tmp_path / 'cache'}",
        workdir=work,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert "config.faults.mx_scale_flip.block_size=7: blocks of 7" in errors[0]
    assert "Traceback" not in proc.stderr
    assert tree_state(work) == before and not (tmp_path / "cache").exists()


def test_a_checkpoint_of_another_layout_is_named_not_moved_aside(tmp_path):
    """`restore_latest` with a state of other shapes (a config that changed the layout): a
    ValueError naming the leaf, the checkpoint left where it is; the same layout restores."""
    import numpy as np

    from aqn_jax.checkpoint import Checkpointer

    ckpt = Checkpointer(str(tmp_path), 0, 2)
    ckpt.save(1, {"params": {"lora": {"a": np.ones((4, 16), np.float32)}}}, {"step": 1})
    ckpt.wait()
    before = tree_state(tmp_path)
    other = {"params": {"lora": {"a": np.zeros((4, 8), np.float32)}}}
    with pytest.raises(ValueError) as e:
        ckpt.restore_latest(other)
    assert (
        "checkpoints/1 holds a train state of another layout than this config's"
        " (params/lora/a: saved shape (4, 16), this config's (4, 8))" in str(e.value)
    )
    assert tree_state(tmp_path) == before  # not moved to 1.unreadable-...
    same = {"params": {"lora": {"a": np.zeros((4, 16), np.float32)}}}
    step, state, _ = ckpt.restore_latest(same)
    assert step == 1 and np.all(np.asarray(state["params"]["lora"]["a"]) == 1)
    ckpt.close()


@pytest.mark.slow
def test_a_refused_resume_writes_nothing(tmp_path, sft_cache):
    """A QeRL run's workdir resumed with --config.resume_override=True and a changed base
    format, LoRA rank or warm start (issue 50): each refused in one line, the workdir
    byte-identical (config.json and config_overrides.jsonl not rewritten, no checkpoint moved
    aside); the original command still resumes. The warm start is the session's (the shallow
    smokes' SFT cache key); the changed one (sft.steps=9) is refused before it trains: the SFT
    cache gains no entry for it. The refusals read the configs and the checkpoint, not the
    device: the arm's deadzone is off, so the run validates with one program (a clean device's
    two validations are one), not a faulty one and a clean one."""
    import pathlib

    from aqn_jax.launch import run
    from aqn_jax.spec import warm_start_spec

    def qerl():  # the run's config on the shallow model, with `extra`'s fields
        config = load_config("qerl", "mxfp4_lora,smoke")
        config.sft.cache_dir = sft_cache
        small = {"trainer.total_steps": 1, "faults.deadzone.enabled": False}
        return shallow(config, **small, **extra)

    work = tmp_path / "run"
    extra = {}
    run(qerl(), str(work))
    before = tree_state(work)
    cases = [
        (
            {"model.weight_format": "nvfp4"},
            "config.model.weight_format: 'mxfp4' -> 'nvfp4' changes the frozen base the"
            " adapters were trained over; use a new --workdir",
        ),
        ({"lora.rank": 8}, "config.lora.rank: 16 -> 8 changes the adapters' shapes; use a new"),
        ({"sft.steps": 9}, "checkpoints/1 was trained over base mxfp4:"),
    ]
    # The changed warm start's cache entry (the session's cache is shared with the other
    # worker's tests, so only this key's entry and its temporary are checked): absent before,
    # and after every refusal.
    extra = {"sft.steps": 9}
    changed_entry = f"sft-{warm_start_spec(qerl()).key}*"
    assert not list(pathlib.Path(sft_cache).glob(changed_entry))  # a miss: it would train
    for changed, message in cases:
        extra = {**changed, "resume_override": True}
        with pytest.raises(ValueError) as e:
            run(qerl(), str(work))
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert tree_state(work) == before, changed
        assert not list(pathlib.Path(sft_cache).glob(changed_entry)), changed  # no SFT trained
    assert ", from warm start sft-" in str(e.value) and "not cached" in str(e.value)
    extra = {}
    run(qerl(), str(work))  # negative control: the run's own config resumes (nothing left)
    assert (work / "checkpoints" / "1").is_dir()


def test_divergence_names_the_bit_fault_that_fired():
    """check_finite / check_sane: when a bit fault fired in the step (sdc/injected > 0), its
    sdc/ metrics come first and the guard is the advice; without one, the generic message."""
    import flax.struct
    import jax.numpy as jnp
    import ml_collections

    from aqn_jax.checkpoint import check_sane
    from aqn_jax.rl.trainer import check_finite
    from aqn_jax.sdc.telemetry import fault_fired, guard_hint

    note = "bitflip(count=1, bits=(30,))"
    m = {"actor/pg_loss": float("nan"), "sdc/injected": 1.0, "sdc/grad_norm": float("inf")}
    fired = fault_fired(m)
    assert fired == "sdc/injected=1, sdc/grad_norm=inf"
    with pytest.raises(FloatingPointError) as e:
        check_finite(3, {"actor/pg_loss": m["actor/pg_loss"]}, note, fired)
    assert str(e.value).startswith(
        "RL step 3: a bit fault fired in this step (sdc/injected=1, sdc/grad_norm=inf), then"
        " non-finite metric(s) ['actor/pg_loss']"
    )
    assert str(e.value).endswith("config.sdc.guard=skip or recompute survives a corrupted step")

    @flax.struct.dataclass
    class State:
        params: dict
        opt_state: dict

    bad = State({"w": jnp.ones(3)}, {"nu": jnp.array([jnp.inf, 0.0, 0.0])})
    bounds = ml_collections.ConfigDict({"max_grad_norm": 0.0, "max_param_abs": 0.0})
    cause = f"a bit fault fired in RL step 1 ({fired})"
    with pytest.raises(FloatingPointError) as e:
        check_sane(1, bad, {}, bounds, cause, guard_hint(note))
    assert str(e.value) == (
        f"RL step 1: not saved: {cause}, then non-finite params or optimizer state; the device"
        f" runs bit faults ({note}): config.sdc.guard=skip or recompute survives a corrupted step"
    )
    # Negative controls: no fault fired -> the generic messages.
    assert fault_fired({"sdc/injected": 0.0, "sdc/injected_rollout": 0.0}) is None
    with pytest.raises(FloatingPointError, match="the run diverged: lower config.actor.lr"):
        check_sane(1, bad, {}, bounds)
    with pytest.raises(FloatingPointError, match=r"^RL step 3: non-finite metric\(s\)"):
        check_finite(3, {"actor/pg_loss": m["actor/pg_loss"]})


@pytest.mark.slow
def test_a_gradient_bit_flip_that_diverges_is_named(tmp_path, sft_cache):
    """Issue 50's run: base.py:smoke with one gradient flip of bit 30 at RL step 1, no guard:
    the run stops naming the fault (sdc/injected, sdc/grad_norm) and the guard, not 'lower
    config.actor.lr'."""
    from aqn_jax.launch import run

    from conftest import shallow

    config = shallow(load_config("base", "smoke"), **{"trainer.total_steps": 1})
    config.sft.cache_dir = sft_cache
    _set(config, **_bitflip(**{"faults.bitflip.target": "gradient"}))
    _set(config, **{"faults.bitflip.bits": "(30,)", "faults.bitflip.steps": "(1,)"})
    config.faults.bitflip.phases = ("train",)
    with pytest.raises(FloatingPointError) as e:
        run(config, str(tmp_path))
    message = str(e.value)
    assert message.startswith("RL step 1: ") and "a bit fault fired in" in message, message
    assert (
        "(sdc/injected=60, " in message and "sdc/grad_norm=inf" in message
    )  # summed over the leaves hit
    assert "config.sdc.guard=skip or recompute" in message and "\n" not in message
    assert "lower config.actor.lr" not in message


SLOW_COMPILE = """
import pathlib, sys, time
from aqn_jax.rl.trainer import Trainer

def slow(*args, **kwargs):  # the compile ahead, made long (a 0.5B model's takes minutes)
    pathlib.Path(sys.argv[1]).write_text("compiling")
    time.sleep(300)

Trainer.compile_step = slow
from aqn_jax import launch

launch.main(["launch", *sys.argv[2:]])
"""


@pytest.mark.slow
def test_sigterm_during_the_compile_ahead_exits_at_once(tmp_path, sft_cache):
    """SIGTERM while the step programs compile ahead (nothing trained since the start): one
    line says so and the process exits 143 within 10 s, not after the compile (it took 45 s);
    the workdir holds no lock holder and no checkpoint."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import SHALLOW_FLAGS

    marker, work = tmp_path / "compiling", tmp_path / "run"
    args = [
        "--config=configs/base.py:smoke",
        *SHALLOW_FLAGS,
        f"--config.sft.cache_dir={sft_cache}",
        f"--workdir={work}",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_COMPILE, str(marker), *args],
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), proc.communicate()[0]
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out
    assert took < 10, (took, out)
    assert "SIGTERM during the compile: no RL step since the last checkpoint" in out, out
    assert "Traceback" not in out
    assert not (work / "checkpoints").exists() or not any((work / "checkpoints").iterdir())
    print(f"SIGTERM to exit: {took:.1f} s")


def test_sigterm_in_the_loop_says_it_saves_then_exits(capfd):
    """The train loop's SIGTERM (`Preemption`): one line when it arrives, said by a thread of
    its own (the main thread may be inside a compile); the flag set for the save."""
    import os
    import signal
    import time

    from aqn_jax.checkpoint import SAVE_AND_EXIT, Preemption

    previous = signal.getsignal(signal.SIGTERM)
    stop = Preemption()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)
        assert stop.requested
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGTERM) is previous
    assert capfd.readouterr().out.count(SAVE_AND_EXIT) == 1
    # Negative control: closed, it says nothing more.
    assert capfd.readouterr().out == ""
