"""The study report: statistics over seeds of the `compare` job's `results.json`.

`summarize(results)` computes the per-arm statistics and the Welch tests; `write_report(results,
workdir)` writes `report.md`, `curves.png`, `final.png` and `robustness.png` into `workdir` and
stores the summary under the `"summary"` key of `workdir/results.json` (atomic rewrite; every
other key is kept as given). `python -m aqn_jax.study.report WORKDIR` re-runs it on a finished
or partial study.

Input: `results.json` (written by the `compare` job)::

    {
      "name": "compare", "variant": "default",        # variant: e.g. "threshold_0.1"
      "arms": ["clean", "deadzone", ...],             # declared arms, in report order
      "seeds": [0, 1, 2, 3, 4],                       # declared seeds
      "reference_arm": "global_aqn",                  # the baseline of the Welch tests
      "comparisons": [["targeted", "global_aqn"], ["healthy", "global_aqn"]],  # (a, b): a - b
      "conditions": ["fault", "clean", "noise_5pct", "noise_10pct", "mxfp4"],  # robustness cols
      "runs": {
        "<arm>": {
          "<seed>": {                                 # the seed as a string key (JSON)
            "final": {"acc_fault": float, "acc_clean": float, "heldout_loss": float},
            "curve": {"step": [int, ...], "val-core/acc": [float | null, ...],
                      "val-clean/acc": [...], "critic/score/mean": [...]},  # equal lengths;
                                                      # null where a metric was not measured
            "robustness": {"<condition>": float, ...},  # accuracy under each condition
            "telemetry": {"flushed": float, "rescued": float},  # mean deadzone fractions
            "wall_time_s": float
          }, ...
        }, ...
      },
      "study_fault": "deadzone",                      # the arms' fault (a config.faults kind)
      "aqn": {"form", "order", "schedule", ...},      # the AQN arms' form (_design_notes)
      "timing": {...}                                 # free-form, copied into the report
    }

Partial studies are reported as they are: a declared arm without runs, a missing seed, a missing
metric (None / NaN) are skipped with a note. An arm with a single seed gets its mean with std and
CI "n/a", and its tests are reported as not run, with the reason. Missing keys fall back to:
"arms" -> the keys of "runs"; "comparisons" -> every arm against "reference_arm"; "conditions"
-> the conditions found in the runs.

Output: `results["summary"]`::

    {
      "name", "variant", "alpha": 0.05, "ci_level": 0.95,
      "arms": [arms with at least one run], "seeds": [declared seeds],
      "present": {arm: [seed, ...]}, "missing": {arm: [declared seeds without a run]},
      "notes": [str, ...],
      "final": {metric: {arm: describe() + {"seeds": [...], "values": [float | None, ...]}}},
      "tests": [welch() + {"a", "b", "metric", "p_holm", "reading", "seeds_for_0.05"}, ...],
      "robustness": {"conditions": [...], "arms": {arm: {condition: describe()}}},
      "telemetry": {arm: {key: describe()}},
      "wall_time": {arm: describe() + {"total": float}},
    }

describe() / welch() are `aqn_jax.study.stats` (formulas there). Holm's correction runs over
the comparisons of one metric (a family per metric).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from aqn_jax.experiment import ARMS
from aqn_jax.faults.config import FAULT_KINDS, FaultKind
from aqn_jax.files import write_json

from . import stats

RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"
CURVES_PNG = "curves.png"
FINAL_PNG = "final.png"
ROBUSTNESS_PNG = "robustness.png"

ALPHA = 0.05
ACC_DIFF = 0.05  # the accuracy difference whose required seeds the report gives
FINAL_METRICS = ("acc_fault", "acc_clean", "heldout_loss")
METRIC_TITLES = {
    "acc_fault": "accuracy on the faulty device (higher is better)",
    "acc_clean": "accuracy on a clean device (higher is better)",
    "heldout_loss": "held-out loss (lower is better)",
}
CURVE_KEYS = ("val-core/acc", "val-clean/acc", "critic/score/mean")
# The sampler-trainer mismatch (verl's rollout_corr/ names): plotted when the runs logged it.
MISMATCH_KEYS = ("rollout_corr/kl", "rollout_corr/rollout_is_eff_sample_size")
CURVE_TITLES = {
    "val-core/acc": "validation accuracy, faulty device",
    "val-clean/acc": "validation accuracy, clean device",
    "critic/score/mean": "rollout reward (mean score)",
    "rollout_corr/kl": "mismatch KL(rollout || train) per token",
    "rollout_corr/rollout_is_eff_sample_size": "IS effective sample size (fraction)",
}
TELEMETRY_KEYS = ("flushed", "rescued")


# ---------------------------------------------------------------------------------------------
# Reading results.json


def _seed_sort_key(seed: str):
    try:
        return (0, int(seed), seed)
    except ValueError:
        return (1, 0, seed)


def _num(x) -> float | None:
    """A finite float, or None (missing, null, NaN, not a number)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def _arm_order(results: Mapping[str, Any]) -> list[str]:
    runs = results.get("runs") or {}
    declared = list(results.get("arms") or [])
    return declared + [a for a in runs if a not in declared]


