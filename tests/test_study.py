"""The study statistics (against scipy and hand arithmetic) and the study report."""

import copy
import json
import math
import os
import re

import numpy as np
import pytest
import scipy.stats

from aqn_jax.study import report, stats

# Fixed 5-seed samples, shaped like the seed-001 losses (targeted ~12.837 ± 0.005, global
# ~12.861 ± 0.010); the published numbers are summaries, so these arrays are made up.
TARGETED = np.array([12.8321, 12.8412, 12.8350, 12.8436, 12.8351])
GLOBAL = np.array([12.8502, 12.8713, 12.8589, 12.8498, 12.8728])


def test_describe_against_scipy():
    d = stats.describe(TARGETED)
    n = len(TARGETED)
    assert d["n"] == n and d["n_dropped"] == 0
    assert d["mean"] == pytest.approx(TARGETED.mean(), rel=1e-12)
    assert d["std"] == pytest.approx(np.std(TARGETED, ddof=1), rel=1e-12)
    assert d["sem"] == pytest.approx(scipy.stats.sem(TARGETED), rel=1e-12)
    lo, hi = scipy.stats.t.interval(
        0.95, n - 1, loc=TARGETED.mean(), scale=scipy.stats.sem(TARGETED)
    )
    assert d["ci_low"] == pytest.approx(lo, rel=1e-12)
    assert d["ci_high"] == pytest.approx(hi, rel=1e-12)
    assert d["ci_half"] == pytest.approx((hi - lo) / 2, rel=1e-9)
    # t_{0.975, 4} = 2.776445...: the half-width is that times the sem.
    assert d["ci_half"] == pytest.approx(2.7764451 * d["sem"], rel=1e-6)


def test_describe_drops_missing_and_handles_small_n():
    d = stats.describe([0.5, None, float("nan"), 0.7])
    assert d["n"] == 2 and d["n_dropped"] == 2
    assert d["mean"] == pytest.approx(0.6)
    assert d["std"] == pytest.approx(math.sqrt(0.02))  # ((0.1)^2 + (0.1)^2) / 1
    one = stats.describe([0.42])
    assert one["n"] == 1 and one["mean"] == pytest.approx(0.42)
    assert one["std"] is None and one["sem"] is None and one["ci_half"] is None
    assert one["ci_low"] is None and one["ci_high"] is None
    empty = stats.describe([])
    assert empty["n"] == 0 and empty["mean"] is None
    const = stats.describe([0.3, 0.3, 0.3])
    assert const["std"] == 0.0 and const["ci_half"] == 0.0


def test_welch_against_scipy():
    w = stats.welch(TARGETED, GLOBAL)
    ref = scipy.stats.ttest_ind(TARGETED, GLOBAL, equal_var=False)
    assert w["reason"] is None
    assert w["t"] == pytest.approx(ref.statistic, rel=1e-10)
    assert w["p"] == pytest.approx(ref.pvalue, rel=1e-8)
    assert w["p"] < 0.01  # these made-up samples are well separated
    # Welch–Satterthwaite by hand.
    q1 = np.var(TARGETED, ddof=1) / 5
    q2 = np.var(GLOBAL, ddof=1) / 5
    df = (q1 + q2) ** 2 / (q1**2 / 4 + q2**2 / 4)
    assert w["df"] == pytest.approx(df, rel=1e-12)
    assert w["df"] == pytest.approx(ref.df, rel=1e-10)
    assert w["diff"] == pytest.approx(TARGETED.mean() - GLOBAL.mean(), rel=1e-12)
    lo, hi = ref.confidence_interval(0.95)
    assert w["diff_ci_low"] == pytest.approx(lo, rel=1e-9)
    assert w["diff_ci_high"] == pytest.approx(hi, rel=1e-9)
    lo2, hi2 = scipy.stats.t.interval(0.95, df, loc=w["diff"], scale=math.sqrt(q1 + q2))
    assert (w["diff_ci_low"], w["diff_ci_high"]) == pytest.approx((lo2, hi2), rel=1e-9)
    # Symmetry: swapping the groups flips t, the difference and d; p and df stay.
    r = stats.welch(GLOBAL, TARGETED)
    assert r["t"] == pytest.approx(-w["t"]) and r["cohen_d"] == pytest.approx(-w["cohen_d"])
    assert r["p"] == pytest.approx(w["p"]) and r["df"] == pytest.approx(w["df"])


