"""Job `compare`: the study. Every arm x every seed is a full train run plus a robustness
evaluation; the statistics and the report come from aqn_jax/study.

  python -m aqn_jax.launch --config=configs/compare.py                  # 6 arms x 5 seeds
  python -m aqn_jax.launch --config=configs/compare.py:threshold_0.1    # a sweep variant
  python -m aqn_jax.launch --config=configs/compare.py:smoke

Layout of the workdir:

  cache/                 the one SFT warm start every run shares (sft.seed fixed)
  srdd/srdd.json         the one SRDD diagnosis of the faulty device (the warm start is shared,
                         so every seed would find the same): targeted gets its located layers,
                         srdd_guided its sigma map, as explicit flags
  runs/<arm>/seed<k>/    each run's train workdir (+ evaluation.json)
  xla_cache/             the persistent compilation cache: seeds and arms that share a program
                         compile it once
  results.json, report.md, curves.png, final.png, robustness.png

A run whose `evaluation.json` exists is reused; a run killed midway resumes from its latest
checkpoint (`checkpoint.every`); so re-running the same command completes only what is missing.

Parallel runs (`config.compare.workers`): on a single-process CPU backend the pending runs go to
one worker process per core (0 = that default; each worker pinned to its share of the cores),
because the tiny model's programs use two cores far less than twice as well as one. A worker
keeps its compiled programs from one run to the next; each run's output goes to
`runs/<arm>/seed<k>/log.txt`. On GPU/TPU, or over several hosts, runs go one
after another in this process (workers=1). SIGTERM is passed to the workers: a run in its train
loop saves a checkpoint, one elsewhere (warm start, diagnosis, evaluation) stops; the job exits
143 when they have returned, after GRACE_S or at a second SIGTERM (what is left is killed, and
resumes from its latest checkpoint); nothing finished is redone on the re-run. A run's numbers are
bitwise reproducible for a given layout, but XLA's threaded reductions round differently on one
core than on two: the same (arm, seed) run with workers=1 and with one worker per core differs
at rounding level, which RL's sampling then amplifies (results.json records `timing.workers`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import time
import traceback

import jax
import numpy as np

from aqn_jax import parallel, training
from aqn_jax.checkpoint import Checkpointer
from aqn_jax.checks import check_names, check_train
from aqn_jax.compute_dtype import machine_class
from aqn_jax.data.config import load_split
from aqn_jax.diagnosis import srdd
from aqn_jax.evaluation import check_evaluate, conditions, robustness, write_evaluation
from aqn_jax.experiment import ARMS, apply_arm
from aqn_jax.faults.config import fault_plan
from aqn_jax.files import write_atomic, write_json
from aqn_jax.jobs import run_policy
from aqn_jax.metrics import read_metrics
from aqn_jax.models.factory import logical_axes, model_config
from aqn_jax.spec import eval_spec, srdd_spec, warm_start_spec
from aqn_jax.study import report as study_report
from aqn_jax.study import stats
from aqn_jax.study.config import check_compare
from aqn_jax.study.outcome import MACHINE_FILE
from aqn_jax.study.report import write_report
from aqn_jax.warm_start import sft_seed, tokenizer_for, warm_start

# The curves results.json keeps per run: those the study report plots.
CURVE_KEYS = (*study_report.CURVE_KEYS, *study_report.MISMATCH_KEYS)
# Means over a run's RL steps, in its results.json telemetry (the sampler-trainer mismatch).
MISMATCH_TELEMETRY = {
    "mismatch_kl": "rollout_corr/kl",
    "mismatch_k3_kl": "rollout_corr/k3_kl",
    "is_ess": "rollout_corr/rollout_is_eff_sample_size",
    "rs_masked": "rollout_corr/rollout_rs_masked_fraction",
}


def worker_count(cmp, pending: int) -> int:
    """How many runs go in parallel (see the module docstring)."""
    w = int(cmp.workers)
    single_cpu = jax.default_backend() == "cpu" and jax.process_count() == 1
    if w > 1 and not single_cpu:
        raise ValueError(
            f"config.compare.workers={w}: parallel worker processes share the CPU cores of one"
            f" host; this is a {jax.default_backend()} backend with {jax.process_count()}"
            " process(es): use 0 or 1 (one run after another)"
        )
    if w == 0:
        w = len(os.sched_getaffinity(0)) if single_cpu else 1
    return max(1, min(w, pending))


def run_config(config, arm: str, seed: int, workdir: str, diagnosis: dict | None):
    """The train config of one (arm, seed): the shared warm start and diagnosis made explicit.
    With `diagnosis=None` (validation, before the diagnosis exists) the SRDD arms keep
    `aqn.layers='located'` / `'srdd'`, which `check_train` checks with stand-in layers."""
    c = copy.deepcopy(config)
    with c.unlocked():
        c.job = "train"
        apply_arm(c, arm)
        c.seed = int(seed)
        # Every seed of the study shares one warm start.
        c.sft.seed = sft_seed(config.sft, config.seed)
        c.sft.cache_dir = os.path.join(os.path.abspath(workdir), "cache")
        placed = None if diagnosis is None else ARMS.get(arm).layers
        if placed == "located":  # the layers SRDD located, as explicit ids
            c.aqn.layers = str(tuple(diagnosis["verdict"]["layers"]))
        elif placed == "srdd":  # SRDD's per-layer sigma map
            c.aqn.layer_sigmas = os.path.join(os.path.abspath(workdir), "srdd", "srdd.json")
    return c


def check_config(config, workdir: str) -> None:
    """Every check that needs no compile, for every arm: bad input fails before any training."""
    check_names(config)  # config.arm / study_fault by name: each run sets its own arm
    check_compare(config.compare)
    check_evaluate(config.evaluate)  # each run's evaluation, and the warm start's baseline
    names = [c.name for c in conditions(config.evaluate)]
    target = config.compare.get("target_condition", "fault")
    if float(config.compare.get("target_mdd", 0.0)) > 0 and target not in names:
        raise ValueError(
            f"config.compare.target_condition={target!r}; allowed: the evaluation's"
            f" conditions {names}"
        )
    lengths: dict = {}  # every arm reads the same data: tokenized once
    for arm in config.compare.arms:
        rc = run_config(config, arm, int(config.compare.seeds[0]), workdir, None)
        check_train(rc, cache=lengths)


def run(config, workdir: str) -> None:
    """The job's stages: check every arm, the shared warm start, the shared SRDD diagnosis,
    the warm start's baseline, the pending runs, the results and the report."""
    t_start = time.perf_counter()
    cmp = config.compare
    check_config(config, workdir)
    arms, seeds = tuple(cmp.arms), tuple(int(s) for s in cmp.seeds)
    if cmp.compile_cache:
        _use_compile_cache(os.path.join(workdir, "xla_cache"))
    base = run_config(config, "deadzone", seeds[0], workdir, None)
    t0 = time.perf_counter()
    model_cfg, params, _ = warm_start(warm_start_spec(base), workdir)
    timing = {"sft_s": time.perf_counter() - t0}
    diagnosis = None
    if any(ARMS.get(a).layers in ("located", "srdd") for a in arms):
        diagnosis = _diagnose(base, arms, workdir, model_cfg, params, timing)
    if cmp.get("baseline", False):
        timing.update(_baseline(base, workdir, model_cfg, params))
    if jax.process_index() == 0:  # what the outcome reads: the arms, names and comparisons
        write_atomic(os.path.join(workdir, "config.json"), config.to_json_best_effort(indent=2))
    todo = _pending(workdir, arms, seeds)
    walls = _run_all(config, workdir, todo, diagnosis, timing)
    stopping = None
    if float(cmp.get("target_mdd", 0.0)) > 0:
        seeds, stopping, more = sequential(config, workdir, arms, seeds, diagnosis, timing)
        walls += more
        if jax.process_index() == 0:
            write_json(os.path.join(workdir, SEQUENTIAL_FILE), stopping)
    timing["runs_s_this_invocation"] = float(np.sum(walls)) if walls else 0.0
    timing["runs_this_invocation"] = len(walls)
    timing["total_s_this_invocation"] = time.perf_counter() - t_start
    runs, waiting = {}, []
    for arm in arms:
        for seed in seeds:
            run_dir = os.path.join(workdir, "runs", arm, f"seed{seed}")
            if os.path.isfile(os.path.join(run_dir, "evaluation.json")):
                runs.setdefault(arm, {})[str(seed)] = _collect(run_dir)
            else:  # a seed deferred to its machine class (`_pending`)
                waiting.append(f"{arm}/seed{seed}")
    if waiting:
        print(f"results.json: without the unfinished runs {waiting} (rerun on their class)")
    results = _results(config, workdir, diagnosis, runs, timing)
    results["seeds"], results["stopping"] = list(seeds), stopping
    if jax.process_index() == 0:
        write_json(os.path.join(workdir, "results.json"), results, default=str)
        report = write_report(results, workdir)
        print(f"report: {report}")


