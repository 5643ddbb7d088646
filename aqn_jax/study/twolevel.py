"""Two-level (seeds x problems) analysis of a paired difference between two arms.

Pure numpy; scipy gives the Student t quantiles (`scipy.stats.t.ppf`).
Each run (one arm, one training seed) is evaluated on the SAME P problems, each scored 0/1:
a[s, p] and b[s, p] are [S, P] arrays (seed s pairs across the arms: same seed, same data order;
problem p pairs across every run). The paired difference is d[s, p] = a[s, p] - b[s, p].

Model (crossed two-way random effects, one observation per cell):
  d[s, p] = delta + u_s + v_p + e_sp
  Var(u) = sigma2_seed   the training-seed effect
  Var(v) = sigma2_prob   the problem's own paired effect, shared by every seed (same problems)
  Var(e) = sigma2_res    the seed x problem residual
  D = mean_{s,p} d;  Var(D) = sigma2_seed/S + sigma2_prob/P + sigma2_res/(S P)

components(a, b)  (method of moments, two-way ANOVA without replication)
  D_s = mean_p d[s, p] (per-seed paired difference), D_p = mean_s d[s, p], D = mean d
  MS_seed = P sum_s (D_s - D)^2 / (S - 1)                   E[MS_seed] = sigma2_res + P sigma2_seed
  MS_prob = S sum_p (D_p - D)^2 / (P - 1)                   E[MS_prob] = sigma2_res + S sigma2_prob
  MS_res  = sum_sp (d - D_s - D_p + D)^2 / ((S-1)(P-1))     E[MS_res]  = sigma2_res
  sigma2_seed = max(0, (MS_seed - MS_res) / P), sigma2_prob = max(0, (MS_prob - MS_res) / S),
  sigma2_res = MS_res
  seed_part    = sigma2_seed / S                   (shrinks only with more seeds)
  problem_part = sigma2_prob / P + sigma2_res/(S P)
      The residual term shrinks with more seeds OR more problems; it is attributed to the
      problem part because it is evaluation noise within a run (which problems a run gets right).
  var_total = seed_part + problem_part  (= (MS_seed + MS_prob - MS_res)/(S P) when nothing clips),
  se = sqrt(var_total), seed_share = seed_part / var_total
  Degenerate: S < 2 or P < 2 -> the MS, sigma2, parts, se and share are None with `reason`;
  var_total = 0 (every d the same) -> seed_share None with `reason`.

bootstrap_ci(a, b)  (the crossed-design bootstrap)
  Each replicate resamples the seeds (S with replacement) and, within them, the problems (P with
  replacement): ONE problem draw per replicate, the same problems for every drawn seed, so the
  replicate keeps problems paired across seeds. D* = mean of d over the drawn (seed, problem)
  cells = w_s^T d w_p / (S P) with w_s, w_p the multinomial draw counts, so a replicate costs
  S + P counts and an [S]x[S,P]x[P] product (memory reps x P, not reps x S x P).
  se_boot = SD of the replicates (ddof 1);
  ci = D ± t_{(1+level)/2, S-1} se_boot  (a percentile interval over 6..12 seed clusters
       under-covers; the t quantile with S - 1 df stands in for the few seeds);
  ci_percentile = the (1-level)/2 and (1+level)/2 quantiles of the replicates.
  Expected resampling variance given the data (alpha_s = D_s - D, beta_p = D_p - D, gamma the
  double-centred residual; McCullagh 2000, "Resampling and exchangeable arrays"):
    Var*(D*) = sum alpha^2 / S^2 + sum beta^2 / P^2 + sum gamma^2 / (S^2 P^2)
            = ((S-1) MS_seed/S + (P-1) MS_prob/P + (S-1)(P-1) MS_res/(S P)) / (S P)
  whose expectation is about sigma2_seed (S-1)/S^2 + sigma2_prob/P + 3 sigma2_res/(S P): no
  bootstrap of a crossed array is unbiased (Var(D) itself is (MS_seed + MS_prob - MS_res)/(S P)).
  The residual is counted three times (twice too often), so where the problem part dominates
  the interval is conservative (simulated coverage 0.99 at level 0.95). The seed part comes with
  a factor (S-1)/S (a ddof-0 variance over the seed clusters), so where it dominates the
  coverage tends to P(|T_{S-1}| < t_{0.975, S-1} sqrt((S-1)/S)) = 0.934, 0.937, 0.941 at
  S = 6, 8, 12 (simulated 0.94-0.95 with some residual; tests/test_twolevel.py). Multiplying
  se_boot by sqrt(S/(S-1)) would remove that shortfall, at more over-coverage elsewhere.
  Degenerate: S < 2 -> se_boot and both intervals None with `reason`.

plan(sigma2_seed, sigma2_prob, sigma2_res, target_mdd, seconds_per_run, seconds_per_problem)
  mdd(S, P) = (t_{1-alpha/2, S-1} + t_{power, S-1}) sqrt(sigma2_seed/S + sigma2_prob/P
             + sigma2_res/(S P))
      (the normal-approximation planning formula with t quantiles on S - 1 df: the seeds are
      the scarce replicates); None for S < 2.
  cost(S, P) = arms S (seconds_per_run + P seconds_per_problem)  (seconds_per_run: the training
      part of one run; seconds_per_problem: evaluation seconds per problem per run)
  Over the grid seeds x problems: the cheapest (S, P) with mdd <= target_mdd (ties: the smaller
  mdd, then fewer seeds), or None with `reason`; per P the smallest S reaching the target; the
  mdd at the smallest grid point. The sigma2 are estimates taken as the truth: a planning
  figure, not a guarantee.

from_records(records_a, records_b)  records: {seed: {problem_index: correct (bool or 0/1)}}
  Keeps the seeds present in both arms and the problems present in every run of those seeds in
  both arms; returns (a, b, seeds, problems): two [S, P] float arrays, rows in sorted seed order
  and columns in sorted problem order, and the sorted seed and problem lists.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from scipy import stats as _sps

LEVEL = 0.95
ALPHA = 0.05
POWER = 0.8
PROBLEMS = (128, 256, 384, 512, 768, 1024, 1319)


def _diff(a: Any, b: Any) -> np.ndarray:
    """d = a - b as a finite [S, P] float array; one-line ValueError otherwise."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(
            f"twolevel: arms must be same-shape [S, P] arrays, got {a.shape} and {b.shape}"
        )
    d = a - b
    if not np.all(np.isfinite(d)):
        raise ValueError(f"twolevel: {int(np.sum(~np.isfinite(d)))} non-finite differences")
    return d


