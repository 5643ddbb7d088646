"""SRDD end to end: calibration prompts -> scans on the faulty device -> verdict -> sigma map,
with the `config.diagnosis` section typed (its defaults: diagnosis/config.py), the report
(srdd.json, table, plot) and the AQN fragment.

The device is simulated by the *hardware* part of the config (`config.faults`); AQN is never
active during diagnosis (it is the treatment, not the device).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from aqn_jax.data.gsm8k import Example, left_pad
from aqn_jax.data.tokenizers import Tokenizer
from aqn_jax.faults.intercept import FaultPlan, step_key
from aqn_jax.files import write_json
from aqn_jax.models.registry import ModelConfig, causal_lm

from . import analysis
from .scans import METRICS, ScanSettings, scan_layers

SRDD_FILE = "srdd.json"
PLOT_FILE = "srdd.png"


@dataclasses.dataclass(frozen=True)
class SrddSpec:
    """What SRDD reads of an experiment config, checked and typed once at the job
    (`srdd_spec(config)`, or `SrddSpec.of(config.diagnosis, base_sigma)`)."""

    num_prompts: int
    max_prompt_len: int
    settings: ScanSettings
    z_threshold: float
    declare: tuple[str, ...]
    dead_floor: float
    instability_floor: float
    signal_loss: str
    base_sigma: float  # the sigma map's base
    seed: int

    @classmethod
    def of(cls, diag: Any, base_sigma: float) -> SrddSpec:
        """From the `config.diagnosis` section; raises naming the field."""
        check_config(diag)
        return cls(
            num_prompts=int(diag.num_prompts),
            max_prompt_len=int(diag.max_prompt_len),
            settings=settings_from(diag),
            z_threshold=float(diag.z_threshold),
            declare=(diag.declare,) if isinstance(diag.declare, str) else tuple(diag.declare),
            dead_floor=float(diag.dead_floor),
            instability_floor=float(diag.instability_floor),
            signal_loss=str(diag.signal_loss),
            base_sigma=float(base_sigma),
            seed=int(diag.seed),
        )


def settings_from(diag: Any) -> ScanSettings:
    return ScanSettings(
        trials=int(diag.trials), gain_scale=float(diag.gain_scale), dc_scale=float(diag.dc_scale)
    )


def check_config(diag: Any) -> None:
    """Field-named validation, before any compile."""
    settings_from(diag)
    if diag.num_prompts < 1:
        raise ValueError(f"config.diagnosis.num_prompts={diag.num_prompts}; must be >= 1")
    if not diag.z_threshold > 0:
        raise ValueError(f"config.diagnosis.z_threshold={diag.z_threshold}; must be > 0")
    declare = (diag.declare,) if isinstance(diag.declare, str) else tuple(diag.declare)
    bad = [m for m in declare if m not in analysis.DIRECTIONS]
    if bad or not declare:
        raise ValueError(
            f"config.diagnosis.declare={declare}; allowed: a non-empty subset of"
            f" {list(analysis.DIRECTIONS)}"
        )
    if diag.signal_loss not in analysis.SIGNAL_LOSS:
        raise ValueError(
            f"config.diagnosis.signal_loss={diag.signal_loss!r}; allowed: {analysis.SIGNAL_LOSS}"
        )


def calibration_batch(
    examples: Sequence[Example], tokenizer: Tokenizer, num_prompts: int, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """The first `num_prompts` prompts (chat template, generation prompt) that fit `max_len`,
    left-padded to the longest: ids, mask [B, T] int32."""
    rows = []
    for ex in examples:
        ids = tokenizer.encode_chat(ex.prompt_messages)
        if 0 < len(ids) <= max_len:
            rows.append(ids)
        if len(rows) == num_prompts:
            break
    if len(rows) < num_prompts:
        raise ValueError(
            f"config.diagnosis.num_prompts={num_prompts}: only {len(rows)} prompts of <="
            f" {max_len} tokens in the data"
        )
    return left_pad(rows, tokenizer.pad_id)


def diagnose(
    model: nn.Module,
    params: Any,
    plan: FaultPlan,
    ids: np.ndarray,
    mask: np.ndarray,
    spec: SrddSpec,
) -> dict[str, Any]:
    """Scans, verdict and sigma map as one JSON-ready dict (the content of srdd.json)."""
    if model.config.remat:  # forward only: remat buys nothing, and its trace hides the probes
        model = model.clone(config=dataclasses.replace(model.config, remat=False))
    t0 = time.perf_counter()
    scans = scan_layers(
        model,
        params,
        ids,
        mask,
        plan=plan,
        settings=spec.settings,
        fault_key=step_key(spec.seed, 0, "eval"),
        probe_key=jax.random.key(spec.seed + 1),
    )
    scan_s = time.perf_counter() - t0
    v = analysis.verdict(
        scans,
        z_threshold=spec.z_threshold,
        declare=spec.declare,
        dead_floor=spec.dead_floor,
        instability_floor=spec.instability_floor,
    )
    base_sigma = spec.base_sigma
    sig = analysis.guided_sigmas(
        scans, base_sigma, located=v["layers"], signal_loss=spec.signal_loss
    )
    n = len(scans["gain"])
    layers = []
    for i in range(n):
        row = {"layer": i, **{m: float(scans[m][i]) for m in METRICS}}
        row["z"] = {m: _json_float(v["z"][m][i]) for m in analysis.DIRECTIONS}
        row["score"] = float(v["scores"][i])
        row["sigma"] = sig["sigmas"][i]
        row["sigma_rules"] = sig["rules"][i]
        layers.append(row)
    return {
        "verdict": {
            "layers": v["layers"],
            "confidence": v["confidence"],
            "message": v["message"],
            "declare": v["declare"],
            "z_threshold": v["z_threshold"],
        },
        "suspects": v["suspects"],
        "layers": layers,
        "sigma_map": {
            "base_sigma": base_sigma,
            "sigmas": {str(k): s for k, s in sig["sigmas"].items()},
            "high_priority": sig["high_priority"],
            "signal_loss": sig["signal_loss"],
        },
        "aqn_fragment": aqn_fragment(sig["sigmas"], v["layers"], base_sigma),
        "calibration": {"prompts": int(ids.shape[0]), "tokens": int(mask.sum())},
        "fault_plan": plan.describe(),
        "scan_seconds": scan_s,
    }


def run_srdd(
    spec: SrddSpec,
    model_cfg: ModelConfig,
    params: Any,
    plan: FaultPlan,
    examples: Sequence[Example],
    tokenizer: Tokenizer,
    workdir: str | None = None,
) -> dict[str, Any]:
    """SRDD of `params` on the device `plan` (the hardware faults, no AQN), as every job runs
    it: calibration prompts from `examples` (the train split), the scans and the sigma map of
    `spec`. Writes srdd.json and srdd.png into `workdir` (process 0) when given; returns the
    report."""
    ids, mask = calibration_batch(examples, tokenizer, spec.num_prompts, spec.max_prompt_len)
    report = diagnose(causal_lm(model_cfg), params, plan, ids, mask, spec)
    if workdir is not None and jax.process_index() == 0:
        write_report(report, workdir)
    return report


def aqn_fragment(sigmas: Mapping[int, float], located: Sequence[int], base: float) -> dict:
    """What `config.aqn` accepts: the guided arm (layers='srdd' with the sigma map) and the
    targeted arm (AQN on the located layers), with the override flags that set them."""
    literal = "{" + ", ".join(f"{k}: {s:g}" for k, s in sorted(sigmas.items())) + "}"
    targeted = "(" + ",".join(str(i) for i in located) + ("," if len(located) == 1 else "") + ")"
    return {
        "srdd_guided": {"layers": "srdd", "layer_sigmas": literal, "sigma_start": base},
        "targeted": {"layers": targeted if located else "", "sigma_start": base},
        "flags_srdd_guided": (
            f"--config.aqn.enabled=True --config.aqn.layers=srdd"
            f" --config.aqn.layer_sigmas='{literal}' --config.aqn.sigma_start={base:g}"
        ),
        "flags_targeted": (
            f"--config.aqn.enabled=True --config.aqn.layers='{targeted}'" if located else ""
        ),
    }


def _json_float(x) -> float | None:
    x = float(x)
    return x if np.isfinite(x) else None


def format_table(report: Mapping[str, Any]) -> str:
    """The per-layer table printed by the diagnose job."""
    head = (
        f"{'layer':>5} {'gain':>8} {'instab':>9} {'dead':>7} {'kurt':>8} {'min_g':>8}"
        f" {'max_g':>8} {'score':>9} {'sigma':>7}  flags"
    )
    lines = [head, "-" * len(head)]
    located = set(report["verdict"]["layers"])
    for row in report["layers"]:
        thr = report["verdict"]["z_threshold"]
        flags = [
            m
            for m, z in row["z"].items()
            if z is not None and analysis.bad_z(np.array(z), analysis.DIRECTIONS[m]) > thr
        ]
        mark = "  <== FAULT" if row["layer"] in located else ""
        lines.append(
            f"{row['layer']:>5} {row['gain']:>8.4f} {row['instability']:>9.2e}"
            f" {row['dead']:>7.4f} {row['kurtosis']:>8.3f} {row['min_gain']:>8.3f}"
            f" {row['max_gain']:>8.3f} {min(row['score'], 9.99e6):>9.3g} {row['sigma']:>7.4f}"
            f"  {','.join(flags)}{mark}"
        )
    v = report["verdict"]
    lines.append(f"verdict: {v['message']} (confidence {v['confidence']:.3f})")
    return "\n".join(lines)


def plot_report(report: Mapping[str, Any], path: str) -> str:
    """Per-layer metrics with the located layers marked (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["layers"]
    x = np.array([r["layer"] for r in rows])
    panels = [
        ("gain", "gain  std(Δout)/std(noise)"),
        ("instability", "instability  mean std(out_t - out_0)"),
        ("dead", "dead fraction (no response to DC bias)"),
        ("kurtosis", "Fisher kurtosis of the output"),
        ("min_gain", "min / max per-element DC gain"),
        ("sigma", "guided AQN sigma"),
    ]
    fig, axes = plt.subplots(3, 2, figsize=(11, 9), sharex=True)
    for ax, (metric, title) in zip(axes.flat, panels, strict=True):
        ax.plot(x, [r[metric] for r in rows], "o-", ms=3, label=metric)
        if metric == "min_gain":
            ax.plot(x, [r["max_gain"] for r in rows], "s-", ms=3, label="max_gain")
            ax.legend(fontsize=7)
        for layer in report["verdict"]["layers"]:
            ax.axvspan(layer - 0.4, layer + 0.4, color="red", alpha=0.2)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("decoder layer")
    v = report["verdict"]
    fig.suptitle(f"SRDD: {v['message']} (confidence {v['confidence']:.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(report: Mapping[str, Any], workdir: str) -> tuple[str, str]:
    """srdd.json and srdd.png in `workdir`; returns their paths."""
    os.makedirs(workdir, exist_ok=True)
    json_path = os.path.join(workdir, SRDD_FILE)
    write_json(json_path, report)
    return json_path, plot_report(report, os.path.join(workdir, PLOT_FILE))


def load_report(path: str) -> dict[str, Any]:
    with open(path) as f:
        report = json.load(f)
    for key in ("verdict", "layers", "sigma_map"):
        if key not in report:
            raise ValueError(f"{path}: not an srdd.json (no {key!r})")
    return report


def sigmas_of(report: Mapping[str, Any]) -> dict[int, float]:
    return {int(k): float(s) for k, s in report["sigma_map"]["sigmas"].items()}
