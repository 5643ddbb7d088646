"""aqn_jax/study/twolevel.py against hand-computed numbers, with negative controls."""

import numpy as np
import pytest
from scipy import stats as sps

from aqn_jax.study import twolevel as T

# Differences d = a - b on S = 3 seeds x P = 4 problems (0/1 scores).
A = np.array([[1, 1, 0, 1], [1, 0, 0, 1], [1, 1, 1, 1]], float)
B = np.array([[0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 0]], float)
# d = [[1,0,0,1], [0,0,-1,1], [1,0,1,1]]: row means 1/2, 0, 3/4; column means 2/3, 0, 0, 1;
# grand mean 5/12.


def test_components_by_hand():
    got = T.components(A, B)
    S, P, D = 3, 4, 5 / 12
    rows, cols = np.array([1 / 2, 0, 3 / 4]), np.array([2 / 3, 0, 0, 1])
    ms_seed = P * np.sum((rows - D) ** 2) / (S - 1)
    ms_prob = S * np.sum((cols - D) ** 2) / (P - 1)
    d = A - B
    resid = d - rows[:, None] - cols[None, :] + D
    ms_res = np.sum(resid**2) / ((S - 1) * (P - 1))
    assert ms_seed == pytest.approx(4 * (1 / 144 + 25 / 144 + 16 / 144) / 2, rel=1e-12)
    assert (got["ms_seed"], got["ms_prob"], got["ms_res"]) == pytest.approx(
        (ms_seed, ms_prob, ms_res), rel=1e-12
    )
    v_seed, v_prob = max(0, (ms_seed - ms_res) / P), max(0, (ms_prob - ms_res) / S)
    assert got["sigma2_seed"] == pytest.approx(v_seed, abs=1e-15)
    assert got["sigma2_prob"] == pytest.approx(v_prob, rel=1e-12)
    assert got["diff"] == pytest.approx(D) and got["diff_per_seed"] == pytest.approx(rows)
    total = v_seed / S + v_prob / P + ms_res / (S * P)
    assert got["var_total"] == pytest.approx(total, rel=1e-12)
    assert got["se"] == pytest.approx(np.sqrt(total), rel=1e-12)
    assert got["seed_share"] == pytest.approx((v_seed / S) / total, rel=1e-12)
    if ms_seed > ms_res and ms_prob > ms_res:  # nothing clipped: the ANOVA identity
        assert total == pytest.approx((ms_seed + ms_prob - ms_res) / (S * P), rel=1e-12)


def test_components_clip_and_degenerate():
    # Every seed the same mean: MS_seed = 0 < MS_res, so sigma2_seed clips at 0.
    a = np.array([[1, 0, 1, 0], [0, 1, 0, 1]], float)
    got = T.components(a, np.zeros_like(a))
    assert got["ms_seed"] == 0.0 and got["ms_res"] > 0 and got["sigma2_seed"] == 0.0
    assert got["seed_share"] == 0.0
    assert T.components(a[:1], a[:1] * 0)["reason"].startswith("need S >= 2")
    same = T.components(np.ones((3, 4)), np.zeros((3, 4)))
    assert same["var_total"] == 0.0 and same["seed_share"] is None and same["reason"]
    with pytest.raises(ValueError, match="same-shape"):
        T.components(np.ones((3, 4)), np.ones((3, 5)))
    with pytest.raises(ValueError, match="non-finite"):
        T.components(np.full((2, 2), np.nan), np.zeros((2, 2)))


def test_bootstrap_matches_the_exact_resampling_variance():
    rng = np.random.default_rng(1)
    a = (rng.random((6, 40)) < 0.6).astype(float)
    b = (rng.random((6, 40)) < 0.5).astype(float)
    d = a - b
    S, P = d.shape
    alpha = d.mean(1) - d.mean()
    beta = d.mean(0) - d.mean()
    gamma = d - d.mean(1)[:, None] - d.mean(0)[None, :] + d.mean()
    exact = (alpha**2).sum() / S**2 + (beta**2).sum() / P**2 + (gamma**2).sum() / (S * P) ** 2
    reps = 20000
    got = T.bootstrap_ci(a, b, reps=reps, seed=3)
    # The replicates' variance estimates `exact` with relative SE about sqrt(2 / (reps - 1)).
    assert got["se_boot"] ** 2 == pytest.approx(exact, rel=5 * np.sqrt(2 / (reps - 1)))
    half = sps.t.ppf(0.975, S - 1) * got["se_boot"]
    assert got["ci"] == pytest.approx((d.mean() - half, d.mean() + half), rel=1e-12)
    assert T.bootstrap_ci(a, b, reps=reps, seed=3) == got  # a fixed seed: the same answer
    # Negative control: the pairing broken (one run's problems permuted), the interval moves.
    shuffled = b.copy()
    shuffled[0] = shuffled[0][rng.permutation(P)]
    assert T.bootstrap_ci(a, shuffled, reps=reps, seed=3)["se_boot"] != got["se_boot"]
    assert T.bootstrap_ci(a[:1], b[:1])["reason"].startswith("need S >= 2")