def test_welch_by_hand():
    # a = [1, 2, 3]: mean 2, var = (1 + 0 + 1) / 2 = 1
    # b = [2, 4, 6]: mean 4, var = (4 + 0 + 4) / 2 = 4
    # se = sqrt(1/3 + 4/3) = sqrt(5/3);  t = (2 - 4) / sqrt(5/3) = -1.5491933
    # df = (5/3)^2 / ((1/3)^2 / 2 + (4/3)^2 / 2) = (25/9) / (17/18) = 50/17
    # s_p = sqrt((1 + 4) / 2) = sqrt(2.5);  d = -2 / sqrt(2.5) = -1.2649111
    # J = 1 - 3 / (4 * 6 - 9) = 1 - 3/15 = 0.8;  g = 0.8 * d = -1.0119289
    w = stats.welch([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    assert w["diff"] == pytest.approx(-2.0)
    assert w["se"] == pytest.approx(math.sqrt(5 / 3))
    assert w["t"] == pytest.approx(-2 / math.sqrt(5 / 3))
    assert w["df"] == pytest.approx(50 / 17)
    assert w["sd_pooled"] == pytest.approx(math.sqrt(2.5))
    assert w["cohen_d"] == pytest.approx(-1.2649111, rel=1e-7)
    assert w["hedges_g"] == pytest.approx(-1.0119289, rel=1e-7)
    # p against scipy's t distribution at the hand df, and against ttest_ind.
    assert w["p"] == pytest.approx(2 * scipy.stats.t.sf(2 / math.sqrt(5 / 3), 50 / 17))
    assert w["p"] == pytest.approx(
        scipy.stats.ttest_ind([1, 2, 3], [2, 4, 6], equal_var=False).pvalue
    )
    # Unequal sizes: a = [0, 2] (mean 1, var 2), b = [1, 1, 4] (mean 2, var 3):
    # s_p = sqrt((2 + 3) / 2) = sqrt(2.5); d = -1 / sqrt(2.5) = -0.6324555
    # J = 1 - 3 / (4 * 5 - 9) = 1 - 3/11 = 8/11; g = -0.6324555 * 8/11 = -0.4599677
    u = stats.welch([0.0, 2.0], [1.0, 1.0, 4.0])
    assert u["cohen_d"] == pytest.approx(-0.6324555, rel=1e-6)
    assert u["hedges_g"] == pytest.approx(-0.4599677, rel=1e-6)
    ref = scipy.stats.ttest_ind([0.0, 2.0], [1.0, 1.0, 4.0], equal_var=False)
    assert u["t"] == pytest.approx(ref.statistic) and u["p"] == pytest.approx(ref.pvalue)


def test_welch_degenerate():
    single = stats.welch([0.5], [0.4, 0.5, 0.6])
    assert single["p"] is None and single["t"] is None and single["cohen_d"] is None
    assert "n < 2" in single["reason"]
    assert single["diff"] == pytest.approx(0.0)
    assert stats.welch([], [0.1, 0.2])["diff"] is None
    # Seven copies of 0.7 have a float mean != 0.7 (a ~1e-32 variance if computed naively).
    const = stats.welch([0.7] * 7, [0.5, 0.5])
    assert const["p"] is None and const["reason"] == "zero variance in both groups"
    assert const["diff"] == pytest.approx(0.2)
    assert stats.describe([0.7] * 7)["std"] == 0.0
    same = stats.welch([0.3, 0.3], [0.3, 0.3])
    assert same["p"] is None and same["diff"] == 0.0
    # One constant group is fine: df = n_other - 1.
    # a = [0.25] * 3 (var 0), b = [0.1, 0.2, 0.3, 0.6]: mean 0.3, var = (0.04 + 0.01 + 0 + 0.09)
    # / 3 = 0.14/3; se = sqrt(0.14/12); t = -0.05 / se; df = n_b - 1 = 3.
    one_const = stats.welch([0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.6])
    assert one_const["df"] == pytest.approx(3.0)
    assert one_const["t"] == pytest.approx(-0.05 / math.sqrt(0.14 / 12))
    assert one_const["p"] == pytest.approx(2 * scipy.stats.t.cdf(-0.05 / math.sqrt(0.14 / 12), 3))
    assert one_const["cohen_d"] == pytest.approx(-0.05 / math.sqrt(0.14 / 6))


def test_power_and_minimum_detectable_difference():
    # Equal SDs and n: Welch's df is n_a + n_b - 2, Student's test. Known value (G*Power,
    # Cohen's tables): n = 5 per group, alpha 0.05 two-sided, power 0.8 -> d = 2.025.
    assert stats.mdd(1.0, 1.0, 5, 5) == pytest.approx(2.025, abs=1e-3)
    assert stats.power(stats.mdd(1.0, 1.0, 5, 5), 1.0, 1.0, 5, 5) == pytest.approx(0.8, abs=1e-9)
    # Scales with the SD; large n -> (z_0.975 + z_0.8) * se = 2.8016 se.
    assert stats.mdd(0.03, 0.03, 5, 5) == pytest.approx(0.03 * 2.0244, rel=1e-3)
    se = math.sqrt(2 / 2000)
    assert stats.mdd(1.0, 1.0, 2000, 2000) / se == pytest.approx(1.959964 + 0.841621, abs=2e-3)
    # The classic planning figure: d = 0.5 needs 64 per group.
    assert stats.seeds_needed(0.5, 1.0, 1.0) == 64
    assert stats.power(0.5, 1.0, 1.0, 63, 63) < 0.8 <= stats.power(0.5, 1.0, 1.0, 64, 64)
    # A simulation of Student's test at that difference rejects 80% of the time; with no
    # difference, 5% (the negative control: the power is not a constant).
    rng = np.random.default_rng(0)
    b = rng.normal(0.0, 1.0, (100_000, 5))
    for shift, rate in ((stats.mdd(1.0, 1.0, 5, 5), 0.8), (0.0, 0.05)):
        a = rng.normal(shift, 1.0, (100_000, 5))
        p = scipy.stats.ttest_ind(a, b, axis=1, equal_var=True).pvalue
        assert np.mean(p < 0.05) == pytest.approx(rate, abs=0.006)
    # Undefined: n < 2, or both SDs zero.
    assert stats.mdd(1.0, 1.0, 1, 5) is None and stats.power(0.1, 0.0, 0.0, 5, 5) is None
    # welch() reports the MDD of its own groups.
    a, b = [0.50, 0.52, 0.47, 0.55, 0.49], [0.45, 0.46, 0.51, 0.44, 0.48]
    w = stats.welch(a, b)
    sd_a, sd_b = np.std(a, ddof=1), np.std(b, ddof=1)
    assert w["mdd"] == pytest.approx(stats.mdd(sd_a, sd_b, 5, 5))
    assert w["mdd"] > abs(w["diff_ci_half"]) / 2


def test_holm_by_hand():
    # m = 4 (None is not a test). Sorted: 0.005 * 4 = 0.02; 0.01 * 3 = 0.03; 0.03 * 2 = 0.06;
    # 0.04 * 1 = 0.04 -> max(0.06, 0.04) = 0.06 (monotone).
    adj = stats.holm([0.01, 0.04, 0.03, None, 0.005])
    assert adj[3] is None
    assert adj[:3] + adj[4:] == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])  # 2 * 0.5 = 1; capped at 1
    assert stats.holm([0.2]) == pytest.approx([0.2])
    assert stats.holm([]) == []


