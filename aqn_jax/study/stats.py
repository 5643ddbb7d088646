"""Statistics over seeds: descriptive summaries, Welch's t-test, effect sizes, Holm's correction.

Pure numpy; scipy gives the Student t and noncentral t distributions (`scipy.stats.t`, `.nct`)
and the root finder of the minimum detectable difference (`scipy.optimize.brentq`).
Every function takes plain sequences of floats; `None` and non-finite values (a run that did not
measure a metric, or diverged to NaN) are dropped and counted in `n_dropped`.

Formulas (x_1..x_n one group, n its size, level = 0.95 unless given):

describe(x)
  mean  m = sum(x) / n
  std   s = sqrt(sum((x - m)^2) / (n - 1))            (sample SD, ddof = 1)
  sem     = s / sqrt(n)
  CI      m ± t_{(1+level)/2, n-1} * sem               (Student t with n - 1 df)
  n = 1: std, sem and the CI are None (undefined); n = 0: the mean is None too.

welch(a, b)  (a: n1, m1, s1^2; b: n2, m2, s2^2)
  diff  = m1 - m2
  se    = sqrt(s1^2/n1 + s2^2/n2)
  t     = diff / se
  df    = se^4 / ((s1^2/n1)^2/(n1-1) + (s2^2/n2)^2/(n2-1))        (Welch–Satterthwaite)
  p     = 2 * P(T_df <= -|t|) = 2 * cdf(-|t|, df)                  (two-sided)
  CI    diff ± t_{(1+level)/2, df} * se                            (same Welch df)
  Cohen's d = diff / s_p with s_p = sqrt((s1^2 + s2^2) / 2)        (the root of the MEAN of the
            two variances, unweighted; it equals the df-weighted pooled SD when n1 = n2)
  Hedges' g = J * d with J = 1 - 3 / (4 (n1 + n2) - 9)             (small-sample correction)
  Degenerate: n1 < 2 or n2 < 2, or both variances zero (se = 0) -> t, df, p, CI, d, g are None
  and `reason` says why; `diff` is still reported whenever both groups have a value.

power(diff, sd_a, sd_b, n_a, n_b)  (Welch's test at two-sided level alpha = 0.05)
  se = sqrt(sd_a^2/n_a + sd_b^2/n_b), df Welch–Satterthwaite as above, tc = t_{1-alpha/2, df}
  power = P(T' > tc) + P(T' < -tc),  T' ~ noncentral t(df, ncp = diff / se)
mdd(sd_a, sd_b, n_a, n_b)  the minimum detectable difference: the diff > 0 whose power is 0.8
  (root of power(diff) = 0.8; for large df it tends to (z_0.975 + z_0.8) se = 2.80 se)
seeds_needed(diff, sd_a, sd_b)  the smallest n per arm (n_a = n_b = n) with power >= 0.8
  The SDs are the observed ones, taken as the truth: a planning figure, not a guarantee.

paired(a, b)  (a_i, b_i measured on the same seed i; d_i = a_i - b_i, n pairs)
  diff  = mean(d);  sd_d = sqrt(sum((d - diff)^2) / (n - 1));  se = sd_d / sqrt(n)
  t     = diff / se, df = n - 1, p = 2 * cdf(-|t|, df)             (paired t-test, two-sided)
  CI    diff ± t_{(1+level)/2, n-1} * se
  d_z   = diff / sd_d;  Hedges' g = J * d_z with J = 1 - 3 / (4 (n - 1) - 1); at n = 2
        (df 1) J is 0, so g is None there: undefined, not a zero effect
  mdd   the diff > 0 detected with power 0.8: P(T' > tc) + P(T' < -tc) = 0.8,
        T' ~ noncentral t(n - 1, diff / se), tc = t_{0.975, n-1}
  Degenerate: n < 2, or every difference the same (sd_d = 0) -> None with `reason`.

holm(p_1..p_m)  (Holm–Bonferroni step-down; None entries are tests not run and are left out of
  the family: m counts the non-None p-values)
  sort ascending p_(1) <= ... <= p_(m);  adj_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))
  returned in the input order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats as _sps

LEVEL = 0.95
ALPHA = 0.05
POWER = 0.8


def _values(x: Sequence[Any] | np.ndarray) -> tuple[np.ndarray, int]:
    """The finite float values of `x` and how many entries were dropped (None / NaN / inf)."""
    raw = np.asarray(x, dtype=object).ravel().tolist()
    vals = [float(v) for v in raw if v is not None and math.isfinite(float(v))]
    return np.asarray(vals, dtype=np.float64), len(raw) - len(vals)


def _var(v: np.ndarray, m: float) -> float:
    """Sample variance (ddof=1); exactly 0 for identical values (the float mean of n copies of
    x need not be x, which would leave a ~1e-32 variance and an infinite t)."""
    if np.all(v == v[0]):
        return 0.0
    return float(np.sum((v - m) ** 2) / (v.size - 1))


def _tcrit(df: float, level: float) -> float:
    return float(_sps.t.ppf(0.5 + level / 2.0, df))


def describe(x: Sequence[Any] | np.ndarray, level: float = LEVEL) -> dict[str, Any]:
    """n, mean, std (ddof=1), sem and the t-based CI of the mean (half-width and bounds)."""
    v, dropped = _values(x)
    n = int(v.size)
    out: dict[str, Any] = {
        "n": n,
        "n_dropped": dropped,
        "mean": float(v.mean()) if n else None,
        "std": None,
        "sem": None,
        "ci_level": level,
        "ci_half": None,
        "ci_low": None,
        "ci_high": None,
    }
    if n >= 2:
        m = float(v.mean())
        s = math.sqrt(_var(v, m))
        sem = s / math.sqrt(n)
        half = _tcrit(n - 1, level) * sem
        out.update(std=s, sem=sem, ci_half=half, ci_low=m - half, ci_high=m + half)
    return out


def welch(
    a: Sequence[Any] | np.ndarray, b: Sequence[Any] | np.ndarray, level: float = LEVEL
) -> dict[str, Any]:
    """Welch's unequal-variance t-test of mean(a) - mean(b), with its CI and effect sizes."""
    va, da = _values(a)
    vb, db = _values(b)
    n1, n2 = int(va.size), int(vb.size)
    out: dict[str, Any] = {
        "n_a": n1,
        "n_b": n2,
        "n_dropped": da + db,
        "mean_a": float(va.mean()) if n1 else None,
        "mean_b": float(vb.mean()) if n2 else None,
        "diff": float(va.mean() - vb.mean()) if n1 and n2 else None,
        **_not_tested(level),
        "diff_ci_half": None,
        "sd_pooled": None,
        "cohen_d": None,
        "hedges_g": None,
        "mdd": None,
        "reason": None,
    }
    if n1 < 2 or n2 < 2:
        out["reason"] = f"n < 2 (n_a={n1}, n_b={n2})"
        return out
    m1, m2 = float(va.mean()), float(vb.mean())
    v1, v2 = _var(va, m1), _var(vb, m2)
    q1, q2 = v1 / n1, v2 / n2
    se = math.sqrt(q1 + q2)
    sd_pooled = math.sqrt((v1 + v2) / 2.0)
    if se == 0.0:
        out["reason"] = "zero variance in both groups"
        return out
    diff = m1 - m2
    t = diff / se
    df = (q1 + q2) ** 2 / (q1**2 / (n1 - 1) + q2**2 / (n2 - 1))
    p = float(min(1.0, 2.0 * _sps.t.cdf(-abs(t), df)))
    half = _tcrit(df, level) * se
    d = diff / sd_pooled
    j = 1.0 - 3.0 / (4.0 * (n1 + n2) - 9.0)
    out.update(
        se=se,
        t=t,
        df=df,
        p=p,
        diff_ci_low=diff - half,
        diff_ci_high=diff + half,
        diff_ci_half=half,
        sd_pooled=sd_pooled,
        cohen_d=d,
        hedges_g=j * d,
        mdd=mdd(math.sqrt(v1), math.sqrt(v2), n1, n2),
    )
    return out


