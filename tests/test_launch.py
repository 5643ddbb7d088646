"""End-to-end smoke runs of `python -m aqn_jax.launch` and its errors on bad input."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import launch_cli, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tiny preset: embed 256*128; per layer q 128*128+128, k,v 128*64+64, o 128*128,
# mlp 3*128*384, two norms 2*128; final norm 128; tied head.
TINY_PARAMS = (
    256 * 128
    + 8 * (128 * 128 + 128 + 2 * (128 * 64 + 64) + 128 * 128 + 3 * 128 * 384 + 2 * 128)
    + 128
)


def _launch(*args, workdir):
    return launch_cli(*args, workdir=workdir)


# A line of absl's log format at INFO (`I1126 06:46:37.279289 140117 launch.py:55] ...`).
ABSL_INFO = re.compile(r"^I\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ", re.M)


@pytest.mark.slow
def test_model_summary_embedded_default_writes_to_runs_config_stem(tmp_path):
    """The embedded default's model summary; without --workdir a job writes to
    ./runs/<config file stem> (the README's commands); `--compile_cache` wins over the
    environment's directory; the log is quiet (no INFO lines:
    test_model_summary_with_faults_writes_manifest has them back with --verbosity=1). One run
    checks all. The flag names the session's own cache (tests/conftest.py), warm."""
    cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
    unused = tmp_path / "env_cache"
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    env["JAX_COMPILATION_CACHE_DIR"] = str(unused)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aqn_jax.launch",
            f"--config={os.path.join(REPO, 'configs', 'model_summary.py')}",
            f"--compile_cache={cache}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"total parameters: {TINY_PARAMS:,}" in proc.stdout
    assert not unused.exists()  # the flag's directory, not the environment's
    assert not ABSL_INFO.search(proc.stderr + proc.stdout), proc.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "model_summary" / "model_summary.json").read_text())
    assert summary["param_count"] == TINY_PARAMS == 1_609_856
    assert summary["config"]["num_hidden_layers"] == 8
    assert len(summary["top5_next_tokens"]) == 5
    assert {r["path"] for r in summary["params"]} >= {
        "embed_tokens/embedding",
        "layers_7/mlp/down_proj/kernel",
        "norm/weight",
    }


@pytest.mark.slow
def test_model_summary_from_hf_snapshot(hf_factory, tmp_path):
    from aqn_jax.data.tokenizers import CharTokenizer

    path, hf_model = hf_factory(seed=9, tie_word_embeddings=False, vocab_size=200)
    CharTokenizer().save(tmp_path / "tok")
    proc = _launch(
        "--config=configs/model_summary.py",
        f"--config.model.hf_path={path}",
        f"--config.tokenizer_path={tmp_path / 'tok'}",
        "--config.model.dtype=bfloat16",
        workdir=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "model_summary.json").read_text())
    assert summary["param_count"] == sum(p.numel() for p in hf_model.parameters())
    assert summary["config"]["dtype"] == "bfloat16"
    assert summary["config"]["tie_word_embeddings"] is False


@pytest.mark.parametrize(
    "override,message",
    [
        ("--config.model.preset=qwen9", "config.model.preset='qwen9'; allowed:"),
        ("--config.model.dtype=float64", "config.model.dtype='float64'; allowed:"),
        ("--config.model.hf_path=/nonexistent/dir", "config.model.hf_path='/nonexistent/dir'"),
        ("--config.job=nope", "config.job='nope'; allowed: .*'model_summary'"),
    ],
)
@pytest.mark.slow
def test_bad_config_fails_before_work(tmp_path, override, message):
    proc = _launch("--config=configs/model_summary.py", override, workdir=tmp_path)
    assert proc.returncode != 0
    assert re.search(message, proc.stderr), proc.stderr[-2000:]
    assert not (tmp_path / "model_summary.json").exists()


@pytest.mark.slow
def test_tokenizer_larger_than_model_vocab(hf_factory, tmp_path):
    from aqn_jax.data.tokenizers import CharTokenizer

    path, _ = hf_factory(seed=10, vocab_size=97)  # CharTokenizer has 178 ids
    CharTokenizer().save(tmp_path / "tok")
    proc = _launch(
        "--config=configs/model_summary.py",
        f"--config.model.hf_path={path}",
        f"--config.tokenizer_path={tmp_path / 'tok'}",
        workdir=tmp_path,
    )
    assert proc.returncode != 0
    assert "the tokenizer has 178 ids but the model's vocab_size is 97" in proc.stderr


def test_model_summary_with_faults_writes_manifest(tmp_path):
    proc = _launch(
        "--config=configs/model_summary.py",
        "--config.faults.deadzone.enabled=True",
        "--config.faults.deadzone.layers=(3,5)",
        "--config.aqn.enabled=True",
        "--config.aqn.layers=3",
        "--config.phase=rollout",
        "--verbosity=1",
        workdir=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # --verbosity brings the INFO lines back (the launch's own devices line among them).
    assert re.search(ABSL_INFO.pattern + r"JAX \S+, 1 devices", proc.stderr, re.M), proc.stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    rollout = manifest["hits"]["rollout"]
    assert rollout["deadzone"] == ["layers_3/layer:output", "layers_5/layer:output"]
    assert rollout["aqn"] == ["layers_3/layer:output"]
    assert manifest["hits"]["eval"] == {"deadzone": rollout["deadzone"]}  # AQN: rollout only
    summary = json.loads((tmp_path / "model_summary.json").read_text())
    assert summary["max_logit_diff_vs_clean"] > 0
    assert 0 < summary["fault_stats"]["deadzone.flushed/mean"] < 1
    assert summary["aqn_sigma"] == pytest.approx(0.05 * 0.01 ** (1 / 8))  # step 20 of 100
    assert "layers_3/layer:output" in proc.stdout


def test_bad_fault_config_fails_before_work(tmp_path):
    proc = _launch(
        "--config=configs/model_summary.py",
        "--config.faults.deadzone.enabled=True",
        "--config.faults.deadzone.layers=9",
        workdir=tmp_path,
    )
    # One line, exit 2, no traceback (a user error); --verbose shows the traceback.
    assert proc.returncode == 2
    assert (
        "error: config.faults.deadzone.layers='9' but the model has 8 layers (ids 0..7)"
        in proc.stderr.splitlines()
    )
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "model_summary.json").exists()
    proc = _launch(
        "--config=configs/model_summary.py",
        "--config.faults.deadzone.enabled=True",
        "--config.faults.deadzone.layers=9",
        "--verbose",
        workdir=tmp_path,
    )
    assert proc.returncode == 1 and "Traceback" in proc.stderr


