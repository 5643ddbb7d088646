"""`python -m aqn_jax.study.outcome` as a careful tool (issues 67 and 69): the arms and
comparisons from the study's config, the two-level statistics from per-problem records
recomputed by hand on a synthetic study, and every refusal: one line naming the file, exit
status 2, the workdir and the out folder byte-identical afterwards. No model: fast."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aqn_jax.study import outcome as O

from conftest import tree_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("deadzone", "targeted")
NAMES = {"deadzone": "faulty", "targeted": "targeted_seed"}
SEEDS = (0, 1, 2)
P, P_CLEAN = 10, 4
TRAIN_S = {0: 100.0, 1: 120.0, 2: 90.0}  # per seed: the 2 logged steps' timing_s/step sum
WALL_EXTRA_S = {0: 28.0, 1: 42.0, 2: 14.0}  # wall_time_s - training: the evaluation (+ start)
TARGET_MDD = 0.3  # within the planner's grid at this spread (0.05 would need > 40 seeds)


def correctness() -> dict:
    """(arm, seed) -> (fault [P], clean [P_CLEAN]) 0/1: a fixed draw, the targeted arm's gain
    on the faulty device growing with the seed (per-seed differences 0.1, 0.3, 0.6: a seed part
    and a problem part both above 0)."""
    rng = np.random.default_rng(1)
    out = {}
    for s in SEEDS:
        for arm, p in (("deadzone", 0.5), ("targeted", 0.45 + 0.25 * s)):
            out[arm, s] = (
                (rng.random(P) < p).astype(int).tolist(),
                (rng.random(P_CLEAN) < 0.5).astype(int).tolist(),
            )
    return out


def _write(path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)


def _evaluation(directory, fault, clean, wall=None) -> None:
    """evaluation.json and samples.jsonl of one evaluation, as `write_evaluation` writes them."""
    rows = [
        {"condition": c, "index": i, "prompt_sha": f"sha{i:04d}", "correct": bool(v), "sample": 0}
        for c, values in (("fault", fault), ("clean", clean))
        for i, v in enumerate(values)
    ]
    _write(directory / "samples.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    ev = {
        "conditions": {
            "fault": {"acc": float(np.mean(fault)), "n": len(fault), "samples": 1},
            "clean": {"acc": float(np.mean(clean)), "n": len(clean), "samples": 1},
        },
        "samples_file": "samples.jsonl",
    }
    if wall is not None:
        ev["wall_time_s"] = wall
    _write(directory / "evaluation.json", ev)


def make_study(root, cells=None, arms=ARMS, names=NAMES, comparisons=(("targeted", "deadzone"),)):
    """A compare workdir by hand: config.json, the step-0 evaluation, SRDD's verdict, and per
    (arm, seed) evaluation.json, metrics.jsonl and samples.jsonl."""
    cells = cells or correctness()
    _write(
        root / "config.json",
        {
            "job": "compare",
            "compare": {
                "arms": list(arms),
                "names": dict(names),
                "comparisons": [list(c) for c in comparisons],
                "clean_comparisons": [],
                "target_mdd": TARGET_MDD,
            },
        },
    )
    _evaluation(root / "baseline", [0] * P, [1, 0, 0, 0], wall=64.0)
    _write(root / "srdd" / "srdd.json", {"verdict": {"layers": [1]}})
    for (arm, s), (fault, clean) in cells.items():
        run = root / "runs" / arm / f"seed{s}"
        noisy = arm != "deadzone"
        rows = [{"step": 0, "timing_s/testing": 5.0}] + [
            {
                "step": k,
                "critic/groups_with_advantage": 0.5,
                "aqn/sigma": (0.05 / k) if noisy else 0.0,
                "rollout_corr/log_ppl_abs_diff": (0.01 * k + 0.001 * s) if noisy else 0.0,
                "timing_s/step": TRAIN_S[s] / 2,
            }
            for k in (1, 2)
        ]
        _write(run / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        _evaluation(run, fault, clean, wall=TRAIN_S[s] + 5.0 + WALL_EXTRA_S[s])
    return root


def by_hand(cells, cond: int = 0):
    """The two-level split of targeted - deadzone, with loops (the module docstring of
    aqn_jax/study/twolevel.py): MS_seed, MS_prob, MS_res, then the parts."""
    d = [[cells["targeted", s][cond][p] - cells["deadzone", s][cond][p] for p in range(P)]
         for s in SEEDS]  # fmt: skip
    S = len(SEEDS)
    row = [sum(r) / P for r in d]
    col = [sum(d[s][p] for s in range(S)) / S for p in range(P)]
    grand = sum(row) / S
    ms_seed = P * sum((r - grand) ** 2 for r in row) / (S - 1)
    ms_prob = S * sum((c - grand) ** 2 for c in col) / (P - 1)
    ms_res = sum((d[s][p] - row[s] - col[p] + grand) ** 2 for s in range(S) for p in range(P)) / (
        (S - 1) * (P - 1)
    )
    v_seed, v_prob = max(0.0, (ms_seed - ms_res) / P), max(0.0, (ms_prob - ms_res) / S)
    seed_part, problem_part = v_seed / S, v_prob / P + ms_res / (S * P)
    # The crossed bootstrap's expected resampling variance given the data (McCullagh 2000).
    alpha = [r - grand for r in row]
    beta = [c - grand for c in col]
    gamma = [d[s][p] - row[s] - col[p] + grand for s in range(S) for p in range(P)]
    var_boot = (
        sum(a * a for a in alpha) / S**2
        + sum(b * b for b in beta) / P**2
        + sum(g * g for g in gamma) / (S**2 * P**2)
    )
    return {
        "diff": grand,
        "per_seed": row,
        "seed_part": seed_part,
        "problem_part": problem_part,
        "sigma2": (v_seed, v_prob, ms_res),
        "var_boot": var_boot,
    }


def run_main(capsys, *args):
    """`main` in this process: (exit code, stderr lines)."""
    try:
        O.main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, err


def test_two_level_statistics_recomputed_by_hand(tmp_path, capsys):
    cells = correctness()
    work = make_study(tmp_path / "S", cells)
    (tmp_path / "out").mkdir()
    code, err = run_main(capsys, f"--workdir={work}", f"--out={tmp_path / 'out' / 'o'}")
    assert code == 0 and err == []
    result = json.loads((tmp_path / "out" / "o.json").read_text())
    assert sorted(os.listdir(tmp_path / "out")) == ["o.json", "o.md", "o.png"]
    # The legacy part: per-seed paired accuracies.
    (legacy,) = result["comparisons"]
    assert (legacy["a"], legacy["b"], legacy["device"]) == ("targeted_seed", "faulty", "faulty")
    hand = by_hand(cells)
    assert legacy["mean_diff"] == pytest.approx(hand["diff"], abs=1e-12)
    two = result["twolevel"]
    assert two["config"] == str(work / "config.json") and two["target_mdd"] == TARGET_MDD
    (c,) = two["comparisons"]
    assert c["seeds"] == [0, 1, 2] and c["P"] == P
    assert hand["per_seed"] == pytest.approx([0.1, 0.3, 0.6])
    assert c["diff_per_seed"] == pytest.approx(hand["per_seed"], abs=1e-12)
    comp = c["components"]
    assert comp["seed_part"] == pytest.approx(hand["seed_part"], rel=1e-12)
    assert comp["problem_part"] == pytest.approx(hand["problem_part"], rel=1e-12)
    assert comp["seed_share"] == pytest.approx(
        hand["seed_part"] / (hand["seed_part"] + hand["problem_part"]), rel=1e-12
    )
    assert hand["seed_part"] > 0 and hand["problem_part"] > 0  # both parts are exercised
    # The interval: D ± t_{0.975, 2} se_boot, se_boot within 6% of the exact resampling SD
    # (2000 replicates: the SD's own relative error is about 1/sqrt(4000) = 1.6%).
    lo, hi = c["bootstrap"]["ci"]
    assert (lo + hi) / 2 == pytest.approx(hand["diff"], abs=1e-12)
    half_by_hand = 4.302652729911275 * math.sqrt(hand["var_boot"])  # t_{0.975, 2}
    assert (hi - lo) / 2 == pytest.approx(half_by_hand, rel=0.06)
    # The planner's costs, measured from the runs: the training seconds in metrics.jsonl
    # (2 steps + the step-0 validation) and (wall - training) / problems (fault + clean).
    clock = two["timing"]
    assert clock["seconds_per_run"] == pytest.approx(np.median([v + 5.0 for v in TRAIN_S.values()]))
    per_problem = [WALL_EXTRA_S[s] / (P + P_CLEAN) for s in SEEDS for _ in ARMS]
    assert clock["seconds_per_problem"] == pytest.approx(np.median(per_problem))
    assert clock["baseline_seconds_per_problem"] == pytest.approx(64.0 / (P + P_CLEAN))
    plan = c["plan"]
    best = plan["best"]
    assert best is not None and best["mdd"] <= TARGET_MDD
    assert plan["by_problems"][0]["P"] == 128 and two["plan_arms"] == 2
    cost = 2 * best["S"] * (clock["seconds_per_run"] + best["P"] * clock["seconds_per_problem"])
    assert best["cost_s"] == pytest.approx(cost)
    # Per arm: AQN's sigma and the mismatch per step, means over seeds.
    arm = two["arms"]["targeted_seed"]
    assert arm["aqn_sigma_per_step"]["step"] == [1, 2]
    assert arm["aqn_sigma_per_step"]["mean"] == pytest.approx([0.05, 0.025])
    assert arm["mismatch_per_step"]["mean"] == pytest.approx([0.011, 0.021])
    md = (tmp_path / "out" / "o.md").read_text()
    assert f"| targeted_seed − faulty | faulty | 3 x {P} | " in md
    assert f"{comp['seed_part']:.1e} | {comp['problem_part']:.1e}" in md

    # Negative control: one problem of one run flipped (its accuracy updated alike), and the
    # parts move; the by-hand split follows them.
    flipped = {k: (list(f), list(cl)) for k, (f, cl) in cells.items()}
    flipped["targeted", 0][0][2] = 1 - flipped["targeted", 0][0][2]
    work2 = make_study(tmp_path / "S2", flipped)
    code, _ = run_main(capsys, f"--workdir={work2}", f"--out={tmp_path / 'out' / 'o2'}")
    c2 = json.loads((tmp_path / "out" / "o2.json").read_text())["twolevel"]["comparisons"][0]
    hand2 = by_hand(flipped)
    assert code == 0
    assert c2["components"]["seed_part"] != pytest.approx(comp["seed_part"], rel=1e-6)
    assert c2["components"]["problem_part"] != pytest.approx(comp["problem_part"], rel=1e-6)
    assert c2["components"]["seed_part"] == pytest.approx(hand2["seed_part"], rel=1e-12)
    assert c2["components"]["problem_part"] == pytest.approx(hand2["problem_part"], rel=1e-12)
    assert c2["bootstrap"]["ci"] != c["bootstrap"]["ci"]


def test_arms_come_from_the_config_a_new_arm_reaches_the_table(tmp_path, capsys):
    cells = {("throwaway" if a == "targeted" else a, s): v for (a, s), v in correctness().items()}
    work = make_study(
        tmp_path / "S",
        cells,
        arms=("deadzone", "throwaway"),
        names={"deadzone": "faulty", "throwaway": "thrown"},
        comparisons=(("throwaway", "deadzone"),),
    )
    code, err = run_main(capsys, f"--workdir={work}", f"--out={tmp_path / 'o'}")
    assert code == 0, err
    md = (tmp_path / "o.md").read_text()
    assert "| thrown | 3 | " in md and "| thrown − faulty | faulty | 3 | " in md
    assert json.loads((tmp_path / "o.json").read_text())["arms"]["thrown"]["seeds"] == [0, 1, 2]
    # An arm the config leaves unnamed keeps its own name.
    study = O.study_from({"arms": ["deadzone", "x"], "comparisons": [["x", "deadzone"]]})
    assert study.comparisons == (("x", "deadzone", "faulty"),)


def test_out_with_a_suffix_and_the_sequential_stopping_reason(tmp_path, capsys):
    work = make_study(tmp_path / "S")
    _write(work / "sequential.json", {"reason": "max_seeds=3 reached", "reached": False})
    code, err = run_main(capsys, f"--workdir={work}", f"--out={tmp_path / 'x.json'}")
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == ["S", "x.json", "x.md", "x.png"]  # not x.json.json
    assert json.loads((tmp_path / "x.json").read_text())["sequential"]["reached"] is False
    assert "Sequential stopping (sequential.json): max_seeds=3 reached." in (
        (tmp_path / "x.md").read_text()
    )


def test_legacy_study_reproduces_its_committed_files_through_the_command(tmp_path, capsys):
    """docs/qwen05_arith_study.{json,md} from docs/qwen05_study (no config.json: --config), byte
    for byte but the commit."""
    docs = os.path.join(ROOT, "docs")
    with open(os.path.join(docs, "qwen05_arith_study.json")) as f:
        committed = json.load(f)
    args = (
        f"--workdir={os.path.join(docs, 'qwen05_study')}",
        f"--out={tmp_path / 'legacy'}",
        f"--config={os.path.join(ROOT, 'configs/qwen2p5_coder_0p5b_gsm8k.py')}:study",
        f"--cpu={committed['cpu']}",
    )
    code, err = run_main(capsys, *args)
    assert code == 0, err
    got = (tmp_path / "legacy.json").read_text()
    with open(os.path.join(docs, "qwen05_arith_study.json")) as f:
        want = f.read()
    assert got.replace(json.loads(got)["commit"], committed["commit"]) == want
    with open(os.path.join(docs, "qwen05_arith_study.md")) as f:
        assert (tmp_path / "legacy.md").read_text() == f.read()
    # The commit is this package's repository's, whatever the working directory.
    head = subprocess.run(
        ["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert json.loads(got)["commit"] == (head or "unknown")


# -- refusals: one line naming the file, exit 2, nothing written ---------------------------------
def _truncate(path):
    """The file cut in the middle of a line (as a killed writer leaves it)."""
    text = path.read_text()
    cut = len(text) // 2
    while text[cut - 1] == "\n" or text[cut] == "\n":
        cut += 1
    path.write_text(text[:cut])


def _edit_json(path, change):
    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj))


def _flip_record(path):
    """One record flipped, its evaluation.json's accuracy left: they disagree."""
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows[0]["correct"] = not rows[0]["correct"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _other_problems(run):
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    rows[2]["prompt_sha"] = "another"
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _other_n(run):
    """The run evaluated on one problem fewer (records and evaluation.json agree)."""
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    rows = [r for r in rows if not (r["condition"] == "fault" and r["index"] == P - 1)]
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fault = [int(r["correct"]) for r in rows if r["condition"] == "fault"]

    def change(ev):
        ev["conditions"]["fault"].update(acc=float(np.mean(fault)), n=len(fault))

    _edit_json(run / "evaluation.json", change)


def _no_records(run):
    (run / "samples.jsonl").unlink()
    _edit_json(run / "evaluation.json", lambda ev: ev.pop("samples_file"))


def _other_n_without_records(work):
    """A study without per-problem records (the legacy form), one run on 9 problems."""
    for run in work.glob("runs/*/seed*"):
        _no_records(run)
    _edit_json(
        work.joinpath(*RUN, "evaluation.json"), lambda ev: ev["conditions"]["fault"].update(n=9)
    )


def _machines(work, other=None):
    """machine.json in every run: class A, but the (arm, seed) runs of `other`."""
    for run in work.glob("runs/*/seed*"):
        key = (run.parent.name, int(run.name[4:]))
        _write(run / "machine.json", {"machine_class": (other or {}).get(key, "class A")})


def _ro(path):
    path.chmod(0o555)


RUN = ("runs", "targeted", "seed1")
# name -> (how the study / out folder is broken, the workdir / out arguments, what the line names)
REFUSALS = {
    "missing_workdir": (None, ("nowhere", "out/o"), "nowhere: no such directory"),
    "empty_workdir": (
        lambda w, o: (w.parent / "empty").mkdir(),
        ("empty", "out/o"),
        "empty: empty",
    ),
    "workdir_is_runs": (None, ("S/runs", "out/o"), "S/runs: a study's runs/ folder"),
    "workdir_is_a_run": (None, ("S/runs/targeted/seed0", "out/o"), "seed0: a run directory"),
    "workdir_is_an_arm": (None, ("S/runs/targeted", "out/o"), "targeted: an arm's folder"),
    "missing_out_folder": (None, ("S", "absent/o"), "absent/o: no such folder"),
    "read_only_out_folder": (lambda w, o: _ro(o), ("S", "out/o"), "out/o: folder"),
    "out_inside_workdir": (
        None,
        ("S", "S/runs/deadzone/seed0/evaluation"),
        "inside the workdir it reads",
    ),
    "png_is_a_directory": (
        lambda w, o: (o / "o.png").mkdir(),
        ("S", "out/o"),
        "o.png exists and is not a file",
    ),
    "truncated_evaluation": (
        lambda w, o: _truncate(w.joinpath(*RUN, "evaluation.json")),
        ("S", "out/o"),
        "seed1/evaluation.json: not valid JSON",
    ),
    "truncated_metrics": (
        lambda w, o: _truncate(w.joinpath(*RUN, "metrics.jsonl")),
        ("S", "out/o"),
        "seed1/metrics.jsonl: line 2 is not valid JSON",
    ),
    "truncated_samples": (
        lambda w, o: _truncate(w.joinpath(*RUN, "samples.jsonl")),
        ("S", "out/o"),
        "seed1/samples.jsonl: line 8 is not valid JSON (",
    ),
    "evaluation_without_n": (
        lambda w, o: _edit_json(
            w.joinpath(*RUN, "evaluation.json"), lambda ev: ev["conditions"]["fault"].pop("n")
        ),
        ("S", "out/o"),
        "seed1/evaluation.json: conditions.fault has no n",
    ),
    "missing_baseline": (
        lambda w, o: (w / "baseline" / "evaluation.json").unlink(),
        ("S", "out/o"),
        "baseline/evaluation.json: missing",
    ),
    "stray_seed_directory": (
        lambda w, o: w.joinpath(*RUN).rename(w / "runs" / "targeted" / "seed1.bak"),
        ("S", "out/o"),
        "runs/targeted/seed1.bak: not a run directory seed<k>",
    ),
    "unknown_arm": (
        lambda w, o: (w / "runs" / "healthy" / "seed0").mkdir(parents=True),
        ("S", "out/o"),
        "runs/healthy: not an arm of the study",
    ),
    "records_disagree_with_accuracy": (
        lambda w, o: _flip_record(w.joinpath(*RUN, "samples.jsonl")),
        ("S", "out/o"),
        "seed1/samples.jsonl: its records give 'fault' accuracy",
    ),
    "different_n_in_a_comparison": (
        lambda w, o: _other_n(w.joinpath(*RUN)),
        ("S", "out/o"),
        "were evaluated on different n on the faulty device (10 vs 9)",
    ),
    "different_n_without_records": (
        lambda w, o: _other_n_without_records(w),
        ("S", "out/o"),
        "seed1 were evaluated on different n on the faulty device (10 vs 9)",
    ),
    "different_problems_in_a_comparison": (
        lambda w, o: _other_problems(w.joinpath(*RUN)),
        ("S", "out/o"),
        "were evaluated on different problems on the faulty device (problem 2",
    ),
    "records_in_some_runs_only": (
        lambda w, o: _no_records(w.joinpath(*RUN)),
        ("S", "out/o"),
        "seed1: no per-problem records (samples.jsonl), but",
    ),
    "a_seed_on_two_machine_classes": (
        lambda w, o: _machines(w, {("targeted", 1): "class B"}),
        ("S", "out/o"),
        "seed1: ran on 'class B', but",
    ),
    "machine_record_without_class": (
        lambda w, o: _write(w.joinpath(*RUN, "machine.json"), {"lscpu": "x"}),
        ("S", "out/o"),
        "seed1/machine.json: no machine_class",
    ),
    "no_config": (
        lambda w, o: (w / "config.json").unlink(),
        ("S", "out/o"),
        "config.json: missing; give --config=FILE[:ARG]",
    ),
    "invalid_config": (
        lambda w, o: _edit_json(w / "config.json", lambda c: c["compare"].update(arms=[])),
        ("S", "out/o"),
        "config.json: compare.arms is []",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusal_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, case):
    breaker, (workdir, out), names = REFUSALS[case]
    make_study(tmp_path / "S")
    (tmp_path / "out").mkdir()
    if breaker is not None:
        breaker(tmp_path / "S", tmp_path / "out")
    before = tree_state(tmp_path)
    code, err = run_main(capsys, f"--workdir={tmp_path / workdir}", f"--out={tmp_path / out}")
    assert code == 2
    assert len(err) == 1 and names in err[0], err
    assert err[0].startswith("python -m aqn_jax.study.outcome: error: ")
    assert tree_state(tmp_path) == before  # the workdir and the out folder untouched


def test_out_inside_a_linked_run_of_a_merged_workdir_is_refused(tmp_path, capsys):
    """A merged workdir (bench/device/learn.sh) links each arm's runs from its own job's
    workdir: an --out inside a link's target is inside what the outcome reads."""
    make_study(tmp_path / "S")
    merged = tmp_path / "merged"
    (merged / "runs").mkdir(parents=True)
    for part in ("config.json", "baseline", "srdd"):
        (merged / part).symlink_to(tmp_path / "S" / part)
    for arm in ARMS:
        (merged / "runs" / arm).symlink_to(tmp_path / "S" / "runs" / arm)
    before = tree_state(tmp_path)
    target = tmp_path / "S" / "runs" / "deadzone" / "seed0" / "evaluation"
    code, err = run_main(capsys, f"--workdir={merged}", f"--out={target}")
    assert code == 2 and len(err) == 1 and "inside the workdir it reads" in err[0], err
    assert tree_state(tmp_path) == before
    code, err = run_main(capsys, f"--workdir={merged}", f"--out={tmp_path / 'o'}")
    assert code == 0, err  # the same merged workdir, written elsewhere


def test_config_disagreeing_with_the_workdirs_is_refused(tmp_path, capsys):
    work = make_study(tmp_path / "S")
    before = tree_state(tmp_path)
    code, err = run_main(
        capsys,
        f"--workdir={work}",
        f"--out={tmp_path / 'o'}",
        f"--config={ROOT}/configs/qwen2p5_coder_0p5b_gsm8k.py:seed_study",
    )
    assert code == 2 and len(err) == 1, err
    assert "seed_study: its compare.arms differs from" in err[0] and "config.json" in err[0]
    code, err = run_main(
        capsys, f"--workdir={work}", f"--out={tmp_path / 'o'}", "--config=configs/nope.py:x"
    )
    assert code == 2 and err == [
        "python -m aqn_jax.study.outcome: error: --config=configs/nope.py:x: no such file"
        " configs/nope.py"
    ]
    assert tree_state(tmp_path) == before


def test_command_line_refusal_has_no_traceback(tmp_path):
    work = make_study(tmp_path / "S")
    _truncate(work / "runs" / "deadzone" / "seed2" / "samples.jsonl")
    before = tree_state(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "aqn_jax.study.outcome", f"--workdir={work}", "--out=o"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "deadzone/seed2/samples.jsonl: line" in proc.stderr
    assert tree_state(tmp_path) == before


def test_a_step_without_an_update_is_not_a_zero_mismatch(tmp_path, capsys):
    """A step whose update ran no pass logs its rollout-correction metrics as 0; the per-step
    mismatch is the mean over the runs that measured it (targeted: 0.01 k + 0.001 s at step k,
    seed s), and "n/a" where none did."""
    work = make_study(tmp_path / "S")
    path = work / "runs" / "targeted" / "seed1" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[2].update({"actor/update_skipped": 1.0, "rollout_corr/log_ppl_abs_diff": 0.0})  # step 2
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, err = run_main(capsys, f"--workdir={work}", f"--out={tmp_path / 'o'}")
    assert code == 0, err
    got = json.loads((tmp_path / "o.json").read_text())["twolevel"]["arms"]["targeted_seed"]
    mis = got["mismatch_per_step"]
    assert mis["step"] == [1, 2] and mis["runs"] == [3, 2]
    assert mis["mean"] == pytest.approx([0.011, (0.020 + 0.022) / 2], rel=1e-12)
    # Negative control: counted as measured, the zero would pull step 2's mean to 0.014.
    assert abs(mis["mean"][1] - (0.020 + 0.0 + 0.022) / 3) > 0.005


def test_machine_class_per_seed_from_the_runs(tmp_path, capsys):
    """`cpu` and `machines` are the classes the runs recorded (machine.json), not the machine
    the outcome is written on; a study whose seeds ran on two classes lists both."""
    work = make_study(tmp_path / "S")
    _machines(work, {(arm, 1): "class B" for arm in ARMS})
    code, err = run_main(capsys, f"--workdir={work}", f"--out={tmp_path / 'o'}")
    assert code == 0, err
    got = json.loads((tmp_path / "o.json").read_text())
    seeds = sorted({s for _, s in correctness()})
    assert got["machines"] == {str(s): ("class B" if s == 1 else "class A") for s in seeds}
    assert got["cpu"] == "class A; class B"
    assert "- seed 1: class B" in (tmp_path / "o.md").read_text()
    # Negative control: without machine.json, no `machines` and `cpu` is --cpu's.
    plain = make_study(tmp_path / "T")
    code, err = run_main(capsys, f"--workdir={plain}", f"--out={tmp_path / 'p'}", "--cpu=here")
    assert code == 0, err
    got = json.loads((tmp_path / "p.json").read_text())
    assert "machines" not in got and got["cpu"] == "here"


def test_seed_study_committed_outcome_reproduces_from_its_run_directories(
    tmp_path, capsys, monkeypatch
):
    """docs/qwen05_seed_study.{json,md} from docs/qwen05_seed_study (its config.json, its runs'
    machine.json), byte for byte but the commit: the committed reading is the runs' own."""
    docs = os.path.join(ROOT, "docs")
    with open(os.path.join(docs, "qwen05_seed_study.json")) as f:
        want = f.read()
    committed = json.loads(want)
    monkeypatch.chdir(ROOT)  # the workdir as the committed outcome was written: relative
    code, err = run_main(capsys, "--workdir=docs/qwen05_seed_study", f"--out={tmp_path / 's'}")
    assert code == 0, err
    got = (tmp_path / "s.json").read_text()
    assert got.replace(json.loads(got)["commit"], committed["commit"]) == want
    with open(os.path.join(docs, "qwen05_seed_study.md")) as f:
        assert (tmp_path / "s.md").read_text() == f.read()
    assert len(committed["runs"]) == sum(
        1 for _ in Path(docs, "qwen05_seed_study", "runs").glob("*/seed*/evaluation.json")
    )
