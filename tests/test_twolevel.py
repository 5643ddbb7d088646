"""The two-level (seeds x problems) analysis: hand-computed ANOVA, the exact resampling variance
of the crossed bootstrap, simulated coverage, the planning mdd and grid search, and the records.

Tolerances: the statistics are float64 sums over at most a few thousand O(1) terms, so a value
computed two ways agrees to ~1e-15 relative; rel=1e-12 leaves three orders of margin. The
Monte Carlo checks take their bands from the Monte Carlo error (derived where they are used)
and a fixed seed, so they are deterministic.
"""

import math
from fractions import Fraction as F
from functools import cache

import numpy as np
import pytest
from scipy import stats

from aqn_jax.study import twolevel as tl

REL = 1e-12

# The no-clipping example, [S=3, P=4]: d = a - b =
#   [[-1, 0, 1, 0],
#    [ 1, 1, 1, 1],
#    [-1, 1, 0, 0]]
A_HAND = np.array([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 0, 1]])
B_HAND = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 0, 0, 1]])

# The clipping example (MS_seed < MS_res): d =
#   [[0, 0,  1, -1],
#    [1, 1, -1, -1],
#    [0, 1,  1,  0]]
A_CLIP = np.array([[1, 0, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1]])
B_CLIP = np.array([[1, 0, 0, 1], [0, 0, 1, 1], [0, 0, 0, 1]])


def _approx(x):
    return pytest.approx(float(x), rel=REL, abs=0)


def _one_line_value_error(fn, *args, match):
    with pytest.raises(ValueError, match=match) as exc:
        fn(*args)
    assert "\n" not in str(exc.value)


# ---------------------------------------------------------------------------------------------
# components


def test_components_hand_computed():
    S, P = 3, 4
    d = A_HAND - B_HAND
    assert d.tolist() == [[-1, 0, 1, 0], [1, 1, 1, 1], [-1, 1, 0, 0]]
    # Means: D_s = (0, 4/4, 0) = (0, 1, 0); D_p = (-1/3, 2/3, 2/3, 1/3); D = 4/12 = 1/3.
    d_s = [F(0), F(1), F(0)]
    d_p = [F(-1, 3), F(2, 3), F(2, 3), F(1, 3)]
    grand = F(1, 3)
    assert [F(int(x), P) for x in d.sum(axis=1)] == d_s
    assert [F(int(x), S) for x in d.sum(axis=0)] == d_p
    assert F(int(d.sum()), S * P) == grand
    # alpha = D_s - D = (-1/3, 2/3, -1/3): sum alpha^2 = 1/9 + 4/9 + 1/9 = 2/3.
    # MS_seed = P * 2/3 / (S - 1) = 4 * 2/3 / 2 = 4/3.
    ms_seed = F(P) * (F(1, 9) + F(4, 9) + F(1, 9)) / (S - 1)
    assert ms_seed == F(4, 3)
    # beta = D_p - D = (-2/3, 1/3, 1/3, 0): sum beta^2 = 4/9 + 1/9 + 1/9 + 0 = 2/3.
    # MS_prob = S * 2/3 / (P - 1) = 3 * 2/3 / 3 = 2/3.
    ms_prob = F(S) * (F(4, 9) + F(1, 9) + F(1, 9) + 0) / (P - 1)
    assert ms_prob == F(2, 3)
    # gamma = d - D_s - D_p + D, row by row:
    #   row 0 (D_s = 0): (-1+1/3+1/3, 0-2/3+1/3, 1-2/3+1/3, 0-1/3+1/3) = (-1/3, -1/3, 2/3, 0)
    #   row 1 (D_s = 1): (1-1+1/3+1/3, 1-1-2/3+1/3, ...)             = ( 2/3, -1/3, -1/3, 0)
    #   row 2 (D_s = 0): (-1+1/3+1/3, 1-2/3+1/3, 0-2/3+1/3, 0)        = (-1/3,  2/3, -1/3, 0)
    gamma = [
        [F(-1, 3), F(-1, 3), F(2, 3), F(0)],
        [F(2, 3), F(-1, 3), F(-1, 3), F(0)],
        [F(-1, 3), F(2, 3), F(-1, 3), F(0)],
    ]
    for s in range(S):
        for p in range(P):
            assert gamma[s][p] == int(d[s, p]) - d_s[s] - d_p[p] + grand
    # sum gamma^2 = 3 * (1/9 + 1/9 + 4/9) = 2; MS_res = 2 / ((S-1)(P-1)) = 2/6 = 1/3.
    ss_res = sum(g * g for row in gamma for g in row)
    assert ss_res == 2
    ms_res = ss_res / ((S - 1) * (P - 1))
    assert ms_res == F(1, 3)
    # The ANOVA identity: SS_total = sum d^2 - S P D^2 = 8 - 12/9 = 20/3 = P*2/3 + S*2/3 + 2.
    assert F(int((d**2).sum())) - S * P * grand**2 == F(20, 3) == 4 * F(2, 3) + 3 * F(2, 3) + 2

    sigma2_seed = (ms_seed - ms_res) / P  # (4/3 - 1/3)/4 = 1/4
    sigma2_prob = (ms_prob - ms_res) / S  # (2/3 - 1/3)/3 = 1/9
    assert (sigma2_seed, sigma2_prob) == (F(1, 4), F(1, 9))
    seed_part = sigma2_seed / S  # 1/12
    problem_part = sigma2_prob / P + ms_res / (S * P)  # 1/36 + 1/36 = 1/18
    var_total = seed_part + problem_part  # 5/36
    assert (seed_part, problem_part, var_total) == (F(1, 12), F(1, 18), F(5, 36))
    assert var_total == (ms_seed + ms_prob - ms_res) / (S * P)  # nothing clips
    assert seed_part / var_total == F(3, 5)

    c = tl.components(A_HAND, B_HAND)
    assert (c["S"], c["P"], c["reason"]) == (3, 4, None)
    assert c["diff"] == _approx(grand)
    assert c["diff_per_seed"] == [_approx(x) for x in d_s]
    for key, want in [
        ("ms_seed", ms_seed),
        ("ms_prob", ms_prob),
        ("ms_res", ms_res),
        ("sigma2_seed", sigma2_seed),
        ("sigma2_prob", sigma2_prob),
        ("sigma2_res", ms_res),
        ("seed_part", seed_part),
        ("problem_part", problem_part),
        ("var_total", var_total),
        ("seed_share", F(3, 5)),
    ]:
        assert c[key] == _approx(want), key
    assert c["se"] == pytest.approx(math.sqrt(5) / 6, rel=REL)
    assert c["var_total"] == _approx((c["ms_seed"] + c["ms_prob"] - c["ms_res"]) / (S * P))


