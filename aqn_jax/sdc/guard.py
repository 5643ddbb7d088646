"""Step guards against silent data corruption (`config.sdc`): detect a corrupted RL step from its
metrics and decide what the trainer does with it.

  none       the run stops at a non-finite step, as without any guard (`check_finite`)
  skip       a non-finite loss, gradient or update: the update is skipped (the state before
             the step is kept; `optax.apply_if_finite`'s policy, at the RL step)
  recompute  a non-finite step, a gradient-norm or update-RMS anomaly (a robust z over the
             trailing window of accepted steps), an AdamW moment out of its range
             (`trees.moment_bound`) or an ABFT detection in the train passes: the step is
             recomputed on the same batch with a fresh fault draw (the next attempt's key);
             after `max_recomputes` failed attempts the run rolls back to its last checkpoint

A corrupted rollout (`rollout_verdict`: a non-finite sampler log-prob on a response token, or,
with recompute, an ABFT detection in the rollout's forwards) is an attempt that failed before
its update: with recompute the step's rollout is generated again from the same prompts and
sampling key with the next attempt's fault draw (so a cured transient fault gives the clean
run's rollout), counted against the same `max_recomputes`; with skip the step's update is
skipped.

The verdict reads the step's metrics only (host floats), so the device programs stay those of
an unguarded run plus a few reductions (`sdc/update_rms`, `sdc/moments_ok`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

GUARDS = ("none", "skip", "recompute")
# A robust z needs a spread: below this many accepted steps no anomaly is called.
MIN_HISTORY = 5
# The z is taken on log values (the norms are scales; a spike is a ratio), with the MAD floored
# at 5% (0.05 in log units): a run whose norms vary by less would otherwise call its ordinary
# step-to-step noise an anomaly.
_LOG_MAD_FLOOR = 0.05
# sdc/grad_norm: the gradient as the optimizer received it (after gradient faults, if any).
WATCHED = ("actor/grad_norm", "sdc/grad_norm", "sdc/update_rms")
FINITE = ("actor/pg_loss", *WATCHED)


@dataclasses.dataclass(frozen=True)
class GuardSpec:
    """`config.sdc`, typed (`guard_spec`)."""

    mode: str = "none"  # GUARDS
    max_recomputes: int = 2
    window: int = 20  # accepted steps the robust z looks back over
    z: float = 6.0  # |robust z| of log grad-norm or log update-RMS above which a step is flagged
    abft: bool = False
    abft_backward: bool = False

    @property
    def on(self) -> bool:
        return self.mode != "none"


def guard_spec(sdc: Any) -> GuardSpec:
    """`config.sdc` (absent in configs written before it: no guard) -> GuardSpec; raises naming
    the field."""
    if sdc is None:
        return GuardSpec()
    if sdc.guard not in GUARDS:
        raise ValueError(f"config.sdc.guard={sdc.guard!r}; allowed: {GUARDS}")
    if int(sdc.max_recomputes) < 0:
        raise ValueError(f"config.sdc.max_recomputes={sdc.max_recomputes}; must be >= 0")
    if int(sdc.window) < MIN_HISTORY:
        raise ValueError(f"config.sdc.window={sdc.window}; must be >= {MIN_HISTORY}")
    if not float(sdc.z) > 0:
        raise ValueError(f"config.sdc.z={sdc.z}; must be > 0")
    return GuardSpec(
        mode=sdc.guard,
        max_recomputes=int(sdc.max_recomputes),
        window=int(sdc.window),
        z=float(sdc.z),
        abft=bool(sdc.abft),
        abft_backward=bool(sdc.get("abft_backward", False)),
    )


def robust_z(value: float, history) -> float:
    """(log value - median) / (1.4826 MAD) over the log history (MAD floored, see above)."""
    h = np.log(np.asarray(history, np.float64))
    med = float(np.median(h))
    mad = max(1.4826 * float(np.median(np.abs(h - med))), _LOG_MAD_FLOOR)
    return (math.log(value) - med) / mad if value > 0 else -math.inf


class Guard:
    """The verdict on each attempt of a step and the history of accepted steps."""

    def __init__(self, spec: GuardSpec):
        self.spec = spec
        self.history: dict[str, collections.deque] = {
            k: collections.deque(maxlen=spec.window) for k in WATCHED
        }

    def verdict(self, m: Mapping[str, float]) -> str | None:
        """Why this attempt is rejected (a line naming the metric), or None to accept it."""
        bad = [k for k in FINITE if k in m and not math.isfinite(m[k])]
        if bad:
            return f"non-finite {bad[0]}={m[bad[0]]}"
        if self.spec.mode != "recompute":
            return None
        if m.get("sdc/moments_ok", 1.0) < 1.0:
            return "an AdamW moment out of range"
        if m.get("sdc/detected_abft_train", 0.0) > 0:
            return f"ABFT flagged {m['sdc/detected_abft_train']:g} rows in the train passes"
        for k in WATCHED:
            h = self.history[k]
            if k in m and len(h) >= MIN_HISTORY:
                z = robust_z(m[k], h)
                if abs(z) > self.spec.z:
                    return f"{k}={m[k]:.4g} is an anomaly (robust z {z:+.1f})"
        return None

    def rollout_verdict(self, sampler_logp, response_mask, abft_rows: float) -> str | None:
        """Why the step's rollout is rejected (a line), or None: a non-finite log-prob of a
        sampled response token (the logits it was drawn from were not finite), or, with
        recompute, rows ABFT flagged in the rollout's forward passes."""
        live = np.asarray(response_mask) > 0
        bad = int((~np.isfinite(np.asarray(sampler_logp)[live])).sum())
        if bad:
            return f"non-finite sampler log-probs on {bad} response token(s) of the rollout"
        if self.spec.mode == "recompute" and abft_rows > 0:
            return f"ABFT flagged {abft_rows:g} rows in the rollout"
        return None

    def accept(self, m: Mapping[str, float]) -> None:
        for k in WATCHED:
            if k in m and math.isfinite(m[k]) and m[k] > 0:
                self.history[k].append(float(m[k]))


class RollbackNeeded(Exception):  # noqa: N818 (a request, not an error)
    """Raised by the trainer when a step failed `max_recomputes` recomputes: the job restores
    its last checkpoint."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"RL step {step}: {reason} after every recompute; rolling back")
        self.step, self.reason = step, reason
