"""The paired study's outcome (`configs/qwen2p5_coder_0p5b_gsm8k.py:study`): for each run the
faulty- and clean-device accuracies at step 0 (the warm start, evaluated once for the whole
study: greedy decoding of one model is deterministic) and at the end; for each arm the mean
with its 95% interval over seeds, the share of groups with a signal per step, and AQN's
largest sigma with the rollout's mean |log-perplexity difference| from the training pass (the
check that an AQN arm's condition differs: 0 without AQN); the paired comparisons (the arms
of a seed see the same prompts in the same order) with Holm's p over the family, Hedges' g
and the minimum detectable difference.

  python -m aqn_jax.study.outcome --workdir=runs/qwen05_study --out=docs/qwen05_arith_study

reads the compare job's workdir (`baseline/evaluation.json`, `runs/<arm>/seed<k>/`,
`srdd/srdd.json`) and writes `<out>.json`, `<out>.png` and `<out>.md` (the tables). Only
finished runs count (those with `evaluation.json`); a comparison needs at least two seeds
finished in both of its arms (its p is otherwise `n/a` with the reason).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from aqn_jax.study import stats

# The compare job's arm -> the study's name for it.
ARM_NAMES = {
    "deadzone": "faulty",
    "clean": "clean_rl",
    "targeted": "targeted_aqn",
    "global_aqn": "global_aqn",
}
# (a, b, device): mean(a - b) over seeds on that device's final accuracy.
COMPARISONS = (
    ("faulty", "clean_rl", "faulty"),  # the seed's hypothesis: RL on the device it serves
    ("targeted_aqn", "faulty", "faulty"),
    ("global_aqn", "faulty", "faulty"),
    ("targeted_aqn", "global_aqn", "faulty"),
    ("faulty", "clean_rl", "clean"),  # what adapting to the fault costs elsewhere
)
DEVICES = {"faulty": "fault", "clean": "clean"}  # the device -> its evaluation condition


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


# Per RL step, from metrics.jsonl: the share of groups with an advantage (the run had signal),
# AQN's sigma and the rollout's |log-perplexity difference| from the training pass (AQN acts on
# the rollout only, so this is how far its noise moved the sampler: 0 without AQN).
PER_STEP = {
    "signal": "critic/groups_with_advantage",
    "aqn_sigma": "aqn/sigma",
    "mismatch": "rollout_corr/log_ppl_abs_diff",
}


def _per_step(run_dir: str) -> dict[str, list[float]]:
    """`PER_STEP`'s series of one run, each over the RL steps that logged it."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = []
    if os.path.isfile(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return {name: [r[key] for r in rows if key in r] for name, key in PER_STEP.items()}


def collect(workdir: str) -> dict[str, Any]:
    """The finished runs of a compare workdir, with the step-0 evaluation and SRDD's layers."""
    base = _load(os.path.join(workdir, "baseline", "evaluation.json"))["conditions"]
    runs = []
    for arm, name in ARM_NAMES.items():
        arm_dir = os.path.join(workdir, "runs", arm)
        if not os.path.isdir(arm_dir):
            continue
        for seed_dir in sorted(os.listdir(arm_dir)):
            run_dir = os.path.join(arm_dir, seed_dir)
            ev_path = os.path.join(run_dir, "evaluation.json")
            if not os.path.isfile(ev_path):
                continue
            conds = _load(ev_path)["conditions"]
            series = _per_step(run_dir)
            runs.append(
                {
                    "arm": name,
                    "seed": int(seed_dir.removeprefix("seed")),
                    "steps": len(series["signal"]),  # the RL steps the run logged
                    "faulty_step0": base["fault"]["acc"],
                    "faulty_final": conds["fault"]["acc"],
                    "clean_step0": base["clean"]["acc"],
                    "clean_final": conds["clean"]["acc"],
                    "n": int(conds["fault"]["n"]),
                    "n_clean": int(conds["clean"]["n"]),
                    **series,
                }
            )
    srdd_path = os.path.join(workdir, "srdd", "srdd.json")
    layers = _load(srdd_path)["verdict"]["layers"] if os.path.isfile(srdd_path) else None
    return {"runs": runs, "srdd_layers": layers}


def outcome(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per arm the final accuracies' means and intervals over seeds and the signal per step;
    the paired comparisons (`COMPARISONS`), Holm-corrected over the family."""
    arms: dict[str, Any] = {}
    for name in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == name]
        signal = [r["signal"] for r in mine if r["signal"]]
        steps = min((len(s) for s in signal), default=0)
        sigmas = [x for r in mine for x in r.get("aqn_sigma", [])]
        mismatch = [x for r in mine for x in r.get("mismatch", [])]
        arms[name] = {
            "seeds": sorted(r["seed"] for r in mine),
            "faulty_final": stats.describe([r["faulty_final"] for r in mine]),
            "clean_final": stats.describe([r["clean_final"] for r in mine]),
            "signal_per_step": [float(np.mean([s[i] for s in signal])) for i in range(steps)],
            "aqn_sigma_max": max(sigmas) if sigmas else None,
            "mismatch_mean": float(np.mean(mismatch)) if mismatch else None,
        }
    comparisons = []
    for a, b, device in COMPARISONS:
        by_a = {r["seed"]: r[f"{device}_final"] for r in runs if r["arm"] == a}
        by_b = {r["seed"]: r[f"{device}_final"] for r in runs if r["arm"] == b}
        seeds = sorted(set(by_a) & set(by_b))
        test = stats.paired([by_a[s] for s in seeds], [by_b[s] for s in seeds])
        comparisons.append(
            {
                "a": a,
                "b": b,
                "device": device,
                "seeds": seeds,
                "mean_diff": test["diff"],
                "ci": [test["diff_ci_low"], test["diff_ci_high"]],
                "p": test["p"],
                "g": test["hedges_g"],
                "mdd": test["mdd"],
                "reason": test["reason"],
            }
        )
    for c, p in zip(comparisons, stats.holm([c["p"] for c in comparisons]), strict=True):
        c["p_holm"] = p
    return {"arms": arms, "comparisons": comparisons}


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _machine() -> str:
    """This CPU as `cpu` records it: its model name, family and model, and the flags that set
    XLA:CPU's matmul speed and rounding (the study's seeds pair only on one machine class)."""
    from aqn_jax.compute_dtype import cpu_flags

    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor's block
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown"
    flags = ",".join(cpu_flags() or ()) or "none of avx2/avx512/amx"
    return (
        f"{info.get('model name', 'unknown')}, family {info.get('cpu family', '?')} model"
        f" {info.get('model', '?')}; flags {flags}"
    )


def plot(result: Mapping[str, Any], path: str) -> str:
    """Each run's faulty-device accuracy at step 0 and at the end, per arm, with the arm's
    mean and interval; beside it the clean device's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    names = list(result["arms"])
    for ax, device in zip(axes, ("faulty", "clean"), strict=True):
        for i, name in enumerate(names):
            finals = [r[f"{device}_final"] for r in result["runs"] if r["arm"] == name]
            ax.scatter([i] * len(finals), finals, color="C0", alpha=0.6, zorder=3)
            d = result["arms"][name][f"{device}_final"]
            if d["mean"] is not None:
                low = d["ci_low"] if d["ci_low"] is not None else d["mean"]
                high = d["ci_high"] if d["ci_high"] is not None else d["mean"]
                ax.errorbar(
                    i + 0.15,
                    d["mean"],
                    yerr=[[d["mean"] - low], [high - d["mean"]]],
                    fmt="s",
                    color="k",
                    capsize=4,
                )
        if result["runs"]:
            ax.axhline(result["runs"][0][f"{device}_step0"], color="gray", ls="--", label="step 0")
        labels = [f"{n}\n{len(result['arms'][n]['seeds'])} seeds" for n in names]
        ax.set_xticks(range(len(names)), labels)
        ax.set_ylim(0.0, 1.0)  # an accuracy: a t interval over two seeds runs far past it
        ax.set_title(f"final greedy accuracy, {device} device")
        ax.legend(loc="lower right")
    axes[0].set_ylabel("accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _num(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _sci(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1e}"


def _interval(d: Mapping[str, Any]) -> str:
    """`mean [low, high]` of a `stats.describe`, or the mean alone under two seeds."""
    if d["ci_low"] is None:
        return _num(d["mean"])
    return f"{_num(d['mean'])} [{_num(d['ci_low'])}, {_num(d['ci_high'])}]"


def table(result: Mapping[str, Any]) -> str:
    """The outcome as markdown: the arms (final accuracies with their 95% intervals over
    seeds, AQN's sigma and its effect on the rollout, the share of groups with a signal), the
    paired comparisons (with why one is untested) and every run."""
    runs = result["runs"]
    lines = [
        f"SRDD's layers: {result['srdd_layers']}. Step 0 (every arm): faulty device "
        + (
            f"{_num(runs[0]['faulty_step0'])}, clean device {_num(runs[0]['clean_step0'])}."
            if runs
            else "n/a."
        ),
        "",
        "| arm | seeds | faulty device, final | clean device, final | AQN σ, max |"
        " rollout vs train, mean abs Δ log ppl | groups with a signal, per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, arm in result["arms"].items():
        signal = arm["signal_per_step"]
        shown = " ".join(f"{s:.2f}" for s in signal) if signal else "n/a"
        lines.append(
            f"| {name} | {len(arm['seeds'])} | {_interval(arm['faulty_final'])} | "
            f"{_interval(arm['clean_final'])} | {_sci(arm['aqn_sigma_max'])} | "
            f"{_sci(arm['mismatch_mean'])} | {shown} |"
        )
    lines += [
        "",
        "| a − b | device | seeds | mean diff [95% CI] | p | p (Holm) | Hedges' g | MDD |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in result["comparisons"]:
        p = stats.format_p(c["p"]) if c["p"] is not None or not c["reason"] else c["reason"]
        ci = "" if c["ci"][0] is None else f" [{_num(c['ci'][0])}, {_num(c['ci'][1])}]"
        lines.append(
            f"| {c['a']} − {c['b']} | {c['device']} | {len(c['seeds'])} | "
            f"{_num(c['mean_diff'])}{ci} | {p} | "
            f"{stats.format_p(c['p_holm'])} | {_num(c['g'], 2)} | {_num(c['mdd'])} |"
        )
    lines += [
        "",
        "| arm | seed | steps | faulty device (n) | clean device (n) |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['arm']} | {r['seed']} | {r['steps']} | "
            f"{_num(r['faulty_step0'])} → {_num(r['faulty_final'])} ({r['n']}) | "
            f"{_num(r['clean_step0'])} → {_num(r['clean_final'])} ({r['n_clean']}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True, help="the path without .json / .png / .md")
    p.add_argument("--cpu", default=None, help="the machine the runs ran on (default: this one)")
    args = p.parse_args(argv)
    got = collect(args.workdir)
    result = {**got, **outcome(got["runs"]), "commit": _commit(), "cpu": args.cpu or _machine()}
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    plot(result, args.out + ".png")
    with open(args.out + ".md", "w") as f:
        f.write(table(result))
    for c in result["comparisons"]:
        print(
            f"{c['a']} - {c['b']} ({c['device']} device, seeds {c['seeds']}): "
            f"{c['mean_diff']} p_holm {c['p_holm']} g {c['g']} mdd {c['mdd']}"
        )
    print(f"wrote {args.out}.json, .png and .md ({len(result['runs'])} runs)")


if __name__ == "__main__":
    main()