def test_components_clipping_at_zero():
    S, P = 3, 4
    d = A_CLIP - B_CLIP
    assert d.tolist() == [[0, 0, 1, -1], [1, 1, -1, -1], [0, 1, 1, 0]]
    # D_s = (0, 0, 1/2), D_p = (1/3, 2/3, 1/3, -2/3), D = 2/12 = 1/6.
    # alpha = (-1/6, -1/6, 1/3): sum alpha^2 = 1/36 + 1/36 + 4/36 = 1/6 -> MS_seed = 4/6/2 = 1/3.
    # beta = (1/6, 1/2, 1/6, -5/6): sum beta^2 = (1 + 9 + 1 + 25)/36 = 1 -> MS_prob = 3*1/3 = 1.
    # SS_total = sum d^2 - S P D^2 = 8 - 12/36 = 23/3; SS_res = 23/3 - 4*(1/6) - 3*1 = 4,
    # MS_res = 4/6 = 2/3 > MS_seed.
    ms_seed, ms_prob, ms_res = F(4, 6) / 2, F(3, 3), (F(23, 3) - F(4, 6) - 3) / 6
    assert (ms_seed, ms_prob, ms_res) == (F(1, 3), F(1), F(2, 3))
    sigma2_prob = (ms_prob - ms_res) / S  # 1/9
    problem_part = sigma2_prob / P + ms_res / (S * P)  # 1/36 + 2/36 = 1/12
    c = tl.components(A_CLIP, B_CLIP)
    assert c["diff"] == _approx(F(1, 6))
    assert c["diff_per_seed"] == [0.0, 0.0, _approx(F(1, 2))]
    assert c["ms_seed"] == _approx(ms_seed)
    assert c["ms_prob"] == _approx(ms_prob)
    assert c["ms_res"] == _approx(ms_res)
    assert c["ms_seed"] < c["ms_res"]
    assert c["sigma2_seed"] == 0.0 and c["seed_part"] == 0.0 and c["seed_share"] == 0.0
    assert c["sigma2_prob"] == _approx(F(1, 9))
    assert c["sigma2_res"] == _approx(F(2, 3))
    assert c["problem_part"] == _approx(problem_part)
    assert c["var_total"] == _approx(F(1, 12))
    assert c["se"] == pytest.approx(math.sqrt(1 / 12), rel=REL)
    assert c["reason"] is None
    # Clipping breaks the unclipped identity: (1/3 + 1 - 2/3)/12 = 1/18 < 1/12.
    unclipped = (c["ms_seed"] + c["ms_prob"] - c["ms_res"]) / (S * P)
    assert unclipped == _approx(F(1, 18))
    assert c["var_total"] > unclipped


