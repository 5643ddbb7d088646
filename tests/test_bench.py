"""The peer benchmark's smoke mode, so it cannot rot (issue 17): `bench/rl_step.py --smoke` runs
one GRPO step of ours and one of TRL's `GRPOTrainer` on the same weights and prompts, at the
smoke shape (4 prompts x 2 samples, at most 8 new tokens). Nothing here is timed; the test
checks that both sides ran a real step, that the BENCH line is the ratio of the two step
times it prints, and that each side's ROOFLINE line is consistent. `--device=gpu` without a
GPU, and a bad `--shape`, stop with one line before any work (issue 41)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(*args, env, timeout):
    return subprocess.run(
        [sys.executable, "bench/rl_step.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_rl_step_bench_smoke_runs_one_step_per_side():
    import trl  # noqa: F401  (the `bench` extra; a missing install must fail, not skip)

    proc = _bench("--smoke", env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=600)
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
    roof = {
        m[0]: dict(kv.split("=", 1) for kv in m[1].split())
        for m in re.findall(r"^ROOFLINE setting=(\S+) (.*)$", out, re.M)
    }
    assert set(roof) == {"ours1", "trl1"}, out
    for side, f in roof.items():
        f = {k: float(v) for k, v in f.items()}
        assert all(v > 0 for v in f.values()), (side, f)
        # Printed to 6 significant digits (each within 5e-6 relative): the % of the floor is
        # the one its own fields give.
        pct = 100 * f["decode_floor_s"] / f["gen_s"]
        assert f["decode_pct_floor"] == pytest.approx(pct, rel=2e-5), (side, f)


def test_rl_step_bench_refuses_a_missing_gpu_and_a_bad_shape_in_one_line():
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update(HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")  # no GPU, on any machine
    for args, message in (
        (["--device=gpu"], "error: --device=gpu: no GPU for both sides on this machine: "),
        (["--shape=3,2,8"], "error: --shape=3,2,8: want P,N,T: prompts per step (even"),
    ):
        proc = _bench(*args, env=env, timeout=120)
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), proc.stderr[-3000:]
        assert "BENCH" not in proc.stdout and "ROOFLINE" not in proc.stdout