def _mean_squares(d: np.ndarray) -> tuple[float, float, float]:
    """(MS_seed, MS_prob, MS_res) of the two-way ANOVA without replication."""
    s, p = d.shape
    row, col, grand = d.mean(axis=1), d.mean(axis=0), d.mean()
    resid = d - row[:, None] - col[None, :] + grand
    ms_seed = p * float(np.sum((row - grand) ** 2)) / (s - 1)
    ms_prob = s * float(np.sum((col - grand) ** 2)) / (p - 1)
    return ms_seed, ms_prob, float(np.sum(resid**2)) / ((s - 1) * (p - 1))


def components(a: Any, b: Any) -> dict[str, Any]:
    """The seed / problem split of Var(D) by the method of moments (module docstring)."""
    d = _diff(a, b)
    s, p = d.shape
    keys = ("ms_seed", "ms_prob", "ms_res", "sigma2_seed", "sigma2_prob", "sigma2_res")
    out: dict[str, Any] = {"S": s, "P": p, "diff": float(d.mean()) if d.size else None}
    out["diff_per_seed"] = [float(x) for x in d.mean(axis=1)] if p else []
    out.update(dict.fromkeys(keys + ("seed_part", "problem_part", "var_total", "se")))
    out.update(seed_share=None, reason=None)
    if s < 2 or p < 2:
        out["reason"] = f"need S >= 2 seeds and P >= 2 problems (S={s}, P={p})"
        return out
    ms_seed, ms_prob, ms_res = _mean_squares(d)
    v_seed, v_prob = max(0.0, (ms_seed - ms_res) / p), max(0.0, (ms_prob - ms_res) / s)
    seed_part, problem_part = v_seed / s, v_prob / p + ms_res / (s * p)
    total = seed_part + problem_part
    out.update(zip(keys, (ms_seed, ms_prob, ms_res, v_seed, v_prob, ms_res), strict=True))
    out.update(seed_part=seed_part, problem_part=problem_part, var_total=total)
    out["se"] = math.sqrt(total)
    if total > 0.0:
        out["seed_share"] = seed_part / total
    else:
        out["reason"] = "every paired difference is the same (var_total 0)"
    return out