def test_format_p():
    assert stats.format_p(None) == "n/a"
    assert stats.format_p(0.0004) == "< 0.001"
    assert stats.format_p(0.13) == "0.130"
    assert stats.format_p(0.0123456) == "0.0123"
    assert stats.format_p(0.001) == "0.00100"
    assert stats.format_p(1.0) == "1.00"


# ---------------------------------------------------------------------------------------------
# The report on a synthetic study

ACC = {  # (arm, seed) -> (acc_fault, acc_clean, heldout_loss)
    ("clean", "0"): (0.610, 0.640, 1.2345),
    ("clean", "1"): (0.620, 0.650, 1.2301),
    ("clean", "2"): (0.600, 0.630, 1.2399),
    ("global_aqn", "0"): (0.500, 0.600, 1.3012),
    ("global_aqn", "2"): (0.520, 0.590, 1.2987),  # seed 1 missing
    ("targeted", "0"): (0.540, 0.610, 1.2876),
    ("targeted", "1"): (0.560, 0.605, 1.2911),
    ("targeted", "2"): (0.530, 0.620, 1.2850),
    ("healthy", "0"): (0.515, 0.600, 1.2950),  # a single seed
}
CONDITIONS = ["fault", "clean", "noise_5pct"]


def _run(arm, seed, acc_fault, acc_clean, loss):
    k = int(seed)
    steps = [0, 5, 10]
    core = [acc_fault - 0.1, None, acc_fault]  # validation not measured at step 5
    return {
        "final": {"acc_fault": acc_fault, "acc_clean": acc_clean, "heldout_loss": loss},
        "curve": {
            "step": steps,
            "val-core/acc": core,
            "val-clean/acc": [acc_clean - 0.05, None, acc_clean],
            "critic/score/mean": [0.1 + 0.01 * k, 0.2, 0.3],
        },
        "robustness": {
            "fault": acc_fault,
            "clean": acc_clean,
            "noise_5pct": round(acc_fault - 0.02 * (k + 1), 4),
        },
        "telemetry": {"flushed": 0.0 if arm == "clean" else 0.01 * (k + 1), "rescued": 0.002 * k},
        "wall_time_s": 100.0 + 10 * k,
    }


