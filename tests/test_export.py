"""The export never deletes what it did not write (issues 50, 61): an existing target is replaced
only when it is an earlier export (its marker file) holding only the files the marker lists, the
run itself and anything inside it other than its export directory are refused, so are the
command's own workdir and a run whose config.json is broken, a file or an unwritable path is one
line, and a refused command leaves the run and the target byte-identical. A re-export replaces
the earlier one (written beside it, then renamed); modes follow the umask."""

import os
import stat

import numpy as np
import pytest

from conftest import launch_cli, load_config, random_params, tree_state


@pytest.fixture
def train_run(tmp_path):
    """A train run's workdir as the export job reads it first: config.json and a checkpoint."""
    from aqn_jax.checkpoint import Checkpointer

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(load_config("targeted", "smoke").to_json())
    ckpt = Checkpointer(str(run), 0, 1)
    ckpt.save(1, {"params": {"w": np.zeros(2, np.float32)}}, {"step": 1})
    ckpt.close()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


def _export_config(run, out):
    config = load_config("export")
    config.export.run, config.export.out = str(run), str(out)
    return config


def _refused(config, work, match):
    """launch.run refuses `config` with `match`; the export job's workdir `work` untouched."""
    from aqn_jax.launch import run

    with pytest.raises(ValueError, match=match) as e:
        run(config, str(work))
    assert "\n" not in str(e.value)
    assert not work.exists()  # the export job's own workdir: not even created


def test_export_refuses_targets_it_did_not_write(train_run, tmp_path):
    work = tmp_path / "work"
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("precious")
    afile = tmp_path / "a_file"
    afile.write_text("precious too")
    # An earlier export (its marker lists its files) to which a user added notes and results.
    earlier = tmp_path / "earlier"
    (earlier / "evals").mkdir(parents=True)
    (earlier / ".aqn_jax_export").write_text("an HF snapshot...\nconfig.json\nmodel.safetensors\n")
    (earlier / "config.json").write_text("{}")
    (earlier / "model.safetensors").write_bytes(b"weights")
    (earlier / "NOTES.md").write_text("my notes")
    (earlier / "evals" / "result.json").write_text('{"acc": 0.5}')
    before = {p: tree_state(p) for p in (train_run, other, earlier)}
    cases = [
        (
            other,
            r"an existing directory that is not an export \(no .aqn_jax_export in it; it"
            r" holds notes.txt\)",
        ),
        (
            earlier,
            r"an earlier export, but it also holds NOTES.md, evals/, which the export did not"
            r" write; nothing is deleted",
        ),
        (train_run, "the run .* itself, a directory inside it or one that holds it"),
        (train_run / "checkpoints", "itself, a directory inside it"),
        (tmp_path, "itself, a directory inside it or one that holds it"),
        (afile, "is a file"),
        ("/proc/aqn_jax_export", "/proc is not a writable directory"),
    ]
    for out, match in cases:
        _refused(_export_config(train_run, out), work, rf"config.export.out={out}: .*{match}")
    # The command's own workdir (launch makes it and puts its lock there), or one inside out.
    own = "this command's own --workdir={}"
    _refused(_export_config(train_run, work), work, rf"out={work}: is {own.format(work)}")
    held = tmp_path / "holder" / "work"
    _refused(_export_config(train_run, held.parent), held, rf": holds {own.format(held)}")
    assert not held.parent.exists()
    assert {p: tree_state(p) for p in (train_run, other, earlier)} == before
    assert afile.read_text() == "precious too"
    # From the command line: exit 2 and one line, the directory byte-identical.
    proc = launch_cli(
        "--config=configs/export.py",
        f"--config.export.run={train_run}",
        f"--config.export.out={other}",
        workdir=work,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert f"config.export.out={other}: an existing directory that is not an export" in errors[0]
    assert "Traceback" not in proc.stderr
    assert tree_state(other) == before[other] and tree_state(train_run) == before[train_run]
    # Negative controls: the run's own export directory, a new path, an empty directory.
    from aqn_jax.jobs.export import check_config

    (tmp_path / "empty").mkdir()
    for out in (train_run / "export", tmp_path / "new" / "dir", tmp_path / "empty"):
        assert check_config(_export_config(train_run, out))[3] == str(out)
    assert not (tmp_path / "new").exists()  # checked, not created


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", r"run/config.json is not valid JSON \(Expecting property name"),
        ("[1, 2]", r"run/config.json holds a JSON list, not a run's config"),
    ],
)
def test_a_broken_run_config_is_named_by_path(train_run, tmp_path, text, message):
    (train_run / "config.json").write_text(text)
    before = tree_state(train_run)
    _refused(_export_config(train_run, tmp_path / "out"), tmp_path / "work", message)
    assert tree_state(train_run) == before and not (tmp_path / "out").exists()