def test_components_invariant_to_seed_and_problem_order():
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 2, (5, 30)), rng.integers(0, 2, (5, 30))
    ref = tl.components(a, b)
    rs, rp = rng.permutation(5), rng.permutation(30)
    perm = tl.components(a[rs][:, rp], b[rs][:, rp])
    for key in ("diff", "ms_seed", "ms_prob", "ms_res", "var_total", "seed_share"):
        assert perm[key] == pytest.approx(ref[key], rel=REL), key
    assert perm["diff_per_seed"] == [pytest.approx(ref["diff_per_seed"][i], rel=REL) for i in rs]
    # Negative control: a within-seed shuffle of one arm is not a relabelling; the split moves.
    b_shuf = np.stack([row[rng.permutation(30)] for row in b])
    assert tl.components(a, b_shuf)["ms_res"] != pytest.approx(ref["ms_res"], rel=1e-3)


@pytest.mark.parametrize("shape", [(1, 5), (4, 1), (1, 1)])
def test_components_degenerate_sizes(shape):
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 2, shape), rng.integers(0, 2, shape)
    c = tl.components(a, b)
    assert (c["S"], c["P"]) == shape
    assert c["diff"] == pytest.approx(float((a - b).mean()), rel=REL)
    assert len(c["diff_per_seed"]) == shape[0]
    keys = ("ms_seed", "ms_prob", "ms_res", "sigma2_seed", "sigma2_prob", "sigma2_res")
    keys += ("seed_part", "problem_part", "var_total", "se", "seed_share")
    assert all(c[k] is None for k in keys)
    assert isinstance(c["reason"], str) and f"S={shape[0]}, P={shape[1]}" in c["reason"]


@pytest.mark.parametrize("value", [0, 1])
def test_components_all_differences_equal(value):
    a = np.ones((4, 6))
    b = a - value  # every d == value
    c = tl.components(a, b)
    assert c["diff"] == value and c["diff_per_seed"] == [value] * 4
    assert c["ms_seed"] == c["ms_prob"] == c["ms_res"] == 0.0
    assert c["var_total"] == 0.0 and c["se"] == 0.0
    assert c["seed_share"] is None and "var_total 0" in c["reason"]
    # Control: one flipped cell makes the variance positive and the share defined.
    b[0, 0] += 1
    c2 = tl.components(a, b)
    assert c2["var_total"] > 0 and c2["seed_share"] is not None and c2["reason"] is None


@pytest.mark.parametrize("fn", [tl.components, tl.bootstrap_ci])
def test_bad_input_raises_one_line(fn):
    ok = np.zeros((3, 4))
    _one_line_value_error(fn, ok, np.zeros((3, 5)), match=r"same-shape \[S, P\]")
    _one_line_value_error(fn, np.zeros(4), np.zeros(4), match=r"same-shape \[S, P\]")
    _one_line_value_error(fn, np.zeros((2, 3, 4)), np.zeros((2, 3, 4)), match="same-shape")
    bad = ok.copy()
    bad[1, 2], bad[0, 0] = np.nan, np.inf
    _one_line_value_error(fn, bad, ok, match="2 non-finite differences")
    fn(ok, ok)  # control: the same arrays without the non-finite cells are accepted


# ---------------------------------------------------------------------------------------------
# bootstrap_ci


def _crossed_01(S, P, seed):
    """0/1 arms with a seed effect per run, a shared problem difficulty and a paired effect."""
    rng = np.random.default_rng(seed)
    difficulty = rng.normal(0.0, 1.0, P)
    paired = rng.normal(0.0, 0.7, P)
    seed_a, seed_b = rng.normal(0.3, 0.4, (S, 1)), rng.normal(0.0, 0.4, (S, 1))
    a = (difficulty + paired / 2 + seed_a + rng.normal(0, 0.5, (S, P)) > 0).astype(float)
    b = (difficulty - paired / 2 + seed_b + rng.normal(0, 0.5, (S, P)) > 0).astype(float)
    return a, b


def _resampling_variance(d):
    """Var*(D*) of the crossed bootstrap given d (module docstring, McCullagh 2000)."""
    S, P = d.shape
    grand = d.mean()
    alpha, beta = d.mean(axis=1) - grand, d.mean(axis=0) - grand
    gamma = d - alpha[:, None] - beta[None, :] - grand
    return (alpha @ alpha) / S**2 + (beta @ beta) / P**2 + np.sum(gamma**2) / (S * P) ** 2


