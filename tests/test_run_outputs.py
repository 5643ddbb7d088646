"""`metrics.open_run`, the one rule for a run's per-step outputs at start or resume: exactly the
rows up to the restored checkpoint (metrics.jsonl and TensorBoard), none on a fresh start with
the earlier outputs moved aside, and a refusal when the rows cannot match the checkpoint."""

import json
import os
import struct
from pathlib import Path

import pytest

from aqn_jax.metrics import open_run, read_metrics


def _write(workdir, steps, tail=""):
    rows = [{"step": s, "critic/score/mean": 0.1 * s, "timing_s/step": 1.0} for s in steps]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def _tensorboard_steps(workdir, key="critic/score/mean"):
    """Steps of `key` in every event file (TFRecord: u64 length, u32 crc, data, u32 crc)."""
    from tensorboardX.proto.event_pb2 import Event

    steps = []
    for path in sorted((workdir / "tensorboard").iterdir()):
        data = path.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            steps += [event.step for v in event.summary.value if v.tag == key]
    return steps


def test_resume_keeps_exactly_the_rows_up_to_the_checkpoint(tmp_path):
    # A killed run: rows 0..4 (one cut short while written), TensorBoard events 0..4.
    writer, rows = open_run(str(tmp_path), None, log=lambda m: None)
    assert rows == []
    for s in range(5):
        writer.write(s, {"critic/score/mean": 0.1 * s})
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "critic/sco')
    assert sorted(_tensorboard_steps(tmp_path)) == [0, 1, 2, 3, 4]

    writer, rows = open_run(str(tmp_path), 2)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2]
    writer.write(3, {"critic/score/mean": 0.3})
    writer.close()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2, 3]
    assert sorted(_tensorboard_steps(tmp_path)) == [0, 1, 2, 3]  # 3 and 4 of the killed run gone
    assert not (tmp_path / "previous").exists()


def test_tensorboard_tags_are_legal_and_jsonl_keeps_verl_names(tmp_path, caplog):
    """`@` becomes `_at_` in TensorBoard only, silently (tensorboardX would log 'Summary name ...
    is illegal' at INFO on every write and turn `@` into `_`)."""
    import logging

    name = "val-core/arithmetic/acc/mean@1"
    writer, _ = open_run(str(tmp_path), None, log=lambda m: None)
    with caplog.at_level(logging.INFO):
        writer.write(0, {name: 0.5, "critic/score/mean": 0.25})
    writer.close()
    assert not [r for r in caplog.records if "illegal" in r.getMessage()]
    assert read_metrics(str(tmp_path))[0][name] == 0.5
    assert _tensorboard_steps(tmp_path, "val-core/arithmetic/acc/mean_at_1") == [0]
    assert _tensorboard_steps(tmp_path, name) == []  # the negative control: not the raw name
    assert _tensorboard_steps(tmp_path, "critic/score/mean") == [0]  # legal names unchanged


def test_fresh_start_moves_earlier_outputs_aside(tmp_path):
    _write(tmp_path, [0])  # killed after its step-0 validation row, before any checkpoint
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "config.json").write_text("{}")  # not a per-step output: stays
    said = []
    writer, rows = open_run(str(tmp_path), None, log=said.append)
    writer.write(0, {"critic/score/mean": 0.5})
    writer.close()
    assert rows == [] and [r["step"] for r in read_metrics(str(tmp_path))] == [0]
    (aside,) = (tmp_path / "previous").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "summary.json"]
    assert [r["step"] for r in read_metrics(str(aside))] == [0]
    assert (tmp_path / "config.json").exists() and str(aside) in said[0]
    # Negative control: a workdir with no outputs moves nothing.
    empty = tmp_path / "empty"
    empty.mkdir()
    open_run(str(empty), None, log=said.append)[0].close()
    assert len(said) == 1 and not (empty / "previous").exists()


@pytest.mark.parametrize(
    "steps, restored, message",
    [
        ([0, 1], 3, r"missing steps \[2, 3\]"),  # rows deleted after the checkpoint was written
        ([0, 0, 1, 2], 2, r"repeated steps \[0\]"),  # an older bug appended a second start
        ([], 1, r"missing steps \[0, 1\]"),  # metrics.jsonl removed
    ],
)
def test_rows_that_cannot_match_the_checkpoint_are_refused(tmp_path, steps, restored, message):
    _write(tmp_path, steps)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match=r"metrics\.jsonl does not hold exactly.*" + message):
        open_run(str(tmp_path), restored)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before  # nothing rewritten


def test_resume_with_another_config_is_refused_unless_overridden(tmp_path):
    """Checkpoints made under one config are never resumed under another without saying so."""
    from aqn_jax.checkpoint import check_resume_config, record_override
    from aqn_jax.experiment import arm_config

    def check(c):
        return check_resume_config(c.to_json_best_effort(), c.resume_override, str(tmp_path))

    config = arm_config("deadzone", "smoke")
    (tmp_path / "config.json").write_text(config.to_json_best_effort(indent=2))
    before = (tmp_path / "config.json").read_bytes()
    assert check(config) == {}  # no checkpoint: nothing to check
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    assert check(config) == {}  # the same config resumes

    changed = arm_config("deadzone", "smoke")
    changed.actor.lr = 1e6
    changed.checkpoint.keep = 5  # where and how often things are saved may change
    with pytest.raises(ValueError, match=r"config\.actor\.lr: 3e-05 -> 1000000\.0; resume"):
        check(changed)
    assert (tmp_path / "config.json").read_bytes() == before

    changed.resume_override = True
    diff = check(changed)
    assert diff == {"actor.lr": (3e-05, 1e6)}
    record_override(str(tmp_path), diff)
    (row,) = [json.loads(x) for x in (tmp_path / "config_overrides.jsonl").read_text().splitlines()]
    assert row["changed"] == {"actor.lr": {"from": 3e-05, "to": 1e6}}