SEQUENTIAL_FILE = "sequential.json"


def sequential(config, workdir: str, arms: tuple, seeds: tuple, diagnosis, timing: dict):
    """Seeds in rounds until the study reaches its precision: after `seeds` (run before), while
    some comparison's minimum detectable difference (`comparison_mdds`) is above
    `config.compare.target_mdd` and fewer than `max_seeds` seeds have run, the next seed's arms
    run (every arm of a seed before the next seed). Returns (the seeds, the stopping record,
    the new runs' wall times).

    The rule reads only the spread of each comparison's per-seed paired differences and the
    number of seeds (the MDD is a function of the two), never the difference itself: whether
    a study goes on does not depend on which arm is ahead, so stopping does not bias the
    estimate the way stopping at a significant p would. Resumable: every finished run is
    reused, so a rerun after a kill recomputes the same rounds from the same runs."""
    cmp = config.compare
    target, top = float(cmp.target_mdd), int(cmp.max_seeds)
    rounds, walls = [], []
    while True:
        mdds = comparison_mdds(workdir, cmp.comparisons, seeds, cmp.target_condition)
        rounds.append({"seeds": list(seeds), "mdd": mdds})
        shown = ", ".join(f"{k} {_fmt(v)}" for k, v in mdds.items())
        print(f"sequential: {len(seeds)} seeds: MDD {shown} (target {target})", flush=True)
        if all(v is not None and v <= target for v in mdds.values()):
            reason = f"every MDD <= target_mdd={target} at {len(seeds)} seeds"
            break
        if len(seeds) >= top:
            reason = f"max_seeds={top} reached; MDD {shown} (target {target})"
            break
        seeds = (*seeds, max(seeds) + 1)
        walls += _run_all(config, workdir, _pending(workdir, arms, seeds[-1:]), diagnosis, timing)
    print(f"sequential: stopped: {reason}", flush=True)
    stopping = {
        "target_mdd": target,
        "max_seeds": top,
        "condition": cmp.target_condition,
        "reached": reason.startswith("every"),
        "reason": reason,
        "rounds": rounds,
    }
    return seeds, stopping, walls


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def comparison_mdds(workdir: str, comparisons, seeds, condition: str) -> dict[str, float | None]:
    """Per comparison "a-b", the paired test's minimum detectable difference (power 0.8, two-
    sided 0.05; `stats.paired_mdd`) over the seeds both arms finished, from their
    `evaluation.json` on `condition`: 0 when every seed's difference is the same, None below
    two seeds."""
    out = {}
    for a, b in comparisons:
        acc = {}
        for arm in (a, b):
            for seed in seeds:
                path = os.path.join(workdir, "runs", arm, f"seed{seed}", "evaluation.json")
                if os.path.isfile(path):
                    with open(path) as f:
                        acc[arm, seed] = json.load(f)["conditions"][condition]["acc"]
        d = [acc[a, s] - acc[b, s] for s in seeds if (a, s) in acc and (b, s) in acc]
        sd = float(np.std(d, ddof=1)) if len(d) >= 2 else None
        out[f"{a}-{b}"] = None if sd is None else (stats.paired_mdd(sd, len(d)) if sd else 0.0)
    return out


