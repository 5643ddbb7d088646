"""The vulnerability study's statistics and report (job `vulnerability`): each trial's outcome
against the fault-free run of the same seed, shares per cell with Wilson intervals, the guard's
catches, false positives and overhead, and vulnerability.{json,md} with a heat map.

Outcome classes (He et al. ISCA'23; LLM-PRISM), in this order:
  diverged          the run stopped on a non-finite value, or ended with one
  degraded          final accuracy below the clean run's 95% Wilson interval (slow degradation)
  spike_recover     a step's gradient norm (as the optimizer received it) was non-finite or left
                    [1/SPIKE, SPIKE] x the clean run's at that step, and the final accuracy is
                    within the clean interval
  masked            none of these
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from aqn_jax.files import write_atomic, write_json

OUTCOMES = ("masked", "spike_recover", "degraded", "diverged")
SPIKE = 2.0  # a step's gradient norm more than 2x (or below 1/2) the clean run's
Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of k successes in n trials (Wilson 1927); (0, 1) for n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def _spiked(trial: Sequence[Mapping], clean: Sequence[Mapping]) -> bool:
    """A step whose gradient norm as the optimizer received it (`sdc/grad_norm` when gradient
    faults ran, else `actor/grad_norm`) is non-finite or outside [1/SPIKE, SPIKE] x the clean
    run's at that step. (Not the loss: GRPO's policy loss is ~0 by construction, a ratio of it
    is noise.)"""
    by_step = {int(r["step"]): r for r in clean}
    for r in trial:
        c = by_step.get(int(r["step"]))
        if c is None or "actor/grad_norm" not in c:
            continue
        a = float(r.get("sdc/grad_norm", r.get("actor/grad_norm", math.nan)))
        b = float(c["actor/grad_norm"])
        if not math.isfinite(a):
            return True
        if b > 0 and not 1 / SPIKE <= a / b <= SPIKE:
            return True
    return False


def classify(trial: Sequence[Mapping], clean: Sequence[Mapping], val_n: int, stopped: bool) -> str:
    """The outcome of a trial (its metrics rows) against the clean run of its seed; `stopped`:
    the trial raised on a non-finite value."""
    last = {k: v for k, v in trial[-1].items() if not k.startswith("sdc/")}  # (diagnostics)
    if stopped or any(isinstance(v, float) and not math.isfinite(v) for v in last.values()):
        return "diverged"
    acc = float(trial[-1]["val-core/acc"])
    clean_acc = float(clean[-1]["val-core/acc"])
    lo, _ = wilson(round(clean_acc * val_n), val_n)
    if acc < lo:
        return "degraded"
    return "spike_recover" if _spiked(trial, clean) else "masked"


def cell_summary(outcomes: Sequence[str]) -> dict[str, Any]:
    """Counts per outcome and the share (with its Wilson interval) ending degraded or
    diverged."""
    n = len(outcomes)
    counts = {o: sum(x == o for x in outcomes) for o in OUTCOMES}
    bad = counts["degraded"] + counts["diverged"]
    lo, hi = wilson(bad, n)
    return {"n": n, **counts, "bad_share": bad / n if n else float("nan"), "ci": [lo, hi]}


def write_report(workdir: str, result: Mapping[str, Any]) -> str:
    """vulnerability.json, vulnerability.md and vulnerability.png (bit field x site -> share of
    trials degraded or diverged) in `workdir`; returns the markdown path."""
    write_json(os.path.join(workdir, "vulnerability.json"), result)
    bits, sites = result["bits"], result["sites"]
    cells = result["cells"]
    lines = [
        "# Vulnerability of RL post-training to single-bit faults",
        "",
        f"Model: {result['model']}; dtype {result['dtype']}; {result['steps']} RL steps per"
        f" trial; the fault fires on the first attempt of step {result['fire_step']}"
        f" ({result['count']} element(s) per tensor per call); {result['trials']} trials per"
        f" cell (seeds {result['seeds']}); final accuracy on {result['val_size']} problems.",
        "",
        "Share of trials ending degraded or diverged (95% Wilson interval); outcome counts"
        " masked / spike-recover / degraded / diverged:",
        "",
        "| bit | " + " | ".join(sites) + " |",
        "|---|" + "---|" * len(sites),
    ]
    for b in bits:
        row = []
        for s in sites:
            c = cells.get(f"{s}/{b}")
            if c is None:
                row.append("")
                continue
            counts = "/".join(str(c[o]) for o in OUTCOMES)
            row.append(f"{c['bad_share']:.2f} [{c['ci'][0]:.2f}, {c['ci'][1]:.2f}] ({counts})")
        lines.append(f"| {b} | " + " | ".join(row) + " |")
    descriptions = result.get("site_descriptions") or {}
    if descriptions:  # the sites' legend (jobs/vulnerability.py's SITES)
        lines += ["", "Sites:", ""]
        lines += [f"- {s}: {descriptions[s]}" for s in sites if s in descriptions]
    guard = result.get("guard")
    if guard:
        lines += [
            "",
            f"## With detection and recovery (config.sdc: {guard['setting']})",
            "",
            "| cell | caught | recomputed | skipped | rolled back | ABFT rows | bad share |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, g in guard["cells"].items():
            lines.append(
                f"| {name} | {g['caught']}/{g['n']} | {g['recomputed']} | {g['skipped']} |"
                f" {g['rolled_back']} | {g['abft_rows']:g} | {g['bad_share']:.2f} |"
            )
        fp = guard["false_positives"]
        lines += [
            "",
            f"False positives over fault-free runs ({fp['steps']} steps): recomputes"
            f" {fp['recomputed']}, skips {fp['skipped']}, ABFT rows {fp['abft_rows']:g}.",
            f"Step time (mean over steps 2..end, {guard['timing_runs']} runs each): clean"
            f" {guard['step_s_clean']:.3f} s, with detection {guard['step_s_guard']:.3f} s"
            f" ({guard['overhead']:+.1%}).",
        ]
    lines += [
        "",
        f"Run time: {result.get('trials_s', result['wall_s']):.0f} s in {result.get('runs', '?')}"
        f" train runs (this invocation {result['wall_s']:.0f} s; finished runs are reused).",
        "",
    ]
    path = os.path.join(workdir, "vulnerability.md")
    write_atomic(path, "\n".join(lines))
    _heat_map(os.path.join(workdir, "vulnerability.png"), bits, sites, cells)
    return path


def _heat_map(path: str, bits, sites, cells) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.full((len(bits), len(sites)), np.nan)
    for i, b in enumerate(bits):
        for j, s in enumerate(sites):
            c = cells.get(f"{s}/{b}")
            if c is not None:
                grid[i, j] = c["bad_share"]
    fig, ax = plt.subplots(figsize=(1.2 * len(sites) + 2, 0.5 * len(bits) + 1.5))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="magma_r", aspect="auto")
    ax.set_xticks(range(len(sites)), sites, rotation=30, ha="right")
    ax.set_yticks(range(len(bits)), bits)
    for i in range(len(bits)):
        for j in range(len(sites)):
            if np.isfinite(grid[i, j]):
                color = "white" if grid[i, j] > 0.5 else "black"  # legible on the dark end
                text = f"{grid[i, j]:.2f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=8, color=color)
    fig.colorbar(im, ax=ax, label="share degraded or diverged")
    ax.set_title("bit field x site")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
