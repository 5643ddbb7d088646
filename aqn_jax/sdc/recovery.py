"""`Recovery`: what the run does with a corrupted RL step (`config.sdc.guard`, guard.py).

It owns the attempts of each step: their numbers (a recomputed or regenerated attempt n >= 1,
and a step reached again after a rollback, starts past the attempts that failed), their fault
keys (`fault_key`: a new attempt draws its faults anew), the guard's verdicts, and skip,
recompute and rollback. The trainer hands it the step's rollout and train function as
callables (`Recovery.step`); the job hands it the checkpoint's reader (`Recovery.rollback`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from aqn_jax.faults.intercept import step_key

from .guard import Guard, GuardSpec, RollbackNeeded
from .telemetry import rollout_totals

# Folded into a later attempt's fault keys (attempt >= 1): a stream apart from the passes'.
ATTEMPT_TAG = 1 << 30


class Attempted(NamedTuple):
    """The accepted attempt of a step: its rollout (the sampler's output and the train rows
    made of it), what its train function returned, and the guard's sdc/* counts."""

    out: Any
    rows: Any
    train: Any
    counts: dict  # the guard's sdc/* metrics (empty without a guard)
    rejected_rollout: np.ndarray  # (bits flipped, rows ABFT flagged) of rejected rollouts
    t_gen: float  # seconds of the rollouts, the rejected ones included
    skipped: bool  # guard=skip dropped the update: the caller keeps the state before the step


class Recovery:
    """The attempts of each RL step under `config.sdc` (`spec`; `kinds`: the plan's injections
    whose telemetry is SDC's, `telemetry.sdc_kinds`; `note`: the bit faults the device runs,
    named in errors)."""

    def __init__(self, spec: GuardSpec, seed: int, kinds=frozenset(), note: str = ""):
        self.guard = Guard(spec) if spec.on else None
        self.seed, self.kinds, self.note = seed, kinds, note
        self.first_attempt: dict[int, int] = {}  # step -> its first attempt after a rollback
        self.rolled_back = False  # the next step's metrics say so

    def fault_key(self, step: int, phase: str, attempt: int = 0) -> jax.Array:
        """The faults' key of `phase` at attempt `attempt` of RL step `step`: (seed, step,
        phase), folded with the attempt from the first recompute on."""
        key = step_key(self.seed, step, phase)
        return jax.random.fold_in(key, ATTEMPT_TAG + attempt) if attempt else key

    def step(
        self,
        step: int,
        rollout: Callable[[int], tuple[Any, Any]],
        train: Callable[[Any, int], Any],
    ) -> Attempted:
        """Attempts of RL step `step` until one is accepted. `rollout(attempt)` -> (the
        sampler's output, its train rows); `train(rows, attempt)` -> an attempt's result whose
        `.mets` (host floats) the guard judges. A rejected rollout (`Guard.rollout_verdict`)
        is generated again with the next attempt's faults (recompute) or its update skipped
        (skip); a rejected update (`Guard.verdict`) is recomputed on the same rows or skipped;
        past `max_recomputes` failed attempts it raises `RollbackNeeded`."""
        first = attempt = self.first_attempt.get(step, 0)
        rejected_rollout, t_regen = np.zeros(2), 0.0
        t0 = time.perf_counter()
        while True:
            out, rows = rollout(attempt)
            bad_rollout = None
            if self.guard is not None:
                totals = rollout_totals(
                    self.kinds, out.fault_stats, int(rows["rmask"].sum(1).max())
                )
                bad_rollout = self.guard.rollout_verdict(
                    rows["sampler_logp"], rows["rmask"], totals[1]
                )
            if bad_rollout is None or self.guard.spec.mode == "skip":
                break
            # guard=recompute: the same prompts and sampling key, the next attempt's faults.
            rejected_rollout += totals
            attempt = self._next(step, attempt, first, bad_rollout, "generating it again")
            t_regen = time.perf_counter() - t0
        t_gen = time.perf_counter() - t0
        result = train(rows, attempt)
        if self.guard is None:
            return Attempted(out, rows, result, {}, rejected_rollout, t_gen, False)
        result, counts, skipped = self._judge(
            step, rows, train, result, first, attempt, bad_rollout
        )
        counts["timing_s/sdc_recompute"] += t_regen
        return Attempted(out, rows, result, counts, rejected_rollout, t_gen, skipped)

    def _next(self, step: int, attempt: int, first: int, reason: str, doing: str) -> int:
        """The next attempt after one rejected for `reason`; `RollbackNeeded` past the last."""
        attempt += 1
        if attempt - first > self.guard.spec.max_recomputes:
            raise RollbackNeeded(step, reason)
        print(f"RL step {step}: {reason}; {doing} (attempt {attempt})")
        return attempt

    def _judge(self, step, rows, train, result, first, attempt, bad_rollout):
        """The guard's verdict on each attempt at the update: skip, or recompute with a fresh
        fault draw (`_next`); (the accepted attempt, the guard's sdc/* metrics, skipped).
        `bad_rollout` (skip mode only): why the rollout was rejected, which skips its
        update."""
        t0, skipped = time.perf_counter(), False
        rejected = {"sdc/injected_rejected": 0.0, "sdc/detected_abft_rejected": 0.0}
        while (reason := bad_rollout or self.guard.verdict(result.mets)) is not None:
            if self.guard.spec.mode == "skip":  # the update is dropped; the step counts
                skipped = True
                print(f"RL step {step}: {reason}; update skipped (config.sdc.guard=skip)")
                break
            # What fired in the rejected attempt still counts (sdc/injected includes it).
            rejected["sdc/injected_rejected"] += sum(
                result.mets.get(f"sdc/injected_{k}", 0.0) for k in ("prepare", "update", "tree")
            )
            rejected["sdc/detected_abft_rejected"] += result.mets.get(
                "sdc/detected_abft_train", 0.0
            )
            attempt = self._next(step, attempt, first, reason, "recomputing")
            result = train(rows, attempt)
        if not skipped:
            self.guard.accept(result.mets)
        rolled, self.rolled_back = self.rolled_back, False
        return (
            result,
            {
                **rejected,
                "sdc/rolled_back": float(rolled),
                "sdc/recomputed": float(attempt - first),
                "sdc/guard_skipped": float(skipped),
                "timing_s/sdc_recompute": time.perf_counter() - t0 if attempt > first else 0.0,
            },
            skipped,
        )

    def rollback(
        self, error: RollbackNeeded, latest: Callable[[], Any], first: tuple
    ) -> tuple[Any, Any, int]:
        """The job's last resort for `error`'s step, which failed every recompute: (the state,
        the data position, the step to run next) of the last checkpoint (`latest()`: those
        three, or None without one), else `first` (the loop's start). When the run reaches
        the step again, its attempts continue past the failed ones (fresh draws); a second
        rollback of the same step raises (a fault no recompute cures)."""
        if error.step in self.first_attempt:
            raise FloatingPointError(
                f"RL step {error.step}: failed every recompute again after a rollback (a"
                f" permanent fault? {self.note or 'no bit fault configured'})"
            )
        self.first_attempt[error.step] = self.guard.spec.max_recomputes + 1
        self.rolled_back = True
        print(f"{error}")
        got = latest()
        return first if got is None else got