def _diagnose(base, arms, workdir: str, model_cfg, params, timing: dict) -> dict:
    """The one SRDD diagnosis every run shares (`srdd/srdd.json`, reused when it exists)."""
    path = os.path.join(workdir, "srdd", "srdd.json")
    if os.path.isfile(path):
        diagnosis = srdd.load_report(path)
    else:
        t0 = time.perf_counter()
        diagnosis = srdd.run_srdd(
            srdd_spec(base),
            model_cfg,
            params,
            fault_plan(base.faults, model_cfg.num_hidden_layers),
            load_split(base.data, "train"),
            tokenizer_for(base.tokenizer_path, base.model.hf_path, model_cfg.vocab_size),
            os.path.dirname(path),
        )
        timing["srdd_s"] = time.perf_counter() - t0
    print(f"SRDD (shared by every run): {diagnosis['verdict']['message']}")
    located = [a for a in arms if ARMS.get(a).layers == "located"]
    if not diagnosis["verdict"]["layers"] and located:
        raise ValueError(
            f"the SRDD diagnosis found no faulty layer, so arms {located} have nothing to"
            f" target; check config.faults or drop them from config.compare.arms"
        )
    return diagnosis


def _run_machine(run_dir: str) -> str | None:
    """The machine class a run was started on (its machine.json), or None if not started."""
    path = os.path.join(run_dir, MACHINE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)["machine_class"]