def _arm_runs(results: Mapping[str, Any], arm: str) -> dict[str, Mapping[str, Any]]:
    """{seed (str): run} of one arm, in seed order; runs that are not mappings are dropped."""
    runs = (results.get("runs") or {}).get(arm) or {}
    items = {str(s): r for s, r in runs.items() if isinstance(r, Mapping)}
    return {s: items[s] for s in sorted(items, key=_seed_sort_key)}


def _comparisons(results: Mapping[str, Any], arms: Sequence[str]) -> list[tuple[str, str]]:
    if results.get("comparisons") is not None:
        return [(str(a), str(b)) for a, b in results["comparisons"]]
    ref = results.get("reference_arm")
    return [(a, ref) for a in arms if ref is not None and a != ref]


def _conditions(results: Mapping[str, Any], arms: Sequence[str]) -> list[str]:
    conditions = [str(c) for c in results.get("conditions") or []]
    for arm in arms:
        for run in _arm_runs(results, arm).values():
            for c in run.get("robustness") or {}:
                if c not in conditions:
                    conditions.append(c)
    return conditions


# ---------------------------------------------------------------------------------------------
# Statistics


def _plain_reading(test: Mapping[str, Any]) -> str:
    """One line, e.g. "targeted − global_aqn (acc_fault): +0.012 acc (95% CI −0.004 … +0.028),
    p = 0.130, Holm p = 0.260: not significant at 0.05"."""
    a, b, metric = test["a"], test["b"], test["metric"]
    head = f"{a} − {b} ({metric})"
    dec = _decimals(metric)
    unit = "loss" if "loss" in metric else "acc"
    if test["p"] is None:
        diff = "" if test["diff"] is None else f" {_signed(test['diff'], dec, True)} {unit},"
        return f"{head}:{diff} test not run ({test['reason']})"
    ci = f"{_signed(test['diff_ci_low'], dec, True)} … {_signed(test['diff_ci_high'], dec, True)}"
    level = round(100 * test["ci_level"])
    text = (
        f"{head}: {_signed(test['diff'], dec, True)} {unit} ({level}% CI {ci}),"
        f" {_p_eq(test['p'])}, Holm {_p_eq(test['p_holm'])}: "
    )
    if test["p_holm"] is not None and test["p_holm"] < ALPHA:
        better = a if (test["diff"] > 0) == (unit == "acc") else b
        return text + f"significant at {ALPHA} after Holm, in favour of {better}"
    if test["p"] < ALPHA:
        return text + f"significant at {ALPHA} uncorrected, not after Holm"
    return text + f"not significant at {ALPHA}"


def _activation_aqn_arms() -> set[str]:
    """The arms that run AQN in the config's (activation) form, not QeRL's."""
    return {name for name, arm in ARMS.items() if arm.aqn and not arm.qerl_form}