def test_every_config_takes_smoke_and_refuses_an_unknown_argument():
    import pathlib

    names = sorted(p.stem for p in (pathlib.Path(REPO) / "configs").glob("*.py"))
    assert len(names) >= 14
    for name in names:
        if name == "gsm8k_qwen2p5_1p5b":  # its argument is the arm; ':smoke' is not one
            continue
        assert load_config(name, "smoke").job, name
        with pytest.raises(ValueError, match=rf"configs/{name}\.py:nonsense|nonsense"):
            load_config(name, "nonsense")


def test_compile_cache_directory_flag_then_environment_then_per_user_default(tmp_path, monkeypatch):
    from aqn_jax import compile_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home_cache"))
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.resolve(str(tmp_path / "flag")) == str(tmp_path / "flag")
    assert compile_cache.resolve(None) == str(tmp_path / "env")
    assert compile_cache.resolve("off") is None and compile_cache.resolve("OFF") is None
    monkeypatch.delenv(compile_cache.ENV)
    assert compile_cache.resolve(None) == str(tmp_path / "home_cache" / "aqn_jax" / "xla")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"--compile_cache=.*file is not a directory; give"):
        compile_cache.resolve(str(tmp_path / "file"))


def test_an_unusable_compile_cache_is_refused_naming_the_flag(tmp_path, monkeypatch, capsys):
    """--compile_cache (or $JAX_COMPILATION_CACHE_DIR) that cannot be created or written: one
    line naming it, exit 2, nothing written (JAX alone only warned and ran uncached); the
    per-user default in that state turns the cache off, saying so in one line."""
    from aqn_jax import compile_cache

    from conftest import launch_cli, tree_state

    work = tmp_path / "run"
    work.mkdir()
    (work / "notes.txt").write_text("an earlier run's file")
    before = tree_state(work)
    proc = launch_cli("--config=configs/export.py", "--compile_cache=/proc/aqn_x", workdir=work)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: --compile_cache=/proc/aqn_x: /proc/aqn_x cannot be")
    assert "give a writable directory or 'off'" in errors[0] and "Traceback" not in proc.stderr
    assert tree_state(work) == before
    monkeypatch.setenv(compile_cache.ENV, "/proc/aqn_env")
    with pytest.raises(ValueError, match=rf"^{compile_cache.ENV}=/proc/aqn_env: /proc/aqn_env"):
        compile_cache.resolve(None)
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/aqn_home")
    assert compile_cache.resolve(None) is None
    assert capsys.readouterr().err.startswith("compile cache off: /proc/aqn_home/aqn_jax/xla")
    # Negative control: a directory that can be made is taken (made by JAX, not here).
    assert compile_cache.resolve(str(tmp_path / "new" / "xla")) == str(tmp_path / "new" / "xla")
    assert not (tmp_path / "new").exists()


def test_compile_cache_keeps_every_program(tmp_path):
    """`compile_cache.use`: a program that compiles in well under JAX's default threshold
    (1 s) is written too, and a process started from this one (the environment) uses the same
    directory."""
    code = (
        "import sys, subprocess, jax; from aqn_jax import compile_cache;"
        " compile_cache.use(sys.argv[1]); jax.jit(lambda x: x * 3 + 1)(1.0);"
        " subprocess.run([sys.executable, '-c', 'import jax; jax.jit(lambda x: x - 2)(1.0)'],"
        " check=True)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["JAX_PLATFORMS"] = "cpu"
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, check=True, timeout=120, cwd=REPO
    )
    entries = [p for p in tmp_path.iterdir() if not p.name.endswith("-atime")]
    assert len(entries) == 2, sorted(p.name for p in tmp_path.iterdir())


def test_auto_compute_dtype_resolves_once_and_says_why():
    import ml_collections

    from aqn_jax import compute_dtype
    from aqn_jax.launch import resolve_dtype

    config = ml_collections.ConfigDict({"model": {"dtype": "auto", "param_dtype": "float32"}})
    config.lock()
    lines: list[str] = []
    resolve_dtype(config, log=lines.append)
    # Resolved in place to a dtype the model accepts, with the measurement that chose it.
    assert config.model.dtype in ("float32", "bfloat16")
    (line,) = lines
    assert line.startswith(f"config.model.dtype=auto -> {config.model.dtype}: a 256x896x4864")
    ratio = float(line.split("(")[1].split("x;")[0])
    assert (config.model.dtype == "bfloat16") == (ratio >= compute_dtype.MIN_SPEEDUP)
    # An explicit dtype is the user's: left alone, nothing timed or printed.
    resolve_dtype(config, log=lines.append)
    assert len(lines) == 1
    # An accelerator takes bf16 without timing.
    assert compute_dtype.choose("gpu")[0] == "bfloat16"