def record_machine(run_dir: str) -> None:
    """machine.json of a run started on this machine: its class (`machine_class`) and the
    whole `lscpu` output; kept as it is when the run resumes (on the same class)."""
    path = os.path.join(run_dir, MACHINE_FILE)
    if os.path.isfile(path):
        return
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        lscpu = f"lscpu failed: {e}"
    write_json(path, {"machine_class": machine_class(), "lscpu": lscpu, "started": time.time()})


def _pending(workdir: str, arms: tuple, seeds: tuple) -> list[tuple]:
    """The (arm, seed, run_dir) without an evaluation.json, seed by seed (every arm of a seed
    before the next seed; parallel workers compile different arms at once, and the later seeds
    find their programs in the compile cache).

    A seed pairs its arms only on one machine class (XLA:CPU's results differ between classes):
    a seed whose runs were started on another class (their machine.json) is deferred, with one
    line naming the class, until the job runs on that class again."""
    here, todo = machine_class(), []
    for seed in seeds:
        dirs = {arm: os.path.join(workdir, "runs", arm, f"seed{seed}") for arm in arms}
        other = sorted({m for d in dirs.values() if (m := _run_machine(d)) not in (None, here)})
        if other:
            print(f"== seed {seed}: deferred: its runs were started on {other[0]!r}, this is"
                  f" {here!r} (a seed's arms pair on one machine class)")  # fmt: skip
            continue
        for arm in arms:
            run_dir = dirs[arm]
            os.makedirs(run_dir, exist_ok=True)
            if os.path.isfile(os.path.join(run_dir, "evaluation.json")):
                print(f"== {arm} seed {seed}: done, reused ({run_dir})")
            else:
                todo.append((arm, seed, run_dir))
    return todo


def _run_all(config, workdir: str, todo: list, diagnosis, timing: dict) -> list[float]:
    """Train and evaluate the pending runs, in worker processes or one after another; their
    wall times (and the workers, the wall time of them all, into `timing`)."""
    cmp = config.compare
    workers = worker_count(cmp, len(todo))
    timing["workers"] = workers
    t0 = time.perf_counter()
    cache_dir = os.path.join(workdir, "xla_cache") if cmp.compile_cache else None
    # Every arm is evaluated on the study's faulty device (the deadzone arm's hardware; the
    # evaluation never injects AQN), the clean arm included: "fault on" means the same device.
    jobs = [
        (
            run_config(config, arm, seed, workdir, diagnosis),
            run_dir,
            run_config(config, "deadzone", seed, workdir, None),
        )
        for arm, seed, run_dir in todo
    ]
    if workers == 1:
        walls, programs = [], {}
        for (arm, seed, run_dir), job in zip(todo, jobs, strict=True):
            print(f"== {arm} seed {seed} -> {run_dir}")
            walls.append(train_and_evaluate(*job, programs=programs))
    else:
        walls = _run_parallel(todo, jobs, workers, cache_dir)
    timing["runs_wall_s_this_invocation"] = time.perf_counter() - t0
    return walls