@pytest.fixture
def study(tmp_path):
    runs = {}
    for (arm, seed), vals in ACC.items():
        runs.setdefault(arm, {})[seed] = _run(arm, seed, *vals)
    results = {
        "name": "compare",
        "variant": "threshold_0.1",
        "arms": ["clean", "deadzone", "global_aqn", "targeted", "healthy"],  # deadzone: no runs
        "seeds": [0, 1, 2],
        "reference_arm": "global_aqn",
        "comparisons": [["targeted", "global_aqn"], ["healthy", "global_aqn"]],
        "conditions": CONDITIONS,
        "runs": runs,
        "timing": {"total_s": 1234.5, "device": "cpu"},
    }
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    return results, str(tmp_path)


def _vals(arm, i):
    return np.array([v[i] for (a, _), v in ACC.items() if a == arm])


def test_summarize_numbers(study):
    results, _ = study
    s = report.summarize(results)
    assert s["arms"] == ["clean", "global_aqn", "targeted", "healthy"]
    assert s["present"]["global_aqn"] == ["0", "2"] and s["missing"]["global_aqn"] == ["1"]
    assert any("deadzone" in n and "no runs" in n for n in s["notes"])
    assert any("healthy" in n and "single seed" in n for n in s["notes"])
    t = _vals("targeted", 0)
    assert s["final"]["acc_fault"]["targeted"]["mean"] == pytest.approx(t.mean())
    assert s["final"]["acc_fault"]["targeted"]["std"] == pytest.approx(np.std(t, ddof=1))
    assert s["final"]["acc_fault"]["healthy"]["std"] is None
    tests = {(x["a"], x["metric"]): x for x in s["tests"]}
    assert len(s["tests"]) == 6  # 2 comparisons x 3 metrics
    tg = tests[("targeted", "acc_fault")]
    ref = scipy.stats.ttest_ind(t, _vals("global_aqn", 0), equal_var=False)
    assert tg["p"] == pytest.approx(ref.pvalue) and tg["t"] == pytest.approx(ref.statistic)
    # healthy has one seed: no test, so the family has one p and Holm leaves it unchanged.
    hg = tests[("healthy", "acc_fault")]
    assert hg["p"] is None and "n < 2" in hg["reason"] and hg["p_holm"] is None
    assert tg["p_holm"] == pytest.approx(tg["p"])
    # Power: the MDD and the seeds a 0.05 accuracy difference needs, from the two arms' SDs.
    g = _vals("global_aqn", 0)
    sds = np.std(t, ddof=1), np.std(g, ddof=1)
    assert tg["mdd"] == pytest.approx(stats.mdd(*sds, len(t), len(g)))
    assert tg["seeds_for_0.05"] == stats.seeds_needed(0.05, *sds)
    assert tests[("targeted", "heldout_loss")]["seeds_for_0.05"] is None  # accuracy only
    # Robustness, telemetry, wall time.
    rob = s["robustness"]["arms"]["targeted"]["noise_5pct"]
    assert rob["mean"] == pytest.approx(np.mean([0.52, 0.52, 0.47]))
    assert s["telemetry"]["targeted"]["flushed"]["mean"] == pytest.approx(0.02)
    assert s["telemetry"]["clean"]["flushed"]["mean"] == 0.0
    assert s["wall_time"]["global_aqn"]["mean"] == pytest.approx(110.0)
    assert s["wall_time"]["global_aqn"]["total"] == pytest.approx(220.0)
    # Strict JSON: no NaN anywhere in the summary.
    json.dumps(s, allow_nan=False)


