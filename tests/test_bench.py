"""The peer benchmark's smoke mode, so it cannot rot (issue 17): `bench/rl_step.py --smoke` runs
one GRPO step of ours and one of TRL's `GRPOTrainer` on the same weights and prompts, at the
smoke shape (4 prompts x 2 samples, at most 8 new tokens). Nothing here is timed; the test
checks that both sides ran a real step and that the BENCH line is the ratio of the two step
times it prints."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_rl_step_bench_smoke_runs_one_step_per_side():
    import trl  # noqa: F401  (the `bench` extra; a missing install must fail, not skip)

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "bench/rl_step.py", "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # One line per side: a real step with a real completion on each.
    sides = dict(re.findall(r"^(ours1|trl1): step ([0-9.]+)s", out, re.M))
    assert set(sides) == {"ours1", "trl1"}, out
    assert all(float(s) > 0 for s in sides.values()), out
    bench = re.findall(r"^BENCH rl_step_vs_trl (.*)$", out, re.M)
    assert bench, out
    fields = dict(kv.split("=", 1) for kv in bench[0].split())
    assert fields["pairing"] == "best" and fields["ours"] == "ours1" and fields["trl"] == "trl1"
    ours_len, trl_len = float(fields["ours_len"]), float(fields["trl_len"])
    assert 1 <= ours_len <= 8 and 1 <= trl_len <= 8, fields  # <= the smoke's 8 new tokens
    ours_s, trl_s = float(fields["ours_step_s"]), float(fields["trl_step_s"])
    ratio = float(fields["ratio"])
    if fields["normalised"] == "per_step":
        expected = trl_s / ours_s
    else:
        assert fields["normalised"] == "per_generated_token", fields
        expected = (trl_s / trl_len) / (ours_s / ours_len)
    # Printed to 2 decimals (times) and 3 (ratio): the ratio is the one its own fields give.
    assert ratio == pytest.approx(expected, rel=0.02, abs=0.01), fields