def test_bootstrap_reproducible_and_seeded():
    a, b = _crossed_01(6, 40, seed=1)
    r1 = tl.bootstrap_ci(a, b, reps=500, seed=7)
    r2 = tl.bootstrap_ci(a, b, reps=500, seed=7)
    assert r1 == r2
    r3 = tl.bootstrap_ci(a, b, reps=500, seed=8)  # control: another seed, another draw
    assert r3["se_boot"] != r1["se_boot"] and r3["diff"] == r1["diff"]
    assert (r1["S"], r1["P"], r1["reps"], r1["level"], r1["reason"]) == (6, 40, 500, 0.95, None)


def test_bootstrap_constant_difference_has_zero_se():
    a = np.ones((5, 20))
    r = tl.bootstrap_ci(a, np.zeros_like(a), reps=300, seed=0)
    # Every replicate is w_s^T 1 w_p / (S P) = S P / (S P) = 1 exactly.
    assert r["diff"] == 1.0 and r["se_boot"] == 0.0
    assert r["ci"] == (1.0, 1.0) and r["ci_percentile"] == (1.0, 1.0)
    # Control: one changed cell gives a positive spread.
    a[2, 3] = 0.0
    assert tl.bootstrap_ci(a, np.zeros_like(a), reps=300, seed=0)["se_boot"] > 0


@pytest.mark.parametrize("kind", ["crossed", "seed_only", "problem_only"])
def test_bootstrap_variance_matches_exact_resampling_variance(kind):
    S, P, reps = 6, 40, 20000
    a, b = _crossed_01(S, P, seed=2)
    if kind == "seed_only":  # identical columns: beta = gamma = 0
        a, b = np.repeat(a[:, :1], P, axis=1), np.repeat(b[:, :1], P, axis=1)
        a[0], a[1] = 1.0, 0.0  # make sure the per-seed differences differ
    elif kind == "problem_only":  # identical rows: alpha = gamma = 0
        a, b = np.repeat(a[:1], S, axis=0), np.repeat(b[:1], S, axis=0)
    d = a - b
    exact = _resampling_variance(d)
    # The same from the mean squares (module docstring), and its parts as the kind says.
    c = tl.components(a, b)
    ms_form = (
        (S - 1) * c["ms_seed"] / S
        + (P - 1) * c["ms_prob"] / P
        + (S - 1) * (P - 1) * c["ms_res"] / (S * P)
    ) / (S * P)
    assert ms_form == pytest.approx(exact, rel=REL)
    if kind == "seed_only":
        assert c["ms_prob"] == pytest.approx(0.0, abs=1e-12) and c["ms_seed"] > 0
    if kind == "problem_only":
        assert c["ms_seed"] == pytest.approx(0.0, abs=1e-12) and c["ms_prob"] > 0
    r = tl.bootstrap_ci(a, b, reps=reps, seed=11)
    # The sample variance of `reps` near-Gaussian replicates has relative SE sqrt(2/(reps-1))
    # (~0.01 here); 5 of them. (An excess kurtosis k would add k/reps: the replicate is a mean
    # of S seed and P problem draws, k ~ k_1/S + k_1/P, well inside the 5-SE margin.)
    mc_rel = math.sqrt(2.0 / (reps - 1))
    assert r["se_boot"] ** 2 == pytest.approx(exact, rel=5 * mc_rel)
    # The interval is D +- t_{0.975, S-1} se_boot.
    half = stats.t.ppf(0.975, S - 1) * r["se_boot"]
    assert r["diff"] == pytest.approx(d.mean(), rel=REL)
    assert r["ci"][0] == pytest.approx(r["diff"] - half, rel=REL)
    assert r["ci"][1] == pytest.approx(r["diff"] + half, rel=REL)
    lo, hi = r["ci_percentile"]
    assert d.min() <= lo < r["diff"] < hi <= d.max()
    # The percentile interval of a near-Gaussian replicate is about D +- 1.96 se_boot, and
    # narrower than the t one with 5 df (1.96 < 2.57).
    assert hi - lo < r["ci"][1] - r["ci"][0]


def test_bootstrap_level_and_degenerate():
    a, b = _crossed_01(6, 40, seed=4)
    r90 = tl.bootstrap_ci(a, b, level=0.9, reps=500, seed=3)
    r95 = tl.bootstrap_ci(a, b, level=0.95, reps=500, seed=3)
    assert r90["se_boot"] == r95["se_boot"]  # same seed, same replicates
    half90 = stats.t.ppf(0.95, 5) * r90["se_boot"]
    assert r90["ci"][1] - r90["diff"] == pytest.approx(half90, rel=1e-10)
    assert r90["ci"][1] < r95["ci"][1]
    for args, kwargs in [((a[:1], b[:1]), {}), ((a, b), {"reps": 1})]:
        r = tl.bootstrap_ci(*args, **kwargs)
        assert r["se_boot"] is None and r["ci"] is None and r["ci_percentile"] is None
        assert isinstance(r["reason"], str) and "need S >= 2" in r["reason"]
    assert tl.bootstrap_ci(a[:1], b[:1])["diff"] == pytest.approx((a[0] - b[0]).mean(), rel=REL)