def test_curve_band_ignores_nulls(study):
    results, _ = study
    runs = list(results["runs"]["targeted"].values())
    steps, mean, std, n = report.curve_band(runs, "val-core/acc")
    assert steps.tolist() == [0, 10]  # step 5 holds only nulls
    assert n.tolist() == [3, 3]
    assert mean[1] == pytest.approx(_vals("targeted", 0).mean())
    assert std[1] == pytest.approx(np.std(_vals("targeted", 0), ddof=1))
    steps, mean, std, n = report.curve_band(runs, "critic/score/mean")
    assert steps.tolist() == [0, 5, 10]
    assert mean[0] == pytest.approx(0.11)  # (0.10 + 0.11 + 0.12) / 3
    assert std[1] == pytest.approx(0.0)


def test_write_report(study):
    results, workdir = study
    original = copy.deepcopy(results)
    path = report.write_report(results, workdir)
    assert path == os.path.join(workdir, "report.md")
    with open(path) as f:
        text = f.read()
    assert results == original  # the caller's dict is not modified
    assert text.startswith("# Study report: compare (threshold_0.1)")
    # Means (3 decimals for accuracy, 4 for the loss), recomputed here.
    t = _vals("targeted", 0)
    row = f"| targeted | 3 | {t.mean():.3f} ± {np.std(t, ddof=1):.3f} |"
    assert row in text and row == "| targeted | 3 | 0.543 ± 0.015 |"
    loss = _vals("clean", 2)
    assert f"| clean | 3 | {loss.mean():.4f} ± {np.std(loss, ddof=1):.4f} |" in text
    assert "| healthy | 1 | 0.515 ± n/a | n/a |" in text
    assert "| deadzone | none | 0, 1, 2 |" in text
    assert "| global_aqn | 0, 2 | 1 |" in text
    # The tests row of targeted vs global_aqn (acc_fault) carries scipy's p.
    g = _vals("global_aqn", 0)
    ref = scipy.stats.ttest_ind(t, g, equal_var=False)
    p = stats.format_p(ref.pvalue)
    rows = [line for line in text.splitlines() if line.startswith("| targeted vs global_aqn |")]
    fault_row = [r for r in rows if "| acc_fault |" in r]
    assert len(rows) == 3 and len(fault_row) == 1
    cells = [c.strip() for c in fault_row[0].strip("|").split("|")]
    assert cells[2] == "3 / 2"
    assert cells[3].startswith(f"{t.mean() - g.mean():+.3f} [")
    assert cells[4] == f"{ref.statistic:.2f}"
    assert cells[6] == p and cells[7] == p  # one test in the family: Holm p = p
    reading = [line for line in text.splitlines() if line.startswith("- targeted − global_aqn")]
    assert any(f"p = {p}" in r for r in reading)
    assert "test not run (n < 2 (n_a=1, n_b=2))" in text
    # Robustness matrix and telemetry.
    header = "| arm | n | fault | clean | noise_5pct |"
    assert header in text
    assert "| targeted | 0.0200 ± 0.0100 | 0.0020 ± 0.0020 |" in text
    assert '"total_s": 1234.5' in text
    # Plots.
    for name in ("curves.png", "final.png", "robustness.png"):
        png = os.path.join(workdir, name)
        with open(png, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 1024
    # results.json: the summary added, everything else kept.
    with open(os.path.join(workdir, "results.json")) as f:
        stored = json.load(f)
    assert "summary" in stored
    assert stored["runs"] == json.loads(json.dumps(original["runs"]))
    assert {k: v for k, v in stored.items() if k != "summary"} == json.loads(json.dumps(original))
    assert stored["summary"]["final"]["acc_fault"]["targeted"]["mean"] == pytest.approx(t.mean())
    assert not os.path.exists(os.path.join(workdir, "results.json.tmp"))
    # Re-running on the stored file (with its summary) gives the same summary.
    again = report.summarize(report.load_results(os.path.join(workdir, "results.json")))
    assert json.dumps(again, sort_keys=True) == json.dumps(stored["summary"], sort_keys=True)


def test_mismatch_curves_and_telemetry_when_logged(study):
    """The sampler-trainer mismatch (rollout_corr/*) gets its plot panels and telemetry
    columns only when runs logged it (older results.json files have none)."""
    results, workdir = study
    arms = ["clean", "targeted"]
    assert report.curve_keys(results, arms) == report.CURVE_KEYS  # negative control
    run = results["runs"]["targeted"]["0"]
    run["curve"]["rollout_corr/kl"] = [None, 0.47, 0.45]
    run["telemetry"]["mismatch_kl"] = 0.46
    assert report.curve_keys(results, arms) == (*report.CURVE_KEYS, "rollout_corr/kl")
    with open(report.write_report(results, workdir)) as f:
        text = f.read()
    header = [line for line in text.splitlines() if "| flushed | rescued |" in line]
    assert header and header[0].rstrip().endswith("| mismatch_kl |")
    assert any(line.startswith("| targeted |") and "0.4600" in line for line in text.splitlines())


def test_write_report_empty_and_significant(tmp_path):
    # No runs at all: a report with notes, no crash.
    empty = {"name": "compare", "variant": "default", "arms": ["clean"], "seeds": [0], "runs": {}}
    with open(report.write_report(empty, str(tmp_path / "empty"))) as f:
        text = f.read()
    assert "arm clean: no runs; skipped" in text
    # Well separated arms: significant after Holm, in favour of the lower loss.
    runs = {}
    for arm, base in (("targeted", 12.83), ("global_aqn", 12.86)):
        runs[arm] = {
            str(k): {"final": {"acc_fault": 0.5, "acc_clean": 0.6, "heldout_loss": x}}
            for k, x in enumerate(base + np.array([0.002, -0.004, 0.005, -0.001, 0.0]))
        }
    res = {"arms": ["targeted", "global_aqn"], "reference_arm": "global_aqn", "runs": runs}
    s = report.summarize(res)
    loss = [t for t in s["tests"] if t["metric"] == "heldout_loss"][0]
    assert loss["reading"].endswith("significant at 0.05 after Holm, in favour of targeted")
    assert loss["reading"].startswith("targeted − global_aqn (heldout_loss): −0.0300 loss")
    acc = [t for t in s["tests"] if t["metric"] == "acc_fault"][0]
    assert acc["reason"] == "zero variance in both groups"
    report.write_report(res, str(tmp_path / "sig"))


def test_paired_t_hand_computed():
    # d = [0.1, 0.15, 0.05]: mean 0.1, sd 0.05, se 0.05 / sqrt(3), t = 2 sqrt(3), df 2. With
    # 2 df the t CDF is 1/2 + t / (2 sqrt(2 + t^2)), so p = 1 - t / sqrt(2 + t^2) = 1 -
    # sqrt(12 / 14); Hedges' g = (1 - 3 / 7) * 0.1 / 0.05 = 8 / 7.
    from aqn_jax.study import stats as S

    out = S.paired([0.5, 0.6, 0.7], [0.4, 0.45, 0.65])
    assert out["n"] == 3 and out["diff"] == pytest.approx(0.1)
    assert out["t"] == pytest.approx(2 * np.sqrt(3))
    assert out["p"] == pytest.approx(1 - np.sqrt(12 / 14), rel=1e-9)
    assert out["hedges_g"] == pytest.approx(8 / 7)
    # The MDD is the difference the test detects with power 0.8 (checked through the power).
    assert S.paired_power(out["mdd"], out["sd_diff"], 3) == pytest.approx(0.8, abs=1e-8)
    # Pairing matters: the same values unpaired (Welch) do not reach the same p.
    assert S.welch([0.5, 0.6, 0.7], [0.4, 0.45, 0.65])["p"] > 2 * out["p"]
    assert S.paired([0.5, 0.6], [0.4, 0.5])["reason"].startswith("every pair")
    # Two pairs: tested (df 1), but J = 1 - 3 / 3 = 0 leaves g undefined, not 0.
    two = S.paired([0.5, 0.6], [0.4, 0.45])
    assert two["p"] is not None and two["reason"] is None and two["hedges_g"] is None
    assert S.paired([0.5, None, 0.7], [0.4, 0.3, 0.6])["n_dropped"] == 1


# The legacy study's arms, names and comparisons (docs/qwen05_study has no config.json): the
# `:study` preset, loaded as `--config=configs/qwen2p5_coder_0p5b_gsm8k.py:study` loads it.
LEGACY_CONFIG = "configs/qwen2p5_coder_0p5b_gsm8k.py:study"
LEGACY_COMPARISONS = (
    ("faulty", "clean_rl", "faulty"),  # the seed's hypothesis: RL on the device it serves
    ("targeted_aqn", "faulty", "faulty"),
    ("global_aqn", "faulty", "faulty"),
    ("targeted_aqn", "global_aqn", "faulty"),
    ("faulty", "clean_rl", "clean"),  # what adapting to the fault costs elsewhere
)


@pytest.fixture(scope="module")
def legacy_study():
    from aqn_jax.study import outcome as O

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmp = O.load_config_arg(os.path.join(repo, LEGACY_CONFIG))
    study = O.study_from(cmp, LEGACY_CONFIG)
    # The preset gives the legacy table's arms and order.
    assert study.arms == ("deadzone", "clean", "targeted", "global_aqn")
    assert [study.name(a) for a in study.arms] == [
        "faulty",
        "clean_rl",
        "targeted_aqn",
        "global_aqn",
    ]
    assert study.comparisons == LEGACY_COMPARISONS
    return study


def test_study_outcome_recomputes_from_the_run_directories(tmp_path, legacy_study):
    from aqn_jax.study import outcome as O

    def write(path, obj):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj))

    def ev(fault, clean):
        return {
            "conditions": {"fault": {"acc": fault, "n": 256}, "clean": {"acc": clean, "n": 256}}
        }

    write(tmp_path / "baseline" / "evaluation.json", ev(0.18, 0.58))
    write(tmp_path / "srdd" / "srdd.json", {"verdict": {"layers": [15]}})
    finals = {  # arm -> seed -> (faulty, clean)
        "deadzone": {0: (0.5, 0.80), 1: (0.6, 0.82), 2: (0.7, 0.79)},
        "clean": {0: (0.4, 0.85), 1: (0.45, 0.86), 2: (0.65, 0.84)},
    }
    for arm, seeds in finals.items():
        for seed, (f, c) in seeds.items():
            run = tmp_path / "runs" / arm / f"seed{seed}"
            write(run / "evaluation.json", ev(f, c))
            noisy = arm == "clean"  # stands in for an AQN arm: its sigma and the mismatch
            rows = [
                {
                    "step": s,
                    "critic/groups_with_advantage": 0.25 * s,
                    "aqn/sigma": 0.01 * s if noisy else 0.0,
                    "rollout_corr/log_ppl_abs_diff": 0.001 * s if noisy else 0.0,
                }
                for s in (1, 2)
            ]
            (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "runs" / "targeted" / "seed0").mkdir(parents=True)  # unfinished: not counted
    got = O.collect(str(tmp_path), legacy_study)
    assert got["srdd_layers"] == [15] and len(got["runs"]) == 6
    run = next(r for r in got["runs"] if r["arm"] == "faulty" and r["seed"] == 1)
    assert run == {
        "arm": "faulty",
        "seed": 1,
        "steps": 2,
        "faulty_step0": 0.18,
        "faulty_final": 0.6,
        "clean_step0": 0.58,
        "clean_final": 0.82,
        "n": 256,
        "n_clean": 256,
        "signal": [0.25, 0.5],
        "aqn_sigma": [0.0, 0.0],
        "mismatch": [0.0, 0.0],
    }
    res = O.outcome(got["runs"], legacy_study.comparisons)
    assert res["arms"]["faulty"]["faulty_final"]["mean"] == pytest.approx(0.6)
    assert res["arms"]["faulty"]["signal_per_step"] == [0.25, 0.5]
    assert (res["arms"]["faulty"]["aqn_sigma_max"], res["arms"]["faulty"]["mismatch_mean"]) == (
        0,
        0,
    )
    assert res["arms"]["clean_rl"]["aqn_sigma_max"] == pytest.approx(0.02)
    assert res["arms"]["clean_rl"]["mismatch_mean"] == pytest.approx(0.0015)
    by = {(c["a"], c["b"], c["device"]): c for c in res["comparisons"]}
    main = by[("faulty", "clean_rl", "faulty")]  # the hand-computed pairs above
    assert main["mean_diff"] == pytest.approx(0.1) and main["seeds"] == [0, 1, 2]
    assert main["p"] == pytest.approx(1 - np.sqrt(12 / 14), rel=1e-9)
    assert main["g"] == pytest.approx(8 / 7)
    # Holm over the two tests that ran (the AQN arms have no runs): m = 2.
    clean = by[("faulty", "clean_rl", "clean")]
    assert clean["mean_diff"] == pytest.approx(-0.0466667, abs=1e-6)
    ps = sorted([main["p"], clean["p"]])
    expect = {ps[0]: min(1, 2 * ps[0]), ps[1]: max(min(1, 2 * ps[0]), ps[1])}
    assert main["p_holm"] == pytest.approx(expect[main["p"]])
    assert by[("targeted_aqn", "faulty", "faulty")]["p"] is None
    # The markdown tables carry the same numbers: the faulty arm's 0.6 with its t interval
    # (s = 0.1, t_0.975,2 = 4.303: 0.6 -/+ 0.248) and the hand-computed comparison.
    md = O.table({**got, **res}).splitlines()
    assert "| faulty | 3 | 0.600 [0.352, 0.848] | 0.803 [0.765, 0.841] | 0.0e+00 | 0.0e+00 |" in (
        "\n".join(md)
    )
    assert any(
        r.startswith("| clean_rl | 3 |") and "| 2.0e-02 | 1.5e-03 | 0.25 0.50 |" in r for r in md
    )
    row = next(line for line in md if line.startswith("| faulty − clean_rl | faulty |"))
    assert row.startswith(f"| faulty − clean_rl | faulty | 3 | 0.100 [{main['ci'][0]:.3f}, ")
    assert f"| {stats.format_p(main['p'])} | {stats.format_p(main['p_holm'])} | 1.14 |" in row
    assert "| targeted_aqn − faulty | faulty | 0 | n/a | n < 2 pairs (n=0) | n/a |" in "\n".join(md)
    assert "| faulty | 1 | 2 | 0.180 → 0.600 (256) | 0.580 → 0.820 (256) |" in md
    # The JSON's `cpu` by default: this machine's class, as /proc/cpuinfo names it.
    assert re.fullmatch(r".+, family \d+ model \d+; flags .+", O._machine())
    # Negative control: one seed's pairing changed, and the test's p moves.
    swapped = [dict(r) for r in got["runs"]]
    for r in swapped:
        if r["arm"] == "clean_rl" and r["seed"] in (0, 2):
            r["seed"] = 2 if r["seed"] == 0 else 0
    moved = O.outcome(swapped, legacy_study.comparisons)["comparisons"][0]
    assert moved["mean_diff"] == pytest.approx(0.1) and abs(moved["p"] - main["p"]) > 0.01