def _replicates(d: np.ndarray, reps: int, rng: np.random.Generator) -> np.ndarray:
    """`reps` crossed-bootstrap means: S seeds and P problems drawn with replacement, the same
    problem draw for every drawn seed, as multinomial counts (chunks of <= 2**22 weights)."""
    s, p = d.shape
    chunk = max(1, (1 << 22) // max(s, p))
    out = []
    for start in range(0, reps, chunk):
        n = min(chunk, reps - start)
        w_seed = rng.multinomial(s, np.full(s, 1.0 / s), size=n)
        w_prob = rng.multinomial(p, np.full(p, 1.0 / p), size=n)
        out.append(np.einsum("rp,rp->r", w_seed @ d, w_prob) / (s * p))
    return np.concatenate(out)


def bootstrap_ci(
    a: Any, b: Any, level: float = LEVEL, reps: int = 2000, seed: int = 0
) -> dict[str, Any]:
    """The crossed-design bootstrap of D: se_boot, the t-based `ci` and the percentile interval
    (module docstring); numpy's default_rng(seed), so a fixed seed gives the same answer."""
    d = _diff(a, b)
    s, p = d.shape
    out: dict[str, Any] = {"S": s, "P": p, "diff": float(d.mean()) if d.size else None}
    out.update(level=level, reps=reps, se_boot=None, ci=None, ci_percentile=None, reason=None)
    if s < 2 or p < 1 or reps < 2:
        out["reason"] = f"need S >= 2 seeds, P >= 1 problem, reps >= 2 (S={s}, P={p}, reps={reps})"
        return out
    boot = _replicates(d, reps, np.random.default_rng(seed))
    se = float(np.std(boot, ddof=1))
    half = float(_sps.t.ppf(0.5 + level / 2.0, s - 1)) * se
    lo, hi = np.quantile(boot, [0.5 - level / 2.0, 0.5 + level / 2.0])
    diff = out["diff"]
    out.update(se_boot=se, ci=(diff - half, diff + half), ci_percentile=(float(lo), float(hi)))
    return out


def mdd(
    S: int,
    P: int,
    sigma2_seed: float,
    sigma2_prob: float,
    sigma2_res: float,
    power: float = POWER,
    alpha: float = ALPHA,
) -> float | None:
    """The planning minimum detectable difference at S seeds and P problems (module docstring);
    None for S < 2 (no t quantile on 0 df)."""
    if S < 2 or P < 1:
        return None
    var = sigma2_seed / S + sigma2_prob / P + sigma2_res / (S * P)
    t = _sps.t.ppf(1.0 - alpha / 2.0, S - 1) + _sps.t.ppf(power, S - 1)
    return float(t * math.sqrt(var))


def plan(
    sigma2_seed: float,
    sigma2_prob: float,
    sigma2_res: float,
    target_mdd: float,
    seconds_per_run: float,
    seconds_per_problem: float,
    arms: int = 2,
    seeds: Iterable[int] = range(2, 41),
    problems: Iterable[int] = PROBLEMS,
    power: float = POWER,
    alpha: float = ALPHA,
) -> dict[str, Any]:
    """The cheapest (S, P) on the grid whose mdd reaches `target_mdd` (module docstring)."""
    seeds, problems = sorted(seeds), sorted(problems)
    sig = (sigma2_seed, sigma2_prob, sigma2_res)
    points = []
    for p in problems:
        for s in seeds:
            m = mdd(s, p, *sig, power=power, alpha=alpha)
            cost = arms * s * (seconds_per_run + p * seconds_per_problem)
            points.append({"S": s, "P": p, "mdd": m, "cost_s": float(cost)})
    ok = [pt for pt in points if pt["mdd"] is not None and pt["mdd"] <= target_mdd]
    best = min(ok, key=lambda pt: (pt["cost_s"], pt["mdd"], pt["S"])) if ok else None
    table = []
    for p in problems:
        hit = [pt for pt in ok if pt["P"] == p]
        table.append(min(hit, key=lambda pt: pt["S"]) if hit else {"P": p, "S": None})
    out: dict[str, Any] = {"target_mdd": target_mdd, "best": best, "by_problems": table}
    out["mdd_smallest"] = mdd(seeds[0], problems[0], *sig, power=power, alpha=alpha)
    out["reason"] = None if best else f"no (S, P) on the grid reaches mdd <= {target_mdd}"
    return out


def from_records(
    records_a: Mapping[Any, Mapping[int, Any]], records_b: Mapping[Any, Mapping[int, Any]]
) -> tuple[np.ndarray, np.ndarray, list[Any], list[int]]:
    """(a, b, seeds, problems) from per-run correctness records (module docstring)."""
    seeds = sorted(set(records_a) & set(records_b))
    if not seeds:
        a_seeds, b_seeds = sorted(records_a), sorted(records_b)
        raise ValueError(f"from_records: no seed common to both arms ({a_seeds} vs {b_seeds})")
    runs = [records_a[s] for s in seeds] + [records_b[s] for s in seeds]
    problems = sorted(set.intersection(*(set(r) for r in runs)))
    if not problems:
        raise ValueError(f"from_records: no problem is in every run of seeds {seeds}")

    def grid(records: Mapping[Any, Mapping[int, Any]]) -> np.ndarray:
        return np.array([[float(records[s][q]) for q in problems] for s in seeds], np.float64)

    return grid(records_a), grid(records_b), seeds, problems