def test_bootstrap_pairing_matters():
    """Both arms solve mostly the same problems; shuffling one arm's problems within each seed
    keeps every mean but breaks the pairing, and the interval must widen."""
    S, P = 6, 80
    rng = np.random.default_rng(5)
    difficulty = rng.normal(0, 1.5, P)
    a = (difficulty + rng.normal(0, 0.3, (S, P)) > 0).astype(float)
    b = (difficulty + rng.normal(0, 0.3, (S, P)) > 0).astype(float)
    b_shuf = np.stack([row[rng.permutation(P)] for row in b])
    paired = tl.bootstrap_ci(a, b, reps=2000, seed=0)
    broken = tl.bootstrap_ci(a, b_shuf, reps=2000, seed=0)
    assert broken["diff"] == paired["diff"]  # sums of 0/1 cells: exact
    assert broken["ci"] != paired["ci"]
    assert broken["se_boot"] > 2 * paired["se_boot"]
    # The exact resampling variances say the same, without Monte Carlo error.
    assert _resampling_variance(a - b_shuf) > 4 * _resampling_variance(a - b)


# ---------------------------------------------------------------------------------------------
# Simulated coverage and unbiasedness: d = delta + u_s + v_p + e_sp, Gaussian.

N_STUDIES, S_SIM, P_SIM, REPS_SIM, DELTA = 400, 8, 64, 400, 0.1
REGIMES = {
    # Var(D) = 1/8 + 0.01/64 + 0.1/512: the seed part is 99.7 %.
    "seed": (1.0, 0.01, 0.1),
    # Var(D) = 0 + 0.1/64 + 0.2/512: all problem part.
    "problem": (0.0, 0.1, 0.2),
}


@cache
def _simulate(regime):
    s2_seed, s2_prob, s2_res = REGIMES[regime]
    n, S, P = N_STUDIES, S_SIM, P_SIM
    rng = np.random.default_rng({"seed": 101, "problem": 202}[regime])
    d = (
        DELTA
        + math.sqrt(s2_seed) * rng.standard_normal((n, S, 1))
        + math.sqrt(s2_prob) * rng.standard_normal((n, 1, P))
        + math.sqrt(s2_res) * rng.standard_normal((n, S, P))
    )
    zero = np.zeros((S, P))
    boots = [tl.bootstrap_ci(d[i], zero, reps=REPS_SIM, seed=i) for i in range(n)]
    comps = [tl.components(d[i], zero) for i in range(n)]
    lo = np.array([r["ci"][0] for r in boots])
    hi = np.array([r["ci"][1] for r in boots])
    # The two one-way mistakes, with their exact resampling variances (vectorised):
    # resampling only the seeds (sum alpha^2 / S^2) or only the problems (sum beta^2 / P^2).
    grand = d.mean(axis=(1, 2))
    alpha = d.mean(axis=2) - grand[:, None]
    beta = d.mean(axis=1) - grand[:, None]
    se_seeds_only = np.sqrt(np.sum(alpha**2, axis=1)) / S
    se_problems_only = np.sqrt(np.sum(beta**2, axis=1)) / P
    return d, lo, hi, comps, grand, se_seeds_only, se_problems_only


def _binomial_sd(q, n=N_STUDIES):
    return math.sqrt(q * (1 - q) / n)


def test_coverage_seed_part_dominates():
    d, lo, hi, _, grand, _, se_problems_only = _simulate("seed")
    rate = float(np.mean((lo <= DELTA) & (hi >= DELTA)))
    S = S_SIM
    t = stats.t.ppf(0.975, S - 1)
    # The docstring's limit: se_boot^2 -> (S-1)/S * s^2/S, so the pivot is T_{S-1} sqrt(S/(S-1)).
    q_low = 2 * stats.t.cdf(t * math.sqrt((S - 1) / S), S - 1) - 1
    assert q_low == pytest.approx(0.937, abs=5e-4)  # the docstring's 0.937 at S = 8
    for s_, want in [(6, 0.934), (12, 0.941)]:
        tq = stats.t.ppf(0.975, s_ - 1)
        assert 2 * stats.t.cdf(tq * math.sqrt((s_ - 1) / s_), s_ - 1) - 1 == pytest.approx(
            want, abs=5e-4
        )
    assert q_low - 3 * _binomial_sd(q_low) <= rate <= 0.95 + 3 * _binomial_sd(0.95)
    # Negative control: resampling only the problems ignores the seed part and under-covers.
    naive = np.mean(np.abs(grand - DELTA) <= t * se_problems_only)
    assert naive < q_low - 3 * _binomial_sd(q_low) - 0.3