def test_committed_study_agrees_with_its_run_directories(legacy_study):
    """docs/qwen05_arith_study.{json,md} (issue 59) are what `study.outcome` computes from the
    run directories committed beside them (docs/qwen05_study: each run's evaluation.json and
    metrics.jsonl, the step-0 evaluation, SRDD's verdict), its arms and comparisons from the
    `:study` preset: the per-seed numbers, the means and intervals, and the paired tests with
    their Holm p-values."""
    from aqn_jax.study import outcome as O

    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
    with open(os.path.join(docs, "qwen05_arith_study.json")) as f:
        committed = json.load(f)
    got = O.collect(os.path.join(docs, "qwen05_study"), legacy_study)
    # No per-problem records: nothing new (no two-level statistics, no stopping record).
    assert O.twolevel_outcome(legacy_study, got["_detail"]) is None
    assert got["_detail"]["sequential"] is None and list(committed) == [
        "runs",
        "srdd_layers",
        "arms",
        "comparisons",
        "commit",
        "cpu",
    ]
    assert sorted((r["arm"], r["seed"]) for r in got["runs"]) == [  # the whole study: 4 x 3
        (a, s) for a in ("clean_rl", "faulty", "global_aqn", "targeted_aqn") for s in (0, 1, 2)
    ]
    assert got["srdd_layers"] == committed["srdd_layers"] == [15]
    assert got["runs"] == committed["runs"]
    res = json.loads(json.dumps(O.outcome(got["runs"], legacy_study.comparisons)))  # round trip
    assert res["arms"] == committed["arms"]
    assert res["comparisons"] == committed["comparisons"]
    with open(os.path.join(docs, "qwen05_arith_study.md")) as f:
        assert f.read() == O.table({**got, **res})
    # Negative control: one run's final accuracy changed, and its comparison's p moves.
    moved = [dict(r) for r in got["runs"]]
    next(r for r in moved if r["arm"] == "faulty" and r["seed"] == 0)["faulty_final"] -= 0.1
    moved_p = O.outcome(moved, legacy_study.comparisons)["comparisons"][0]["p"]
    assert moved_p != committed["comparisons"][0]["p"]
