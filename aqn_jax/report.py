"""The run report: `summary.json`'s content (`run_summary`, with what it says of the config
typed at the job boundary by `summary_spec`), `report.md` with the training-curve plot
(`training_curves.png`), and the closing lines a run prints."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from aqn_jax.diagnosis.srdd import sigmas_of


def _series(rows: Sequence[Mapping[str, Any]], key: str):
    xs = [r["step"] for r in rows if isinstance(r.get(key), (int, float))]
    ys = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return np.asarray(xs), np.asarray(ys, np.float64)


def plot_training(rows: Sequence[Mapping[str, Any]], path: str, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 7))
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
        (axes[0, 2], "rollout_corr/kl", "sampler-trainer mismatch KL per token"),
        (axes[1, 2], "rollout_corr/rollout_is_eff_sample_size", "IS effective sample size"),
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
        *_mismatch_lines(summary.get("mismatch") or {}, summary.get("rollout_correction")),
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


# The sampler-trainer mismatch of a run (verl's rollout_corr/ names), its means over the steps.
MISMATCH_KEYS = (
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "rollout_corr/chi2_token",
    "rollout_corr/rollout_is_mean",
    "rollout_corr/rollout_is_eff_sample_size",
    "rollout_corr/rollout_rs_masked_fraction",
    "training/rollout_probs_diff_mean",
)


def _mismatch_lines(mismatch: Mapping[str, float], correction: Mapping[str, Any] | None):
    if not mismatch:
        return []
    lines = [
        "| sampler vs trainer (mean over the RL steps) | value |",
        "|---|---|",
        *(f"| `{k}` | {v:.4g} |" for k, v in mismatch.items()),
        "",
    ]
    if correction:
        on = ", ".join(f"{k}={v}" for k, v in correction.items())
        lines += [f"Rollout correction: {on}.", ""]
    return lines


def mismatch_summary(history: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Means over the RL steps of MISMATCH_KEYS (those the run logged)."""
    out = {}
    for key in MISMATCH_KEYS:
        vals = [h[key] for h in history if isinstance(h.get(key), (int, float))]
        if vals:
            out[key] = float(np.mean(vals))
    return out


@dataclasses.dataclass(frozen=True)
class SummarySpec:
    """What a train run's summary.json says of its config (`summary_spec`)."""

    n_layers: int  # the model's decoder layers
    fault_layers: tuple[int, ...]  # the hardware fault's layers (`fault_layers`)
    srdd_sigmas: bool  # config.aqn.layers == 'srdd': the summary lists the per-layer sigmas
    rollout_correction: tuple[tuple[str, Any], ...]  # config.algo's CORRECTION_FIELDS
    mesh: tuple[tuple[str, int], ...]  # the mesh's axis sizes (config.mesh over the devices)


def run_summary(
    spec: SummarySpec,
    workdir: str,
    plan,
    diagnosis: Mapping[str, Any] | None,
    history: Sequence[Mapping[str, Any]],
    val: tuple[Mapping[str, float], Mapping[str, float], int],
    steps: int,
    sft_info: Mapping[str, Any],
    t_start: float,
) -> dict:
    """The content of a train run's summary.json. `val`: (the validation at the start, the
    last one, its size); `t_start`: the run's perf_counter at its start."""
    val0, last_val, val_size = val
    n_layers = spec.n_layers
    aqn_inj = [inj for inj in plan.injections if inj.name == "aqn"]
    aqn_layers = None
    if aqn_inj:
        layers = aqn_inj[0].sites.layers
        aqn_layers = list(range(n_layers)) if layers == "all" else list(layers)
    sigmas = None if diagnosis is None else sigmas_of(diagnosis)
    return {
        "name": os.path.basename(os.path.abspath(workdir)),
        "fault_layers": list(spec.fault_layers),
        "train_prompts_dropped": None,  # set by the train job
        "srdd_located_layers": None if diagnosis is None else diagnosis["verdict"]["layers"],
        "aqn_layers": aqn_layers,
        "aqn_layer_sigmas": sigmas if spec.srdd_sigmas else None,
        "val_acc_start": val0["val-core/acc"],
        "val_acc_clean_start": val0["val-clean/acc"],
        "val_acc_end": last_val["val-core/acc"],
        "val_acc_clean_end": last_val["val-clean/acc"],
        # The fault's cost at the start (clean minus faulty device, same policy) and the share
        # of it RL won back on the faulty device (None without a cost to win back).
        "fault_gap_start": val0["val-clean/acc"] - val0["val-core/acc"],
        "recovered": recovered(val0, last_val),
        # The gap at the end (clean minus faulty device, the trained policy): where the clean
        # device gains too, `recovered` overstates what RL on the faulty device won back.
        "fault_gap_end": last_val["val-clean/acc"] - last_val["val-core/acc"],
        "val_size": val_size,
        "steps": steps,
        "mismatch": mismatch_summary(history),
        "rollout_correction": dict(spec.rollout_correction),
        "final_reward_mean": float(
            np.mean([h["critic/score/mean"] for h in history[-5:] if "critic/score/mean" in h])
        ),
        "sft": sft_info,
        "wall_time_s": time.perf_counter() - t_start,
        "devices": jax.device_count(),
        "mesh": dict(spec.mesh),
    }


def print_summary(summary: Mapping[str, Any], report: str) -> None:
    print(
        f"val acc (faulty device): {summary['val_acc_start']:.3f} ->"
        f" {summary['val_acc_end']:.3f};"
        f" clean: {summary['val_acc_clean_end']:.3f}; SRDD located"
        f" {summary['srdd_located_layers']}, fault at {summary['fault_layers']}"
    )
    if summary["recovered"] is not None:
        print(
            f"the fault cost {summary['fault_gap_start']:.3f} accuracy at the start (clean"
            f" {summary['val_acc_clean_start']:.3f}, faulty {summary['val_acc_start']:.3f});"
            f" RL won back {100 * summary['recovered']:.0f}% of it; the gap to the clean device"
            f" went {summary['fault_gap_start']:.3f} -> {summary['fault_gap_end']:.3f} (clean"
            f" {summary['val_acc_clean_start']:.3f} -> {summary['val_acc_clean_end']:.3f})"
        )
    print(f"report: {report}")


def recovered(start: Mapping[str, float], end: Mapping[str, float]) -> float | None:
    """The share of the fault's cost at the start that RL won back on the faulty device."""
    gap = start["val-clean/acc"] - start["val-core/acc"]
    return (end["val-core/acc"] - start["val-core/acc"]) / gap if gap > 0 else None