def test_coverage_problem_part_dominates():
    d, lo, hi, _, grand, se_seeds_only, _ = _simulate("problem")
    rate = float(np.mean((lo <= DELTA) & (hi >= DELTA)))
    lower = 0.95 - 3 * _binomial_sd(0.95)
    assert rate >= lower  # conservative (the docstring: ~0.99)
    # Negative control: resampling only the seeds ignores the shared problem effect.
    t = stats.t.ppf(0.975, S_SIM - 1)
    naive = np.mean(np.abs(grand - DELTA) <= t * se_seeds_only)
    assert naive < lower - 0.1


@pytest.mark.parametrize("regime", list(REGIMES))
def test_components_unbiased_in_simulation(regime):
    s2_seed, s2_prob, s2_res = REGIMES[regime]
    S, P = S_SIM, P_SIM
    comps = _simulate(regime)[3]
    ms = {k: np.array([c[k] for c in comps]) for k in ("ms_seed", "ms_prob", "ms_res")}
    # The unclipped method-of-moments estimates are unbiased (module docstring E[MS]).
    est = {
        "sigma2_seed": (ms["ms_seed"] - ms["ms_res"]) / P,
        "sigma2_prob": (ms["ms_prob"] - ms["ms_res"]) / S,
        "sigma2_res": ms["ms_res"],
        "var_D": (ms["ms_seed"] + ms["ms_prob"] - ms["ms_res"]) / (S * P),
    }
    truth = {
        "sigma2_seed": s2_seed,
        "sigma2_prob": s2_prob,
        "sigma2_res": s2_res,
        "var_D": s2_seed / S + s2_prob / P + s2_res / (S * P),
    }
    for key, x in est.items():
        se = x.std(ddof=1) / math.sqrt(len(x))
        assert abs(x.mean() - truth[key]) <= 4 * se, key
        if truth[key] > 0:  # control: the check could see a 20 % bias
            assert 4 * se < 0.2 * truth[key], key
    # The reported sigma2 are those estimates clipped at 0 (same float operations: exact).
    for key in ("sigma2_seed", "sigma2_prob"):
        reported = np.array([c[key] for c in comps])
        assert np.array_equal(reported, np.maximum(0.0, est[key])), key
    assert np.array_equal(np.array([c["sigma2_res"] for c in comps]), est["sigma2_res"])
    if regime == "seed":  # the seed part is far from 0: nothing clips, share near 1
        assert np.all(est["sigma2_seed"] > 0)
        assert np.mean([c["seed_share"] for c in comps]) > 0.9


# ---------------------------------------------------------------------------------------------
# mdd


def _t_factor(S, power=0.8, alpha=0.05):
    return stats.t.ppf(1 - alpha / 2, S - 1) + stats.t.ppf(power, S - 1)


def test_mdd_formula():
    sig = (0.004, 0.03, 0.2)
    for S, P in [(2, 128), (3, 256), (8, 1319), (40, 64)]:
        var = sig[0] / S + sig[1] / P + sig[2] / (S * P)
        assert tl.mdd(S, P, *sig) == pytest.approx(_t_factor(S) * math.sqrt(var), rel=REL)
    # Closed-form t quantiles, independent of scipy: df 1 is Cauchy, tan(pi (q - 1/2));
    # df 2 is (2q - 1) / sqrt(2 q (1 - q)).
    var2 = sig[0] / 2 + sig[1] / 128 + sig[2] / 256
    cauchy = math.tan(math.pi * 0.475) + math.tan(math.pi * 0.3)
    assert tl.mdd(2, 128, *sig) == pytest.approx(cauchy * math.sqrt(var2), rel=REL)

    def t2(q):
        return (2 * q - 1) / math.sqrt(2 * q * (1 - q))

    var3 = sig[0] / 3 + sig[1] / 50 + sig[2] / 150
    assert tl.mdd(3, 50, *sig) == pytest.approx((t2(0.975) + t2(0.8)) * math.sqrt(var3), rel=REL)
    # Other power and alpha.
    want = (stats.t.ppf(0.995, 9) + stats.t.ppf(0.9, 9)) * math.sqrt(
        sig[0] / 10 + sig[1] / 100 + sig[2] / 1000
    )
    assert tl.mdd(10, 100, *sig, power=0.9, alpha=0.01) == pytest.approx(want, rel=REL)
    assert tl.mdd(1, 128, *sig) is None and tl.mdd(0, 128, *sig) is None
    assert tl.mdd(5, 0, *sig) is None


