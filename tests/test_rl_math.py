"""Advantages and PPO losses against hand computations (derivations in the comments)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqn_jax.logprobs import logprobs_from_logits
from aqn_jax.rl import advantages as A
from aqn_jax.rl import losses as L


def test_grpo_hand_computed():
    # Group 1 scores [1, 0, 0, 1, 1]: mean 0.6, deviations [.4, -.6, -.6, .4, .4],
    # unbiased var = (3 * .16 + 2 * .36) / 4 = 0.3, std = sqrt(0.3).
    # Group 2 all zero: std 0 -> advantage 0 / (0 + 1e-6) = 0.
    scores = jnp.array([1, 0, 0, 1, 1, 0, 0, 0, 0, 0], jnp.float32)
    mask = jnp.ones((10, 3)).at[1, 2].set(0)
    adv = np.asarray(A.grpo_outcome_advantage(scores, mask, 5))
    std = math.sqrt(0.3)
    expect = np.array([0.4, -0.6, -0.6, 0.4, 0.4]) / (std + 1e-6)
    np.testing.assert_allclose(adv[:5, 0], expect, rtol=1e-6)
    np.testing.assert_allclose(adv[5:], 0.0)
    assert adv[1, 2] == 0.0 and adv[1, 1] == pytest.approx(expect[1], rel=1e-6)
    # Dr.GRPO: mean-centred only.
    adv = np.asarray(A.grpo_outcome_advantage(scores, mask, 5, norm_by_std=False))
    np.testing.assert_allclose(adv[:5, 0], [0.4, -0.6, -0.6, 0.4, 0.4], rtol=1e-6)
    # A group of one: mean 0, std 1 (verl) -> the score itself (up to the 1e-6 eps).
    adv = np.asarray(A.grpo_outcome_advantage(jnp.array([0.7, 0.2]), jnp.ones((2, 1)), 1))
    np.testing.assert_allclose(adv[:, 0], np.array([0.7, 0.2]) / (1 + 1e-6), rtol=1e-7)


def test_token_level_rewards():
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]])
    r = np.asarray(A.token_level_rewards(jnp.array([2.0, 3.0]), mask))
    np.testing.assert_array_equal(r, [[0, 0, 2, 0], [3, 0, 0, 0]])
    kl = jnp.full((2, 4), 0.5)
    r = np.asarray(A.token_level_rewards(jnp.array([2.0, 3.0]), mask, kl, 0.1))
    np.testing.assert_allclose(r, [[-0.05, -0.05, 1.95, 0], [2.95, 0, 0, 0]], rtol=1e-6)


def test_gae_hand_computed():
    # Row 0: mask [1, 1, 0], rewards [0, 1, 0], values [0.5, 0.2, 9 (masked)].
    # gamma = lam = 1, backwards: t=2 masked -> carries (V_next 0, A_next 0) unchanged;
    # t=1: delta = 1 + 0 - 0.2 = 0.8, A_1 = 0.8; t=0: delta = 0 + 0.2 - 0.5 = -0.3,
    # A_0 = -0.3 + 0.8 = 0.5. Returns = A + V = [1.0, 1.0].
    # Row 1: mask [1, 0, 0], reward [2], value [1.5]: A = 2 - 1.5 = 0.5, return 2.0.
    rewards = jnp.array([[0, 1, 0], [2, 0, 0]], jnp.float32)
    values = jnp.array([[0.5, 0.2, 9.0], [1.5, 7.0, 7.0]], jnp.float32)
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    adv, ret = A.gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    np.testing.assert_allclose(np.asarray(ret), [[1.0, 1.0, 0], [2.0, 0, 0]], rtol=1e-6)
    raw = np.array([0.5, 0.8, 0.5])  # the real tokens' advantages before whitening
    white = (raw - raw.mean()) / np.sqrt(raw.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(np.asarray(adv)[mask > 0], white, rtol=1e-5)
    # gamma 0.9, lam 0.5, row 0: A_1 = 0.8; A_0 = (0 + 0.9 * 0.2 - 0.5) + 0.45 * 0.8 = 0.04.
    _, ret = A.gae_advantage_return(rewards, values, mask, 0.9, 0.5)
    np.testing.assert_allclose(np.asarray(ret)[0, :2], [0.54, 1.0], rtol=1e-5)


def test_policy_loss_hand_computed():
    # Four tokens, clip 0.2, dual-clip c = 3:
    #  1: ratio 1.5, A +1: l1 -1.5, l2 -1.2 -> max -1.2 (clipped: l2 > l1)
    #  2: ratio 0.5, A +1: l1 -0.5, l2 -0.8 -> -0.5
    #  3: ratio 5.0, A -1: l1 5, l2 1.2 -> 5, dual-clip min(5, 3) = 3 (lower clip)
    #  4: ratio 1.0, A -2: l1 = l2 = 2 -> min(2, 6) = 2
    # token-mean: (-1.2 - 0.5 + 3 + 2) / 4 = 0.825
    old = jnp.zeros((1, 4))
    logp = jnp.log(jnp.array([[1.5, 0.5, 5.0, 1.0]]))
    adv = jnp.array([[1.0, 1.0, -1.0, -2.0]])
    mask = jnp.ones((1, 4))
    loss, m = L.ppo_loss(logp, old, adv, mask)
    assert float(loss) == pytest.approx(0.825, rel=1e-6)
    assert float(m["pg_clipfrac"]) == pytest.approx(0.25)
    assert float(m["pg_clipfrac_lower"]) == pytest.approx(0.25)
    expect_kl = -(math.log(1.5) + math.log(0.5) + math.log(5.0)) / 4
    assert float(m["ppo_kl"]) == pytest.approx(expect_kl, rel=1e-6)
    # Masked tokens do not count: masking token 3 -> (-1.2 - 0.5 + 2) / 3.
    loss, _ = L.ppo_loss(logp, old, adv, jnp.array([[1, 1, 0, 1]]))
    assert float(loss) == pytest.approx(0.3 / 3, rel=1e-5)
    # clip_high 0.28 (DAPO's clip-higher): token 1 -> -1.28.
    loss, _ = L.ppo_loss(logp, old, adv, mask, clip_high=0.28)
    assert float(loss) == pytest.approx((-1.28 - 0.5 + 3 + 2) / 4, rel=1e-6)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        L.ppo_loss(logp, old, adv, mask, clip_ratio_c=1.0)


def test_gspo_loss_hand_computed():
    # Two sequences, old log-probs 0, GSPO's clip range [1 - 3e-4, 1 + 4e-4]:
    #  row 0 (A +1): token ratios 1.2, 0.9 and a masked slot (log-prob 5, left out of the mean):
    #    log s_0 = (ln 1.2 + ln 0.9) / 2 -> s_0 = sqrt(1.08) = 1.03923; l1 = -1.03923,
    #    l2 = -1.0004 -> max -1.0004 on both tokens (clipped);
    #  row 1 (A -2): token log-ratios 0.5, -0.5, 0 -> log s_1 = 0, s_1 = 1: l1 = l2 = 2 on all 3.
    # token-mean: (2 * -1.0004 + 3 * 2) / 5 = 0.79984; seq-mean-token-mean: (-1.0004 + 2) / 2.
    # clipfrac: row 0's 2 tokens of 5; ppo_kl: -(ln 1.2 + ln 0.9) / 5 (token means, as PPO's).
    # Gradient in logp: row 0 clipped -> 0; row 1: d(-A * s_1t)/d logp_t = -A * s_1 = 2 per token
    # (the stop-gradient keeps the sequence mean's 1/|y| out), over 5 tokens -> 0.4 each.
    old = jnp.zeros((2, 3))
    logp = jnp.array([[math.log(1.2), math.log(0.9), 5.0], [0.5, -0.5, 0.0]])
    adv = jnp.array([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = jnp.array([[1, 1, 0], [1, 1, 1]])
    loss, m = L.gspo_loss(logp, old, adv, mask)
    assert float(loss) == pytest.approx((2 * -1.0004 + 6) / 5, rel=1e-6)
    assert float(m["pg_clipfrac"]) == pytest.approx(0.4)
    assert float(m["pg_clipfrac_lower"]) == 0.0
    assert float(m["ppo_kl"]) == pytest.approx(-math.log(1.08) / 5, rel=1e-6)
    seq, _ = L.gspo_loss(logp, old, adv, mask, agg="seq-mean-token-mean")
    assert float(seq) == pytest.approx((-1.0004 + 2) / 2, rel=1e-6)
    grad = jax.grad(lambda lp: L.gspo_loss(lp, old, adv, mask)[0])(logp)
    np.testing.assert_allclose(np.asarray(grad), [[0, 0, 0], [0.4, 0.4, 0.4]], atol=1e-7)
    # Through the registry with config.algo's default settings: the same numbers.
    spec = L.policy_loss_from({"policy_loss": "gspo", "gspo": dict(L.GSPO_CLIP)})
    assert spec.settings == (("clip_high", 4e-4), ("clip_low", 3e-4))
    assert float(spec(logp, old, adv, mask)[0]) == float(loss)
    # Negative controls: the token-level ratio at the same clip range (PPO's loss) gives
    # (-1.0004 - 0.9 + 2 e^0.5 + 2 * 0.9997 + 2) / 5 = 1.0793, and a wider range leaves row 0
    # unclipped: (2 * -1.03923 + 6) / 5.
    token, _ = L.ppo_loss(logp, old, adv, mask, clip_low=3e-4, clip_high=4e-4)
    expect = (-1.0004 - 0.9 + 2 * math.exp(0.5) + 2 * 0.9997 + 2) / 5
    assert float(token) == pytest.approx(expect, rel=1e-6)
    assert float(token) != pytest.approx(float(loss), rel=1e-2)
    wide, _ = L.gspo_loss(logp, old, adv, mask, clip_high=0.2)
    assert float(wide) == pytest.approx((2 * -math.sqrt(1.08) + 6) / 5, rel=1e-6)


def test_policy_loss_registry():
    """config.algo.policy_loss picks the entry; ppo (the default) reads PPO's fields as before;
    a bad name or setting is one line naming the field."""
    algo = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    spec = L.policy_loss_from(algo)
    settings = (("clip_high", 0.28), ("clip_low", 0.2), ("clip_ratio_c", 3.0))
    assert spec == L.PolicyLoss("ppo", settings)
    logp = jnp.log(jnp.array([[1.5, 0.5, 5.0, 1.0]]))
    args = (logp, jnp.zeros((1, 4)), jnp.array([[1.0, 1.0, -1.0, -2.0]]), jnp.ones((1, 4)))
    assert float(spec(*args)[0]) == float(L.ppo_loss(*args, clip_high=0.28)[0])
    with pytest.raises(ValueError) as e:
        L.policy_loss_from({**algo, "policy_loss": "grpo"})
    assert str(e.value) == f"config.algo.policy_loss='grpo'; allowed: {L.POLICY_LOSSES.names()}"
    assert L.POLICY_LOSSES.names()[0] == "ppo"  # the default comes first
    with pytest.raises(ValueError, match=r"^config.algo.clip_ratio_c=1.0; must be > 1"):
        L.policy_loss_from({**algo, "clip_ratio_c": 1.0})
    with pytest.raises(ValueError, match=r"^config.algo.gspo.clip_ratio_high=1.5; must be in"):
        L.policy_loss_from({"policy_loss": "gspo", "gspo": {"clip_ratio_high": 1.5}})


def test_kl_estimators_hand_computed():
    logp, ref = jnp.array([-1.0]), jnp.array([-1.5])
    assert float(L.kl_penalty(logp, ref, "kl")[0]) == pytest.approx(0.5)
    assert float(L.kl_penalty(logp, ref, "abs")[0]) == pytest.approx(0.5)
    assert float(L.kl_penalty(logp, ref, "mse")[0]) == pytest.approx(0.125)
    # k3: d = ref - logp = -0.5; exp(d) - d - 1 = 0.6065307 + 0.5 - 1
    assert float(L.kl_penalty(logp, ref, "low_var_kl")[0]) == pytest.approx(
        math.exp(-0.5) - 0.5, rel=1e-6
    )
    # Clamped to [-10, 10]: d = 30 -> clamp 20 -> exp(20) - 21 -> 10.
    assert float(L.kl_penalty(jnp.array([-31.0]), jnp.array([-1.0]), "low_var_kl")[0]) == 10.0
    with pytest.raises(ValueError, match="kl_type"):
        L.kl_penalty(logp, ref, "bogus")


def test_value_loss_hand_computed():
    # vpred 1.0 old 0.2 R 0: clipped 0.7; l1 1, l2 0.49 -> 1
    # vpred 0.0 old 0.2 R 1: clipped 0.0; l1 = l2 = 1 -> 1
    # vpred 0.9 old 0.0 R 1: clipped 0.5; l1 0.01, l2 0.25 -> 0.25 (clipped counts)
    # 0.5 * mean(1, 1, 0.25) = 0.375
    loss, m = L.value_loss(
        jnp.array([[1.0, 0.0, 0.9]]),
        jnp.array([[0.2, 0.2, 0.0]]),
        jnp.array([[0.0, 1.0, 1.0]]),
        jnp.ones((1, 3)),
    )
    assert float(loss) == pytest.approx(0.375, rel=1e-6)
    assert float(m["vf_clipfrac"]) == pytest.approx(1 / 3)


def test_aggregation_modes_hand_computed():
    # Row 0: losses [1, 2, 3] all real; row 1: [4, 5, 6] with 1 real token.
    x = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = jnp.array([[1, 1, 1], [1, 0, 0]])
    assert float(L.agg_loss(x, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(L.agg_loss(x, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(L.agg_loss(x, mask, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    assert float(L.agg_loss(x, mask, "seq-mean-token-sum-norm")) == pytest.approx((2 + 4 / 3) / 2)
    # A global denominator makes micro-batch sums equal the mini-batch loss exactly.
    d = L.agg_denominator(mask, "token-mean")
    parts = sum(float(L.agg_loss(x[i : i + 1], mask[i : i + 1], "token-mean", d)) for i in (0, 1))
    assert parts == pytest.approx(10 / 4)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        L.agg_loss(x, mask, "bogus")


def test_entropy_from_logits():
    p = np.array([0.5, 0.25, 0.25])
    logp, ent = logprobs_from_logits(jnp.log(jnp.asarray(p))[None], jnp.asarray([1]), 1.0)
    assert float(ent[0]) == pytest.approx(-(p * np.log(p)).sum(), rel=1e-6)
    assert float(logp[0]) == pytest.approx(np.log(0.25), rel=1e-6)


_SILENT_VALUES = (0.0, 1.0, 0.3)  # all wrong, all right, a fractional reward


def _silent_cases():
    """(n, groups): every group size 2-16 with as many groups as fit 128 rows, and a single
    group (n rows) for the sizes whose jitted mean is not exact (n = 3, 5, 7: issue 61)."""
    for n in range(2, 17):
        yield n, 128 // n
    for n in (3, 5, 7):
        yield n, 1


def test_silent_groups_get_exactly_zero_advantage_under_jit():
    # All-equal groups (0, 1, fractional) beside one live group: every silent row is exactly
    # 0 for GRPO and Dr.GRPO under jit (without the exact-zero rule, n = 5 gave -0.0149).
    for norm in (True, False):
        f = jax.jit(A.grpo_outcome_advantage, static_argnums=2, static_argnames="norm_by_std")
        for n, groups in _silent_cases():
            for v in _SILENT_VALUES:
                scores = np.full((groups, n), v, np.float32)
                scores[0, 0] = 1.0 - v if groups > 1 else v  # a live group, when there are two
                adv = np.asarray(
                    f(jnp.asarray(scores.ravel()), jnp.ones((groups * n, 2)), n, norm_by_std=norm)
                ).reshape(groups, n, 2)
                silent = np.asarray(A.silent_groups(scores.ravel(), n))
                assert silent.tolist() == [groups == 1] + [True] * (groups - 1), (n, groups)
                assert np.all(adv[silent] == 0.0), (n, groups, v, norm)
                if groups > 1:  # negative control: the changed group has its signal
                    assert np.all(adv[0, :, 0] != 0.0), (n, groups, v, norm)
