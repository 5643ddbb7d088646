"""AdamW with global-norm clipping and a warmup/constant/cosine learning-rate schedule.

One builder for the SFT warm start and the RL actor and critic, so every optimizer in the
project is configured the same way and validated with the field's name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from aqn_jax.registry import Registry

# Learning-rate schedules (the `schedule` field of config.actor / config.critic / config.sft):
# fn(lr, total_steps, warmup, min_lr_ratio) -> optax schedule.
LR_SCHEDULES = Registry("config.actor.schedule")


@LR_SCHEDULES.register("constant")
def _constant(lr, total_steps, warmup, min_lr_ratio):
    """`lr` throughout (the warmup ignored)."""
    return optax.constant_schedule(lr)


@LR_SCHEDULES.register("warmup_constant")
def _warmup_constant(lr, total_steps, warmup, min_lr_ratio):
    """Linear warmup from 0, then `lr` (verl's default actor schedule)."""
    if warmup == 0:
        return optax.constant_schedule(lr)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
    )


@LR_SCHEDULES.register("cosine")
def _cosine(lr, total_steps, warmup, min_lr_ratio):
    """Linear warmup from 0, then cosine down to `min_lr_ratio * lr` at `total_steps`."""
    decay = max(int(total_steps) - warmup, 1)
    return (
        optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup, warmup + decay, end_value=lr * min_lr_ratio
        )
        if warmup > 0
        else optax.cosine_decay_schedule(lr, decay, alpha=min_lr_ratio)
    )


def lr_schedule(
    lr: float,
    total_steps: int,
    *,
    warmup_steps: int = 0,
    schedule: str = "constant",
    min_lr_ratio: float = 0.0,
    field: str = "optim",
) -> optax.Schedule:
    """Linear warmup over `warmup_steps` (from 0), then constant or cosine down to
    `min_lr_ratio * lr` at `total_steps`. 'constant' ignores the warmup; 'warmup_constant' is
    verl's default actor schedule (lr_warmup_steps then constant)."""
    make = LR_SCHEDULES.get(schedule, f"{field}.schedule")
    if lr < 0:
        raise ValueError(f"{field}.lr={lr}; must be >= 0")
    if warmup_steps < 0:
        raise ValueError(f"{field}.warmup_steps={warmup_steps}; must be >= 0")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"{field}.min_lr_ratio={min_lr_ratio}; must be in [0, 1]")
    return make(lr, total_steps, max(int(warmup_steps), 0), min_lr_ratio)


def adamw(
    schedule: optax.ScalarOrSchedule,
    *,
    weight_decay: float = 0.01,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    grad_clip: float = 1.0,
    field: str = "optim",
) -> optax.GradientTransformation:
    """optax AdamW (decoupled weight decay, torch defaults) at the learning rate `schedule`
    (`lr_schedule`), after global-norm clipping (`grad_clip` <= 0 disables it), as verl's FSDP
    actor (clip 1.0, wd 0.01)."""
    if weight_decay < 0:
        raise ValueError(f"{field}.weight_decay={weight_decay}; must be >= 0")
    parts = []
    if grad_clip and grad_clip > 0:
        parts.append(optax.clip_by_global_norm(grad_clip))
    parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return optax.chain(*parts)


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer section (config.actor / config.critic), typed (`OptimizerSpec.of`);
    `build` makes its (schedule, AdamW)."""

    lr: float
    schedule: str  # LR_SCHEDULES
    warmup_steps: int  # RL steps
    weight_decay: float
    grad_clip: float
    field: str  # the section as errors name it, e.g. 'config.actor'

    @classmethod
    def of(cls, section: Any, warmup_field: str, field: str) -> OptimizerSpec:
        """From a config section (lr, schedule, weight_decay, grad_clip and `warmup_field`)."""
        return cls(
            lr=float(section.lr),
            schedule=section.schedule,
            warmup_steps=int(section[warmup_field]),
            weight_decay=float(section.weight_decay),
            grad_clip=float(section.grad_clip),
            field=field,
        )

    def build(
        self, total_updates: int, per_step: int
    ) -> tuple[optax.Schedule, optax.GradientTransformation]:
        """(schedule, AdamW), the schedule counted in optimizer updates (`per_step` of them per
        RL step); raises naming the field."""
        schedule = lr_schedule(
            self.lr,
            total_updates,
            warmup_steps=self.warmup_steps * per_step,
            schedule=self.schedule,
            field=self.field,
        )
        opt = adamw(
            schedule, weight_decay=self.weight_decay, grad_clip=self.grad_clip, field=self.field
        )
        return schedule, opt


def check_optimizer(section, warmup_field: str, field: str) -> None:
    """A config section's optimizer (config.actor / config.critic) before anything compiles:
    `OptimizerSpec.build`'s checks, and a learning rate > 0 (at 0 every update leaves the
    weights as they are: a run would go to its end and learn nothing)."""
    if not float(section.lr) > 0:
        raise ValueError(f"{field}.lr={section.lr}; must be > 0 (at 0 nothing is learned)")
    OptimizerSpec.of(section, warmup_field, field).build(1, 1)