def _fault_kind(results: Mapping[str, Any]) -> tuple[str, FaultKind | None]:
    """The study's fault (`study_fault`) and its registry entry (None: a kind not registered
    in this process, e.g. a test's)."""
    fault = str(results.get("study_fault", "deadzone"))
    return fault, FAULT_KINDS.get(fault) if fault in FAULT_KINDS else None


def _design_notes(results: Mapping[str, Any], arms: Sequence[str]) -> list[str]:
    """What the study's design can and cannot show: its fault kind's note on the AQN form
    (`FaultKind.aqn_note`) where an arm runs AQN in that form."""
    _, kind = _fault_kind(results)
    if kind is None or kind.aqn_note is None or not _activation_aqn_arms() & set(arms):
        return []
    note = kind.aqn_note(results.get("aqn") or {})
    return [note] if note else []


def _presence(results: Mapping[str, Any], notes: list[str]):
    """(declared seeds, {arm: seeds present}, {arm: declared seeds missing}); notes the gaps."""
    declared_seeds = [str(s) for s in results.get("seeds") or []]
    present: dict[str, list[str]] = {}
    missing: dict[str, list[str]] = {}
    for arm in _arm_order(results):
        runs = _arm_runs(results, arm)
        missing[arm] = [s for s in declared_seeds if s not in runs]
        if not runs:
            notes.append(f"arm {arm}: no runs; skipped")
            continue
        present[arm] = list(runs)
        if missing[arm]:
            notes.append(f"arm {arm}: missing seeds {', '.join(missing[arm])}")
        if len(runs) == 1:
            notes.append(f"arm {arm}: a single seed; std, CI and its tests are n/a")
    return declared_seeds, present, missing


def _final(results: Mapping[str, Any], arms: Sequence[str], notes: list[str]) -> dict:
    """{metric: {arm: describe() + seeds and values}} of FINAL_METRICS; notes missing values."""
    final: dict[str, dict[str, Any]] = {}
    for metric in FINAL_METRICS:
        final[metric] = {}
        for arm in arms:
            runs = _arm_runs(results, arm)
            values = [_num((r.get("final") or {}).get(metric)) for r in runs.values()]
            d = stats.describe(values)
            d.update(seeds=list(runs), values=values)
            final[metric][arm] = d
            if d["n_dropped"]:
                lost = [s for s, v in zip(runs, values, strict=True) if v is None]
                notes.append(f"arm {arm}: {metric} missing or not finite for seeds {lost}")
    return final


def _tests(results: Mapping[str, Any], arms, present, final) -> list[dict[str, Any]]:
    """Welch's test of each comparison per metric, Holm-corrected over the metric's family."""
    tests: list[dict[str, Any]] = []
    comparisons = _comparisons(results, arms)
    for metric in FINAL_METRICS:
        family = []
        for a, b in comparisons:
            va = final[metric][a]["values"] if a in final[metric] else []
            vb = final[metric][b]["values"] if b in final[metric] else []
            w = stats.welch(va, vb)
            w["seeds_for_0.05"] = None
            if metric.startswith("acc") and w["sd_pooled"] is not None:
                sds = [final[metric][x]["std"] for x in (a, b)]
                w["seeds_for_0.05"] = stats.seeds_needed(ACC_DIFF, *sds)
            absent = [x for x in (a, b) if x not in present]
            if absent:
                w["reason"] = f"no runs of {' and '.join(absent)}"
            family.append({"a": a, "b": b, "metric": metric, **w})
        for test, adj in zip(family, stats.holm([t["p"] for t in family]), strict=True):
            test["p_holm"] = adj
            test["reading"] = _plain_reading(test)
        tests.extend(family)
    return tests


def _robustness(results: Mapping[str, Any], arms: Sequence[str]) -> dict[str, Any]:
    conditions = _conditions(results, arms)
    robustness = {
        arm: {
            c: stats.describe(
                [_num((r.get("robustness") or {}).get(c)) for r in _arm_runs(results, arm).values()]
            )
            for c in conditions
        }
        for arm in arms
    }
    return {"conditions": conditions, "arms": robustness}


