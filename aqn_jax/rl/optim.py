"""AdamW with global-norm clipping and a warmup/constant/cosine learning-rate schedule.

One builder for the SFT warm start and the RL actor and critic, so every optimizer in the
project is configured the same way and validated with the field's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from aqn_jax.faults.bitfaults import SDC_ATTEMPT, SDC_BIT, SDC_STEP

LR_SCHEDULES = ("constant", "warmup_constant", "cosine")


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
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"{field}.schedule={schedule!r}; allowed: {LR_SCHEDULES}")
    if lr < 0:
        raise ValueError(f"{field}.lr={lr}; must be >= 0")
    if warmup_steps < 0:
        raise ValueError(f"{field}.warmup_steps={warmup_steps}; must be >= 0")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"{field}.min_lr_ratio={min_lr_ratio}; must be in [0, 1]")
    if schedule == "constant":
        return optax.constant_schedule(lr)
    warmup = max(int(warmup_steps), 0)
    if schedule == "warmup_constant":
        if warmup == 0:
            return optax.constant_schedule(lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
        )
    decay = max(int(total_steps) - warmup, 1)
    return (
        optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup, warmup + decay, end_value=lr * min_lr_ratio
        )
        if warmup > 0
        else optax.cosine_decay_schedule(lr, decay, alpha=min_lr_ratio)
    )


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


# -- bit faults on the gradients and the AdamW moments (issue 44) ----------------------------------
class TreeFaultState(NamedTuple):
    """The state of a tree fault: its key (raw key data of the run's seed, as `optax.add_noise`
    holds its own), the updates it has seen and the bits it has changed in all (int32)."""

    key: jax.Array
    count: jax.Array
    flips: jax.Array


class GradientFaultState(NamedTuple):
    """`TreeFaultState` of the gradient faults, with the global norm of the gradient as they
    left it (what the optimizer received: the guard watches it)."""

    key: jax.Array
    count: jax.Array
    flips: jax.Array
    norm: jax.Array


def _tree_fault_state(seed: int, tag: int) -> TreeFaultState:
    key = jax.random.key_data(jax.random.fold_in(jax.random.key(seed), tag))
    zero = jnp.zeros((), jnp.int32)
    return TreeFaultState(key, zero, zero)


def _apply_tree_faults(faults, tree, state, sdc_step, sdc_attempt, prefix: str, sdc_bit=0):
    """(tree, flips) with each (TreeBits, SiteSelector) of `faults` applied, keyed by (seed,
    step, attempt, update count, fault index, leaf path)."""
    key = jax.random.wrap_key_data(state.key)
    for v in (sdc_step, sdc_attempt, state.count):
        key = jax.random.fold_in(key, jnp.asarray(v, jnp.int32))
    values = {SDC_STEP: sdc_step, SDC_ATTEMPT: sdc_attempt, SDC_BIT: sdc_bit}
    values = {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}
    flips = jnp.zeros((), jnp.int32)
    for i, (fault, sites) in enumerate(faults):
        tree, f = fault.apply(tree, sites, jax.random.fold_in(key, i), values, tag=prefix)
        flips = flips + f
    return tree, flips


def gradient_faults(faults: Sequence, seed: int) -> optax.GradientTransformationExtraArgs:
    """Bit faults (`bitfaults.TreeBits` with their `SiteSelector`s) on the gradients, between
    the micro-batch gradients and the optimizer's update: the first element of the chain (so
    before clipping, as a corrupted backward would reach it). Extra args `sdc_step` and
    `sdc_attempt` (the RL step and the guard's attempt) key the draw and gate `steps`."""

    def init(params):
        del params
        return GradientFaultState(*_tree_fault_state(seed, 0x6AD), jnp.zeros((), jnp.float32))

    def update(updates, state, params=None, *, sdc_step=0, sdc_attempt=0, sdc_bit=0, **extra):
        del params, extra
        updates, flips = _apply_tree_faults(
            faults, updates, state, sdc_step, sdc_attempt, "g/", sdc_bit
        )
        norm = optax.tree.norm(updates).astype(jnp.float32)
        return updates, state._replace(count=state.count + 1, flips=state.flips + flips, norm=norm)

    return optax.GradientTransformationExtraArgs(init, update)


def _map_adam(opt_state, fn):
    """opt_state with every `ScaleByAdamState`'s mu and nu replaced by fn(tree, 'mu' | 'nu')."""

    def visit(s):
        if isinstance(s, optax.ScaleByAdamState):
            return s._replace(mu=fn(s.mu, "mu"), nu=fn(s.nu, "nu"))
        return s

    is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
    return jax.tree_util.tree_map(visit, opt_state, is_leaf=is_adam)


def moment_faults(
    inner: optax.GradientTransformation, faults: Sequence, seed: int
) -> optax.GradientTransformationExtraArgs:
    """`inner` (AdamW) whose stored moments (mu and nu, selected by param path) get the bit
    faults after each update: the optimizer-state hook. The corruption is in memory, so the
    next update reads it."""
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return _tree_fault_state(seed, 0x0A7), inner.init(params)

    def update(updates, state, params=None, *, sdc_step=0, sdc_attempt=0, sdc_bit=0, **extra):
        own, inner_state = state
        sdc = dict(sdc_step=sdc_step, sdc_attempt=sdc_attempt, sdc_bit=sdc_bit)
        updates, inner_state = inner.update(updates, inner_state, params, **sdc, **extra)
        total = jnp.zeros((), jnp.int32)

        def corrupt(tree, which):
            nonlocal total
            tree, flips = _apply_tree_faults(
                faults, tree, own, sdc_step, sdc_attempt, which, sdc_bit
            )
            total = total + flips
            return tree

        inner_state = _map_adam(inner_state, corrupt)
        own = own._replace(count=own.count + 1, flips=own.flips + total)
        return updates, (own, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def with_tree_faults(
    opt: optax.GradientTransformation, gradient: Sequence, moments: Sequence, seed: int
) -> optax.GradientTransformation:
    """`opt` with the gradient faults in front of its chain and the moment faults on its state;
    `opt` itself when both are empty (the program is then unchanged)."""
    if gradient:
        opt = optax.chain(gradient_faults(gradient, seed), opt)
    if moments:
        opt = moment_faults(opt, moments, seed)
    return opt


def tree_fault_flips(opt_state) -> jax.Array:
    """The bits the tree faults in `opt_state` have changed so far (0 without any)."""
    found = [s.flips for s in _fault_states(opt_state)]
    return sum(found, jnp.zeros((), jnp.int32))


def _fault_states(opt_state) -> list:
    is_state = lambda s: isinstance(s, (TreeFaultState, GradientFaultState))  # noqa: E731
    return [s for s in jax.tree_util.tree_leaves(opt_state, is_leaf=is_state) if is_state(s)]


def faulty_grad_norm(opt_state) -> jax.Array | None:
    """The global norm of the gradient the last update received after the gradient faults
    (None without them)."""
    found = [s.norm for s in _fault_states(opt_state) if isinstance(s, GradientFaultState)]
    return found[0] if found else None


def moment_bound(grad_clip: float, total_updates: int) -> float | None:
    """The largest |mu| (and nu / grad_clip) AdamW can hold after global-norm clipping at
    `grad_clip`: each clipped gradient has |g_i| <= ||g|| <= c, mu is a convex combination of
    them (|mu| <= c), nu of their squares (0 <= nu <= c^2). Each float32 update rounds by at
    most 3 units (2^-24) relative, so after T updates the bound is c (1 + 3 2^-24 T). None
    without clipping (no bound follows)."""
    if not grad_clip or grad_clip <= 0:
        return None
    return float(grad_clip) * (1.0 + 3 * 2.0**-24 * max(int(total_updates), 1))


def moments_in_range(opt_state, bound: float) -> jax.Array:
    """Whether every AdamW moment is finite with |mu| <= bound and 0 <= nu <= bound^2
    (`moment_bound`): the guard's range check."""
    ok = jnp.bool_(True)
    is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
    for s in jax.tree_util.tree_leaves(opt_state, is_leaf=is_adam):
        if not is_adam(s):
            continue
        for m in jax.tree_util.tree_leaves(s.mu):
            ok = ok & jnp.all(jnp.abs(m) <= bound)  # NaN compares False
        for v in jax.tree_util.tree_leaves(s.nu):
            ok = ok & jnp.all((v >= 0) & (v <= bound * bound))
    return ok
