"""PPO losses with verl's exact semantics (verl/trainer/ppo/core_algos.py).

All token arrays are [N, T] over response tokens; `mask` is the response mask. Aggregation
modes (`agg_loss`): token-mean (verl default: mean over every real token of the batch),
seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm (Dr.GRPO: token sums divided
by a constant, the max response length).

For gradient accumulation the caller passes `denom`: the token (or sequence) count of the
whole mini-batch, so that the sum over micro-batches equals the mini-batch loss exactly.

Policy losses (`POLICY_LOSSES`, chosen by config.algo.policy_loss): `ppo`, verl's clipped
dual-clip surrogate (the default), and `gspo`, GSPO's sequence-level ratio (Zheng et al. 2025,
arXiv 2507.18071; verl `policy_loss.loss_mode=gspo`, TRL `importance_sampling_level="sequence"`).
Each entry is its function and the reader of its own config fields: adding one is writing both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from aqn_jax.registry import Registry

# Aggregation (config.algo.loss_agg_mode): mode -> fn(masked loss_NT, mask_NT, denom) -> loss.
AGG = Registry("config.algo.loss_agg_mode")


@AGG.register("token-mean")
def _token_mean(lm, mask, denom):
    """The mean over every real token of the batch (verl's default)."""
    d = jnp.sum(mask) if denom is None else denom
    return jnp.sum(lm) / jnp.maximum(d, 1.0)


def _seq_mean(per_sequence):
    """The mean over the non-empty sequences of `per_sequence(lm, mask)`, each one's loss."""

    def agg(lm, mask, denom):
        per_seq = per_sequence(lm, mask)
        valid = (jnp.sum(mask, axis=1) > 0).astype(jnp.float32)
        d = jnp.sum(valid) if denom is None else denom
        return jnp.sum(per_seq * valid) / jnp.maximum(d, 1.0)

    return agg


AGG.register(
    "seq-mean-token-mean",
    _seq_mean(lambda lm, m: jnp.sum(lm, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)),
)
AGG.register("seq-mean-token-sum", _seq_mean(lambda lm, m: jnp.sum(lm, axis=1)))
AGG.register("seq-mean-token-sum-norm", _seq_mean(lambda lm, m: jnp.sum(lm, axis=1) / lm.shape[1]))
AGG_MODES = AGG.names()


def agg_loss(loss_NT, mask_NT, mode: str = "token-mean", denom=None):
    """Aggregate per-token losses. `denom` (optional) replaces this batch's own count of tokens
    (token-mean) or sequences (seq-mean-*)."""
    aggregate = AGG.get(mode)
    mask = mask_NT.astype(jnp.float32)
    return aggregate(loss_NT * mask, mask, denom)


def agg_denominator(mask_NT, mode: str):
    """What `agg_loss` divides by: real tokens (token-mean) or non-empty sequences."""
    mask = mask_NT.astype(jnp.float32)
    if mode == "token-mean":
        return jnp.sum(mask)
    return jnp.sum((jnp.sum(mask, axis=1) > 0).astype(jnp.float32))


def _masked_mean(x, mask):
    mask = mask.astype(jnp.float32)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


# -- policy losses: name -> one signature ----------------------------------------------------------
# `loss(logp_NT, old_logp_NT, advantages_NT, mask_NT, *, agg, denom, weights_NT, **settings)
# -> (loss, {pg_clipfrac, pg_clipfrac_lower, ppo_kl})`, with `settings` what the entry's
# `settings` reader returns of config.algo (checked there, before anything compiles: one line
# naming the field).
@dataclasses.dataclass(frozen=True)
class PolicyLossEntry:
    loss: Callable
    settings: Callable  # config.algo -> {keyword of `loss`: value}
    # The config.algo fields `settings` reads: {dotted name: (its default, what it is)}. Another
    # entry's run refuses them away from their defaults: they would do nothing there.
    fields: dict[str, tuple[float, str]]


POLICY_LOSSES: Registry[PolicyLossEntry] = Registry("config.algo.policy_loss")


def register_policy_loss(name: str, settings: Callable, fields: dict[str, tuple[float, str]]):
    """`@register_policy_loss(name, settings, fields)` on the loss function: its entry."""

    def wrap(fn):
        POLICY_LOSSES.register(name, PolicyLossEntry(fn, settings, fields))
        return fn

    return wrap


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """config.algo.policy_loss with its entry's settings, typed (`policy_loss_from`); calling it
    calls the entry's loss with them."""

    name: str
    settings: tuple  # (keyword, value) pairs, sorted

    def __call__(self, logp_NT, old_logp_NT, advantages_NT, mask_NT, **kw):
        entry = POLICY_LOSSES[self.name]
        return entry.loss(logp_NT, old_logp_NT, advantages_NT, mask_NT, **dict(self.settings), **kw)


# GSPO's clip range: the paper's (section 5.1: "the left and right clipping ranges ... 3e-4 and
# 4e-4"), which verl's GSPO recipe (clip_ratio_low=0.0003, clip_ratio_high=0.0004) and TRL's GSPO
# example (epsilon=3e-4, epsilon_high=4e-4) use too. A sequence ratio is a geometric mean of the
# token ratios, so it stays within a few 1e-4 of 1 where PPO's token ratios spread by 0.1s.
GSPO_CLIP = {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}
PPO_CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}


