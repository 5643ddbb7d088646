"""From per-layer scans to robust z-scores, a verdict, and a per-layer AQN sigma map.

Robust z (the original's srdd_error_finder, docs/ARCHITECTURE.md):

    z = (v - median) / (max(MAD, 0.01 * |median|, 1e-6) * 1.4826)

over the layers (min/max gain: the first two and last two layers are left out of the
statistics and get no z, as in the original, when at least three layers remain).

Which metrics may declare a fault. `instability` and `dead` are exactly zero on every layer of a
healthy deterministic device, so any layer where they rise above a small floor and a z of
`z_threshold` is faulty. `gain`, `kurtosis`, `min_gain` and `max_gain` vary smoothly with depth
on healthy models (on the random tiny model the first layer's gain has z = 14 with no fault at
all), so by default they are evidence - reported for every suspect, used to rank - but do not
declare a fault on their own; `declare` adds them when a user wants.

Verdict: the layers whose declaring score (the largest bad-direction z among declaring metrics
that pass their floor) exceeds `z_threshold`, else "no fault found". Confidence:
  fault found:    1 - max(z_threshold, best score of the other layers) / weakest located score
  no fault found: 1 - best score / z_threshold
both clipped to [0, 1]: how far the located layers stand out, or how far the most suspicious
layer is from the threshold.

Guided sigma (the original system's, docs/ARCHITECTURE.md "SRDD diagnosis"): start at `base`;
gain < 0.8 * median -> x1.5; kurtosis > 1.2 * median -> x1.5; instability > 0.1 -> x0.5; clamp
to [0.01, 0.15]; layers with sigma > 1.2 * base are high priority. Two choices of ours, both
recorded in the output:
  * the kurtosis rule compares Pearson kurtosis (Fisher + 3): the seed's values were in the
    thousands, where the two agree, while on small models the Fisher median can be <= 0 and the
    rule as written would flag every layer;
  * signal_loss='gain_or_dead' (default) also applies the seed's signal-loss rule (x1.5) where
    the dead fraction declares a fault: a deadzone on the residual stream *raises* the gain
    probe (noise rescues flushed elements), so the seed's gain rule cannot see it.
    signal_loss='gain' is the seed's mapping exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# metric -> direction in which it signals a fault
DIRECTIONS = {
    "instability": "high",
    "dead": "high",
    "gain": "both",
    "kurtosis": "high",
    "min_gain": "low",
    "max_gain": "high",
}
DECLARING = ("instability", "dead")
EDGE_EXCLUDED = ("min_gain", "max_gain")
SIGNAL_LOSS = ("gain_or_dead", "gain")


def robust_z(values: Sequence[float], include: Sequence[bool] | None = None) -> np.ndarray:
    """The original's robust z of every value, statistics over the `include`d ones (NaN for the
    others)."""
    v = np.asarray(values, np.float64)
    inc = np.ones(len(v), bool) if include is None else np.asarray(include, bool)
    ref = v[inc]
    med = float(np.median(ref))
    mad = float(np.median(np.abs(ref - med)))
    denom = max(mad, 0.01 * abs(med), 1e-6) * 1.4826
    z = (v - med) / denom
    return np.where(inc, z, np.nan)


def edge_mask(num_layers: int) -> np.ndarray:
    """Layers that take part in min/max gain statistics: all but the first two and last two
    (when at least three remain)."""
    inc = np.ones(num_layers, bool)
    if num_layers - 4 >= 3:
        inc[:2] = False
        inc[-2:] = False
    return inc


def bad_z(z: np.ndarray, direction: str) -> np.ndarray:
    if direction == "high":
        return z
    if direction == "low":
        return -z
    return np.abs(z)


def z_scores(scans: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    n = len(scans["gain"])
    return {m: robust_z(scans[m], edge_mask(n) if m in EDGE_EXCLUDED else None) for m in DIRECTIONS}


def _floors(scans, dead_floor, instability_floor):
    """Per metric, per layer: does the raw value clear the floor a declaration needs?"""
    n = len(scans["gain"])
    return {
        "dead": np.asarray(scans["dead"]) > dead_floor,
        "instability": np.asarray(scans["instability"])
        > instability_floor * np.maximum(np.asarray(scans["out_std"]), 1e-30),
        **{m: np.ones(n, bool) for m in DIRECTIONS if m not in ("dead", "instability")},
    }


def verdict(
    scans: Mapping[str, np.ndarray],
    *,
    z_threshold: float = 3.0,
    declare: Sequence[str] = DECLARING,
    dead_floor: float = 1e-3,
    instability_floor: float = 1e-4,
    top_k: int = 3,
) -> dict[str, Any]:
    """Localise the faulty layer(s). Returns {"layers", "confidence", "message", "suspects",
    "z", "scores"} (see the module docstring)."""
    unknown = [m for m in declare if m not in DIRECTIONS]
    if unknown or not declare:
        raise ValueError(
            f"config.diagnosis.declare={tuple(declare)}; allowed: non-empty subset of"
            f" {list(DIRECTIONS)}"
        )
    z = z_scores(scans)
    floors = _floors(scans, dead_floor, instability_floor)
    n = len(scans["gain"])
    bad = {m: np.nan_to_num(bad_z(z[m], d), nan=-np.inf) for m, d in DIRECTIONS.items()}
    score = np.full(n, -np.inf)
    for m in declare:
        score = np.maximum(score, np.where(floors[m], bad[m], -np.inf))
    evidence_score = np.max(np.stack([bad[m] for m in DIRECTIONS]), axis=0)
    located = [int(i) for i in np.flatnonzero(score > z_threshold)]
    # Rank: declaring score first, all evidence second.
    order = sorted(range(n), key=lambda i: (-max(score[i], 0.0), -evidence_score[i]))
    suspects = []
    for i in order[:top_k]:
        suspects.append(
            {
                "layer": int(i),
                "score": _finite(score[i]),
                "evidence": {
                    m: {"value": float(scans[m][i]), "z": _finite(z[m][i])}
                    for m in DIRECTIONS
                    if np.isfinite(bad[m][i]) and bad[m][i] > z_threshold
                },
            }
        )
    if located:
        others = [score[i] for i in range(n) if i not in located]
        s_out = max([z_threshold, *[s for s in others if np.isfinite(s)]])
        confidence = float(np.clip(1.0 - s_out / min(score[i] for i in located), 0.0, 1.0))
        message = f"fault at layer(s) {located}"
    else:
        best = max(0.0, float(np.max(np.where(np.isfinite(score), score, 0.0))))
        confidence = float(np.clip(1.0 - best / z_threshold, 0.0, 1.0))
        message = "no fault found"
    return {
        "layers": located,
        "confidence": confidence,
        "message": message,
        "suspects": suspects,
        "z": z,
        "scores": np.where(np.isfinite(score), score, 0.0),
        "declare": list(declare),
        "z_threshold": z_threshold,
    }


def _finite(x) -> float | None:
    x = float(x)
    return x if np.isfinite(x) else None


def guided_sigmas(
    scans: Mapping[str, np.ndarray],
    base_sigma: float = 0.05,
    *,
    located: Sequence[int] = (),
    signal_loss: str = "gain_or_dead",
    lo: float = 0.01,
    hi: float = 0.15,
) -> dict[str, Any]:
    """The original system's per-layer sigma map (module docstring). Returns
    {"sigmas": {layer: sigma}, "high_priority": [...], "rules": {layer: [rule, ...]}}."""
    if signal_loss not in SIGNAL_LOSS:
        raise ValueError(f"config.diagnosis.signal_loss={signal_loss!r}; allowed: {SIGNAL_LOSS}")
    if not base_sigma > 0:
        raise ValueError(f"base sigma={base_sigma}; must be > 0")
    gains = np.asarray(scans["gain"], np.float64)
    kurt = np.asarray(scans["kurtosis"], np.float64) + 3.0  # Pearson
    instab = np.asarray(scans["instability"], np.float64)
    g_med, k_med = float(np.median(gains)), float(np.median(kurt))
    sigmas: dict[int, float] = {}
    rules: dict[int, list[str]] = {}
    for i in range(len(gains)):
        sigma, why = base_sigma, []
        if gains[i] < 0.8 * g_med or (
            signal_loss == "gain_or_dead" and i in located and scans["dead"][i] > 0
        ):
            sigma *= 1.5
            why.append("signal loss x1.5")
        if kurt[i] > 1.2 * k_med:
            sigma *= 1.5
            why.append("kurtosis x1.5")
        if instab[i] > 0.1:
            sigma *= 0.5
            why.append("instability x0.5")
        sigma = min(max(sigma, lo), hi)
        sigmas[i] = round(float(sigma), 12)  # 0.05 * 1.5 prints as 0.075
        rules[i] = why
    return {
        "sigmas": sigmas,
        "high_priority": [i for i, s in sigmas.items() if s > 1.2 * base_sigma],
        "rules": rules,
        "base_sigma": base_sigma,
        "signal_loss": signal_loss,
    }
