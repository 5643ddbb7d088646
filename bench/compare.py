"""The study's runs one after another vs in parallel worker processes (job `compare`).

  python bench/compare.py [--arms deadzone,global_aqn] [--seeds 0,1] [--record] [-- FLAGS]

Both modes run the same `configs/compare.py` runs (default: 2 arms x 2 seeds of the embedded
study at full size, 30 RL steps + the robustness matrix each) as `python -m aqn_jax.launch`
subprocesses in fresh workdirs that start from one shared SFT warm start (built once first,
outside the timing) and a cold XLA cache, so each mode pays its own compiles:

  sequential   --config.compare.workers=1: the runs one after another in one process
  parallel     --config.compare.workers=0: one worker process per core

Prints `BENCH compare_parallel ratio=<sequential wall / parallel wall>` and compares the numbers
of both modes (per-run metrics rows except timings, accuracies, held-out losses): a worker has
one core, so XLA's threaded reductions round differently than with two; the line says how far
apart the two are. With --record, the table into WORKSPACE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, check_load, cpu_description, record  # noqa: E402


def launch(workdir: Path, flags: list[str]) -> float:
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "aqn_jax.launch", *flags, f"--workdir={workdir}"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return time.perf_counter() - t0


def numbers(workdir: Path) -> dict:
    """Everything a run computed (no timings): metrics rows and the evaluation."""
    out = {}
    for ev in sorted(workdir.glob("runs/*/seed*/evaluation.json")):
        run = ev.parent
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        rows = [{k: v for k, v in r.items() if not k.startswith("timing_s/")} for r in rows]
        e = json.loads(ev.read_text())
        out[str(run.relative_to(workdir))] = {
            "rows": rows,
            "acc": {k: c["acc"] for k, c in e["conditions"].items()},
            "loss": e.get("loss"),
        }
    return out


def differences(a: dict, b: dict) -> str:
    """How far apart two modes' numbers are: exact-equal runs, max |diff| of the held-out
    losses, of the final accuracies, and of the RL reward curves."""
    same = sum(a[k] == b[k] for k in a)
    loss = max(abs(a[k]["loss"][f] - b[k]["loss"][f]) for k in a for f in a[k]["loss"])
    acc = max(abs(a[k]["acc"][c] - b[k]["acc"][c]) for k in a for c in a[k]["acc"])
    reward = max(
        abs(x.get("critic/score/mean", 0) - y.get("critic/score/mean", 0))
        for k in a
        for x, y in zip(a[k]["rows"], b[k]["rows"], strict=True)
    )
    return (
        f"identical_runs={same}/{len(a)} max_dloss={loss:.2e} max_dacc={acc:.3f}"
        f" max_dreward={reward:.3f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="deadzone,global_aqn")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("flags", nargs="*", help="extra --config.* flags for both modes")
    args = ap.parse_args()
    print(cpu_description())
    arms = tuple(args.arms.split(","))
    seeds = tuple(int(s) for s in args.seeds.split(","))
    flags = [
        "--config=configs/compare.py",
        f"--config.compare.arms={arms!r}",
        f"--config.compare.reference_arm={arms[0]}",  # comparisons: inside the arms
        f"--config.compare.comparisons={tuple((a, arms[0]) for a in arms[1:])!r}",
        f"--config.compare.seeds={seeds!r}",
        *args.flags,
    ]
    root = Path(tempfile.mkdtemp(prefix="bench_compare_"))
    # The shared warm start, outside the timing (both modes would read the same cache).
    warm = root / "warm"
    launch(warm / "sft", [*flags, "--config.job=pretrain", f"--config.sft.cache_dir={warm}/cache"])
    rows, walls, results = [], {}, {}
    load = check_load()
    for mode, workers in (("sequential", 1), ("parallel", 0)):
        work = root / mode
        work.mkdir()
        shutil.copytree(warm / "cache", work / "cache")
        wall = launch(work, [*flags, f"--config.compare.workers={workers}"])
        res = json.loads((work / "results.json").read_text())
        t = res["timing"]
        walls[mode] = wall
        results[mode] = numbers(work)
        per_run = [r["wall_time_s"] for a in res["runs"].values() for r in a.values()]
        rows.append(
            f"| {mode} | {t['workers']} | {len(per_run)} | {wall:.1f} |"
            f" {t['runs_wall_s_this_invocation']:.1f} | {min(per_run):.1f} | {max(per_run):.1f} |"
        )
        print(rows[-1], flush=True)
    same = differences(results["sequential"], results["parallel"])
    ratio = walls["sequential"] / walls["parallel"]
    line = (
        f"BENCH compare_parallel ratio={ratio:.3f} runs={len(arms) * len(seeds)}"
        f" workers={rows[1].split('|')[2].strip()} {same}"
    )
    print(line)
    shutil.rmtree(root, ignore_errors=True)
    if args.record:
        intro = (
            f"Job `compare`, arms {list(arms)} x seeds {list(seeds)} of the embedded study (full"
            " size: 30 RL steps + the robustness matrix per run), each mode a fresh process and"
            " workdir from one shared SFT warm start (built before the timing) and a cold XLA"
            " cache. Wall = the whole `python -m aqn_jax.launch` command; runs wall = the runs"
            " part of it; per run = one run's train + evaluate wall (in parallel mode runs"
            f" overlap). Numbers of the two modes: {same}. Load average before: {load}."
            f"\n\n`{line}`"
        )
        table = [
            "| mode | workers | runs | wall s | runs wall s | per run min s | per run max s |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
        print(f"recorded in {record('bench/compare.py', intro, table)}")


if __name__ == "__main__":
    main()