def policy_loss_config(algo) -> None:
    """The policy-loss fields of `config.algo`: the choice and each entry's settings."""
    algo.policy_loss = "ppo"  # ppo | gspo (rl/losses.POLICY_LOSSES)
    algo.clip_ratio_low = PPO_CLIP["clip_ratio_low"]  # PPO ratio clip below 1 (0.2), in [0, 1)
    algo.clip_ratio_high = PPO_CLIP["clip_ratio_high"]  # PPO ratio clip above 1 (0.2; DAPO 0.28)
    algo.clip_ratio_c = PPO_CLIP["clip_ratio_c"]  # PPO's dual-clip, > 1
    algo.gspo = dict(GSPO_CLIP)  # GSPO's sequence-ratio clip range (policy_loss='gspo')


def policy_loss_from(algo) -> PolicyLoss:
    """`config.algo.policy_loss` and its entry's settings, checked (one line naming the field);
    another entry's fields away from their defaults are refused (the run would ignore them)."""
    name = algo.get("policy_loss", "ppo")
    chosen = POLICY_LOSSES.get(name)
    settings = chosen.settings(algo)
    for other, entry in POLICY_LOSSES.items():
        for field, (default, what) in entry.fields.items():
            if field in chosen.fields:
                continue
            value = _field(algo, field, default)
            if not value == default:  # NaN included
                raise ValueError(
                    f"config.algo.{field}={value}: {what}, which config.algo.policy_loss={name!r}"
                    f" does not use; allowed: {default} (the default), or policy_loss={other!r}"
                )
    return PolicyLoss(name, tuple(sorted(settings.items())))


def _field(algo, name: str, default):
    """config.algo's field `name` (dotted: 'gspo.clip_ratio_low'), `default` where absent."""
    *sections, last = name.split(".")
    node = algo
    for section in sections:
        node = node.get(section) or {}
    return node.get(last, default)


def _setting(algo, name: str, default: float, ok, allowed: str) -> float:
    """config.algo's float field `name` (`default` where absent) when `ok(value)` holds, else
    one line naming it; NaN fails every range."""
    value = float(_field(algo, name, default))
    if not ok(value):
        raise ValueError(f"config.algo.{name}={value}; must be {allowed}")
    return value


_PPO_FIELDS = {
    "clip_ratio_low": (PPO_CLIP["clip_ratio_low"], "PPO's ratio clip below 1"),
    "clip_ratio_high": (PPO_CLIP["clip_ratio_high"], "PPO's ratio clip above 1"),
    "clip_ratio_c": (PPO_CLIP["clip_ratio_c"], "PPO's dual clip (GSPO has none)"),
}