def _telemetry(results: Mapping[str, Any], arms: Sequence[str]) -> dict[str, dict[str, Any]]:
    telemetry: dict[str, dict[str, Any]] = {}
    for arm in arms:
        runs = list(_arm_runs(results, arm).values())
        keys = list(TELEMETRY_KEYS)
        for r in runs:
            keys += [k for k in r.get("telemetry") or {} if k not in keys]
        telemetry[arm] = {
            k: stats.describe([_num((r.get("telemetry") or {}).get(k)) for r in runs]) for k in keys
        }
    return telemetry


def _wall_time(results: Mapping[str, Any], arms: Sequence[str]) -> dict[str, dict[str, Any]]:
    wall_time: dict[str, dict[str, Any]] = {}
    for arm in arms:
        values = [_num(r.get("wall_time_s")) for r in _arm_runs(results, arm).values()]
        d = stats.describe(values)
        d["total"] = float(sum(v for v in values if v is not None))
        wall_time[arm] = d
    return wall_time


def summarize(results: Mapping[str, Any]) -> dict[str, Any]:
    """Per-arm statistics over seeds, the Welch tests, robustness, telemetry and wall time."""
    notes: list[str] = []
    declared_seeds, present, missing = _presence(results, notes)
    arms = list(present)
    notes += _design_notes(results, arms)
    final = _final(results, arms, notes)
    return {
        "name": results.get("name", ""),
        "variant": results.get("variant", ""),
        "alpha": ALPHA,
        "ci_level": stats.LEVEL,
        "arms": arms,
        "seeds": declared_seeds,
        "present": present,
        "missing": missing,
        "notes": notes,
        "final": final,
        "tests": _tests(results, arms, present, final),
        "robustness": _robustness(results, arms),
        "telemetry": _telemetry(results, arms),
        "wall_time": _wall_time(results, arms),
    }


def curve_band(
    runs: Sequence[Mapping[str, Any]], key: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, std, n) of `curve[key]` across runs, per step; nulls are ignored, std is
    ddof=1 where n >= 2 and 0 where a step has a single value."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        curve = run.get("curve") or {}
        for step, value in zip(curve.get("step") or [], curve.get(key) or [], strict=False):
            v = _num(value)
            if v is not None and _num(step) is not None:
                by_step.setdefault(int(step), []).append(v)
    steps = sorted(by_step)
    mean = np.array([np.mean(by_step[s]) for s in steps], np.float64)
    std = np.array(
        [np.std(by_step[s], ddof=1) if len(by_step[s]) > 1 else 0.0 for s in steps], np.float64
    )
    n = np.array([len(by_step[s]) for s in steps], np.int64)
    return np.asarray(steps, np.int64), mean, std, n


# ---------------------------------------------------------------------------------------------
# Formatting


def _decimals(metric: str) -> int:
    return 4 if "loss" in metric else 3


def _f(x: float | None, dec: int) -> str:
    return "n/a" if x is None else f"{x:.{dec}f}"


def _signed(x: float | None, dec: int, unicode_minus: bool = False) -> str:
    if x is None:
        return "n/a"
    s = f"{x:+.{dec}f}"
    return s.replace("-", "−") if unicode_minus else s


def _pm(d: Mapping[str, Any], dec: int) -> str:
    if d["mean"] is None:
        return "n/a"
    return f"{_f(d['mean'], dec)} ± {_f(d['std'], dec)}"


def _ci(d: Mapping[str, Any], dec: int) -> str:
    if d["ci_low"] is None:
        return "n/a"
    return f"[{_f(d['ci_low'], dec)}, {_f(d['ci_high'], dec)}]"


def _p_eq(p: float | None) -> str:
    s = stats.format_p(p)
    return f"p {s}" if s.startswith("<") else f"p = {s}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


# ---------------------------------------------------------------------------------------------
# Plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _arm_colors(summary: Mapping[str, Any]):
    """(pyplot, the study's arms, a color per arm) for a study plot."""
    plt = _pyplot()
    arms = summary["arms"]
    cycle = plt.get_cmap("tab10")
    return plt, arms, {arm: cycle(i % 10) for i, arm in enumerate(arms)}