def test_bootstrap_interval_covers_at_its_nominal_rate():
    """Studies drawn with a known seed part (dominant) and problem part: the t interval covers
    the true difference at about 0.934-0.95 (module docstring), within the binomial error."""
    rng = np.random.default_rng(7)
    studies, S, P, delta = 300, 8, 32, 0.05
    hits = 0
    for _ in range(studies):
        d = delta + rng.normal(0, 0.05, (S, 1)) + rng.normal(0, 0.02, (1, P))
        d = d + rng.normal(0, 0.02, (S, P))
        lo, hi = T.bootstrap_ci(d, np.zeros_like(d), reps=300, seed=int(rng.integers(1 << 30)))[
            "ci"
        ]
        hits += lo <= delta <= hi
    rate, band = hits / studies, 3 * np.sqrt(0.94 * 0.06 / studies)
    assert 0.934 - band <= rate <= 0.99, rate


def test_mdd_and_plan_by_brute_force():
    sig = (0.002, 0.02, 0.1)
    t = sps.t.ppf(0.975, 7) + sps.t.ppf(0.8, 7)
    assert T.mdd(8, 256, *sig) == pytest.approx(
        t * np.sqrt(0.002 / 8 + 0.02 / 256 + 0.1 / (8 * 256)), rel=1e-12
    )
    assert T.mdd(1, 256, *sig) is None
    assert T.mdd(9, 256, *sig) < T.mdd(8, 256, *sig) and T.mdd(8, 512, *sig) < T.mdd(8, 256, *sig)
    seeds, problems = range(2, 21), (128, 256, 512, 1024)
    out = T.plan(*sig, 0.05, 1200.0, 1.5, seeds=seeds, problems=problems)
    ok = [
        (2 * s * (1200.0 + p * 1.5), T.mdd(s, p, *sig), s, p)
        for s in seeds
        for p in problems
        if T.mdd(s, p, *sig) <= 0.05
    ]
    cost, m, s, p = min(ok)
    assert (out["best"]["S"], out["best"]["P"]) == (s, p)
    assert out["best"]["cost_s"] == pytest.approx(cost) and out["best"]["mdd"] == pytest.approx(m)
    for row in out["by_problems"]:
        hit = [x[2] for x in ok if x[3] == row["P"]]
        assert row["S"] == (min(hit) if hit else None)
    # The seed part dominant: more problems buy little; the problem part dominant: they do.
    seedy = T.plan(0.002, 0.0, 0.01, 0.05, 100.0, 0.01, seeds=seeds, problems=problems)
    probby = T.plan(0.0, 0.0, 0.5, 0.05, 5000.0, 0.01, seeds=seeds, problems=problems)
    assert seedy["best"]["S"] > probby["best"]["S"] and probby["best"]["P"] == 1024
    none = T.plan(*sig, 1e-6, 1.0, 1.0, seeds=seeds, problems=problems)
    assert none["best"] is None and none["reason"].startswith("no (S, P)")


def test_from_records_keeps_what_every_run_shares():
    ra = {0: {0: True, 1: False, 2: True}, 1: {0: 1, 1: 1, 2: 0}, 2: {0: 1}}
    rb = {1: {0: 0, 1: 1, 2: 1}, 0: {0: False, 2: False}}
    a, b, seeds, problems = T.from_records(ra, rb)
    assert seeds == [0, 1] and problems == [0, 2]  # seed 2 and problem 1 are not in every run
    np.testing.assert_array_equal(a, [[1, 1], [1, 0]])
    np.testing.assert_array_equal(b, [[0, 0], [0, 1]])
    with pytest.raises(ValueError, match="no seed common"):
        T.from_records({0: {0: 1}}, {1: {0: 1}})