def _ppo_settings(algo) -> dict:
    low, high, c = (PPO_CLIP[k] for k in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"))
    return {
        "clip_low": _setting(algo, "clip_ratio_low", low, lambda v: 0 <= v < 1, "in [0, 1)"),
        "clip_high": _setting(
            algo, "clip_ratio_high", high, lambda v: 0 <= v < math.inf, ">= 0 and finite"
        ),
        "clip_ratio_c": _setting(
            algo, "clip_ratio_c", c, lambda v: 1 < v < math.inf, "> 1 and finite (dual-clip)"
        ),
    }


@register_policy_loss("ppo", _ppo_settings, _PPO_FIELDS)
def ppo_loss(
    logp_NT,
    old_logp_NT,
    advantages_NT,
    mask_NT,
    *,
    clip_low: float = PPO_CLIP["clip_ratio_low"],
    clip_high: float = PPO_CLIP["clip_ratio_high"],
    clip_ratio_c: float = PPO_CLIP["clip_ratio_c"],
    agg: str = "token-mean",
    denom=None,
    weights_NT=None,
):
    """Clipped surrogate with dual-clip (verl `compute_policy_loss`, 'vanilla'):

        ratio = exp(clamp(logp - old, -20, 20))
        l1 = -A * ratio;  l2 = -A * clip(ratio, 1 - clip_low, 1 + clip_high)
        clipped = max(l1, l2)
        for A < 0 the loss is also capped at -A * clip_ratio_c (dual-clip): min(clipped, -A*c)

    `weights_NT` (optional, detached): the rollout correction's truncated IS weights; they
    multiply the per-token loss after the clips (verl: `pg_losses * rollout_is_weights`).

    Returns (loss, {pg_clipfrac, pg_clipfrac_lower, ppo_kl}) with the metrics as token means.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"config.algo.clip_ratio_c={clip_ratio_c}; must be > 1 (dual-clip)")
    neg_kl = jnp.clip(logp_NT - old_logp_NT, -20.0, 20.0)
    ratio = jnp.exp(neg_kl)
    ppo_kl = _masked_mean(-neg_kl, mask_NT)
    l1 = -advantages_NT * ratio
    l2 = -advantages_NT * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = jnp.maximum(l1, l2)
    clipfrac = _masked_mean((l2 > l1).astype(jnp.float32), mask_NT)
    l3 = -advantages_NT * clip_ratio_c
    dual = jnp.minimum(l3, clipped)
    clipfrac_lower = _masked_mean(
        ((clipped > l3) & (advantages_NT < 0)).astype(jnp.float32), mask_NT
    )
    losses = jnp.where(advantages_NT < 0, dual, clipped)
    if weights_NT is not None:
        losses = losses * jax.lax.stop_gradient(weights_NT)
    loss = agg_loss(losses, mask_NT, agg, denom)
    return loss, {"pg_clipfrac": clipfrac, "pg_clipfrac_lower": clipfrac_lower, "ppo_kl": ppo_kl}


_GSPO_FIELDS = {
    "gspo.clip_ratio_low": (GSPO_CLIP["clip_ratio_low"], "GSPO's sequence-ratio clip below 1"),
    "gspo.clip_ratio_high": (GSPO_CLIP["clip_ratio_high"], "GSPO's sequence-ratio clip above 1"),
}


def _gspo_settings(algo) -> dict:
    return {
        key: _setting(algo, f"gspo.{field}", GSPO_CLIP[field], lambda v: 0 <= v < 1, "in [0, 1)")
        for field, key in (("clip_ratio_low", "clip_low"), ("clip_ratio_high", "clip_high"))
    }


@register_policy_loss("gspo", _gspo_settings, _GSPO_FIELDS)
def gspo_loss(
    logp_NT,
    old_logp_NT,
    advantages_NT,
    mask_NT,
    *,
    clip_low: float = GSPO_CLIP["clip_ratio_low"],
    clip_high: float = GSPO_CLIP["clip_ratio_high"],
    agg: str = "token-mean",
    denom=None,
    weights_NT=None,
):
    """GSPO-token (arXiv 2507.18071 eq. 7-8; verl `compute_policy_loss_gspo`): one importance
    ratio per sequence, the geometric mean of its token ratios,

        log s_i = sum_t m_it (logp_it - old_it) / max(sum_t m_it, 1)
        log s_it = sg[log s_i] + logp_it - sg[logp_it]   (clamped above at 10, as verl)
        l1 = -A * s_it;  l2 = -A * clip(s_it, 1 - clip_low, 1 + clip_high);  loss = max(l1, l2)

    so every token of a sequence carries s_i's value and its own log-prob's gradient. No
    dual-clip (GSPO has none; pg_clipfrac_lower is 0). `weights_NT` as PPO's (verl multiplies
    them in the same place). The aggregation is config.algo.loss_agg_mode, as the entropy and KL
    terms' (TRL keeps its loss_type with GSPO); verl's GSPO always takes seq-mean-token-mean,
    the paper's 1/G sum_i 1/|y_i| sum_t: set loss_agg_mode='seq-mean-token-mean' for theirs.

    Returns (loss, {pg_clipfrac, pg_clipfrac_lower, ppo_kl}), token means as PPO's."""
    mask = mask_NT.astype(jnp.float32)
    neg_kl = logp_NT - old_logp_NT
    seq = jnp.sum(neg_kl * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    sg = jax.lax.stop_gradient
    log_ratio = jnp.minimum(sg(seq)[:, None] + logp_NT - sg(logp_NT), 10.0)
    ratio = jnp.exp(log_ratio)
    l1 = -advantages_NT * ratio
    l2 = -advantages_NT * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    losses = jnp.maximum(l1, l2)
    if weights_NT is not None:
        losses = losses * sg(weights_NT)
    loss = agg_loss(losses, mask_NT, agg, denom)
    return loss, {
        "pg_clipfrac": _masked_mean((l2 > l1).astype(jnp.float32), mask_NT),
        "pg_clipfrac_lower": jnp.zeros((), jnp.float32),
        "ppo_kl": _masked_mean(-neg_kl, mask_NT),
    }


def _low_var_kl(logp_NT, ref_logp_NT):
    kl = jnp.clip(ref_logp_NT - logp_NT, -20.0, 20.0)
    return jnp.clip(jnp.exp(kl) - kl - 1.0, -10.0, 10.0)


# KL estimators (config.algo.kl_type): fn(logp, ref_logp) -> per-token estimate (verl
# `kl_penalty`).
KL_ESTIMATORS = Registry("config.algo.kl_type")
KL_ESTIMATORS.register("low_var_kl", _low_var_kl)  # k3
KL_ESTIMATORS.register("kl", lambda logp, ref: logp - ref)  # k1
KL_ESTIMATORS.register("mse", lambda logp, ref: 0.5 * jnp.square(logp - ref))  # k2
KL_ESTIMATORS.register("abs", lambda logp, ref: jnp.abs(logp - ref))
KL_TYPES = KL_ESTIMATORS.names()


def kl_penalty(logp_NT, ref_logp_NT, kind: str = "low_var_kl"):
    """Per-token KL estimate of the policy from the reference (verl `kl_penalty`):
    kl (k1): logp - ref; abs: |logp - ref|; mse (k2): 0.5 (logp - ref)^2;
    low_var_kl (k3): exp(ref - logp) - (ref - logp) - 1, with ref - logp clamped to [-20, 20]
    and the result to [-10, 10]."""
    return KL_ESTIMATORS.get(kind)(logp_NT, ref_logp_NT)


def value_loss(
    vpreds_NT,
    old_values_NT,
    returns_NT,
    mask_NT,
    *,
    clip: float = 0.5,
    agg: str = "token-mean",
    denom=None,
):
    """Clipped value loss (verl `compute_value_loss`): 0.5 * agg(max((v - R)^2,
    (clip(v, old - c, old + c) - R)^2)). Returns (loss, {vf_clipfrac})."""
    clipped = jnp.clip(vpreds_NT, old_values_NT - clip, old_values_NT + clip)
    l1 = jnp.square(vpreds_NT - returns_NT)
    l2 = jnp.square(clipped - returns_NT)
    loss = 0.5 * agg_loss(jnp.maximum(l1, l2), mask_NT, agg, denom)
    return loss, {"vf_clipfrac": _masked_mean((l2 > l1).astype(jnp.float32), mask_NT)}
