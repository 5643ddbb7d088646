"""PPO losses with verl's exact semantics (verl/trainer/ppo/core_algos.py).

All token arrays are [N, T] over response tokens; `mask` is the response mask. Aggregation
modes (`agg_loss`): token-mean (verl default: mean over every real token of the batch),
seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm (Dr.GRPO: token sums divided
by a constant, the max response length).

For gradient accumulation the caller passes `denom`: the token (or sequence) count of the
whole mini-batch, so that the sum over micro-batches equals the mini-batch loss exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Aggregation: mode -> the per-sequence loss (token sums or means) of the seq-mean-* modes;
# token-mean averages over every real token instead (None here).
_PER_SEQUENCE = {
    "token-mean": None,
    "seq-mean-token-mean": lambda lm, m: jnp.sum(lm, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0),
    "seq-mean-token-sum": lambda lm, m: jnp.sum(lm, axis=1),
    "seq-mean-token-sum-norm": lambda lm, m: jnp.sum(lm, axis=1) / lm.shape[1],
}
AGG_MODES = tuple(_PER_SEQUENCE)


def agg_loss(loss_NT, mask_NT, mode: str = "token-mean", denom=None):
    """Aggregate per-token losses. `denom` (optional) replaces this batch's own count of tokens
    (token-mean) or sequences (seq-mean-*)."""
    if mode not in _PER_SEQUENCE:
        raise ValueError(f"loss_agg_mode={mode!r}; allowed: {AGG_MODES}")
    mask = mask_NT.astype(jnp.float32)
    per_sequence = _PER_SEQUENCE[mode]
    if per_sequence is None:
        d = jnp.sum(mask) if denom is None else denom
        return jnp.sum(loss_NT * mask) / jnp.maximum(d, 1.0)
    per_seq = per_sequence(loss_NT * mask, mask)
    valid = (jnp.sum(mask, axis=1) > 0).astype(jnp.float32)
    d = jnp.sum(valid) if denom is None else denom
    return jnp.sum(per_seq * valid) / jnp.maximum(d, 1.0)


def agg_denominator(mask_NT, mode: str):
    """What `agg_loss` divides by: real tokens (token-mean) or non-empty sequences."""
    mask = mask_NT.astype(jnp.float32)
    if mode == "token-mean":
        return jnp.sum(mask)
    return jnp.sum((jnp.sum(mask, axis=1) > 0).astype(jnp.float32))


def _masked_mean(x, mask):
    mask = mask.astype(jnp.float32)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def policy_loss(
    logp_NT,
    old_logp_NT,
    advantages_NT,
    mask_NT,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float = 3.0,
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


def _low_var_kl(logp_NT, ref_logp_NT):
    kl = jnp.clip(ref_logp_NT - logp_NT, -20.0, 20.0)
    return jnp.clip(jnp.exp(kl) - kl - 1.0, -10.0, 10.0)


# KL estimator: kl_type -> fn(logp, ref_logp) -> per-token estimate (verl `kl_penalty`).
KL_ESTIMATORS = {
    "low_var_kl": _low_var_kl,  # k3
    "kl": lambda logp, ref: logp - ref,  # k1
    "mse": lambda logp, ref: 0.5 * jnp.square(logp - ref),  # k2
    "abs": lambda logp, ref: jnp.abs(logp - ref),
}
KL_TYPES = tuple(KL_ESTIMATORS)


def kl_penalty(logp_NT, ref_logp_NT, kind: str = "low_var_kl"):
    """Per-token KL estimate of the policy from the reference (verl `kl_penalty`):
    kl (k1): logp - ref; abs: |logp - ref|; mse (k2): 0.5 (logp - ref)^2;
    low_var_kl (k3): exp(ref - logp) - (ref - logp) - 1, with ref - logp clamped to [-20, 20]
    and the result to [-10, 10]."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"config.algo.kl_type={kind!r}; allowed: {KL_TYPES}")
    return KL_ESTIMATORS[kind](logp_NT, ref_logp_NT)


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