def test_reexport_replaces_an_earlier_export_atomically(tmp_path):
    from aqn_jax.export import MARKER, export_policy
    from aqn_jax.models.hf import load_hf_checkpoint
    from aqn_jax.models.qwen2 import Qwen2Config

    cfg = Qwen2Config.tiny(num_hidden_layers=1)
    out = tmp_path / "export"
    old_mask = os.umask(0o027)
    try:
        export_policy(str(out), cfg, random_params(cfg, 0), "")
        first = tree_state(out)
        # A user's files in it: refused, naming them, the export byte-identical.
        (out / "evals").mkdir()
        (out / "evals" / "result.json").write_text('{"acc": 0.5}')
        (out / "NOTES.md").write_text("my notes")
        kept = tree_state(out)
        with pytest.raises(ValueError, match=r"also holds NOTES.md, evals/, which the export"):
            export_policy(str(out), cfg, random_params(cfg, 1), "")
        assert tree_state(out) == kept and sorted(os.listdir(tmp_path)) == ["export"]
        (out / "NOTES.md").unlink()
        (out / "evals" / "result.json").unlink()
        (out / "evals").rmdir()
        export_policy(str(out), cfg, random_params(cfg, 1), "")
    finally:
        os.umask(old_mask)
    assert (out / MARKER).is_file()
    listed = (out / MARKER).read_text().splitlines()[1:]
    assert listed == sorted(set(os.listdir(out)) - {MARKER}), listed
    assert sorted(os.listdir(tmp_path)) == ["export"]  # nothing left beside it
    assert tree_state(out).keys() == first.keys()
    _, params = load_hf_checkpoint(str(out), "float32")
    want = random_params(cfg, 1)["embed_tokens"]["embedding"]
    np.testing.assert_array_equal(np.asarray(params["embed_tokens"]["embedding"]), want)
    # Modes follow the umask (0o027): not mkdtemp's 0700, not the sources' modes.
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    for name in os.listdir(out):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o640, name


def test_export_step_is_a_step_the_run_has_or_minus_one(train_run, tmp_path):
    """config.export.step: a step with a checkpoint, or -1 (the latest); any other value (-5 took
    the latest) is one line naming the steps there, with nothing written."""
    from aqn_jax.checkpoint import Checkpointer
    from aqn_jax.jobs.export import check_config

    ckpt = Checkpointer(str(train_run), 0, 2)
    ckpt.save(3, {"params": {"w": np.ones(2, np.float32)}}, {"step": 3})
    ckpt.close()
    before = tree_state(train_run)
    for step in (-5, -2, 2, 4):
        config = _export_config(train_run, tmp_path / "out")
        config.export.step = step
        _refused(
            config,
            tmp_path / "work",
            rf"^config.export.step={step}; allowed: a step {train_run} has a checkpoint of"
            r" \(1, 3\), or -1 \(the latest\)$",
        )
    assert tree_state(train_run) == before and not (tmp_path / "out").exists()
    # Negative controls: -1 is the latest, a step there is itself.
    for step, want in ((-1, 3), (1, 1), (3, 3)):
        config = _export_config(train_run, tmp_path / "out")
        config.export.step = step
        assert check_config(config)[2] == want