def _not_tested(level: float) -> dict[str, Any]:
    """A test's fields before (or without) the test: its statistic, p and interval."""
    keys = ("se", "t", "df", "p", "ci_level", "diff_ci_low", "diff_ci_high")
    return {k: level if k == "ci_level" else None for k in keys}


def _welch_se_df(sd_a: float, sd_b: float, n_a: int, n_b: int) -> tuple[float, float]:
    q1, q2 = sd_a**2 / n_a, sd_b**2 / n_b
    se = math.sqrt(q1 + q2)
    return se, (q1 + q2) ** 2 / (q1**2 / (n_a - 1) + q2**2 / (n_b - 1))


def power(
    diff: float, sd_a: float, sd_b: float, n_a: int, n_b: int, alpha: float = ALPHA
) -> float | None:
    """Power of the two-sided Welch test to detect a true difference `diff` (module docstring).
    None when undefined (n < 2 in a group, or both SDs zero)."""
    if n_a < 2 or n_b < 2 or sd_a == 0.0 and sd_b == 0.0:
        return None
    se, df = _welch_se_df(sd_a, sd_b, n_a, n_b)
    tc = _tcrit(df, 1.0 - alpha)
    ncp = abs(diff) / se
    # The far tail against the difference is negligible; scipy's nct returns NaN for it at
    # large ncp and small df (e.g. df 1.2, ncp 8), where it is < 1e-6.
    against = float(_sps.nct.cdf(-tc, df, ncp))
    return float(_sps.nct.sf(tc, df, ncp)) + (against if math.isfinite(against) else 0.0)


