"""Job `compare` end to end on the shrink setting (2 arms x 2 seeds, in one worker process per
core): the shared warm start and diagnosis, results.json in the study schema, the report; killed
midway and re-run, it completes only the missing runs. Config variants and bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import SHALLOW_FAULT as F
from conftest import SHALLOW_FLAGS, load_config
from conftest import SHALLOW_LAYERS as L

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = [
    "--config=configs/compare.py:smoke",
    *SHALLOW_FLAGS,  # 3 layers, the deadzone at the middle one
    "--config.trainer.total_steps=1",
    "--config.evaluate.noise_levels=(0.0,)",
    # The test session's persistent XLA cache (conftest.py, inherited by the workers) instead of
    # one under the workdir: the arm smokes compile the same programs.
    "--config.compare.compile_cache=False",
    "--config.compare.workers=2",  # the parallel path on any machine (cores shared if fewer)
]


@pytest.mark.slow
def test_compare_resumes_and_reports(tmp_path):
    """SIGTERM (Slurm preemption, scancel) while a run evaluates: the job tells its workers and
    exits 143 within 60 s (it hung in a futex wait before, SIGKILL only: issue 42; WORKSPACE.md
    has that run); the rerun completes only the missing runs, none twice, no row twice."""
    work = tmp_path / "study"
    cmd = [sys.executable, "-m", "aqn_jax.launch", *FLAGS, f"--workdir={work}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    log = (tmp_path / "first.out").open("w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    runs = [(arm, seed) for arm in ("global_aqn", "targeted") for seed in (0, 1)]
    dirs = {r: work / "runs" / r[0] / f"seed{r[1]}" for r in runs}
    evals = {r: d / "evaluation.json" for r, d in dirs.items()}

    def evaluating():  # trained (summary.json), not yet evaluated
        return [
            r for r, d in dirs.items() if (d / "summary.json").is_file() and not evals[r].is_file()
        ]

    # Stopped while a run evaluates and another has finished: at least one run is missing
    # whatever the workers' speeds (the last run to finish evaluates after the others).
    deadline = time.time() + 400
    while not (any(f.is_file() for f in evals.values()) and evaluating()):
        assert proc.poll() is None, (tmp_path / "first.out").read_text()[-3000:]
        assert time.time() < deadline, "no run evaluated within 400 s"
        time.sleep(0.05)
    workers = _children(proc.pid)
    assert len(workers) >= 2  # the 2 workers (+ multiprocessing's resource tracker)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=90)
    waited = time.time() - t0
    first = (tmp_path / "first.out").read_text()
    assert code == 143 and waited < 60, (code, waited, first[-3000:])
    assert "SIGTERM: " in first and "rerun the same command" in first, first[-3000:]
    assert not (work / "results.json").exists()
    # The workers end with the job: none is left writing into the workdir.
    deadline = time.time() + 10
    while any(_alive(p) for p in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if _alive(p)]
    done = {r: f.stat().st_mtime_ns for r, f in evals.items() if f.is_file()}
    missing = [r for r in runs if r not in done]
    assert len(done) >= 1 and len(missing) >= 1, done

    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # The finished runs are reused, the missing ones run now (by the 2 workers); none twice.
    assert f"{len(missing)} runs over 2 worker processes" in out.stdout
    for arm, seed in runs:
        reused = f"== {arm} seed {seed}: done, reused" in out.stdout
        ran = f"== {arm} seed {seed}: finished" in out.stdout
        assert reused == ((arm, seed) in done) and ran == (not reused), (arm, seed)
        assert (work / "runs" / arm / f"seed{seed}" / "log.txt").stat().st_size > 0
    for r, stamp in done.items():
        assert evals[r].stat().st_mtime_ns == stamp  # a finished run was not redone

    results = json.loads((work / "results.json").read_text())
    assert results["arms"] == ["global_aqn", "targeted"] and results["seeds"] == [0, 1]
    assert results["srdd"]["layers"] == [F]  # one shared diagnosis of the deadzone
    assert (work / "srdd" / "srdd.json").is_file()
    assert len(list((work / "cache").iterdir())) == 1  # one shared SFT warm start
    for arm in ("global_aqn", "targeted"):
        for seed in ("0", "1"):
            entry = results["runs"][arm][seed]
            assert set(entry["final"]) == {"acc_fault", "acc_clean", "heldout_loss"}
            assert entry["final"]["heldout_loss"] > 0
            assert set(entry["robustness"]) == {"clean", "fault"}
            assert entry["curve"]["step"] == [0, 1]
            assert entry["telemetry"]["flushed"] > 0
            # The per-problem records reproduce each condition's accuracy, one line each.
            run_dir = work / "runs" / arm / f"seed{seed}"
            ev = json.loads((run_dir / "evaluation.json").read_text())
            lines = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
            for name, cond in ev["conditions"].items():
                mine = [x for x in lines if x["condition"] == name]
                assert len(mine) == cond["n"] == len({x["index"] for x in mine})
                assert np.mean([x["correct"] for x in mine]) == cond["acc"]
            val = (run_dir / "validation_samples.jsonl").read_text().splitlines()
            keys = [(r["step"], r["device"], r["index"]) for r in map(json.loads, val)]
            assert len(keys) == len(set(keys)) > 0  # the rerun wrote no line twice
    # The targeted runs trained with AQN on the located layer only.
    summary = json.loads((work / "runs" / "targeted" / "seed0" / "summary.json").read_text())
    assert summary["aqn_layers"] == [F]
    assert json.loads((work / "runs" / "global_aqn" / "seed1" / "summary.json").read_text())[
        "aqn_layers"
    ] == list(range(L))
    # The report: per-arm tables from the same numbers, the test row, plots.
    report = (work / "report.md").read_text()
    loss = results["summary"]["final"]["heldout_loss"]["targeted"]["mean"]
    assert f"{loss:.4f}" in report
    assert "| targeted vs global_aqn | heldout_loss |" in report
    for png in ("curves.png", "final.png", "robustness.png"):
        assert (work / png).stat().st_size > 1000


def _children(pid: int) -> list[int]:
    out = []
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                fields = Path(f"/proc/{stat}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(stat))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_variants_and_bad_input():
    t05 = load_config("compare", "threshold_0.5").faults.deadzone
    assert t05.threshold == 0.5 and t05.severity == "amax"  # the seed's statement of severity
    default = load_config("compare").faults.deadzone
    assert (default.severity, default.quantile, default.layers) == ("quantile", 0.75, "4")
    seed = load_config("compare", "seed_regime").faults.deadzone
    assert (seed.severity, seed.quantile) == ("quantile", 0.97)
    late = load_config("compare", "layer_late,smoke")
    assert late.faults.deadzone.layers == "6" and late.compare.seeds == (0, 1)
    assert load_config("compare", "two_layers").faults.deadzone.layers == "(2,5)"
    default = load_config("compare")
    from aqn_jax.experiment import arm_names

    assert default.compare.arms == arm_names("study") and len(default.compare.arms) == 6
    assert len(default.compare.seeds) == 5 and default.sft.seed == 0
    with pytest.raises(ValueError, match="allowed: one of"):
        load_config("compare", "threshold_0.3")

    from aqn_jax.study.config import check_compare

    bad = load_config("compare")
    bad.compare.arms = ("targeted", "random_aqn")
    with pytest.raises(ValueError, match=r"config\.compare\.arms="):
        check_compare(bad.compare)
    bad = load_config("compare")
    bad.compare.seeds = (0, 0)
    with pytest.raises(ValueError, match=r"config\.compare\.seeds="):
        check_compare(bad.compare)
    bad.compare.seeds = (0,)  # was taken: two minutes of runs, then tests all "n/a"
    with pytest.raises(ValueError, match=r"config\.compare\.seeds=\(0,\): .* need >= 2 seeds"):
        check_compare(bad.compare)
    bad.compare.allow_single_seed = True
    check_compare(bad.compare)
    bad = load_config("compare")
    bad.compare.workers = -1
    with pytest.raises(ValueError, match=r"config\.compare\.workers=-1"):
        check_compare(bad.compare)


def test_every_arm_validates_before_the_diagnosis_exists(tmp_path):
    """The default study (all 6 arms) and each sweep variant pass validation in an empty workdir
    (srdd_guided's sigma map and targeted's layers come from a diagnosis not yet made)."""
    from aqn_jax.jobs.compare import check_config, run_config

    for variant in (None, "threshold_0.5", "seed_regime", "layer_early", "two_layers"):
        check_config(load_config("compare", variant), str(tmp_path))
    config = load_config("compare")
    assert run_config(config, "srdd_guided", 3, str(tmp_path), None).aqn.layers == "srdd"
    diagnosis = {"verdict": {"layers": [2, 5]}}
    rc = run_config(config, "targeted", 3, str(tmp_path), diagnosis)
    assert rc.aqn.layers == "(2, 5)" and rc.seed == 3 and rc.sft.seed == 0
    rc = run_config(config, "srdd_guided", 3, str(tmp_path), diagnosis)
    assert rc.aqn.layer_sigmas == str(tmp_path / "srdd" / "srdd.json")


def test_aqn_form_and_noise_study_variants(tmp_path):
    """Each new variant's runs get the fault and AQN the variant names (validated, planned, no
    compile); their smoke runs are recorded in WORKSPACE.md (issue 14)."""
    from aqn_jax.aqn import sigma_at
    from aqn_jax.aqn.plan import build_plan
    from aqn_jax.faults.transforms import Noise, NormWeightNoise
    from aqn_jax.jobs.compare import check_config, run_config
    from aqn_jax.study.report import summarize

    diagnosis = {"verdict": {"layers": [4]}}
    expect = {
        "aqn_between": ["deadzone", "aqn", "deadzone_after_aqn"],
        "aqn_before_fault": ["aqn", "deadzone"],
        "aqn_norm_weight": ["deadzone", "aqn"],
    }
    for variant, names in expect.items():
        config = load_config("compare", variant)
        assert config.compare.arms == ("targeted", "global_aqn")
        check_config(config, str(tmp_path))
        for arm, layers in (("targeted", (4,)), ("global_aqn", "all")):
            rc = run_config(config, arm, 0, str(tmp_path), diagnosis)
            plan = build_plan(rc.faults, rc.aqn, 8)
            assert [i.name for i in plan.injections] == names, (variant, arm)
            aqn = next(i for i in plan.injections if i.name == "aqn")
            assert aqn.sites.layers == layers
            form = NormWeightNoise if variant == "aqn_norm_weight" else Noise
            assert isinstance(aqn.transform, form)
        # The report says when a form cannot rescue a flushed value, and only then.
        results = {
            "arms": ["targeted"],
            "runs": {"targeted": {"0": {"final": {"acc_fault": 0.5}}}},
            "aqn": {k: config.aqn[k] for k in ("form", "order", "schedule")},
        }
        rescue = [n for n in summarize(results)["notes"] if "never rescue" in n]
        assert len(rescue) == (variant == "aqn_between"), variant

    config = load_config("compare", "noise_study")
    assert config.compare.arms == ("deadzone", "global_qerl", "global_aqn")
    assert tuple(config.evaluate.noise_levels) == (0.0, 0.05, 0.10, 0.20)
    assert load_config("compare", "noise_study_5pct").faults.noise.scale == 0.05
    check_config(config, str(tmp_path))
    runs = {arm: run_config(config, arm, 0, str(tmp_path), None) for arm in config.compare.arms}
    plans = {arm: build_plan(rc.faults, rc.aqn, 8) for arm, rc in runs.items()}
    for arm, plan in plans.items():
        (noise,) = [i for i in plan.injections if i.name == "noise"]
        assert not [i for i in plan.injections if "deadzone" in i.name], arm
        assert noise.transform.scale.base == 0.10 and noise.sites.layers == "all"
        assert noise.phases == ("rollout", "train", "eval")
    assert [i.name for i in plans["deadzone"].injections] == ["noise"]  # the fault, no AQN
    qerl = run_config(config, "global_qerl", 0, str(tmp_path), None).aqn
    epoch = run_config(config, "global_aqn", 0, str(tmp_path), None).aqn
    assert (qerl.schedule, epoch.schedule) == ("qerl", "epoch_aware")

    def sigmas(a):
        return [
            sigma_at(a.schedule, t, 30, a.sigma_start, a.sigma_end, a.num_stages, a.num_epochs)
            for t in range(30)
        ]

    # The two AQN arms differ in their schedule over the default 30 steps (not only in name).
    assert max(abs(x - y) for x, y in zip(sigmas(qerl), sigmas(epoch), strict=True)) > 0.01
    bad = load_config("compare", "noise_study")
    bad.compare.arms = ("deadzone", "targeted")
    bad.compare.comparisons = (("targeted", "deadzone"),)
    with pytest.raises(ValueError, match="config.study_fault='noise'"):
        check_config(bad, str(tmp_path))
    # config.evaluate (read by each run's evaluation, after its training) refused with the rest.
    bad = load_config("compare", "noise_study")
    bad.evaluate.samples = 0
    with pytest.raises(ValueError, match=r"config\.evaluate\.samples=0; must be >= 1"):
        check_config(bad, str(tmp_path))


def test_train_gives_sigterm_back():
    """train.run's preemption flag handler is removed when the loop ends: a compare worker (or the
    job, evaluating after training) must still stop on SIGTERM."""
    from aqn_jax.checkpoint import Preemption

    before = signal.getsignal(signal.SIGTERM)
    stop = Preemption()
    assert signal.getsignal(signal.SIGTERM) == stop._handle
    os.kill(os.getpid(), signal.SIGTERM)  # caught: only the flag is set
    assert stop.requested
    stop.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_preemption_inside_a_checkpoint_read_stays_a_preemption(tmp_path, monkeypatch):
    """The worker's SIGTERM handler raises `Preempted` wherever the worker is, here inside
    Orbax's restore of the run's checkpoint (the evaluation stage): it reaches `_worker_task` as
    a preemption. Negative control: an ordinary exception there is what an unreadable checkpoint
    is, the one-line ValueError (the suite once caught the preemption turned into that, and the
    job's exit 1 instead of 143)."""
    import jax.numpy as jnp

    from aqn_jax.checkpoint import Checkpointer
    from aqn_jax.jobs.compare import Preempted

    ckpt = Checkpointer(str(tmp_path), 1, 5)
    ckpt.save(1, {"w": jnp.arange(4.0)}, {"step": 1})
    ckpt.wait()

    def interrupted(*args, **kwargs):
        raise Preempted

    monkeypatch.setattr(ckpt.manager, "restore", interrupted)
    with pytest.raises(Preempted):
        ckpt.restore_host(1)
    monkeypatch.setattr(ckpt.manager, "restore", lambda *a, **k: 1 / 0)
    with pytest.raises(ValueError, match="checkpoints/1 is unreadable"):
        ckpt.restore_host(1)
    ckpt.close()


def test_worker_count():
    from aqn_jax.jobs.compare import worker_count

    cmp = load_config("compare").compare
    cores = len(os.sched_getaffinity(0))
    assert worker_count(cmp, 30) == cores  # 0 = one per core on a single-process CPU backend
    assert worker_count(cmp, 1) == 1  # never more workers than pending runs
    cmp.workers = 1
    assert worker_count(cmp, 30) == 1
    cmp.workers = 3
    assert worker_count(cmp, 2) == 2


@pytest.fixture
def dimmer():
    """Two throwaway fault kinds, registered here alone and unregistered after: 'dimmer', a
    deadzone transform under its own kind (threshold 0.1 of amax at one layer's output) that AQN
    can target, and 'smudge', the same fault whose entry says AQN cannot target it."""
    import ml_collections

    from aqn_jax.faults import config as fault_cfg
    from aqn_jax.faults.fields import parse_layers
    from aqn_jax.faults.intercept import Injection
    from aqn_jax.faults.sites import SiteSelector
    from aqn_jax.faults.transforms import Deadzone

    def section():
        return ml_collections.ConfigDict({"enabled": False, "layers": "3", "threshold": 0.1})

    def builder(name):
        def build(sec, num_layers):
            if not sec.enabled:
                return []
            layers = parse_layers(sec.layers, f"config.faults.{name}.layers", num_layers)
            sites = SiteSelector(("layer",), layers, "output")
            return [Injection(name, sites, Deadzone(float(sec.threshold)))]

        return build

    fault_cfg.fault_kind("dimmer", section, aqn_target=True, title="the dimmer (a test's kind)")(
        builder("dimmer")
    )
    fault_cfg.fault_kind("smudge", section)(builder("smudge"))
    yield fault_cfg
    for kind in ("dimmer", "smudge"):
        fault_cfg.FAULT_KINDS.unregister(kind)


@pytest.mark.slow  # the real SRDD diagnosis of the warm start (~5 s): the slow tier
def test_a_new_fault_kind_runs_as_a_study_arm(dimmer, sft_tiny, tmp_path):
    """A fault kind registered in this test alone is a study's fault: every arm validates, the
    real SRDD diagnosis of the warm start locates it, the targeted, healthy and SRDD-guided arms
    place AQN by its layers, the run's summary names its layers, and the report names it.
    Negative control: a kind whose entry says AQN cannot target it is refused for the targeted
    arm in one line naming the field and the kinds allowed."""
    from aqn_jax.aqn.plan import build_plan
    from aqn_jax.diagnosis import srdd
    from aqn_jax.diagnosis.config import diagnosis_config
    from aqn_jax.experiment import apply_arm
    from aqn_jax.jobs.compare import check_config, run_config
    from aqn_jax.models.qwen2 import Qwen2ForCausalLM
    from aqn_jax.spec import fault_layers
    from aqn_jax.study.report import summarize, write_report

    config = load_config("compare")  # the embedded 8-layer model
    config.study_fault = "dimmer"
    config.compare.arms = ("clean", "deadzone", "global_aqn", "targeted", "healthy", "srdd_guided")
    check_config(config, str(tmp_path))  # its section came with its registration
    device = dimmer.fault_plan(run_config(config, "deadzone", 0, str(tmp_path), None).faults, 8)
    assert [i.name for i in device.injections] == ["dimmer"] and fault_layers(device, 8) == [3]
    clean = run_config(config, "clean", 0, str(tmp_path), None)
    assert not dimmer.fault_plan(clean.faults, 8).injections

    # The diagnosis the compare job shares between the arms, on the warm start.
    cfg, params, tok, task = sft_tiny
    ids, mask = srdd.calibration_batch(task.examples("train", 32), tok, 8, 256)
    spec = srdd.SrddSpec.of(diagnosis_config(), 0.05)
    report = srdd.diagnose(Qwen2ForCausalLM(cfg), params, device, ids, mask, spec)
    assert report["verdict"]["layers"] == [3]
    (tmp_path / "srdd").mkdir()
    (tmp_path / "srdd" / "srdd.json").write_text(json.dumps(report))
    plans = {
        arm: build_plan(rc.faults, rc.aqn, 8)
        for arm in ("targeted", "healthy", "srdd_guided")
        for rc in [run_config(config, arm, 0, str(tmp_path), report)]
    }
    for arm, plan in plans.items():  # AQN after the fault (the kind re-applies nothing)
        assert [i.name for i in plan.injections] == ["dimmer", "aqn"], arm
    assert plans["targeted"].injections[1].sites.layers == (3,)
    assert plans["healthy"].injections[1].sites.layers == (0, 1, 2, 4, 5, 6, 7)
    scales = plans["srdd_guided"].injections[1].transform.scale.layer_scales
    assert scales[3] == max(scales.values()) > 1.0  # the located layer's sigma, raised

    # The report names the kind; the deadzone's design note is the deadzone's, not the kind's.
    final = {"acc_fault": 0.5, "acc_clean": 0.8, "heldout_loss": 1.0}
    runs = {arm: {s: {"final": final} for s in ("0", "1")} for arm in config.compare.arms}
    results = {"arms": list(config.compare.arms), "seeds": [0, 1], "runs": runs}
    results.update(study_fault="dimmer", aqn={"form": "activation", "order": "between"})
    text = Path(write_report(results, str(tmp_path / "report"))).read_text()
    assert "- study fault: the dimmer (a test's kind) (`config.faults.dimmer`)" in text
    assert not [n for n in summarize(results)["notes"] if "never rescue" in n]
    results["study_fault"] = "deadzone"
    assert [n for n in summarize(results)["notes"] if "never rescue" in n]

    config.study_fault = "smudge"  # negative control
    apply_arm(load_config("compare"), "global_aqn")
    with pytest.raises(ValueError) as err:
        apply_arm(config, "targeted")
    assert str(err.value) == (
        "config.study_fault='smudge'; allowed with arm 'targeted' (AQN placed by the fault's"
        " layers): ('deadzone', 'dimmer')"
    )


def _sequential_config(target: float, top: int):
    import ml_collections

    from aqn_jax.study.config import compare_config

    config = ml_collections.ConfigDict()
    config.compare = compare_config()
    config.compare.arms = ("deadzone", "clean")
    config.compare.reference_arm = "deadzone"
    config.compare.seeds = (0, 1)
    config.compare.comparisons = (("deadzone", "clean"),)
    config.compare.target_mdd, config.compare.max_seeds = target, top
    return config


# deadzone's and clean's accuracy on the faulty device per seed: differences 0.1, 0.3, 0.2, 0.25.
ACC = {"deadzone": [0.5, 0.6, 0.5, 0.55], "clean": [0.4, 0.3, 0.3, 0.3]}


def _fake_runs(monkeypatch, fail_after=None):
    """compare._run_all replaced by writing each pending run's evaluation.json from ACC (no
    training); `fail_after`: raise after that many runs (a kill), the rest left undone."""
    from aqn_jax.jobs import compare

    done = []

    def run_all(config, workdir, todo, diagnosis, timing):
        for arm, seed, run_dir in todo:
            if fail_after is not None and len(done) == fail_after:
                raise KeyboardInterrupt("killed")
            acc = ACC[arm][seed]
            with open(os.path.join(run_dir, "evaluation.json"), "w") as f:
                json.dump({"conditions": {"fault": {"acc": acc, "n": 10}}}, f)
            done.append((arm, seed))
        return [1.0] * len(todo)

    monkeypatch.setattr(compare, "_run_all", run_all)
    return done


def test_sequential_compare_stops_at_its_precision(tmp_path, monkeypatch, capsys):
    from aqn_jax.jobs import compare
    from aqn_jax.study import stats

    def mdd(d):  # the paired test's MDD, the SD of the differences by hand
        m = sum(d) / len(d)
        return stats.paired_mdd((sum((x - m) ** 2 for x in d) / (len(d) - 1)) ** 0.5, len(d))

    def start(work, config):
        seeds = (0, 1)
        compare._run_all(
            config, str(work), compare._pending(str(work), ("deadzone", "clean"), seeds), None, {}
        )
        return compare.sequential(config, str(work), ("deadzone", "clean"), seeds, None, {})

    # Loose: two seeds already resolve it; no third seed runs.
    done = _fake_runs(monkeypatch)
    seeds, stop, _ = start(tmp_path / "loose", _sequential_config(2.0, 4))
    assert seeds == (0, 1) and stop["reached"] and len(done) == 4
    assert stop["rounds"] == [
        {"seeds": [0, 1], "mdd": {"deadzone-clean": pytest.approx(mdd([0.1, 0.3]))}}
    ]
    assert "sequential: stopped: every MDD <= target_mdd=2.0 at 2 seeds" in capsys.readouterr().out
    # Tight: seeds in rounds, every arm of a seed before the next, up to max_seeds.
    done = _fake_runs(monkeypatch)
    seeds, stop, _ = start(tmp_path / "tight", _sequential_config(0.01, 4))
    assert (
        seeds == (0, 1, 2, 3) and not stop["reached"] and stop["reason"].startswith("max_seeds=4")
    )
    assert [a for a, _ in done[4:]] == ["deadzone", "clean", "deadzone", "clean"]
    assert [s for _, s in done] == [0, 0, 1, 1, 2, 2, 3, 3]
    diffs = [0.1, 0.3, 0.2, 0.25]
    got = [r["mdd"]["deadzone-clean"] for r in stop["rounds"]]
    assert got == pytest.approx([mdd(diffs[:n]) for n in (2, 3, 4)])
    assert got[-1] > 0.01  # the target was really not met (the negative control of `reached`)
    # Killed in the third round after one run; the rerun repeats no finished run and ends as
    # the uninterrupted study did.
    work = tmp_path / "killed"
    _fake_runs(monkeypatch, fail_after=5)
    with pytest.raises(KeyboardInterrupt):
        start(work, _sequential_config(0.01, 4))
    again = _fake_runs(monkeypatch)
    seeds2, stop2, _ = start(work, _sequential_config(0.01, 4))
    assert again == [("clean", 2), ("deadzone", 3), ("clean", 3)]
    assert seeds2 == seeds and stop2 == stop


def test_sequential_compare_config_is_checked():
    from aqn_jax.study.config import check_compare

    for target, top, pairs, message in (
        (-0.1, 4, (("deadzone", "clean"),), "target_mdd=-0.1; must be >= 0"),
        (0.05, 1, (("deadzone", "clean"),), r"max_seeds=1; with target_mdd=0.05 it must be >= len"),
        (0.05, 4, (("deadzone", "targeted"),), r"comparisons has \('deadzone', 'targeted'\)"),
        (0.05, 4, (), r"comparisons=\(\): with target_mdd=0.05"),
    ):
        config = _sequential_config(target, top)
        config.compare.comparisons = pairs
        with pytest.raises(ValueError, match=message):
            check_compare(config.compare)
    config = _sequential_config(0.05, 4)
    config.compare.arms = ("deadzone", "clean", "deadzone")
    with pytest.raises(ValueError, match="an arm is named twice"):
        check_compare(config.compare)
    config = _sequential_config(0.05, 4)
    config.compare.names = {"deadzone": "faulty", "bogus": "x"}
    with pytest.raises(ValueError, match=r"not arms: \['bogus'\]"):
        check_compare(config.compare)
    config.compare.names = {"deadzone": "same", "clean": "same"}
    with pytest.raises(ValueError, match="distinct display names"):
        check_compare(config.compare)
    config = _sequential_config(0.0, 0)  # comparisons and the reference arm: inside the study
    config.compare.clean_comparisons = (("deadzone", "targeted"),)
    with pytest.raises(ValueError, match=r"clean_comparisons has \('deadzone', 'targeted'\)"):
        check_compare(config.compare)
    config = _sequential_config(0.0, 0)
    config.compare.reference_arm = "global_aqn"
    with pytest.raises(ValueError, match="reference_arm='global_aqn'; allowed: one of"):
        check_compare(config.compare)
    config = _sequential_config(0.05, 4)  # the positive control; a name for an arm not run
    config.compare.names = {"deadzone": "faulty", "targeted": "targeted_seed"}
    check_compare(config.compare)


def test_a_seed_runs_on_one_machine_class(tmp_path, monkeypatch, capsys):
    """A seed whose runs were started on another machine class is deferred, with one line; the
    seeds started here, or not started, run; record_machine writes the class and lscpu once."""
    from aqn_jax.jobs import compare

    arms = ("deadzone", "clean")
    monkeypatch.setattr(compare, "machine_class", lambda: "here")
    elsewhere = tmp_path / "runs" / "clean" / "seed1"
    elsewhere.mkdir(parents=True)
    (elsewhere / compare.MACHINE_FILE).write_text(json.dumps({"machine_class": "there"}))
    mine = tmp_path / "runs" / "deadzone" / "seed0"
    mine.mkdir(parents=True)
    compare.record_machine(str(mine))
    record = json.loads((mine / compare.MACHINE_FILE).read_text())
    assert record["machine_class"] == "here" and isinstance(record["lscpu"], str)
    todo = compare._pending(str(tmp_path), arms, (0, 1, 2))
    assert [(a, s) for a, s, _ in todo] == [
        ("deadzone", 0), ("clean", 0), ("deadzone", 2), ("clean", 2)
    ]  # fmt: skip
    assert "== seed 1: deferred: its runs were started on 'there', this is 'here'" in (
        capsys.readouterr().out
    )
    monkeypatch.setattr(compare, "machine_class", lambda: "there")  # on that class: it runs
    assert [(a, s) for a, s, _ in compare._pending(str(tmp_path), arms, (1,))] == [
        ("deadzone", 1), ("clean", 1)
    ]  # fmt: skip
    compare.record_machine(str(mine))  # kept as it is: the run's class is where it started
    assert json.loads((mine / compare.MACHINE_FILE).read_text()) == record


@pytest.mark.slow
def test_sequential_compare_on_the_tiny_model(tmp_path):
    """The sequential compare end to end on the tiny model: killed in its second round, the
    rerun reuses every finished run; its stopping record agrees with its MDDs; the same workdir
    with a loose target stops after the first two seeds, reusing them."""
    work = tmp_path / "seq"
    flags = [
        *[f for f in FLAGS if "workers" not in f],
        "--config.compare.workers=1",
        "--config.compare.arms=('deadzone','clean')",
        "--config.compare.reference_arm=deadzone",
        "--config.compare.comparisons=(('deadzone','clean'),)",
        "--config.compare.seeds=(0,1)",
        "--config.evaluate.size=16",
        f"--workdir={work}",
    ]
    cmd = [sys.executable, "-m", "aqn_jax.launch", *flags]
    tight = [*cmd, "--config.compare.target_mdd=1e-9", "--config.compare.max_seeds=3"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    evals = lambda: sorted(work.glob("runs/*/seed*/evaluation.json"))  # noqa: E731
    proc = subprocess.Popen(
        tight, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.time() + 600
    while len(evals()) < 3:  # killed after the first run of the second round, or later
        assert proc.poll() is None or len(evals()) >= 3, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "3 runs not evaluated within 600 s"
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    stamps = {p: p.stat().st_mtime_ns for p in evals()}
    out = subprocess.run(tight, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())  # none redone
    seq = json.loads((work / "sequential.json").read_text())
    last = seq["rounds"][-1]["mdd"]["deadzone-clean"]
    if seq["reached"]:  # zero spread at 2 seeds: the MDD is 0 and the target is met there
        assert last == 0.0 and [r["seeds"] for r in seq["rounds"]] == [[0, 1]]
    else:
        assert last > 1e-9 and seq["rounds"][-1]["seeds"] == [0, 1, 2]
        assert "sequential: stopped: max_seeds=3 reached" in out.stdout
    results = json.loads((work / "results.json").read_text())
    assert results["seeds"] == seq["rounds"][-1]["seeds"] and results["stopping"] == seq
    loose = subprocess.run(
        [*cmd, "--config.compare.target_mdd=100.0", "--config.compare.max_seeds=3"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert loose.returncode == 0, loose.stderr[-3000:]
    assert "sequential: stopped: every MDD <= target_mdd=100.0 at 2 seeds" in loose.stdout
    assert loose.stdout.count("done, reused") == 4 and " -> " not in loose.stdout
