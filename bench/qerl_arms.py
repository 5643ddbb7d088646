"""QeRL mode's arms side by side, from a finished `configs/compare.py:qerl_study` workdir: what
each arm changes (policy entropy over training, the base's quantisation error) and what it
costs (step time, its phases), beside the study's accuracies (results.json).

  python bench/qerl_arms.py --workdir=runs/qerl_study [--record]

Prints a table per quantity and `BENCH qerl_arms ratio=<full step time / arm step time> arm=..`
lines (the speed of each LoRA arm over full fine-tuning on this machine), and with --record
appends the tables to WORKSPACE.md. The step times are of the study's own runs (two at a time on
two cores: comparable between arms, not a quiet-machine figure).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess

import numpy as np

from aqn_jax.experiment import arm_names

ARMS = arm_names("qerl")  # QeRL Table 1's columns, in the registry's order


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _cpu_flags() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    model = next(
        (ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), "?"
    )
    flags = next((ln.split(":", 1)[1] for ln in out.splitlines() if ln.startswith("Flags")), "")
    keep = [f for f in flags.split() if f.startswith(("avx512", "amx", "avx2"))]
    return f"{model} ({' '.join(keep) or 'no avx2/avx512/amx'})"


def per_arm(workdir: str) -> dict[str, dict]:
    out = {}
    for arm in ARMS:
        # Finished runs only (evaluation.json is written last).
        done = glob.glob(os.path.join(workdir, "runs", arm, "seed*", "evaluation.json"))
        runs = sorted(os.path.join(os.path.dirname(p), "metrics.jsonl") for p in done)
        if not runs:
            continue
        ent, step_t, gen_t, prep_t, upd_t = [], [], [], [], []
        for path in runs:
            rows = [r for r in _rows(path) if "actor/entropy" in r]
            ent.append([r["actor/entropy"] for r in rows])
            # Step 1 holds the compile: the steady state is steps 2..N.
            steady = rows[1:] or rows
            step_t.append(np.median([r["timing_s/step"] for r in steady]))
            gen_t.append(np.median([r["timing_s/gen"] for r in steady]))
            prep_t.append(np.median([r["timing_s/old_log_prob"] for r in steady]))
            upd_t.append(np.median([r["timing_s/update"] for r in steady]))
        n = min(len(e) for e in ent)
        ent = np.array([e[:n] for e in ent])
        out[arm] = {
            "seeds": len(runs),
            "entropy": ent.mean(0),
            "entropy_sd": ent.std(0, ddof=1) if len(runs) > 1 else np.zeros(n),
            "step_s": float(np.median(step_t)),
            "gen_s": float(np.median(gen_t)),
            "prep_s": float(np.median(prep_t)),
            "update_s": float(np.median(upd_t)),
        }
    return out


COMPARISONS = (("nvfp4_lora", "lora"), ("nvfp4_lora_aqn", "nvfp4_lora"), ("lora", "full"))


def _final(workdir: str, arm: str) -> dict[str, list[float]]:
    """Per finished seed: the evaluation's accuracy on the faulty and the clean device, and the
    validation's at the start and the end of training."""
    out: dict[str, list[float]] = {"fault": [], "clean": [], "val0": [], "val_end": []}
    for path in sorted(glob.glob(os.path.join(workdir, "runs", arm, "seed*", "evaluation.json"))):
        with open(path) as f:
            ev = json.load(f)["conditions"]
        with open(os.path.join(os.path.dirname(path), "summary.json")) as f:
            sm = json.load(f)
        out["fault"].append(ev["fault"]["acc"])
        out["clean"].append(ev["clean"]["acc"])
        out["val0"].append(sm["val_acc_start"])
        out["val_end"].append(sm["val_acc_end"])
    return out


def accuracy_tables(workdir: str, arms: list[str]) -> list[str]:
    from aqn_jax.study.stats import describe, holm, welch

    finals = {arm: _final(workdir, arm) for arm in arms}
    lines = [
        "| arm | seeds | faulty device (eval) mean, 95% CI | clean device (eval) |"
        " validation faulty start -> end |",
        "|---|---|---|---|---|",
    ]
    for arm, f in finals.items():
        a, c = describe(f["fault"]), describe(f["clean"])
        ci = lambda d: (  # noqa: E731
            f"{d['mean']:.3f} [{d['ci_low']:.3f}, {d['ci_high']:.3f}]"
            if d["ci_low"] is not None
            else f"{d['mean']:.3f}"
        )
        lines.append(
            f"| {arm} | {a['n']} | {ci(a)} | {ci(c)} | {np.mean(f['val0']):.3f} ->"
            f" {np.mean(f['val_end']):.3f} |"
        )
    for device in ("fault", "clean"):
        tests = [
            (a, b, welch(finals[a][device], finals[b][device]))
            for a, b in COMPARISONS
            if a in finals and b in finals
        ]
        adjusted = holm([t["p"] for _, _, t in tests])
        lines += [
            "",
            f"Welch tests on the {device} device (Holm over the {len(tests)} comparisons):",
            "",
            "| comparison | diff | 95% CI | p | p (Holm) | MDD |",
            "|---|---|---|---|---|---|",
        ]
        for (a, b, t), ph in zip(tests, adjusted, strict=True):
            if t["p"] is None:
                lines.append(f"| {a} - {b} | n/a ({t['reason']}) | | | | |")
                continue
            lines.append(
                f"| {a} - {b} | {t['diff']:+.3f} | [{t['diff_ci_low']:+.3f},"
                f" {t['diff_ci_high']:+.3f}] | {t['p']:.3f} | {ph:.3f} | {t['mdd']:.3f} |"
            )
    return lines


def tables(workdir: str) -> str:
    arms = per_arm(workdir)
    lines = [f"CPU: {_cpu_flags()}; workdir {workdir}", ""]
    lines += [
        "| arm | seeds | entropy step 1 | entropy mid | entropy last | step s (median) |"
        " gen | log-probs | update |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, a in arms.items():
        e, sd = a["entropy"], a["entropy_sd"]
        mid = len(e) // 2
        lines.append(
            f"| {arm} | {a['seeds']} | {e[0]:.4f} ± {sd[0]:.4f} | {e[mid]:.4f} ± {sd[mid]:.4f} |"
            f" {e[-1]:.4f} ± {sd[-1]:.4f} | {a['step_s']:.2f} | {a['gen_s']:.2f} |"
            f" {a['prep_s']:.2f} | {a['update_s']:.2f} |"
        )
    lines += ["", *accuracy_tables(workdir, list(arms))]
    if "full" in arms:
        for arm, a in arms.items():
            if arm != "full":
                print(
                    f"BENCH qerl_arms ratio={arms['full']['step_s'] / a['step_s']:.3f} arm={arm}"
                    f" step_s={a['step_s']:.2f} full_step_s={arms['full']['step_s']:.2f}"
                )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    text = tables(args.workdir)
    print(text)
    if args.record:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with open(os.path.join(here, "WORKSPACE.md"), "a") as f:
            f.write(f"\n#### bench/qerl_arms.py\n\n{text}\n")


if __name__ == "__main__":
    main()