def _results(config, workdir: str, diagnosis, runs: dict, timing: dict) -> dict:
    """results.json (schema in aqn_jax/study/report.py)."""
    cmp = config.compare
    arms = tuple(cmp.arms)
    return {
        "name": os.path.basename(os.path.abspath(workdir)),
        "variant": cmp.variant,
        "arms": list(arms),
        "seeds": [int(s) for s in cmp.seeds],
        "reference_arm": cmp.reference_arm,
        "comparisons": [list(p) for p in cmp.comparisons if set(p) <= set(arms)],
        "conditions": [c.name for c in conditions(config.evaluate)],
        "study_fault": config.study_fault,
        "fault": config.faults[config.study_fault].to_dict(),
        "aqn": {
            k: config.aqn[k] for k in ("form", "order", "schedule", "sigma_start", "sigma_end")
        },
        "srdd": None if diagnosis is None else diagnosis["verdict"],
        "runs": runs,
        "timing": timing,
    }


def train_and_evaluate(rc, run_dir: str, device=None, programs: dict | None = None) -> float:
    """One run of the study: train with `rc`, then the robustness matrix on the hardware of
    `device` (a config; default `rc`) into `evaluation.json` (written last: its presence marks
    the run finished). `programs`: the evaluation programs compiled by earlier runs of this
    process (`evaluation.program`). Returns the wall time."""
    t0 = time.perf_counter()
    if jax.process_index() == 0:
        record_machine(run_dir)
    if not os.path.isfile(os.path.join(run_dir, "summary.json")):  # else trained: stopped later
        training.run(rc, run_dir)
    result = _evaluate(rc if device is None else device, run_dir, programs, rc)
    result["wall_time_s"] = time.perf_counter() - t0
    write_evaluation(run_dir, result)  # samples.jsonl, then evaluation.json
    return result["wall_time_s"]


# -- parallel workers ------------------------------------------------------------------------------
_STOP = None  # the workers' "stop" event (SIGTERM to the job)
_PROGRAMS: dict | None = None  # a worker's evaluation programs, kept across its runs
_BUSY = False  # a worker inside a run (SIGTERM: stop the run) or idle (SIGTERM: exit)
# After the first SIGTERM, how long the workers have to save and return before they are killed
# (a train step of the tiny model takes seconds; evaluation stops after its current batch).
GRACE_S = 40.0


class Preempted(BaseException):  # noqa: N818 (a request to stop, as KeyboardInterrupt is)
    """SIGTERM reached a worker outside the train loop (warm start, diagnosis, evaluation).
    A BaseException, so that no `except Exception` on the way (the checkpoint reader's, say)
    turns it into a failure: the job then exits 143, not 1."""


