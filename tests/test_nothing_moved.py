"""bench/nothing_moved.py's comparison, on two hand-made workdirs: equal runs count every
non-timing value equal; one changed value, a changed manifest, a new and a gone key are each
found (the negative controls); timing keys never count."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("nothing_moved", ROOT / "bench/nothing_moved.py")
nm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nm)

ROWS = [
    {"step": 0, "val-core/acc": 0.484375, "timing_s/testing": 4.7},
    {"step": 1, "critic/score/mean": 0.35, "aqn/sigma": 0.0210848, "timing_s/step": 6.5},
]


def _workdir(path: Path, rows, manifest=b'{"deadzone": ["layers_15"]}') -> str:
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "manifest.json").write_bytes(manifest)
    return str(path)


def test_equal_runs_count_every_value_but_timing(tmp_path):
    a = _workdir(tmp_path / "a", ROWS)
    b = _workdir(tmp_path / "b", [dict(r, **{"timing_s/step": 99.0}) for r in ROWS])
    # step 0: step, val-core/acc; step 1: step, score, sigma -> 5 values, timing left out.
    assert nm.compare(a, b) == (5, 5, [], [], True)


def test_a_changed_value_a_key_and_the_manifest_are_found(tmp_path):
    a = _workdir(tmp_path / "a", ROWS)
    changed = [dict(ROWS[0]), dict(ROWS[1], **{"aqn/sigma": 0.0210849})]
    changed[1]["critic/new"] = 1.0
    del changed[0]["val-core/acc"]
    b = _workdir(tmp_path / "b", changed, manifest=b'{"deadzone": ["layers_14"]}')
    equal, shared, new, gone, same = nm.compare(a, b)
    assert (equal, shared) == (3, 4)
    assert new == ["critic/new"] and gone == ["val-core/acc"] and same is False


def test_timing_names():
    assert nm.timing("timing_s/gen") and nm.timing("perf/throughput") and nm.timing("wall_s")
    assert not nm.timing("critic/score/mean") and not nm.timing("aqn/sigma")