def test_a_diverged_state_is_never_saved():
    """check_sane stops the run before the save, naming the step and what diverged."""
    import flax.struct
    import jax.numpy as jnp
    import ml_collections

    from aqn_jax.checkpoint import check_sane

    @flax.struct.dataclass
    class State:
        params: dict
        opt_state: dict

    bounds = ml_collections.ConfigDict({"max_grad_norm": 1e4, "max_param_abs": 1e4})
    ok = State({"w": jnp.ones(3)}, {"mu": jnp.zeros(3), "count": jnp.array(2, jnp.int32)})
    check_sane(3, ok, {"actor/grad_norm": 8.0}, bounds)  # a healthy step saves
    with pytest.raises(FloatingPointError, match="RL step 4: not saved: non-finite"):
        check_sane(4, State(ok.params, {"mu": jnp.array([0.0, jnp.nan, 0.0])}), {}, bounds)
    with pytest.raises(FloatingPointError, match=r"max \|param\| = 1e\+08 > config\.trainer"):
        check_sane(5, State({"w": jnp.array([1e8, 0.0])}, ok.opt_state), {}, bounds)
    with pytest.raises(FloatingPointError, match=r"actor/grad_norm=3e\+06 > config\.trainer"):
        check_sane(6, ok, {"actor/grad_norm": 3e6}, bounds)
    bounds.max_grad_norm = 0  # 0 = no bound
    check_sane(7, ok, {"actor/grad_norm": 3e6}, bounds)


def test_rollback_rewinds_to_one_row_a_step(tmp_path):
    # A guarded run rolls back (config.sdc) to step 1 after steps 2 and 3 were logged: the redone
    # steps' rows replace the first ones (metrics.jsonl and TensorBoard: one row a step, the
    # accepted attempt's), and the file still satisfies the resume rule.
    writer, history = open_run(str(tmp_path), None, log=lambda m: None)
    for s in range(4):
        history.append({"step": float(s), "critic/score/mean": 0.1 * s})
        writer.write(s, history[-1])
    del history[2:]
    writer.rewind(history)
    for s in (2, 3):
        writer.write(s, {"critic/score/mean": 1.0 + s})
    writer.close()
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # without the rewind: 0, 1, 2, 3, 2, 3
    assert [r["critic/score/mean"] for r in rows] == pytest.approx([0.0, 0.1, 3.0, 4.0])
    assert sorted(_tensorboard_steps(tmp_path)) == [0, 1, 2, 3]
    open_run(str(tmp_path), 3)[0].close()  # resumable: exactly one row for each step 0..3


def test_a_run_writes_tensorboard_events_without_importing_torch(tmp_path):
    """A run's TensorBoard writer does not import torch (tensorboardX imports it, when it is
    installed, only for type hints: ~1.5 CPU-s of every run). In a fresh interpreter, since this
    one may hold torch already. The negative control, in the same interpreter afterwards:
    tensorboardX imported again plainly does import it."""
    import importlib.util
    import subprocess
    import sys

    assert importlib.util.find_spec("torch") is not None  # the test extras install torch
    code = (
        "import sys; from aqn_jax.metrics import open_run\n"
        f"w, _ = open_run({str(tmp_path)!r}, None, log=lambda m: None)\n"
        "w.write(0, {'critic/score/mean': 0.5}); w.close()\n"
        "print('torch' in sys.modules)\n"
        "for name in [m for m in sys.modules if m.split('.')[0] == 'tensorboardX']:\n"
        "    del sys.modules[name]\n"
        "import tensorboardX\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["False", "True"], out.stdout
    assert _tensorboard_steps(tmp_path) == [0]  # the events were written


def test_step_records_are_written_once_per_step(tmp_path):
    """`put_step_records`: a step's per-problem lines replace that step's and later ones (an
    interrupted attempt's), so a resumed run's repeat writes no line twice."""
    from aqn_jax.files import put_step_records

    path = str(tmp_path / "validation_samples.jsonl")
    put_step_records(path, 0, [{"index": 0}, {"index": 1}])
    put_step_records(path, 2, [{"index": 0}])
    put_step_records(path, 4, [{"index": 0}])

    def steps():
        with open(path) as f:
            return [(r["step"], r["index"]) for r in map(json.loads, f)]

    assert steps() == [(0, 0), (0, 1), (2, 0), (4, 0)]
    # Resumed from the step-2 checkpoint after step 4 was validated: step 4 again, once.
    put_step_records(path, 4, [{"index": 0}, {"index": 1}])
    assert steps() == [(0, 0), (0, 1), (2, 0), (4, 0), (4, 1)]
    # Resumed from step 0 (no checkpoint): step 2's repeat drops every later line.
    put_step_records(path, 2, [{"index": 1}])
    assert steps() == [(0, 0), (0, 1), (2, 1)]


def test_write_evaluation_moves_the_records_to_samples_jsonl(tmp_path):
    from aqn_jax.evaluation import write_evaluation

    recs = [{"condition": "fault", "index": i, "correct": i % 3 == 0} for i in range(6)]
    result = {"conditions": {"fault": {"acc": 2 / 6, "n": 6, "records": recs}}, "wall_time_s": 1}
    path = write_evaluation(str(tmp_path), result)
    ev = json.loads(Path(path).read_text())
    assert "records" not in ev["conditions"]["fault"] and ev["samples_file"] == "samples.jsonl"
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines == recs
    assert sum(x["correct"] for x in lines) / len(lines) == ev["conditions"]["fault"]["acc"]
    assert sorted(os.listdir(tmp_path)) == ["evaluation.json", "samples.jsonl"]  # no .tmp left