def mdd(
    sd_a: float, sd_b: float, n_a: int, n_b: int, target: float = POWER, alpha: float = ALPHA
) -> float | None:
    """The minimum difference the Welch test detects with probability `target` (module
    docstring); None when the power is undefined."""
    if power(1.0, sd_a, sd_b, n_a, n_b, alpha) is None:
        return None
    se, _ = _welch_se_df(sd_a, sd_b, n_a, n_b)
    # Power grows with the difference: bracket the root by doubling from one se.
    hi = se
    while power(hi, sd_a, sd_b, n_a, n_b, alpha) < target:
        hi *= 2.0
    return float(_brentq(lambda d: power(d, sd_a, sd_b, n_a, n_b, alpha) - target, 0.0, hi))


def seeds_needed(
    diff: float,
    sd_a: float,
    sd_b: float,
    target: float = POWER,
    alpha: float = ALPHA,
    max_n: int = 10_000,
) -> int | None:
    """The smallest n (seeds per arm) at which the Welch test detects `diff` with probability
    `target`; None past `max_n` or when undefined."""
    n = 2
    while n <= max_n:
        p = power(diff, sd_a, sd_b, n, n, alpha)
        if p is None:
            return None
        if p >= target:
            return n
        n = n + 1 if n < 100 else int(n * 1.05) + 1
    return None


def _brentq(f, lo: float, hi: float) -> float:
    from scipy.optimize import brentq

    return brentq(f, lo, hi, xtol=1e-12, rtol=1e-10)


def paired(
    a: Sequence[Any] | np.ndarray, b: Sequence[Any] | np.ndarray, level: float = LEVEL
) -> dict[str, Any]:
    """The paired t-test of mean(a - b) over matched pairs (module docstring); a pair with a
    missing or non-finite value is dropped and counted in `n_dropped`."""
    if len(a) != len(b):
        raise ValueError(f"paired: {len(a)} values against {len(b)}; pairs must match")
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if _finite(x) and _finite(y)]
    d = np.array([float(x) - float(y) for x, y in pairs], np.float64)
    n = int(d.size)
    out: dict[str, Any] = {
        "n": n,
        "n_dropped": len(a) - n,
        "diff": float(d.mean()) if n else None,
        "sd_diff": None,
        **_not_tested(level),
        "hedges_g": None,
        "mdd": None,
        "reason": None,
    }
    if n < 2:
        out["reason"] = f"n < 2 pairs (n={n})"
        return out
    m = float(d.mean())
    sd = math.sqrt(_var(d, m))
    if sd == 0.0:
        out["reason"] = "every pair differs by the same amount (sd of the differences 0)"
        return out
    se, df = sd / math.sqrt(n), n - 1
    t = m / se
    half = _tcrit(df, level) * se
    out.update(
        sd_diff=sd,
        se=se,
        t=t,
        df=df,
        p=float(min(1.0, 2.0 * _sps.t.cdf(-abs(t), df))),
        diff_ci_low=m - half,
        diff_ci_high=m + half,
        hedges_g=(1.0 - 3.0 / (4.0 * df - 1.0)) * m / sd if df >= 2 else None,
        mdd=paired_mdd(sd, n),
    )
    return out


def paired_power(diff: float, sd_diff: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t-test to detect a true mean difference `diff`."""
    df, se = n - 1, sd_diff / math.sqrt(n)
    tc = _tcrit(df, 1.0 - alpha)
    against = float(_sps.nct.cdf(-tc, df, abs(diff) / se))
    return float(_sps.nct.sf(tc, df, abs(diff) / se)) + (against if math.isfinite(against) else 0)


def paired_mdd(sd_diff: float, n: int, target: float = POWER, alpha: float = ALPHA) -> float:
    """The smallest mean difference the paired test detects with probability `target`."""
    hi = sd_diff / math.sqrt(n)
    while paired_power(hi, sd_diff, n, alpha) < target:
        hi *= 2.0
    return float(_brentq(lambda d: paired_power(d, sd_diff, n, alpha) - target, 0.0, hi))


def _finite(x) -> bool:
    return x is not None and math.isfinite(float(x))


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm–Bonferroni adjusted p-values, in the input order (None stays None, not counted)."""
    idx = [i for i, p in enumerate(pvalues) if p is not None]
    m = len(idx)
    order = sorted(idx, key=lambda i: pvalues[i])
    adjusted: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))
        adjusted[i] = running
    return adjusted


def format_p(p: float | None) -> str:
    """A p-value with 3 significant digits, "< 0.001" below 0.001, "n/a" for None."""
    if p is None:
        return "n/a"
    if p < 0.001:
        return "< 0.001"
    return np.format_float_positional(p, precision=3, unique=False, fractional=False, trim="k")
