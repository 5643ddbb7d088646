"""Issue 51 on the CPU: the real Qwen2.5-Coder-0.5B GRPO step (the `:deadzone` arm of
configs/qwen2p5_coder_0p5b_gsm8k.py, LoRA r32 over the frozen base, 2 prompts x 8 samples x 256
new tokens) with full-vocabulary logits (a source tree before the chunked readout) and with the
chunked readout (this tree), each at its own config's micro-batch, plus this tree at the old
micro-batch (the readout alone).

  python bench/readout_cpu.py --before=/path/to/tree@8ff6bec --hf-path=/models/qwen05 \
      --gsm8k=../shared/datasets/gsm8k [--steps 2] [--out /tmp/readout_cpu] [--record]
      [--order before,after,after_old_mb,before]

Method:
  * each arm is one `python -m aqn_jax.launch` run in its source tree, under
    bench/device/peak_rss.py (the process tree's RSS polled every 0.2 s, and ru_maxrss);
  * `--steps` RL steps, validation on one test problem at the start and the end (the smallest
    allowed), so the peak is the step's;
  * step time: the last step's `timing_s/step` (the first holds no compile, since the step
    programs are compiled ahead, but the last is the steadier); `gen` and `update` split;
  * every arm in one compute dtype (`--dtype`, bf16 by default), not the config's 'auto';
  * the arms run one after another, never side by side (each needs most of the RAM); the load
    average before each is printed.

Prints `BENCH readout_cpu_step ratio=<before step s / after step s> ...` (ours after over ours
before: > 1 is faster) and `BENCH readout_cpu_rss ratio=<before peak / after peak>`; with
--record the table goes to WORKSPACE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_arm(name, tree, micro_batch, a) -> dict:
    workdir = os.path.join(a.out, name)
    cmd = [
        sys.executable,
        "-m",
        "aqn_jax.launch",
        "--config=configs/qwen2p5_coder_0p5b_gsm8k.py:deadzone",
        f"--config.model.hf_path={a.hf_path}",
        f"--config.data.train_path={os.path.join(a.gsm8k, 'train.jsonl')}",
        f"--config.data.test_path={os.path.join(a.gsm8k, 'test.jsonl')}",
        f"--config.trainer.total_steps={a.steps}",
        "--config.trainer.val_size=1",
        "--config.trainer.val_batch_size=1",
        "--config.checkpoint.final=none",
        f"--config.model.dtype={a.dtype}",
        f"--workdir={workdir}",
    ]
    if micro_batch:
        cmd.append(f"--config.actor.micro_batch_rows={micro_batch}")
    res = os.path.join(a.out, name + ".json")
    print(f"[{name}] tree={tree} load={os.getloadavg()[0]:.2f}", flush=True)
    subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "device", "peak_rss.py"),
            f"--timeout={a.timeout}",
            f"--log={os.path.join(a.out, name + '.log')}",
            f"--out={res}",
            f"--workdir={workdir}",
            "--",
            *cmd,
        ],
        cwd=tree,
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    with open(res) as f:
        r = json.load(f)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        steps = [row for row in map(json.loads, f) if "timing_s/step" in row]
    if r["returncode"] != 0 or len(steps) != a.steps:
        raise SystemExit(
            f"[{name}] failed: rc {r['returncode']}, {len(steps)} steps; {r['log_tail']}"
        )
    last = steps[-1]
    out = {
        "arm": name,
        "micro_batch": micro_batch or "config",
        "step_s": last["timing_s/step"],
        "gen_s": last["timing_s/gen"],
        "update_s": last["timing_s/update"],
        "peak_gib": max(r["peak_rss_polled_gib"], r["ru_maxrss_gib"] or 0),
        "planner_gib": r["planner_cpu_rss_gib"],
        "wall_s": r["wall_s"],
    }
    print(f"[{name}] {out}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="a source tree before the chunked readout")
    ap.add_argument("--hf-path", required=True)
    ap.add_argument("--gsm8k", required=True, help="directory with train.jsonl and test.jsonl")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="/tmp/readout_cpu")
    ap.add_argument("--old-micro-batch", type=int, default=2, help="the before tree's config")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        help="the compute dtype of every arm: the config's 'auto' times a product at start-up,"
        " and under load that choice flips between runs (f32 in one arm, bf16 in another)",
    )
    ap.add_argument("--record", action="store_true")
    ap.add_argument(
        "--order",
        default="before,after,after_old_mb,before",
        help="the arms in the order run; an arm given twice is run twice and its mean reported"
        " (before first and last brackets the load's drift)",
    )
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    trees = {"before": (os.path.abspath(a.before), None), "after": (ROOT, None)}
    trees["after_old_mb"] = (ROOT, a.old_micro_batch)
    runs: dict[str, list[dict]] = {}
    for i, arm in enumerate(a.order.split(",")):
        if arm not in trees:
            raise SystemExit(f"--order: {arm!r}; allowed: {sorted(trees)}")
        runs.setdefault(arm, []).append(run_arm(f"{arm}{i}", *trees[arm], a))
    mean = {
        arm: {
            k: (statistics.mean(r[k] for r in rs) if isinstance(rs[0][k], float) else rs[0][k])
            for k in rs[0]
        }
        for arm, rs in runs.items()
    }
    before, after, same = mean["before"], mean["after"], mean["after_old_mb"]
    from common import cpu_flags  # bench/common.py (the script's folder is on sys.path)

    flags = cpu_flags().replace(" ", ",")
    print(
        f"BENCH readout_cpu_step ratio={before['step_s'] / after['step_s']:.3f}"
        f" before_s={before['step_s']:.1f} after_s={after['step_s']:.1f}"
        f" after_old_mb_s={same['step_s']:.1f} flags={flags}"
    )
    print(
        f"BENCH readout_cpu_rss ratio={before['peak_gib'] / after['peak_gib']:.3f}"
        f" before_gib={before['peak_gib']:.2f} after_gib={after['peak_gib']:.2f}"
        f" after_old_mb_gib={same['peak_gib']:.2f}"
    )
    if a.record:
        rows = [r for rs in runs.values() for r in rs]
        lines = [
            f"### bench/readout_cpu.py — the 0.5B step at 2x8x256, {a.steps} steps (flags {flags})",
            "",
            "| arm | micro-batch | step s | gen s | update s | peak RSS GiB | planner GiB |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['arm']} | {r['micro_batch']} | {r['step_s']:.1f} | {r['gen_s']:.1f} |"
                f" {r['update_s']:.1f} | {r['peak_gib']:.2f} | {r['planner_gib']} |"
            )
        with open(os.path.join(ROOT, "WORKSPACE.md"), "a") as f:
            f.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