def _run_parallel(todo, jobs, workers: int, cache_dir: str | None) -> list[float]:
    """The pending runs over `workers` processes, each pinned to its share of the cores.

    SIGTERM to the job: the workers are told (each run saves a checkpoint after its current
    step, or stops its evaluation, and returns), then the job exits 143 once every run has
    returned, or after GRACE_S, or at a second SIGTERM, killing what is left. Multiprocessing's
    Pool replaces a worker that died and never returns its task, so results are awaited with a
    timeout, never forever."""
    ctx = multiprocessing.get_context("spawn")  # a fresh JAX runtime per worker (no fork)
    cores = sorted(os.sched_getaffinity(0))
    # Each worker its share of the cores; more workers than cores share them round-robin.
    groups = [cores[i::workers] or [cores[i % len(cores)]] for i in range(workers)]
    slots = ctx.Queue()
    for g in groups:
        slots.put(g)
    stop = ctx.Event()
    print(
        f"{len(jobs)} runs over {workers} worker processes (cores {groups}); logs in <run>/log.txt"
    )
    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(slots, stop, cache_dir))
    previous = signal.getsignal(signal.SIGTERM)
    terms = []  # the times SIGTERM arrived

    def forward_sigterm(signum, frame):
        terms.append(time.monotonic())
        stop.set()  # workers finish their step, save a checkpoint and take no new run
        for p in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)

    with contextlib.suppress(ValueError):  # only possible on the main thread
        signal.signal(signal.SIGTERM, forward_sigterm)
    walls, failed, preempted, returned = [], [], [], 0
    try:
        results = pool.imap_unordered(_worker_task, [(i, *job) for i, job in enumerate(jobs)])
        while returned < len(jobs):
            if terms and (len(terms) > 1 or time.monotonic() - terms[0] > GRACE_S):
                break  # escalate: the runs still out are killed below
            try:
                i, status, value = results.next(timeout=0.5)
            except multiprocessing.TimeoutError:
                continue
            returned += 1
            arm, seed, run_dir = todo[i]
            if status == "ok":
                walls.append(value)
                print(f"== {arm} seed {seed}: finished in {value:.0f} s ({run_dir})", flush=True)
            elif status == "preempted":
                preempted.append(value)  # None: not started
            else:
                failed.append(f"{arm} seed {seed} ({run_dir}/log.txt):\n{value}")
        if returned == len(jobs):
            pool.close()
            pool.join()
    finally:
        if returned < len(jobs) or sys.exc_info()[0] is not None:
            _kill_workers(pool)
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, previous)
    if failed:
        raise RuntimeError(f"{len(failed)} run(s) failed: " + "\n".join(failed))
    if terms or stop.is_set():
        stopped = sum(v is not None for v in preempted)
        killed = len(jobs) - returned
        why = "a second SIGTERM" if len(terms) > 1 else f"{GRACE_S:.0f} s"
        print(
            f"SIGTERM: {len(walls)} run(s) finished, {stopped} stopped (a checkpoint saved, or"
            f" the evaluation cut short), {len(preempted) - stopped} not started"
            + (f", {killed} killed after {why}" if killed else "")
            + "; rerun the same command: finished runs are reused, the others resume from their"
            " latest checkpoint",
            flush=True,
        )
        raise SystemExit(143)
    return walls


def _kill_workers(pool) -> None:
    """SIGKILL every worker (one stuck in a computation ignores SIGTERM), then reap the pool."""
    for p in list(getattr(pool, "_pool", ())):
        with contextlib.suppress(ProcessLookupError, AttributeError):
            p.kill()
    pool.terminate()
    pool.join()


def _worker_sigterm(signum, frame):
    """A worker's SIGTERM outside the train loop (which saves, then exits 143): inside a run,
    stop it (`Preempted`, caught by `_worker_task`); idle, exit."""
    if _BUSY:
        raise Preempted
    os._exit(143)


def _init_worker(slots, stop, cache_dir) -> None:
    global _STOP, _PROGRAMS
    _STOP, _PROGRAMS = stop, {}
    with contextlib.suppress(Exception):  # die with the job (Linux), never orphaned
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    signal.signal(signal.SIGTERM, _worker_sigterm)
    # Before the first JAX computation: XLA sizes its thread pools from this affinity. A worker
    # the Pool started in place of one that exited finds the slots taken: it keeps every core.
    with contextlib.suppress(queue.Empty):
        os.sched_setaffinity(0, slots.get(timeout=1.0))
    if cache_dir:
        _use_compile_cache(cache_dir)


def _worker_task(task):
    global _BUSY
    i, rc, run_dir, device = task
    if _STOP.is_set():
        return i, "preempted", None
    log = open(os.path.join(run_dir, "log.txt"), "a")  # noqa: SIM115 (closed below)
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)  # C-level output (XLA, absl) too
    _BUSY = True
    try:
        return i, "ok", train_and_evaluate(rc, run_dir, device, _PROGRAMS)
    except Preempted:  # SIGTERM in the warm start, diagnosis or evaluation: nothing to save
        print("SIGTERM: stopped; the rerun resumes this run", flush=True)
        return i, "preempted", "SIGTERM"
    except SystemExit as e:  # SIGTERM in the train loop: it saved a checkpoint
        return i, ("preempted" if e.code == 143 else "failed"), f"exit {e.code}"
    except Exception:
        text = traceback.format_exc()
        print(text, flush=True)
        return i, "failed", text[-2000:]
    finally:
        _BUSY = False
        # A run that raised may leave the train job's SIGTERM flag handler installed: an idle
        # worker must exit on SIGTERM (Pool.terminate) instead of swallowing it.
        signal.signal(signal.SIGTERM, _worker_sigterm)
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        log.close()


