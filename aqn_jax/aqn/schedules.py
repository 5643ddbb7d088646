"""AQN sigma schedules: step -> sigma, computed on the host and passed into jitted code as a
traced scalar (a new sigma never recompiles).

`qerl` is NVlabs/QeRL's `noise_scheduler.py`: the run's steps split evenly into K = num_stages
intervals; interval 0 has sigma 0 (warm-up), interval i >= 1 has
`sigma_start * (sigma_end / sigma_start) ** ((i - 1) / (K - 2))`.
`epoch_aware` is the original system's variant: epoch e starts at
`sigma_e = sigma_start * (sigma_end / sigma_start) ** (e / E)` and runs its own qerl schedule
from sigma_e to sigma_{e+1} (each epoch with its own sigma-0 warm-up interval).
"""

from __future__ import annotations

import math

from aqn_jax.registry import Registry

# config.aqn.schedule: name -> `(step, total_steps, sigma_start, sigma_end, num_stages,
# num_epochs) -> sigma`, the inputs checked by `sigma_at`.
SCHEDULES: Registry = Registry("config.aqn.schedule")


def qerl_sigmas(sigma_start: float, sigma_end: float, num_stages: int) -> list[float]:
    """The K per-interval sigmas of QeRL: [0, sigma_start, ..., sigma_end]."""
    if num_stages < 3:
        raise ValueError(f"num_stages={num_stages}; QeRL's schedule needs >= 3")
    ratio = sigma_end / sigma_start
    return [0.0] + [
        sigma_start * ratio ** ((i - 1) / (num_stages - 2)) for i in range(1, num_stages)
    ]


def _interval(step: int, total_steps: int, num_intervals: int) -> int:
    # QeRL: steps_per_interval = total / K; interval = floor(step / steps_per_interval), capped.
    step = min(max(step, 0), total_steps)
    return min(int(step // (total_steps / num_intervals)), num_intervals - 1)


def sigma_at(
    schedule: str,
    step: int,
    total_steps: int,
    sigma_start: float,
    sigma_end: float,
    num_stages: int = 10,
    num_epochs: int = 1,
) -> float:
    """sigma of `schedule` at `step` (0-based) of a run of `total_steps` steps."""
    fn = SCHEDULES.get(schedule)
    if total_steps <= 0:
        raise ValueError(f"total_steps={total_steps}; must be > 0")
    if sigma_start < 0 or sigma_end < 0:
        raise ValueError(f"sigma_start={sigma_start}, sigma_end={sigma_end}; must be >= 0")
    return fn(step, total_steps, sigma_start, sigma_end, num_stages, num_epochs)


@SCHEDULES.register("qerl")
def _qerl(step, total_steps, sigma_start, sigma_end, num_stages, num_epochs) -> float:
    return qerl_sigmas(sigma_start, sigma_end, num_stages)[_interval(step, total_steps, num_stages)]


@SCHEDULES.register("epoch_aware")
def _epoch_aware(step, total_steps, sigma_start, sigma_end, num_stages, num_epochs) -> float:
    if num_epochs < 1:
        raise ValueError(f"num_epochs={num_epochs}; must be >= 1")
    steps_per_epoch = total_steps / num_epochs
    epoch = min(int(min(max(step, 0), total_steps) // steps_per_epoch), num_epochs - 1)
    ratio = sigma_end / sigma_start
    lo = sigma_start * ratio ** (epoch / num_epochs)
    hi = sigma_start * ratio ** ((epoch + 1) / num_epochs)
    in_epoch = step - epoch * steps_per_epoch
    return qerl_sigmas(lo, hi, num_stages)[_interval(in_epoch, steps_per_epoch, num_stages)]


@SCHEDULES.register("constant")
def _constant(step, total_steps, sigma_start, sigma_end, num_stages, num_epochs) -> float:
    return float(sigma_start)


def _frac(step: int, total_steps: int) -> float:
    return min(max(step, 0), total_steps) / total_steps


@SCHEDULES.register("linear")
def _linear(step, total_steps, sigma_start, sigma_end, num_stages, num_epochs) -> float:
    return float(sigma_start + (sigma_end - sigma_start) * _frac(step, total_steps))


@SCHEDULES.register("cosine")
def _cosine(step, total_steps, sigma_start, sigma_end, num_stages, num_epochs) -> float:
    frac = _frac(step, total_steps)
    return float(sigma_end + 0.5 * (sigma_start - sigma_end) * (1 + math.cos(math.pi * frac)))