def test_mdd_decreasing_in_seeds_and_problems():
    sig = (0.004, 0.03, 0.2)
    by_s = [tl.mdd(S, 256, *sig) for S in range(2, 41)]
    assert all(x > y for x, y in zip(by_s, by_s[1:], strict=False))
    by_p = [tl.mdd(8, P, *sig) for P in tl.PROBLEMS]
    assert all(x > y for x, y in zip(by_p, by_p[1:], strict=False))
    # Control: with no problem-level variance more problems buy nothing (exactly equal).
    flat = {tl.mdd(8, P, 0.004, 0.0, 0.0) for P in tl.PROBLEMS}
    assert len(flat) == 1
    # and seeds still help even with no seed variance (the residual and the t quantile).
    assert tl.mdd(4, 256, 0.0, 0.03, 0.2) > tl.mdd(5, 256, 0.0, 0.03, 0.2)


# ---------------------------------------------------------------------------------------------
# plan


def _brute_plan(sig, target, run_s, prob_s, arms=2, seeds=range(2, 41), problems=tl.PROBLEMS):
    """The grid search written out: every point, the feasible ones, then the tie rule."""
    points = []
    for S in seeds:
        for P in problems:
            if S < 2:
                continue
            var = sig[0] / S + sig[1] / P + sig[2] / (S * P)
            m = _t_factor(S) * math.sqrt(var)
            points.append((S, P, m, arms * S * (run_s + P * prob_s)))
    feasible = [pt for pt in points if pt[2] <= target]
    best = None
    if feasible:
        cheapest = min(pt[3] for pt in feasible)
        tied = [pt for pt in feasible if pt[3] == cheapest]
        smallest_mdd = min(pt[2] for pt in tied)
        tied = [pt for pt in tied if pt[2] == smallest_mdd]
        best = min(tied, key=lambda pt: pt[0])
    by_p = {P: min((pt[0] for pt in feasible if pt[1] == P), default=None) for P in problems}
    return best, by_p, points


def _check_plan_against_brute(sig, target, run_s, prob_s, **kw):
    out = tl.plan(*sig, target, run_s, prob_s, **kw)
    best, by_p, points = _brute_plan(sig, target, run_s, prob_s, **kw)
    assert out["target_mdd"] == target
    if best is None:
        assert out["best"] is None
    else:
        got = out["best"]
        assert (got["S"], got["P"]) == best[:2]
        assert got["mdd"] == pytest.approx(best[2], rel=REL) and got["mdd"] <= target
        assert got["cost_s"] == best[3]
        # Every strictly cheaper grid point misses the target.
        assert all(pt[2] > target for pt in points if pt[3] < got["cost_s"])
    problems = sorted(kw.get("problems", tl.PROBLEMS))
    seeds = sorted(kw.get("seeds", range(2, 41)))
    assert [row["P"] for row in out["by_problems"]] == problems
    for row in out["by_problems"]:
        assert row["S"] == by_p[row["P"]]
        if row["S"] is not None:
            assert row["mdd"] <= target
            assert row["cost_s"] == kw.get("arms", 2) * row["S"] * (run_s + row["P"] * prob_s)
            fewer = [s for s in seeds if 2 <= s < row["S"]]
            if fewer:  # the next smaller seed count on the grid misses
                assert tl.mdd(fewer[-1], row["P"], *sig) > target
    smallest = tl.mdd(seeds[0], problems[0], *sig)
    if smallest is None:
        assert out["mdd_smallest"] is None
    else:
        assert out["mdd_smallest"] == pytest.approx(smallest, rel=REL)
    return out


def test_plan_more_problems_cheaper():
    # A large problem effect and cheap evaluation (1 s per problem vs 1 h of training).
    sig, target, run_s, prob_s = (1e-4, 0.2, 0.2), 0.06, 3600.0, 1.0
    out = _check_plan_against_brute(sig, target, run_s, prob_s)
    best = out["best"]
    assert out["reason"] is None
    assert best["P"] > 512
    rows = {row["P"]: row for row in out["by_problems"]}
    assert rows[128]["S"] is None  # 128 problems never reach it with <= 40 seeds
    assert rows[512]["S"] > best["S"] and rows[512]["cost_s"] > best["cost_s"]


def test_plan_more_seeds_cheaper():
    # A large seed effect and expensive evaluation (2 s per problem vs 60 s of training).
    sig, target, run_s, prob_s = (0.005, 0.002, 0.05), 0.05, 60.0, 2.0
    out = _check_plan_against_brute(sig, target, run_s, prob_s)
    best = out["best"]
    assert best["P"] == min(tl.PROBLEMS) and best["S"] >= 15
    rows = [row for row in out["by_problems"] if row["P"] > best["P"]]
    # More problems save at most a couple of seeds and always cost more.
    assert all(best["S"] - row["S"] <= 2 and row["cost_s"] > best["cost_s"] for row in rows)


