"""Bad input to the main job (`train`): one line `error: ...` naming the config field, exit 2,
before any warm start, diagnosis or compile, and nothing already in the workdir changed.

The launches run in this process (`aqn_jax.launch.main`): validation fails before anything
compiles, so a row takes a fraction of a second where a subprocess would spend seconds on
imports. The warm start is replaced by a tripwire: reaching it fails the test.
"""

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = f"--config={os.path.join(REPO, 'configs', 'targeted.py')}:smoke"
PREVIOUS = {"notes.txt": b"a previous run's notes\n", "config.json": b'{"job": "train"}\n'}


def write_jsonl(path, questions) -> str:
    """A raw GSM8K jsonl of `questions` (answers 'a + b = c #### c')."""
    rows = [
        {"question": q, "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
        for i, q in enumerate(questions)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


SHORT = [f"What is {i} + 1?" for i in range(16)]
LONG = [f"Sam counts {'many long apples and pears ' * 6}and {i} more. How many?" for i in range(16)]


def data_flags(tmp_path, train_questions):
    return (
        f"--config.data.train_path={write_jsonl(tmp_path / 'train.jsonl', train_questions)}",
        f"--config.data.test_path={write_jsonl(tmp_path / 'test.jsonl', SHORT)}",
    )


@pytest.fixture
def launch(monkeypatch, capsys):
    """launch(*flags, workdir) -> (exit code, stdout, stderr) of `python -m aqn_jax.launch
    CONFIG FLAGS --workdir=WORKDIR`, in this process."""
    from absl import flags
    from absl import logging as absl_logging

    from aqn_jax import launch as launcher
    from aqn_jax import training

    def tripwire(*args, **kwargs):
        raise AssertionError("the warm start was reached: the bad input was not refused first")

    monkeypatch.setattr(training, "warm_start", tripwire)

    def call(*args, workdir):
        # argv[0] as is: absl names the process after it on its first run
        argv = [sys.argv[0], CONFIG, *args, f"--workdir={workdir}"]
        monkeypatch.setattr(sys, "argv", argv)  # ml_collections reads overrides from sys.argv
        # absl's log handler keeps the stderr it first saw (an earlier capture): this test's.
        monkeypatch.setattr(absl_logging.get_absl_handler().python_handler, "stream", sys.stderr)
        try:
            launcher.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
        finally:  # the next launch defines its own override flags
            for name in [n for n in list(flags.FLAGS) if n.startswith("config.")]:
                delattr(flags.FLAGS, name)
        out = capsys.readouterr()
        return code, out.out, out.err

    return call


def read_only_cache(tmp_path, monkeypatch):
    ro = tmp_path / "ro_cache"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes anyway: report the directory as any other user sees it
        access = os.access
        monkeypatch.setattr(
            os,
            "access",
            lambda p, mode, *a, **k: (
                False if os.path.abspath(p) == str(ro) and mode & os.W_OK else access(p, mode)
            ),
        )
    return (f"--config.sft.cache_dir={ro}",)


def cache_under_a_file(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("not a directory")
    return (f"--config.sft.cache_dir={tmp_path / 'a_file' / 'cache'}",)


CASES = [
    # (id, flags or a function (tmp_path, monkeypatch) -> flags, what the message must contain)
    ("prompts", ("--config.data_batch.prompts=0",), "config.data_batch.prompts=0; must be"),
    ("max_new", ("--config.rollout.max_new_tokens=0",), "config.rollout.max_new_tokens=0; must"),
    ("top_p", ("--config.rollout.top_p=2",), "config.rollout.top_p=2.0; must be in (0, 1]"),
    ("temperature", ("--config.rollout.temperature=-1",), "config.rollout.temperature=-1.0; must"),
    ("top_k", ("--config.rollout.top_k=-1",), "config.rollout.top_k=-1; must be >= 0"),
    ("n_zero", ("--config.rollout.n=0",), "config.rollout.n=0; must be >= 1"),
    ("n_grpo", ("--config.rollout.n=1",), "config.rollout.n=1; must be >= 2 with config.algo"),
    ("keep", ("--config.checkpoint.keep=0",), "config.checkpoint.keep=0; must be >= 1"),
    ("every", ("--config.checkpoint.every=-1",), "config.checkpoint.every=-1; must be >= 0"),
    ("val_size", ("--config.trainer.val_size=0",), "config.trainer.val_size=0; must be >= 1"),
    ("total_steps", ("--config.trainer.total_steps=0",), "config.trainer.total_steps=0; must"),
    ("val_bs", ("--config.trainer.val_batch_size=0",), "config.trainer.val_batch_size=0; must"),
    ("lr", ("--config.actor.lr=0",), "config.actor.lr=0.0; must be > 0"),
    (
        "reward_method",
        ("--config.data.reward_method=lenient",),
        "config.data.reward_method='lenient'; allowed: ('strict', 'flexible', 'boxed')",
    ),
    (
        "mini_batch",
        ("--config.actor.mini_batch_prompts=3",),
        "config.actor.mini_batch_prompts=3 must divide config.data_batch.prompts=4",
    ),
    (
        "typo",
        ("--config.trainer.totl_steps=3",),
        "--config.trainer.totl_steps: no such field; did you mean config.trainer.total_steps?",
    ),
    (
        "rollout_is",
        ("--config.algo.rollout_is=tok",),
        "config.algo.rollout_is='tok'; allowed: ('none', 'token', 'sequence')",
    ),
    (
        "rs_lower_above_upper",
        ("--config.algo.rollout_rs=token", "--config.algo.rollout_rs_threshold_lower=3"),
        "config.algo.rollout_rs_threshold_lower=3.0 > config.algo.rollout_rs_threshold=2.0",
    ),
    (
        "is_greedy_rollout",
        ("--config.algo.rollout_is=token", "--config.rollout.temperature=0"),
        "config.rollout.temperature=0 samples greedily",
    ),
    (
        "tokenizer_missing",
        lambda tmp_path, _: (f"--config.tokenizer_path={tmp_path / 'nowhere'}",),
        "config.tokenizer_path=",
    ),
    (
        "tokenizer_foreign_dir",
        lambda tmp_path, _: (f"--config.tokenizer_path={tmp_path}",),
        "holds neither tokenizer.json",
    ),
    (
        "test_path_a_directory",
        lambda tmp_path, _: (
            *data_flags(tmp_path, SHORT)[:1],
            f"--config.data.test_path={tmp_path}",
        ),
        "config.data.test_path=",  # the rest below: it said "no such file"
    ),
    ("cache_read_only", read_only_cache, "config.sft.cache_dir="),
    ("cache_under_file", cache_under_a_file, "config.sft.cache_dir="),
    (
        "all_prompts_long",
        lambda tmp_path, _: data_flags(tmp_path, LONG),
        "16 of 16 train prompts are longer than config.rollout.max_prompt_len=72",
    ),
]


@pytest.mark.parametrize("make_flags,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_first_naming_the_field(launch, tmp_path, monkeypatch, make_flags, message):
    from aqn_jax.lock import LOCK_FILE

    work, cache = tmp_path / "run", tmp_path / "cache"
    work.mkdir()
    for name, content in PREVIOUS.items():
        (work / name).write_bytes(content)
    args = make_flags(tmp_path, monkeypatch) if callable(make_flags) else make_flags
    code, _, err = launch(f"--config.sft.cache_dir={cache}", *args, workdir=work)
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], err
    if "test_path=" in message:
        assert "': a directory; expected a file" in errors[0], err
    assert "config." in errors[0] and "Traceback" not in err
    # Nothing trained, cached or compiled; the workdir as it was: no workdir lock left either.
    ro = tmp_path / "ro_cache"
    assert not cache.exists() and (not ro.exists() or not any(ro.iterdir()))
    assert {p.name for p in work.iterdir()} == set(PREVIOUS), LOCK_FILE
    for name, content in PREVIOUS.items():
        assert (work / name).read_bytes() == content


def test_long_train_prompts_are_counted_and_dropped_or_refused(launch, tmp_path, capsys):
    from aqn_jax.checks import check_train

    from conftest import load_config

    mixed = LONG[:5] + SHORT
    config = load_config("targeted", "smoke")
    config.data.train_path, config.data.test_path = (
        f.split("=", 1)[1] for f in data_flags(tmp_path, mixed)
    )
    config.sft.cache_dir = str(tmp_path / "cache")
    result = check_train(config)
    assert (result.train_prompts, result.train_prompts_dropped) == (21, 5)
    out = capsys.readouterr().out
    assert "5 of 21 train prompts are longer than config.rollout.max_prompt_len=72" in out
    assert "dropped (config.data.drop_long_prompts=True); 16 train prompts left" in out

    # drop_long_prompts=False: refused, naming the flag, the count and the length limit.
    work = tmp_path / "run"
    code, _, err = launch(
        *data_flags(tmp_path, mixed), "--config.data.drop_long_prompts=False", workdir=work
    )
    assert code == 2, err
    assert (
        "error: config.data.drop_long_prompts=False and 5 of 21 train prompts are longer than"
        " config.rollout.max_prompt_len=72" in err
    )
    assert not (tmp_path / "cache").exists() and not (work / "checkpoints").exists()


def test_a_failed_sft_cache_write_keeps_the_trained_warm_start(tmp_path, monkeypatch, capsys):
    """The cache checked writable, then the write fails anyway (a full disk): the run goes on
    with the SFT it trained, warning once, and leaves no half-written entry behind."""
    from aqn_jax import warm_start as pretrain
    from aqn_jax.spec import warm_start_spec

    from conftest import load_config

    config = load_config("targeted", "smoke")
    config.sft.cache_dir = str(tmp_path / "cache")
    trained = object()
    monkeypatch.setattr(pretrain, "load_params", lambda *a: "init")
    monkeypatch.setattr(pretrain, "sft_train", lambda *a, **k: (trained, {"loss": [2.0, 0.5]}))

    def full_disk(path, *args):
        os.makedirs(path)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pretrain, "save_hf_checkpoint", full_disk)
    _, params, info = pretrain.warm_start(warm_start_spec(config), str(tmp_path / "run"))
    assert params is trained and info["cache"] == "unsaved"
    assert "warning: the SFT warm start could not be cached" in capsys.readouterr().err
    assert os.listdir(tmp_path / "cache") == []  # the temporary directory removed


def test_a_refused_command_leaves_no_new_directory_and_a_bad_workdir_is_one_line(launch, tmp_path):
    """A refusal in a workdir that did not exist removes the directories it made (no empty
    directory holding a `.lock`), and not one that existed; a workdir that is a file, or under
    one, is one line naming --workdir."""
    (tmp_path / "keep").mkdir()  # existed, empty: stays
    work = tmp_path / "keep" / "new" / "run"
    code, _, err = launch("--config.trainer.total_steps=0", workdir=work)
    assert code == 2 and "error: config.trainer.total_steps=0; must be >= 1" in err, err
    assert os.listdir(tmp_path / "keep") == []
    (tmp_path / "a_file").write_text("x")
    for workdir, message in (
        (tmp_path / "a_file", "is a file, not a directory"),
        (tmp_path / "a_file" / "run", "cannot be created (Not a directory"),
    ):
        code, _, err = launch(workdir=workdir)
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
        assert errors[0].startswith(f"error: --workdir={workdir}: {message}"), err
    assert (tmp_path / "a_file").read_text() == "x"


def test_a_refused_resume_changes_nothing(launch, tmp_path):
    """A finished run whose final checkpoint is params-only, resumed with a changed field under
    --config.resume_override=True: refused before the warm start, and config.json,
    config_overrides.jsonl and the workdir's listing stay as they were (they were rewritten and
    appended before the refusal, so the run's own command was refused next)."""
    import flax.struct
    import numpy as np

    from aqn_jax.checkpoint import Checkpointer

    from conftest import load_config

    work, cache = tmp_path / "run", f"--config.sft.cache_dir={tmp_path / 'cache'}"
    # The run's start: the warm start's tripwire stops it (config.json is written after the
    # warm start since issue 50: written here as that run wrote it).
    with pytest.raises(AssertionError, match="the warm start was reached"):
        launch(cache, "--config.trainer.total_steps=2", workdir=work)
    assert not (work / "config.json").exists()
    started = load_config("targeted", "smoke")
    started.sft.cache_dir, started.trainer.total_steps = str(tmp_path / "cache"), 2
    (work / "config.json").write_text(started.to_json_best_effort(indent=2))
    (work / "config_overrides.jsonl").write_text('{"changed": {}}\n')

    @flax.struct.dataclass
    class State:
        params: dict

    ckpt = Checkpointer(str(work), 0, 1, "params")
    ckpt.save(2, State({"w": np.zeros(3, np.float32)}), {"step": 2, "data": {}}, final=True)
    ckpt.close()

    def snapshot():  # every path and its mtime (the lock's: rewritten by each holder), 2 files
        paths = {str(p.relative_to(work)): p.stat().st_mtime_ns for p in work.rglob("*")}
        return (
            paths.keys(),
            {k: v for k, v in paths.items() if k != ".lock"},
            {
                name: (work / name).read_bytes()
                for name in ("config.json", "config_overrides.jsonl")
            },
        )

    before = snapshot()
    flags = ("--config.trainer.total_steps=1", "--config.resume_override=True")
    code, _, err = launch(cache, *flags, workdir=work)
    assert code == 2 and "is the params-only final checkpoint of a finished run" in err, err
    assert snapshot() == before
    # Without the override: the changed field is refused, naming it; nothing changed either.
    code, _, err = launch(cache, "--config.trainer.total_steps=1", workdir=work)
    assert code == 2 and "config.trainer.total_steps: 2 -> 1" in err, err
    assert snapshot() == before


def test_check_train_parses_the_config_once_into_a_frozen_run_spec(monkeypatch, tmp_path):
    """`check_train` returns the run's `RunSpec`: each part equal to its builder's on the same
    config, config.lora and config.faults parsed once (the step's builder called again parses
    config.lora again: the negative control; the memory plan's builder takes the parsed parts),
    and the spec frozen (a later change of the config changes nothing in it)."""
    import dataclasses

    from aqn_jax import checks
    from aqn_jax import spec as spec_lib
    from aqn_jax.aqn.plan import build_plan
    from aqn_jax.faults.config import fault_plan
    from aqn_jax.lora import lora_spec

    from conftest import load_config

    config = load_config("targeted", "smoke")
    config.sft.cache_dir = str(tmp_path / "cache")
    calls = {"lora": 0, "faults": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapper

    monkeypatch.setattr(spec_lib, "lora_spec", counted("lora", lora_spec))
    monkeypatch.setattr(checks, "fault_plan", counted("faults", fault_plan))
    run = checks.check_train(config)
    assert calls == {"lora": 1, "faults": 1}
    spec_lib.step_spec(config)  # negative control: the builder called again parses again
    job = spec_lib.job_spec(config, run.model, run.step, run.device)
    assert calls == {"lora": 2, "faults": 1} and job.mesh == run.mesh

    n = run.model.num_hidden_layers
    assert isinstance(run, spec_lib.RunSpec) and n == 8
    assert run.step == spec_lib.step_spec(config) and run.loop == spec_lib.loop_spec(config)
    assert run.lora == lora_spec(config.lora) and run.weight_format == "none"
    assert run.device.describe() == fault_plan(config.faults, n).describe()
    assert run.srdd == spec_lib.srdd_spec(config) and run.diagnose  # targeted: aqn 'located'
    located = {"srdd_sigmas": {3: 0.05}, "srdd_layers": [3]}
    want = build_plan(config.faults, config.aqn, n, **located)
    assert run.plan(**located).describe() == want.describe()
    assert run.summary.fault_layers == (int(config.faults.deadzone.layers),)
    assert run.trainer.steps(5) == int(config.trainer.total_steps)
    assert dataclasses.replace(run.trainer, total_epochs=2).steps(5) == 10
    assert run.mesh_axes == {a: int(config.mesh[a]) for a in ("data", "fsdp", "tensor")}
    # Frozen: the config changed afterwards leaves the spec as it was.
    steps, sigma = run.trainer.total_steps, run.aqn.sigma_start
    config.trainer.total_steps, config.aqn.sigma_start = steps + 7, sigma * 3
    assert (run.trainer.total_steps, run.aqn.sigma_start) == (steps, sigma)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.seed = 1
