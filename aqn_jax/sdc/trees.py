"""Bit faults on the gradients and the AdamW moments, as optax wrappers around the
actor's optimizer, and the moments' range check of the guard.

The wrappers take the step's traced values whole (`values=`, the dict every program of the step
reads: `telemetry.step_values`): the RL step (`bitfaults.SDC_STEP`) and the guard's attempt
(`SDC_ATTEMPT`, 0 when absent) key the draw and gate a fault's `steps`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from aqn_jax.faults.bitfaults import SDC_ATTEMPT, SDC_STEP


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


def _apply_tree_faults(faults, tree, state, values: Mapping[str, Any], prefix: str):
    """(tree, flips) with each (TreeBits, SiteSelector) of `faults` applied, keyed by (seed,
    step, attempt, update count, fault index, leaf path)."""
    key = jax.random.wrap_key_data(state.key)
    for v in (values[SDC_STEP], values.get(SDC_ATTEMPT, 0), state.count):
        key = jax.random.fold_in(key, jnp.asarray(v, jnp.int32))
    flips = jnp.zeros((), jnp.int32)
    for i, (fault, sites) in enumerate(faults):
        tree, f = fault.apply(tree, sites, jax.random.fold_in(key, i), values, tag=prefix)
        flips = flips + f
    return tree, flips


def gradient_faults(faults: Sequence, seed: int) -> optax.GradientTransformationExtraArgs:
    """Bit faults (`bitfaults.TreeBits` with their `SiteSelector`s) on the gradients, between
    the micro-batch gradients and the optimizer's update: the first element of the chain (so
    before clipping, as a corrupted backward would reach it). Extra arg `values`: the step's
    traced values (the RL step and the guard's attempt key the draw and gate `steps`)."""

    def init(params):
        del params
        return GradientFaultState(*_tree_fault_state(seed, 0x6AD), jnp.zeros((), jnp.float32))

    def update(updates, state, params=None, *, values, **extra):
        del params, extra
        updates, flips = _apply_tree_faults(faults, updates, state, values, "g/")
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

    def update(updates, state, params=None, *, values, **extra):
        own, inner_state = state
        updates, inner_state = inner.update(updates, inner_state, params, values=values, **extra)
        total = jnp.zeros((), jnp.int32)

        def corrupt(tree, which):
            nonlocal total
            tree, flips = _apply_tree_faults(faults, tree, own, values, which)
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
    `opt` itself when both are empty (the program is then unchanged). Its `update` then takes
    the step's traced values: `update(g, state, params, values=values)`."""
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
