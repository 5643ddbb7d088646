"""The run report: `report.md` with the training-curve plot (`training_curves.png`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def _series(rows: Sequence[Mapping[str, Any]], key: str):
    xs = [r["step"] for r in rows if isinstance(r.get(key), (int, float))]
    ys = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return np.asarray(xs), np.asarray(ys, np.float64)


def plot_training(rows: Sequence[Mapping[str, Any]], path: str, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0, 0]
    for key, label in (("val-core/acc", "val (faulty device)"), ("val-clean/acc", "val (clean)")):
        x, y = _series(rows, key)
        if len(x):
            ax.plot(x, y, "o-", ms=3, label=label)
    ax.set_title("validation accuracy (greedy)")
    ax.legend(fontsize=8)
    panels = [
        (axes[0, 1], "critic/score/mean", "rollout reward (mean score)"),
        (axes[1, 0], "actor/kl_loss", "KL to reference"),
        (axes[1, 1], "aqn/sigma", "AQN sigma"),
    ]
    for ax, key, name in panels:
        x, y = _series(rows, key)
        if len(x):
            ax.plot(x, y, "-", lw=1)
        ax.set_title(name)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.set_xlabel("RL step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_run_report(workdir: str, summary: Mapping[str, Any], rows) -> str:
    png = plot_training(rows, os.path.join(workdir, "training_curves.png"), summary.get("name", ""))

    def pct(v):
        return "n/a" if v is None else f"{100 * v:.1f}%"

    lines = [
        f"# Run report: {summary.get('name', '')}",
        "",
        f"- fault layers: {summary['fault_layers']}; SRDD located:"
        f" {summary['srdd_located_layers']}; AQN layers: {summary['aqn_layers']}",
        f"- RL steps: {summary['steps']}; wall time {summary['wall_time_s']:.0f}s",
        "",
        "| validation (greedy, test split) | start | end |",
        "|---|---|---|",
        f"| faulty device | {pct(summary['val_acc_start'])} | {pct(summary['val_acc_end'])} |",
        f"| clean device | {pct(summary.get('val_acc_clean_start'))} |"
        f" {pct(summary['val_acc_clean_end'])} |",
        "",
        "![training curves](training_curves.png)",
        "",
        "Files: `metrics.jsonl` (a row per step, verl metric names), `tensorboard/`,"
        " `summary.json`, `manifest.json` (modules each fault hit), `config.json`,"
        " `checkpoints/`"
        + (", `srdd.json`" if summary.get("srdd_located_layers") is not None else "")
        + ".",
        "",
    ]
    path = os.path.join(workdir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    del png
    return path