def curve_keys(results: Mapping[str, Any], arms: Sequence[str]) -> tuple[str, ...]:
    """The curves to plot: CURVE_KEYS, then each of MISMATCH_KEYS some run logged."""
    runs = [r for arm in arms for r in _arm_runs(results, arm).values()]
    logged = [
        k
        for k in MISMATCH_KEYS
        if any(v is not None for r in runs for v in (r.get("curve") or {}).get(k) or [])
    ]
    return (*CURVE_KEYS, *logged)


def plot_curves(results: Mapping[str, Any], summary: Mapping[str, Any], path: str) -> str:
    """Validation accuracies and the reward vs step: per arm the mean over seeds, ±1 std band."""
    plt, arms, colors = _arm_colors(summary)
    keys = curve_keys(results, arms)
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4.2))
    for ax, key in zip(axes, keys, strict=True):
        for arm in arms:
            runs = list(_arm_runs(results, arm).values())
            steps, mean, std, n = curve_band(runs, key)
            if not len(steps):
                continue
            style = "o-" if key.startswith("val-") else "-"
            ax.plot(
                steps, mean, style, ms=3, lw=1.2, color=colors[arm], label=f"{arm} (n={len(runs)})"
            )
            if (n > 1).any():
                ax.fill_between(steps, mean - std, mean + std, color=colors[arm], alpha=0.15, lw=0)
        ax.set_title(CURVE_TITLES[key], fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    fig.suptitle(f"{summary['name']} ({summary['variant']}): mean over seeds ± 1 std")
    return _save(plt, fig, path)


def plot_final(summary: Mapping[str, Any], path: str) -> str:
    """Final accuracies per arm: every seed's point, the mean and its 95% CI as error bars."""
    plt, arms, colors = _arm_colors(summary)
    metrics = ("acc_fault", "acc_clean")
    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4.2))
    for ax, metric in zip(axes, metrics, strict=True):
        for i, arm in enumerate(arms):
            d = summary["final"][metric][arm]
            ys = [v for v in d["values"] if v is not None]
            if not ys:
                continue
            xs = i + np.linspace(-0.15, 0.15, len(ys)) if len(ys) > 1 else [i - 0.1]
            ax.scatter(xs, ys, s=18, color=colors[arm], alpha=0.7, zorder=2)
            yerr = None if d["ci_half"] is None else [[d["ci_half"]], [d["ci_half"]]]
            ax.errorbar(
                [i + 0.3], [d["mean"]], yerr=yerr, fmt="D", color="black", ms=5, capsize=4, zorder=3
            )
        ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
        ax.set_title(f"final {metric}: seeds (dots), mean and 95% CI (black)", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{summary['name']} ({summary['variant']})")
    return _save(plt, fig, path)


def plot_robustness(summary: Mapping[str, Any], path: str) -> str:
    """Grouped bars: accuracy under each condition (groups), one bar per arm, ±1 std."""
    plt, arms, colors = _arm_colors(summary)
    conditions = summary["robustness"]["conditions"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(conditions) + 2), 4.5))
    width = 0.8 / max(1, len(arms))
    x = np.arange(len(conditions))
    for i, arm in enumerate(arms):
        cells = [summary["robustness"]["arms"][arm][c] for c in conditions]
        means = [np.nan if d["mean"] is None else d["mean"] for d in cells]
        stds = [np.nan if d["std"] is None else d["std"] for d in cells]  # n=1: no bar
        offset = (i - (len(arms) - 1) / 2) * width
        ax.bar(x + offset, means, width, yerr=stds, capsize=2, color=colors[arm], label=arm)
    ax.set_xticks(x, conditions)
    ax.set_ylabel("accuracy")
    ax.set_title(f"robustness: mean over seeds ± 1 std ({summary['variant']})", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    if arms:
        ax.legend(fontsize=7, ncol=min(3, len(arms)))
    return _save(plt, fig, path)


# ---------------------------------------------------------------------------------------------
# The report


def _md_head(results: Mapping[str, Any], s: Mapping[str, Any]) -> list[str]:
    """The title, what was run and how it is tested, and the runs table with the notes."""
    level = round(100 * s["ci_level"])
    arms = s["arms"]
    fault, kind = _fault_kind(results)
    lines = [
        f"# Study report: {s['name']} ({s['variant']})",
        "",
        f"- arms present: {len(arms)} ({', '.join(arms) or 'none'}); declared seeds:"
        f" {', '.join(s['seeds']) or 'none'}; reference arm: {results.get('reference_arm')}",
        f"- study fault: {(kind.title if kind else '') or fault} (`config.faults.{fault}`)",
        f"- statistics over seeds: mean ± std (ddof=1), {level}% CI of the mean (t, n-1 df);"
        f" Welch's two-sided t-test at α = {s['alpha']} with Holm's correction over the"
        " comparisons of each metric (formulas: `aqn_jax/study/stats.py`)",
        "",
        "## Runs",
        "",
    ]
    rows = [
        [arm, ", ".join(s["present"].get(arm, [])) or "none", ", ".join(s["missing"][arm]) or "-"]
        for arm in s["missing"]
    ]
    lines += _table(["arm", "seeds present", "seeds missing"], rows)
    if s["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in s["notes"]]
    return lines


def _md_tests(s: Mapping[str, Any]) -> list[str]:
    """The tests table, their readings and how to read them."""
    level = round(100 * s["ci_level"])
    rows = []
    for t in s["tests"]:
        dec = _decimals(t["metric"])
        diff = _signed(t["diff"], dec)
        if t["diff_ci_low"] is not None:
            diff += f" [{_signed(t['diff_ci_low'], dec)}, {_signed(t['diff_ci_high'], dec)}]"
        rows.append(
            [
                f"{t['a']} vs {t['b']}",
                t["metric"],
                f"{t['n_a']} / {t['n_b']}",
                diff,
                _f(t["t"], 2),
                _f(t["df"], 1),
                stats.format_p(t["p"]),
                stats.format_p(t["p_holm"]),
                _f(t["cohen_d"], 2),
                _f(t["hedges_g"], 2),
                _f(t["mdd"], dec),
                "n/a" if t.get("seeds_for_0.05") is None else str(t["seeds_for_0.05"]),
                t["reason"] or "",
            ]
        )
    header = ["comparison (a vs b)", "metric", "n", f"mean diff a−b [{level}% CI]", "t", "df"]
    header += ["p", "Holm p", "Cohen's d", "Hedges' g", "MDD (80% power)", "seeds for 0.05"]
    header += ["note"]
    lines = ["", "## Tests", ""]
    lines += _table(header, rows) if rows else ["No comparisons."]
    lines += ["", "Readings:", ""] + [f"- {t['reading']}" for t in s["tests"]]
    return lines + [
        "",
        "Cohen's d = (mean_a − mean_b) / sqrt((var_a + var_b) / 2) (root of the mean of the two"
        " sample variances); Hedges' g = d · (1 − 3 / (4 (n_a + n_b) − 9)).",
        f"MDD: the minimum difference Welch's test detects with 80% power at α = {ALPHA} for these"
        " seeds and the observed SDs (noncentral t); seeds for 0.05: seeds per arm that would"
        " detect a difference of 0.05 (accuracy metrics) with 80% power. Planning figures: the"
        " observed SDs are taken as the true ones.",
    ]


def _md_final(s: Mapping[str, Any]) -> list[str]:
    """Per metric, each arm's mean, CI and seeds; then the curves and robustness."""
    level = round(100 * s["ci_level"])
    arms = s["arms"]
    lines = ["", "## Final metrics", ""]
    for metric in FINAL_METRICS:
        dec = _decimals(metric)
        rows = []
        for arm in arms:
            d = s["final"][metric][arm]
            values = ", ".join(_f(v, dec) for v in d["values"])
            rows.append([arm, str(d["n"]), _pm(d, dec), _ci(d, dec), values])
        lines += [f"### {metric}: {METRIC_TITLES[metric]}", ""]
        lines += _table(["arm", "n", "mean ± std", f"{level}% CI", "per seed"], rows) + [""]
    lines += [f"![final accuracies]({FINAL_PNG})", "", "## Training curves", ""]
    lines += [f"![curves]({CURVES_PNG})", "", "## Robustness (accuracy under each condition)", ""]
    conditions = s["robustness"]["conditions"]
    rows = [
        [arm, str(len(s["present"][arm]))]
        + [_pm(s["robustness"]["arms"][arm][c], 3) for c in conditions]
        for arm in arms
    ]
    lines += _table(["arm", "n", *conditions], rows) if conditions else ["No robustness data."]
    return lines + ["", f"![robustness]({ROBUSTNESS_PNG})"]


def _md_tail(results: Mapping[str, Any], s: Mapping[str, Any]) -> list[str]:
    """Telemetry, timing and the files."""
    arms = s["arms"]
    keys: list[str] = []
    for arm in arms:
        keys += [k for k in s["telemetry"][arm] if k not in keys]
    rows = [
        [arm]
        + [_pm(s["telemetry"][arm][k], 4) if k in s["telemetry"][arm] else "n/a" for k in keys]
        for arm in arms
    ]
    lines = ["", "## Telemetry", ""]
    lines += [
        "Per run, means over its RL steps: the deadzone's flushed and rescued fractions (0"
        " without a fault) and, where logged, the sampler-trainer mismatch (`mismatch_kl`,"
        " `mismatch_k3_kl`: rollout_corr/kl, k3_kl; `is_ess`: the IS effective sample size;"
        " `rs_masked`: the rejected fraction); mean ± std over seeds.",
        "",
    ]
    lines += _table(["arm", *keys], rows)
    lines += ["", "## Timing", ""]
    rows = [
        [arm, str(w["n"]), _pm(w, 1), _f(w["total"], 1)]
        for arm, w in ((arm, s["wall_time"][arm]) for arm in arms)
    ]
    lines += _table(["arm", "n", "wall time per run (s)", "total (s)"], rows)
    timing = results.get("timing")
    if timing:
        lines += ["", "```json", json.dumps(timing, indent=2, sort_keys=True), "```"]
    return lines + [
        "",
        f'Files: `{RESULTS_FILE}` (runs, and this summary under `"summary"`), `{CURVES_PNG}`,'
        f" `{FINAL_PNG}`, `{ROBUSTNESS_PNG}`.",
        "",
    ]


def _markdown(results: Mapping[str, Any], s: Mapping[str, Any]) -> str:
    lines = _md_head(results, s) + _md_tests(s) + _md_final(s) + _md_tail(results, s)
    return "\n".join(lines)


def write_report(results: Mapping[str, Any], workdir: str) -> str:
    """report.md and the plots in `workdir`; results.json gains "summary". Returns report.md."""
    os.makedirs(workdir, exist_ok=True)
    summary = summarize(results)
    plot_curves(results, summary, os.path.join(workdir, CURVES_PNG))
    plot_final(summary, os.path.join(workdir, FINAL_PNG))
    plot_robustness(summary, os.path.join(workdir, ROBUSTNESS_PNG))
    path = os.path.join(workdir, REPORT_FILE)
    with open(path, "w") as f:
        f.write(_markdown(results, summary))
    json_path = os.path.join(workdir, RESULTS_FILE)
    write_json(json_path, {**results, "summary": summary})
    return path


def load_results(path: str) -> dict[str, Any]:
    with open(path) as f:
        results = json.load(f)
    if "runs" not in results:
        raise ValueError(f"{path}: not a study results.json (no 'runs')")
    return results


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        raise SystemExit("usage: python -m aqn_jax.study.report WORKDIR (holding results.json)")
    workdir = argv[0]
    print(write_report(load_results(os.path.join(workdir, RESULTS_FILE)), workdir))


if __name__ == "__main__":
    main()