def test_plan_tie_on_cost_takes_smaller_mdd():
    # run_s = 0, prob_s = 1: cost = 2 S P, so (20, 256) and (40, 128) both cost 10240 s.
    # With only a problem effect (sigma2_prob = 1): mdd(20, 128) = 2.954/sqrt(128) = 0.261
    # misses 0.255, mdd(40, 128) = 2.874/sqrt(128) = 0.254 and mdd(20, 256) = 0.185 reach it.
    kw = {"seeds": [20, 40], "problems": [128, 256]}
    out = _check_plan_against_brute((0.0, 1.0, 0.0), 0.255, 0.0, 1.0, **kw)
    assert out["best"]["cost_s"] == 10240.0
    assert (out["best"]["S"], out["best"]["P"]) == (20, 256)
    assert {(r["S"], r["P"]) for r in out["by_problems"]} == {(40, 128), (20, 256)}
    assert out["by_problems"][0]["cost_s"] == out["best"]["cost_s"]  # a real tie
    # Control: with a seed effect instead the same tie goes to (40, 128), the smaller mdd there.
    out = _check_plan_against_brute((1.0, 0.0, 0.0), 0.5, 0.0, 1.0, **kw)
    assert (out["best"]["S"], out["best"]["P"]) == (40, 128)


def test_plan_arms_grid_and_unreachable():
    sig = (0.002, 0.05, 0.2)
    out = _check_plan_against_brute(sig, 0.08, 600.0, 0.5, arms=3, seeds=[12, 1, 4, 8])
    assert out["best"]["cost_s"] == 3 * out["best"]["S"] * (600.0 + out["best"]["P"] * 0.5)
    assert out["mdd_smallest"] is None  # the smallest grid seed count is 1: no t quantile
    out = _check_plan_against_brute(sig, 1e-4, 600.0, 0.5)
    assert out["best"] is None
    assert all(row["S"] is None for row in out["by_problems"])
    assert isinstance(out["reason"], str) and "0.0001" in out["reason"]
    assert out["mdd_smallest"] == pytest.approx(tl.mdd(2, 128, *sig), rel=REL)


# ---------------------------------------------------------------------------------------------
# from_records


def test_from_records_intersection_and_order():
    records_a = {
        3: {5: True, 2: False, 9: True, 7: 1},
        1: {2: 1, 5: 0, 9: 1, 7: 0},
        4: {2: 1, 5: 1, 9: 1, 7: 1},  # seed 4 is not in arm b: dropped
    }
    records_b = {
        1: {9: False, 2: True, 5: True, 7: True},
        3: {2: 0, 5: 1, 7: 0},  # problem 9 missing in this run: dropped everywhere
        2: {2: 0, 5: 0, 9: 0, 7: 0},  # seed 2 is not in arm a: dropped
    }
    a, b, seeds, problems = tl.from_records(records_a, records_b)
    assert seeds == [1, 3] and problems == [2, 5, 7]
    assert a.dtype == np.float64 and b.dtype == np.float64
    assert a.tolist() == [[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]
    assert b.tolist() == [[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]]
    # The arrays feed the analysis directly.
    assert tl.components(a, b)["diff_per_seed"] == [pytest.approx(-2 / 3, rel=REL), 1 / 3]


def test_from_records_bool_and_int_agree():
    rng = np.random.default_rng(9)
    grid = rng.integers(0, 2, (3, 5))
    as_int = {s: {p: int(grid[s, p]) for p in range(5)} for s in range(3)}
    as_bool = {s: {p: bool(grid[s, p]) for p in range(5)} for s in range(3)}
    a1, b1, _, _ = tl.from_records(as_int, as_bool)
    assert np.array_equal(a1, grid) and np.array_equal(b1, grid)


def test_from_records_nothing_common():
    _one_line_value_error(
        tl.from_records, {1: {0: 1}}, {2: {0: 1}}, match=r"no seed common.*\[1\] vs \[2\]"
    )
    _one_line_value_error(
        tl.from_records,
        {1: {0: 1}, 2: {1: 1}},
        {1: {0: 1, 1: 0}, 2: {0: 1, 1: 1}},
        match="no problem",
    )
    # Control: one shared problem is enough.
    a, b, seeds, problems = tl.from_records({1: {0: 1}, 2: {0: 0, 1: 1}}, {1: {0: 0}, 2: {0: 1}})
    assert (seeds, problems, a.tolist(), b.tolist()) == (
        [1, 2],
        [0],
        [[1.0], [0.0]],
        [[0.0], [1.0]],
    )
