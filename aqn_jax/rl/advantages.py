"""Advantage estimators with verl's exact semantics (verl/trainer/ppo/core_algos.py).

Rows are responses; a prompt's n samples are consecutive rows (the sampler repeats each prompt
n times), so group g is rows [g*n, (g+1)*n). Token arrays are [N, T] over the response tokens
with `response_mask` 1 on real tokens (EOS included).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from aqn_jax.registry import Registry


def grpo_outcome_advantage(
    scores_N: jax.Array,
    response_mask_NT: jax.Array,
    n: int,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> jax.Array:
    """GRPO: per group, (score - mean) / (std + eps) with the unbiased std (ddof 1); a group of
    one has mean 0 and std 1 (verl). `norm_by_std=False` is Dr.GRPO (mean-centred only).
    Returns the advantage broadcast over each response's tokens, [N, T] (0 off the mask).

    A silent group (all n scores equal, `silent_groups`) gets exactly 0: the mean of equal
    values need not round to them (under jit a division by 5 becomes a product by 0.2), and
    divided by a std of the same order the residue would become a push of about 0.015."""
    scores = scores_N.astype(jnp.float32).reshape(-1, n)
    if n == 1:
        mean, std = jnp.zeros_like(scores), jnp.ones_like(scores)
    else:
        mean = jnp.mean(scores, axis=1, keepdims=True)
        std = jnp.std(scores, axis=1, keepdims=True, ddof=1)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    if n > 1:
        adv = jnp.where(silent_groups(scores_N, n)[:, None], 0.0, adv)
    return adv.reshape(-1, 1) * response_mask_NT.astype(jnp.float32)


def silent_groups(scores_N: jax.Array, n: int) -> jax.Array:
    """[N // n] bool: the groups whose n scores are all equal (exact comparisons, no
    arithmetic): no advantage, no gradient. A group of one is never silent (verl gives it its
    score as the advantage)."""
    scores = jnp.asarray(scores_N, jnp.float32).reshape(-1, n)
    if n == 1:
        return jnp.zeros(scores.shape[0], bool)
    return jnp.all(scores == scores[:, :1], axis=1)


def token_level_rewards(
    scores_N: jax.Array,
    response_mask_NT: jax.Array,
    kl_NT: jax.Array | None = None,
    kl_coef: float = 0.0,
) -> jax.Array:
    """The outcome score on each response's last real token, minus `kl_coef * kl` per token
    when the KL penalty is in the reward (verl `apply_kl_penalty`)."""
    mask = response_mask_NT.astype(jnp.float32)
    T = mask.shape[1]
    last = jnp.maximum(jnp.sum(mask, axis=1).astype(jnp.int32) - 1, 0)
    rewards = jax.nn.one_hot(last, T, dtype=jnp.float32) * scores_N.astype(jnp.float32)[:, None]
    rewards = rewards * mask
    if kl_NT is not None and kl_coef:
        rewards = rewards - kl_coef * kl_NT * mask
    return rewards


def masked_mean(x, mask, axis=None):
    mask = mask.astype(jnp.float32)
    return jnp.sum(x * mask, axis=axis) / jnp.maximum(jnp.sum(mask, axis=axis), 1e-8)


def masked_whiten(x, mask, eps: float = 1e-8):
    """verl `masked_whiten` (shift_mean=True): (x - mean) / sqrt(var + eps), var unbiased."""
    mask = mask.astype(jnp.float32)
    mean = masked_mean(x, mask)
    count = jnp.sum(mask)
    var = masked_mean(jnp.square(x - mean), mask) * count / jnp.maximum(count - 1.0, 1.0)
    return (x - mean) * jax.lax.rsqrt(var + eps)


def gae_advantage_return(
    rewards_NT: jax.Array,
    values_NT: jax.Array,
    response_mask_NT: jax.Array,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """GAE over the response tokens, backwards in time (verl `compute_gae_advantage_return`):

        delta_t   = r_t + gamma * V_next - V_t
        A_t       = delta_t + gamma * lam * A_next
        V_next, A_next carry over masked tokens unchanged (they are skipped),

    with V_next = A_next = 0 after the last token; returns = A + V (before whitening), and the
    advantages are whitened over the batch's real tokens. Returns (advantages, returns)."""
    mask = response_mask_NT.astype(jnp.float32)
    r = rewards_NT.astype(jnp.float32)
    v = values_NT.astype(jnp.float32)

    def step(carry, xs):
        next_value, last_gae = carry
        r_t, v_t, m_t = xs
        delta = r_t + gamma * next_value - v_t
        gae = delta + gamma * lam * last_gae
        next_value = v_t * m_t + (1 - m_t) * next_value
        last_gae = gae * m_t + (1 - m_t) * last_gae
        return (next_value, last_gae), last_gae

    zeros = jnp.zeros(r.shape[0], jnp.float32)
    _, adv_TN = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, mask.T), reverse=True)
    adv = adv_TN.T
    returns = adv + v
    return masked_whiten(adv, mask) * mask, returns * mask


# -- the estimators (config.algo.estimator): name -> one signature ------------------------------
# `estimate(token_rewards_NT, values_NT, response_mask_NT, h) -> (advantages_NT, returns_NT)`,
# with `values_NT` the critic's (None without one), `returns_NT` None for an outcome estimator,
# and `h` the step's hyper-parameters (`rl.step.Hyper`: n, gamma, lam), the settings it reads.
@dataclasses.dataclass(frozen=True)
class Estimator:
    estimate: Callable
    critic: bool  # needs a value model (its params, optimizer and forward pass)
    grouped: bool  # compares a prompt's n samples: needs rollout.n >= 2


ESTIMATORS: Registry[Estimator] = Registry("config.algo.estimator")


def register_estimator(name: str, *, critic: bool, grouped: bool):
    """`@register_estimator(name, critic=..., grouped=...)` on the estimate function."""

    def wrap(fn):
        ESTIMATORS.register(name, Estimator(fn, critic=critic, grouped=grouped))
        return fn

    return wrap


def _outcome(norm_by_std: bool):
    def estimate(rewards_NT, values_NT, mask_NT, h):
        # The outcome: the score plus the KL-in-reward term, if any, summed per response.
        seq = jnp.sum(rewards_NT, axis=1)
        return grpo_outcome_advantage(seq, mask_NT, h.n, norm_by_std=norm_by_std), None

    return estimate


register_estimator("grpo", critic=False, grouped=True)(_outcome(norm_by_std=True))
register_estimator("drgrpo", critic=False, grouped=True)(_outcome(norm_by_std=False))


@register_estimator("gae", critic=True, grouped=False)  # PPO with a critic
def _gae(rewards_NT, values_NT, mask_NT, h):
    return gae_advantage_return(rewards_NT, values_NT, mask_NT, h.gamma, h.lam)
