"""AQN sigma schedules: step -> sigma, computed on the host and passed into jitted code as a
traced scalar (a new sigma never recompiles).

`qerl` is NVlabs/QeRL's `noise_scheduler.py`: the run's steps split evenly into K = num_stages
intervals; interval 0 has sigma 0 (warm-up), interval i >= 1 has
`sigma_start * (sigma_end / sigma_start) ** ((i - 1) / (K - 2))`.
`epoch_aware` is the original system's variant: epoch e starts at
`sigma_e = sigma_start * (sigma_end / sigma_start) ** (e / E)` and runs its own qerl schedule
from sigma_e to sigma_{e+1} (each epoch with its own sigma-0 warm-up interval).
Two options of `epoch_aware` state the original design's own numbers (epoch 1: 0.05 -> 0.01,
epoch 2: 0.01 -> 0.0005): `epoch_sigmas`, the E + 1 boundaries sigma_0..sigma_E given
explicitly (empty: the geometric ones above), and `warmup` 'every_epoch' (the default, as
above) or 'first_epoch': only epoch 0 opens with its sigma-0 interval; every later epoch e
runs its K intervals geometrically from sigma_e to sigma_{e+1},
`sigma_e * (sigma_{e+1} / sigma_e) ** (i / (K - 1))`, so sigma > 0 at every step after the
first interval.
"""

from __future__ import annotations

import math

from aqn_jax.registry import Registry

WARMUPS = ("every_epoch", "first_epoch")  # epoch_aware's sigma-0 intervals

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
    epoch_sigmas: tuple[float, ...] = (),
    warmup: str = "every_epoch",
) -> float:
    """sigma of `schedule` at `step` (0-based) of a run of `total_steps` steps."""
    fn = SCHEDULES.get(schedule)
    if total_steps <= 0:
        raise ValueError(f"total_steps={total_steps}; must be > 0")
    if sigma_start < 0 or sigma_end < 0:
        raise ValueError(f"sigma_start={sigma_start}, sigma_end={sigma_end}; must be >= 0")
    check_epoch_options(schedule, num_epochs, epoch_sigmas, warmup)
    if schedule == "epoch_aware":
        return _epoch_aware(
            step, total_steps, sigma_start, sigma_end, num_stages, num_epochs,
            epoch_sigmas=tuple(epoch_sigmas), warmup=warmup,
        )  # fmt: skip
    return fn(step, total_steps, sigma_start, sigma_end, num_stages, num_epochs)


def check_epoch_options(schedule: str, num_epochs: int, epoch_sigmas, warmup: str) -> None:
    """epoch_aware's `epoch_sigmas` and `warmup` (module docstring): checked whatever the
    schedule, and refused where the schedule would ignore them."""
    f = "config.aqn"
    if warmup not in WARMUPS:
        raise ValueError(f"{f}.warmup={warmup!r}; allowed: {WARMUPS}")
    sigmas = tuple(epoch_sigmas)
    if schedule != "epoch_aware" and (sigmas or warmup != WARMUPS[0]):
        raise ValueError(
            f"{f}.epoch_sigmas={sigmas} / {f}.warmup={warmup!r} apply to"
            f" {f}.schedule='epoch_aware' only (schedule is {schedule!r}); allowed here: () and"
            f" {WARMUPS[0]!r}"
        )
    if sigmas and (len(sigmas) != num_epochs + 1 or not all(float(x) > 0 for x in sigmas)):
        raise ValueError(
            f"{f}.epoch_sigmas={sigmas}; allowed: () or num_epochs + 1 = {num_epochs + 1}"
            " sigmas > 0 (the epochs' boundaries)"
        )


@SCHEDULES.register("qerl")
def _qerl(step, total_steps, sigma_start, sigma_end, num_stages, num_epochs) -> float:
    return qerl_sigmas(sigma_start, sigma_end, num_stages)[_interval(step, total_steps, num_stages)]


@SCHEDULES.register("epoch_aware")
def _epoch_aware(
    step,
    total_steps,
    sigma_start,
    sigma_end,
    num_stages,
    num_epochs,
    epoch_sigmas=(),
    warmup="every_epoch",
) -> float:
    if num_epochs < 1:
        raise ValueError(f"num_epochs={num_epochs}; must be >= 1")
    steps_per_epoch = total_steps / num_epochs
    epoch = min(int(min(max(step, 0), total_steps) // steps_per_epoch), num_epochs - 1)
    if epoch_sigmas:
        lo, hi = float(epoch_sigmas[epoch]), float(epoch_sigmas[epoch + 1])
    else:
        ratio = sigma_end / sigma_start
        lo = sigma_start * ratio ** (epoch / num_epochs)
        hi = sigma_start * ratio ** ((epoch + 1) / num_epochs)
    in_epoch = step - epoch * steps_per_epoch
    interval = _interval(in_epoch, steps_per_epoch, num_stages)
    if warmup == "first_epoch" and epoch > 0:
        if num_stages < 2:
            raise ValueError(f"num_stages={num_stages}; a decay without warm-up needs >= 2")
        return lo * (hi / lo) ** (interval / (num_stages - 1))
    return qerl_sigmas(lo, hi, num_stages)[interval]


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