def _use_compile_cache(path: str) -> None:
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _evaluate(config, run_dir: str, programs: dict | None, policy=None) -> dict:
    """The robustness matrix and held-out loss of the run's final checkpoint on the device of
    `config`; `policy`: the run's own config (its LoRA and base format; default `config`)."""
    ckpt = Checkpointer(run_dir, 0, 1)
    state, meta = ckpt.restore_host(ckpt.latest_step())
    ckpt.close()
    model_cfg = model_config(config.model)
    trained = state["params"]
    if "lora" in trained:  # a QeRL-mode arm: its adapters merged into its (quantised) base
        model_cfg, trained = run_policy(policy or config, trained, run_dir, meta.get("base"))
    tokenizer = tokenizer_for(config.tokenizer_path, config.model.hf_path, model_cfg.vocab_size)
    size = int(config.evaluate.size or config.trainer.val_size)
    test = load_split(config.data, "test")[:size]
    mesh = parallel.make_mesh(config.mesh)
    params = parallel.put_global(trained, parallel.param_shardings(logical_axes(model_cfg), mesh))
    hardware = fault_plan(config.faults, model_cfg.num_hidden_layers)
    spec = eval_spec(config)
    return robustness(spec, model_cfg, params, tokenizer, test, hardware, mesh, programs=programs)


def _baseline(config, workdir: str, model_cfg, params) -> dict:
    """The warm start's robustness matrix on the study's faulty device, once:
    `baseline/evaluation.json` (reused when it exists). Returns its timing."""
    path = os.path.join(workdir, "baseline", "evaluation.json")
    if os.path.isfile(path):
        print(f"step 0 (the warm start): evaluated, reused ({path})")
        return {}
    t0 = time.perf_counter()
    size = int(config.evaluate.size or config.trainer.val_size)
    mesh = parallel.make_mesh(config.mesh)
    placed = parallel.put_global(params, parallel.param_shardings(logical_axes(model_cfg), mesh))
    result = robustness(
        eval_spec(config),
        model_cfg,
        placed,
        tokenizer_for(config.tokenizer_path, config.model.hf_path, model_cfg.vocab_size),
        load_split(config.data, "test")[:size],
        fault_plan(config.faults, model_cfg.num_hidden_layers),
        mesh,
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_evaluation(os.path.dirname(path), result)
    print(f"step 0 (the warm start): {path}")
    return {"baseline_s": time.perf_counter() - t0}


def _collect(run_dir: str) -> dict:
    """One run's entry of results.json (schema in aqn_jax/study/report.py)."""
    with open(os.path.join(run_dir, "evaluation.json")) as f:
        ev = json.load(f)
    rows = read_metrics(run_dir)
    curve = {"step": [r["step"] for r in rows]}
    for key in CURVE_KEYS:
        curve[key] = [r.get(key) for r in rows]
    conds = ev["conditions"]
    loss = ev.get("loss", {})

    def mean_of(suffix):
        vals = [
            v
            for r in rows[1:]
            for k, v in r.items()
            if k.startswith("faults/rollout/") and k.endswith(suffix)
        ]
        return float(np.mean(vals)) if vals else 0.0

    telemetry = {"flushed": mean_of(".flushed"), "rescued": mean_of(".rescued")}
    for name, key in MISMATCH_TELEMETRY.items():
        vals = [r[key] for r in rows[1:] if key in r]
        if vals:
            telemetry[name] = float(np.mean(vals))
    return {
        "final": {
            "acc_fault": conds.get("fault", {}).get("acc"),
            "acc_clean": conds.get("clean", {}).get("acc"),
            "heldout_loss": loss.get("fault", loss.get("clean")),
        },
        "curve": curve,
        "robustness": {name: c["acc"] for name, c in conds.items()},
        "telemetry": telemetry,
        "wall_time_s": ev.get("wall_time_s"),
    }
