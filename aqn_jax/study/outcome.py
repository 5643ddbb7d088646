"""The paired study's outcome: the compare job's workdir read, every input checked, and the
statistics over seeds (and, where each run kept its per-problem records, over seeds and
problems) written as `<out>.json`, `<out>.png` and `<out>.md`.

  python -m aqn_jax.study.outcome --workdir=runs/qwen05_seed_study --out=docs/qwen05_seed_study
  python -m aqn_jax.study.outcome --workdir=docs/qwen05_study --out=docs/qwen05_arith_study \\
      --config=configs/qwen2p5_coder_0p5b_gsm8k.py:study      # a workdir without config.json

Inputs (the compare job's workdir, `aqn_jax/jobs/compare.py`):
  config.json            the study's config as the job wrote it; its `compare` section gives
                         the arms (`arms`, in their order), their display names (`names`: arm ->
                         name, an arm not named keeps its own), the comparisons read on the
                         faulty device (`comparisons`) and on the clean one (`clean_comparisons`),
                         and `target_mdd` (the planner's target). A workdir without it (written
                         before the job recorded it, or merged from one-arm jobs: bench/device/
                         learn.sh) needs `--config=FILE[:ARG]`, loaded as `aqn_jax.launch` loads
                         `--config`; with both, they must agree on those fields.
  baseline/evaluation.json   step 0 (the warm start, evaluated once for the whole study).
  runs/<arm>/seed<k>/    evaluation.json (`conditions.{fault,clean}.{acc,n}`, `wall_time_s`;
                         its presence marks the run finished: unfinished runs are left out),
                         metrics.jsonl (per RL step: groups with a signal, `aqn/sigma`,
                         `rollout_corr/log_ppl_abs_diff`, `timing_s/step`, `timing_s/testing`),
                         samples.jsonl (optional: one line a condition's problem and sample,
                         `condition`, `index`, `prompt_sha`, `correct`, `sample`).
  srdd/srdd.json         optional: SRDD's located layers.
  sequential.json        optional: the sequential stopping record (target_mdd, its reason).

Outputs: for each run the faulty- and clean-device accuracies at step 0 and at the end; for
each arm the mean with its 95% interval over seeds, the share of groups with a signal per
step, AQN's largest sigma and the rollout's mean |log-perplexity difference| from the
training pass (0 without AQN); the paired comparisons (a seed's arms see the same prompts in
the same order) with Holm's p over the family, Hedges' g and the minimum detectable
difference. A comparison needs two seeds finished in both arms (its p is otherwise `n/a`
with the reason). Where every finished run has per-problem records, the JSON's `twolevel`
adds per comparison the per-seed paired differences, the seed / problem split of the
difference's variance (`twolevel.components`), the crossed bootstrap's 95% interval
(`twolevel.bootstrap_ci`) and the cheapest (seeds, problems) for the target MDD
(`twolevel.plan`, its costs measured from the runs: `twolevel.timing.how`); per arm AQN's
sigma and the rollout/training mismatch per step; the markdown a table of them, the plot a
panel of each seed's paired difference with the interval. `sequential` carries
sequential.json when it exists. A study without records writes exactly what it wrote before
(docs/qwen05_arith_study.{json,md}).

Refusals (one line naming the file and what is wrong, exit status 2, nothing written): a
missing, empty or non-compare workdir, or one that is a study's `runs/` folder or a run
directory; a missing baseline/evaluation.json or runs/; under runs/ an entry that is not an
arm the config names, or under an arm one that is not a `seed<k>` directory (`seed1.bak`);
an unreadable, truncated or invalid config.json, evaluation.json (or one without `acc` or
`n`), metrics.jsonl, samples.jsonl, srdd.json or sequential.json; records that do not
reproduce their evaluation's accuracy or number of problems; some runs with records and
others without; the runs of one comparison evaluated on different n or different problems
(index or prompt hash); a missing or read-only `--out` folder, `--out` inside the workdir it
reads, an existing `<out>.json/.png/.md` that is not a file. `--out=x.json` (or .md, .png)
means `--out=x`. The three files are written under temporary names beside their targets and
moved into place (`os.replace`) only when all three were produced. The recorded commit is the
repository holding this package (`git -C <aqn_jax/> rev-parse HEAD`), "unknown" if that fails.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from aqn_jax.study import stats, twolevel

DEVICES = {"faulty": "fault", "clean": "clean"}  # the device -> its evaluation condition
SEED_DIR = re.compile(r"seed(0|[1-9][0-9]*)")
ACC_TOL = 1e-6  # |records' accuracy - evaluation.json's| (the evaluation averages in float32)
BOOTSTRAP_REPS = 2000
DEFAULT_TARGET_MDD = 0.05  # the planner's target when config.compare.target_mdd is 0 (off)
SUFFIXES = (".json", ".md", ".png")


class Refused(ValueError):
    """Bad input: one line naming the file and what is wrong (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class Study:
    """The arms, display names and comparisons of a study, from its config."""

    arms: tuple[str, ...]  # the compare job's arms, in the config's order
    names: Mapping[str, str]  # arm -> display name (every arm of `arms`)
    comparisons: tuple[tuple[str, str, str], ...]  # (name a, name b, device): mean(a - b)
    target_mdd: float  # config.compare.target_mdd (0: off)
    source: str  # where they came from: a config.json path or --config=...

    def name(self, arm: str) -> str:
        return self.names[arm]


# -- reading files, strictly ------------------------------------------------------------------
def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise Refused(f"{path}: missing ({what})") from None
    except UnicodeDecodeError:
        raise Refused(f"{path}: not UTF-8 text ({what})") from None
    except OSError as e:
        raise Refused(f"{path}: cannot read it ({e.strerror}; {what})") from None


MACHINE_FILE = "machine.json"  # per run: the machine class it ran on, and `lscpu` (compare's)


def _load(path: str, what: str = "a JSON object") -> dict:
    """A JSON object file, or a one-line refusal naming it."""
    text = _read_text(path, what)
    if not text.strip():
        raise Refused(f"{path}: empty ({what})")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise Refused(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}; truncated?)"
        ) from None
    if not isinstance(obj, dict):
        raise Refused(f"{path}: not a JSON object ({what})")
    return obj


def _load_lines(path: str, what: str) -> list[dict]:
    """A JSON-lines file's objects (blank lines skipped), or a one-line refusal naming the
    file and the line."""
    rows = []
    for k, line in enumerate(_read_text(path, what).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise Refused(f"{path}: line {k} is not valid JSON ({e.msg}; truncated?)") from None
        if not isinstance(row, dict):
            raise Refused(f"{path}: line {k} is not a JSON object")
        rows.append(row)
    return rows


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _evaluation(path: str, what: str = "the run's evaluation") -> dict:
    """An evaluation.json with `conditions.fault` and `.clean`, each with its accuracy in
    [0, 1] and its number of problems n >= 1 (and `samples` >= 1 where given)."""
    ev = _load(path, f"{what}: conditions.{{fault,clean}}.{{acc,n}}")
    conds = ev.get("conditions")
    if not isinstance(conds, dict):
        raise Refused(f"{path}: no `conditions` object (the evaluation's accuracies)")
    missing = [name for name in DEVICES.values() if name not in conds]
    if missing:
        raise Refused(f"{path}: no condition {missing[0]!r} (has {sorted(conds)})")
    for name, c in conds.items():
        if not isinstance(c, dict):
            raise Refused(f"{path}: conditions.{name} is not an object")
        if "acc" not in c or not _is_number(c["acc"]) or not 0.0 <= c["acc"] <= 1.0:
            raise Refused(f"{path}: conditions.{name}.acc is {c.get('acc')!r}; need one in [0, 1]")
        if "n" not in c:
            raise Refused(f"{path}: conditions.{name} has no n (the problems evaluated)")
        if not _is_int(c["n"]) or c["n"] < 1:
            raise Refused(f"{path}: conditions.{name}.n is {c['n']!r}; need an integer >= 1")
        if not _is_int(c.get("samples", 1)) or c.get("samples", 1) < 1:
            raise Refused(f"{path}: conditions.{name}.samples is {c['samples']!r}; need >= 1")
    wall = ev.get("wall_time_s")
    if wall is not None and (not _is_number(wall) or wall < 0):
        raise Refused(f"{path}: wall_time_s is {wall!r}; need seconds >= 0")
    return ev


def _records(run_dir: str, ev: dict, ev_path: str) -> dict | None:
    """A run's per-problem records (samples.jsonl), checked against its evaluation.json:
    {condition: {"value": {index: mean correct over samples}, "sha": {index: prompt hash}}},
    or None when the run has none."""
    named = ev.get("samples_file")
    if named is not None and (not isinstance(named, str) or os.path.basename(named) != named):
        raise Refused(f"{ev_path}: samples_file is {named!r}; need a file name beside it")
    path = os.path.join(run_dir, named or "samples.jsonl")
    if not os.path.isfile(path):
        if named is not None:
            raise Refused(f"{path}: missing ({ev_path} names it as its per-problem records)")
        return None
    conds = ev["conditions"]
    seen: dict[str, dict[int, dict[int, float]]] = {c: {} for c in conds}
    sha: dict[str, dict[int, str]] = {c: {} for c in conds}
    for k, row in enumerate(_load_lines(path, "per-problem records"), 1):
        cond, index, prompt = row.get("condition"), row.get("index"), row.get("prompt_sha")
        correct, sample = row.get("correct"), row.get("sample", 0)
        if cond not in conds:
            raise Refused(f"{path}: line {k}: condition {cond!r} is not one of {ev_path}'s")
        if not _is_int(index) or index < 0 or not _is_int(sample) or sample < 0:
            raise Refused(f"{path}: line {k}: index {index!r} / sample {sample!r}; need ints >= 0")
        if not isinstance(prompt, str) or not prompt:
            raise Refused(f"{path}: line {k}: no prompt_sha (the problem's identity)")
        if correct not in (True, False, 0, 1) or isinstance(correct, float):
            raise Refused(f"{path}: line {k}: correct is {correct!r}; need true/false")
        if sha[cond].setdefault(index, prompt) != prompt:
            raise Refused(
                f"{path}: line {k}: problem {index} of {cond!r} has prompt {prompt}, an earlier"
                f" line {sha[cond][index]}"
            )
        samples = seen[cond].setdefault(index, {})
        if sample in samples:
            raise Refused(f"{path}: line {k}: problem {index} sample {sample} of {cond!r} twice")
        samples[sample] = float(bool(correct))
    out = {}
    for cond, c in conds.items():
        problems, want = seen[cond], int(c.get("samples", 1))
        if len(problems) != c["n"]:
            raise Refused(
                f"{path}: {len(problems)} problems of {cond!r}; {ev_path} says n={c['n']}"
            )
        short = [i for i, s in problems.items() if sorted(s) != list(range(want))]
        if short:
            raise Refused(
                f"{path}: problem {short[0]} of {cond!r} has samples {sorted(problems[short[0]])};"
                f" {ev_path} says {want} a problem"
            )
        value = {i: float(np.mean(list(s.values()))) for i, s in problems.items()}
        acc = float(np.mean(list(value.values())))
        if abs(acc - c["acc"]) > ACC_TOL:
            raise Refused(
                f"{path}: its records give {cond!r} accuracy {acc:.6f}; {ev_path} says"
                f" {c['acc']:.6f}"
            )
        out[cond] = {"value": value, "sha": sha[cond]}
    return out


# Per RL step, from metrics.jsonl: the share of groups with an advantage (the run had signal),
# AQN's sigma and the rollout's |log-perplexity difference| from the training pass (AQN acts on
# the rollout only, so this is how far its noise moved the sampler: 0 without AQN).
PER_STEP = {
    "signal": "critic/groups_with_advantage",
    "aqn_sigma": "aqn/sigma",
    "mismatch": "rollout_corr/log_ppl_abs_diff",
}
# The seconds a run spends training, from metrics.jsonl: its RL steps and its own validations.
TRAIN_TIMING = ("timing_s/step", "timing_s/testing")


def _metrics(run_dir: str) -> list[dict]:
    """A finished run's metrics.jsonl rows, each value of `PER_STEP` and `TRAIN_TIMING` a
    finite number where logged (or null: not measured at that step)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = _load_lines(path, "a finished run's per-step metrics")
    for k, r in enumerate(rows, 1):
        for key in (*PER_STEP.values(), *TRAIN_TIMING):
            if r.get(key) is not None and not _is_number(r[key]):
                raise Refused(f"{path}: row {k}: {key} is {r[key]!r}; need a number")
        if "step" in r and not _is_int(r["step"]):
            raise Refused(f"{path}: row {k}: step is {r['step']!r}; need an integer")
    return rows


def _skipped(row: Mapping[str, Any]) -> bool:
    """A step whose update ran no pass (no group had a signal): its rollout-correction metrics
    are logged as 0, not measured, so the per-step mismatch leaves it out."""
    return bool(row.get("actor/update_skipped"))


def _per_step(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """`PER_STEP`'s series of one run, each over the RL steps that logged it."""
    return {name: [r[key] for r in rows if key in r] for name, key in PER_STEP.items()}


# -- the study's arms and comparisons ---------------------------------------------------------
STUDY_FIELDS = ("arms", "names", "comparisons", "clean_comparisons")


def _compare_fields(cmp: Mapping[str, Any]) -> dict[str, Any]:
    """`STUDY_FIELDS` of a compare section as plain lists and a dict (to compare two)."""
    names = cmp.get("names") or {}
    return {
        "arms": [str(a) for a in cmp.get("arms") or ()],
        "names": {str(k): str(v) for k, v in dict(names).items()},
        "comparisons": [list(p) for p in cmp.get("comparisons") or ()],
        "clean_comparisons": [list(p) for p in cmp.get("clean_comparisons") or ()],
    }


def load_config_arg(spec: str) -> dict[str, Any]:
    """`--config=FILE[:ARG]` loaded as `aqn_jax.launch` loads its `--config` (ml_collections'
    config-file parser: FILE's get_config(ARG)); its `compare` section as a dict."""
    from ml_collections.config_flags import config_flags

    path = spec.split(":", 1)[0]
    if not os.path.isfile(path):
        raise Refused(f"--config={spec}: no such file {path}")
    try:
        config = config_flags.ConfigFileFlagParser("config", lock_config=False).parse(spec)
        cmp = config.get("compare")
    except Exception as e:  # the config file's get_config raised: its last line
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise Refused(f"--config={spec}: cannot load it: {lines[-1] if lines else e!r}") from None
    if cmp is None:
        raise Refused(f"--config={spec}: no compare section (not a compare job's config)")
    return cmp.to_dict() if hasattr(cmp, "to_dict") else dict(cmp)


def study_config(workdir: str, config: str | None = None) -> Study:
    """The study's arms, names and comparisons: from `<workdir>/config.json`, or from
    `--config=FILE[:ARG]` for a workdir without one (module docstring)."""
    path = os.path.join(workdir, "config.json")
    if os.path.isfile(path):
        cmp = _load(path, "the study's config").get("compare")
        if not isinstance(cmp, dict):
            raise Refused(f"{path}: no compare section (not a compare job's config)")
        source = path
        if config is not None:
            given = _compare_fields(load_config_arg(config))
            differ = [k for k in STUDY_FIELDS if _compare_fields(cmp)[k] != given[k]]
            if differ:
                raise Refused(
                    f"--config={config}: its compare.{differ[0]} differs from {path}'s (the"
                    " study's own); drop --config"
                )
    elif config is not None:
        cmp, source = load_config_arg(config), f"--config={config}"
    else:
        raise Refused(
            f"{path}: missing; give --config=FILE[:ARG] (the study's config: its arms, names"
            " and comparisons)"
        )
    return study_from(cmp, source)


def study_from(cmp: Mapping[str, Any], source: str = "config") -> Study:
    """A `Study` from a compare section (config.json's or a loaded config's), checked."""
    raw_arms = cmp.get("arms")
    if not isinstance(raw_arms, list | tuple) or not raw_arms:
        raise Refused(f"{source}: compare.arms is {raw_arms!r}; need a non-empty list of arms")
    arms = tuple(str(a) for a in raw_arms)
    if len(set(arms)) != len(arms):
        raise Refused(f"{source}: compare.arms={list(arms)} names an arm twice")
    raw_names = cmp.get("names") or {}
    if not isinstance(raw_names, Mapping):
        raise Refused(f"{source}: compare.names is {raw_names!r}; need {{arm: display name}}")
    names = {a: str(raw_names.get(a, a)) for a in arms}
    if len(set(names.values())) != len(names):
        raise Refused(f"{source}: compare.names gives two arms one display name ({names})")
    comparisons = []
    for field, device in (("comparisons", "faulty"), ("clean_comparisons", "clean")):
        pairs = cmp.get(field) or ()
        if not isinstance(pairs, list | tuple):
            raise Refused(f"{source}: compare.{field} is {pairs!r}; need pairs of arms")
        for pair in pairs:
            if not isinstance(pair, list | tuple) or len(pair) != 2 or not set(pair) <= set(arms):
                raise Refused(
                    f"{source}: compare.{field} has {pair!r}; need pairs of compare.arms"
                    f" {list(arms)}"
                )
            comparisons.append((names[pair[0]], names[pair[1]], device))
    target = cmp.get("target_mdd", 0.0) or 0.0
    if not _is_number(target) or target < 0:
        raise Refused(f"{source}: compare.target_mdd is {target!r}; need a number >= 0")
    return Study(arms, names, tuple(comparisons), float(target), source)


# -- the workdir ------------------------------------------------------------------------------
def _check_workdir(workdir: str) -> None:
    """A compare workdir, not a missing or empty folder, its runs/ folder or a run directory."""
    if not os.path.exists(workdir):
        raise Refused(f"--workdir={workdir}: no such directory")
    if not os.path.isdir(workdir):
        raise Refused(f"--workdir={workdir}: not a directory")
    try:
        entries = os.listdir(workdir)
    except OSError as e:
        raise Refused(f"--workdir={workdir}: cannot list it ({e.strerror})") from None
    if not entries:
        raise Refused(f"--workdir={workdir}: empty (a compare workdir holds baseline/ and runs/)")
    if os.path.isdir(os.path.join(workdir, "baseline")) or "runs" in entries:
        return
    children = [os.path.join(workdir, e) for e in entries]
    if any(os.path.isdir(c) and any(SEED_DIR.fullmatch(s) for s in _listdir(c)) for c in children):
        raise Refused(
            f"--workdir={workdir}: a study's runs/ folder (its arms' seed<k> directories); give"
            " the study's workdir, the folder holding runs/"
        )
    if all(SEED_DIR.fullmatch(e) for e in entries):
        raise Refused(
            f"--workdir={workdir}: an arm's folder of seed<k> run directories; give the study's"
            " workdir (the folder holding runs/)"
        )
    if {"evaluation.json", "metrics.jsonl", "summary.json"} & set(entries):
        raise Refused(
            f"--workdir={workdir}: a run directory; give the study's workdir (the folder holding"
            " baseline/ and runs/<arm>/seed<k>/)"
        )
    raise Refused(f"--workdir={workdir}: not a compare workdir (no baseline/, no runs/)")


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _run_dirs(workdir: str, study: Study) -> list[tuple[str, int, str]]:
    """(arm, seed, run_dir) of every seed directory, arms in the config's order, seeds in
    numeric order; a stray entry under runs/ or an arm is refused by name."""
    runs_dir = os.path.join(workdir, "runs")
    if not os.path.isdir(runs_dir):
        raise Refused(f"{runs_dir}: missing (the compare job's runs/<arm>/seed<k>/)")
    for entry in _listdir(runs_dir):
        if entry not in study.arms or not os.path.isdir(os.path.join(runs_dir, entry)):
            raise Refused(
                f"{os.path.join(runs_dir, entry)}: not an arm of the study ({study.source} names"
                f" {list(study.arms)})"
            )
    out = []
    for arm in study.arms:
        arm_dir = os.path.join(runs_dir, arm)
        seeds = []
        for entry in _listdir(arm_dir):
            path = os.path.join(arm_dir, entry)
            if not SEED_DIR.fullmatch(entry) or not os.path.isdir(path):
                raise Refused(
                    f"{path}: not a run directory seed<k> (the compare job's runs are seed0,"
                    " seed1, ...); move it out of the workdir"
                )
            seeds.append(int(entry.removeprefix("seed")))
        out += [(arm, s, os.path.join(arm_dir, f"seed{s}")) for s in sorted(seeds)]
    return out


def collect(workdir: str, study: Study) -> dict[str, Any]:
    """The finished runs of a compare workdir, with the step-0 evaluation and SRDD's layers,
    every file checked (module docstring). `_detail` (not written to the JSON): per run the
    per-problem records, the timing and the per-step series; the unfinished runs; the machine
    class per seed (`machines`); sequential.json."""
    _check_workdir(workdir)
    base_path = os.path.join(workdir, "baseline", "evaluation.json")
    base_ev = _evaluation(base_path, "step 0's evaluation, config.compare.baseline")
    base_records = _records(os.path.dirname(base_path), base_ev, base_path)
    base = base_ev["conditions"]
    runs, detail, unfinished = [], [], []
    for arm, seed, run_dir in _run_dirs(workdir, study):
        ev_path = os.path.join(run_dir, "evaluation.json")
        if not os.path.isfile(ev_path):
            if os.path.lexists(ev_path):
                raise Refused(f"{ev_path}: not a file")
            unfinished.append(os.path.relpath(run_dir, workdir))
            continue
        run, run_detail = _run_entry(workdir, run_dir, study.name(arm), seed, base, ev_path)
        runs.append(run)
        detail.append(run_detail)
    with_records = [d["dir"] for d in detail if d["records"] is not None]
    without = [d["dir"] for d in detail if d["records"] is None]
    if with_records and without:
        raise Refused(
            f"{os.path.join(workdir, without[0])}: no per-problem records (samples.jsonl), but"
            f" {os.path.join(workdir, with_records[0])} has them: a study's runs are evaluated"
            " alike"
        )
    _check_pairing(workdir, study, detail)
    by_seed = machines(workdir, detail)
    return {
        "runs": runs,
        "srdd_layers": _srdd_layers(workdir),
        "_detail": {
            "runs": detail,
            "unfinished": unfinished,
            "machines": by_seed,
            "sequential": _sequential(workdir),
            "baseline": {
                "wall_s": base_ev.get("wall_time_s"),
                "n": {c: int(v["n"]) * int(v.get("samples", 1)) for c, v in base.items()},
                "records": base_records is not None,
            },
        },
    }


def _run_entry(
    workdir: str, run_dir: str, name: str, seed: int, base: Mapping[str, Any], ev_path: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One finished run's (results entry, `_detail` entry): its accuracies against step 0's
    (`base`: the baseline's conditions), its per-step series, records and timing."""
    ev = _evaluation(ev_path)
    conds = ev["conditions"]
    rows = _metrics(run_dir)
    series = _per_step(rows)
    run = {
        "arm": name,
        "seed": seed,
        "steps": len(series["signal"]),  # the RL steps the run logged
        "faulty_step0": base["fault"]["acc"],
        "faulty_final": conds["fault"]["acc"],
        "clean_step0": base["clean"]["acc"],
        "clean_final": conds["clean"]["acc"],
        "n": int(conds["fault"]["n"]),
        "n_clean": int(conds["clean"]["n"]),
        **series,
    }
    detail = {
        "arm": name,
        "seed": seed,
        "dir": os.path.relpath(run_dir, workdir),
        "n": {c: int(v["n"]) * int(v.get("samples", 1)) for c, v in conds.items()},
        "records": _records(run_dir, ev, ev_path),
        "train_s": float(sum(r.get(k) or 0.0 for r in rows for k in TRAIN_TIMING)),
        "wall_s": ev.get("wall_time_s"),
        "machine": _run_machine(run_dir),
        "per_step": {
            key_name: [
                (r.get("step"), r[key])
                for r in rows
                if r.get(key) is not None and not (key_name == "mismatch" and _skipped(r))
            ]
            for key_name, key in PER_STEP.items()
        },
    }
    return run, detail


def _run_machine(run_dir: str) -> str | None:
    """The machine class a run ran on (its machine.json, written by the compare job), or None
    for a run without one (a study from before the file)."""
    path = os.path.join(run_dir, MACHINE_FILE)
    if not os.path.lexists(path):
        return None
    cls = _load(path, "the run's machine record").get("machine_class")
    if not isinstance(cls, str) or not cls:
        raise Refused(f"{path}: no machine_class (the machine class the run ran on)")
    return cls


def machines(workdir: str, detail: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """{seed: machine class} of the runs that record one; refused when a seed's runs ran on
    different classes (XLA:CPU's results differ between classes: its arms would not pair)."""
    out: dict[str, str] = {}
    first: dict[str, str] = {}
    for d in detail:
        if d["machine"] is None:
            continue
        seed = str(d["seed"])
        if seed in out and out[seed] != d["machine"]:
            raise Refused(
                f"{os.path.join(workdir, d['dir'])}: ran on {d['machine']!r}, but"
                f" {os.path.join(workdir, first[seed])} of the same seed on {out[seed]!r}: a"
                " seed's arms pair only on one machine class"
            )
        out.setdefault(seed, d["machine"])
        first.setdefault(seed, d["dir"])
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def _srdd_layers(workdir: str) -> list | None:
    """SRDD's located layers (`srdd/srdd.json`'s verdict), or None without a diagnosis."""
    srdd_path = os.path.join(workdir, "srdd", "srdd.json")
    if not os.path.lexists(srdd_path):
        return None
    verdict = _load(srdd_path, "SRDD's diagnosis").get("verdict")
    if not isinstance(verdict, dict) or not isinstance(verdict.get("layers"), list):
        raise Refused(f"{srdd_path}: no verdict.layers (SRDD's located layers)")
    return verdict["layers"]


def _sequential(workdir: str) -> dict | None:
    """The sequential compare's stopping record (`sequential.json`), or None."""
    seq_path = os.path.join(workdir, "sequential.json")
    if not os.path.lexists(seq_path):
        return None
    sequential = _load(seq_path, "the sequential stopping record")
    if not isinstance(sequential.get("reason"), str):
        raise Refused(f"{seq_path}: no reason (why the study stopped adding seeds)")
    return sequential


def _check_pairing(workdir: str, study: Study, detail: Sequence[Mapping[str, Any]]) -> None:
    """Every run of a comparison's two arms evaluated on the same n on its device and, with
    records, on the same problems (index and prompt hash): else refused, naming two runs."""
    for a, b, device in study.comparisons:
        cond = DEVICES[device]
        mine = [d for d in detail if d["arm"] in (a, b)]
        if not mine:
            continue
        first = mine[0]
        for d in mine[1:]:
            where = f"{os.path.join(workdir, first['dir'])} and {os.path.join(workdir, d['dir'])}"
            if d["n"][cond] != first["n"][cond]:
                raise Refused(
                    f"{where} were evaluated on different n on the {device} device"
                    f" ({first['n'][cond]} vs {d['n'][cond]}): comparison {a} − {b} pairs them"
                )
            if first["records"] is None or d["records"] is None:
                continue
            x, y = first["records"][cond]["sha"], d["records"][cond]["sha"]
            if x != y:
                i = min(i for i in set(x) | set(y) if x.get(i) != y.get(i))
                raise Refused(
                    f"{where} were evaluated on different problems on the {device} device"
                    f" (problem {i}: prompt {x.get(i)} vs {y.get(i)}): comparison {a} − {b}"
                    " pairs them"
                )


# -- the statistics ---------------------------------------------------------------------------
def outcome(
    runs: Sequence[Mapping[str, Any]], comparisons: Sequence[tuple[str, str, str]]
) -> dict[str, Any]:
    """Per arm the final accuracies' means and intervals over seeds and the signal per step;
    the paired comparisons ((a, b, device) in display names: `Study.comparisons`),
    Holm-corrected over the family."""
    arms: dict[str, Any] = {}
    for name in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == name]
        signal = [r["signal"] for r in mine if r["signal"]]
        steps = min((len(s) for s in signal), default=0)
        sigmas = [x for r in mine for x in r.get("aqn_sigma", []) if x is not None]
        mismatch = [x for r in mine for x in r.get("mismatch", []) if x is not None]
        arms[name] = {
            "seeds": sorted(r["seed"] for r in mine),
            "faulty_final": stats.describe([r["faulty_final"] for r in mine]),
            "clean_final": stats.describe([r["clean_final"] for r in mine]),
            "signal_per_step": [float(np.mean([s[i] for s in signal])) for i in range(steps)],
            "aqn_sigma_max": max(sigmas) if sigmas else None,
            "mismatch_mean": float(np.mean(mismatch)) if mismatch else None,
        }
    out = []
    for a, b, device in comparisons:
        by_a = {r["seed"]: r[f"{device}_final"] for r in runs if r["arm"] == a}
        by_b = {r["seed"]: r[f"{device}_final"] for r in runs if r["arm"] == b}
        seeds = sorted(set(by_a) & set(by_b))
        test = stats.paired([by_a[s] for s in seeds], [by_b[s] for s in seeds])
        out.append(
            {
                "a": a,
                "b": b,
                "device": device,
                "seeds": seeds,
                "mean_diff": test["diff"],
                "ci": [test["diff_ci_low"], test["diff_ci_high"]],
                "p": test["p"],
                "g": test["hedges_g"],
                "mdd": test["mdd"],
                "reason": test["reason"],
            }
        )
    for c, p in zip(out, stats.holm([c["p"] for c in out]), strict=True):
        c["p_holm"] = p
    return {"arms": arms, "comparisons": out}


def timing(detail: Mapping[str, Any]) -> dict[str, Any]:
    """The planner's costs, measured: seconds a run trains (the median over finished runs of
    metrics.jsonl's `timing_s/step` + `timing_s/testing`) and evaluation seconds per problem
    (the median over runs of (evaluation.json's `wall_time_s` - the training) / the problems
    evaluated, every condition; a run resumed mid-way has a wall time under its training and
    is left out; none left: the step-0 evaluation's wall_time_s / its problems)."""
    runs = detail["runs"]
    train = [d["train_s"] for d in runs if d["train_s"] > 0]
    per_problem = [
        (d["wall_s"] - d["train_s"]) / sum(d["n"].values())
        for d in runs
        if d["wall_s"] is not None and d["wall_s"] > d["train_s"]
    ]
    base = detail["baseline"]
    base_pp = base["wall_s"] / sum(base["n"].values()) if base["wall_s"] else None
    how = (
        "seconds_per_run: the median over finished runs of the training seconds in"
        " metrics.jsonl (timing_s/step + timing_s/testing summed over rows); seconds_per_problem:"
        " the median over runs of (evaluation.json wall_time_s - those training seconds) / the"
        " problems it evaluated over every condition (the run's start, loading and compiling"
        " included: an upper bound), runs resumed mid-way (wall_time_s under the training)"
        " left out"
    )
    if not per_problem and base_pp is not None:
        how += "; none left: baseline/evaluation.json wall_time_s / its problems"
    return {
        "seconds_per_run": float(np.median(train)) if train else None,
        "seconds_per_problem": float(np.median(per_problem)) if per_problem else base_pp,
        "runs_timed": len(train),
        "runs_timed_per_problem": len(per_problem),
        "baseline_seconds_per_problem": base_pp,
        "how": how,
    }


def _per_step_mean(series: Sequence[Sequence[tuple[Any, float]]]) -> dict[str, list]:
    """At each step some run logged, the mean over the runs that logged it and their number:
    {"step": [...], "mean": [...], "runs": [...]} (a step without an update is not measured)."""
    series = [dict(s) for s in series if s]
    if not series:
        return {"step": [], "mean": [], "runs": []}
    steps = sorted(set().union(*(set(s) for s in series)), key=lambda x: (x is None, x))
    have = [[s[k] for s in series if k in s] for k in steps]
    return {
        "step": steps,
        "mean": [float(np.mean(v)) for v in have],
        "runs": [len(v) for v in have],
    }


def _aligned(per_step: Mapping[str, list], steps: Sequence[Any]) -> str:
    """The means at `steps`, "n/a" where no run measured one."""
    at = dict(zip(per_step["step"], per_step["mean"], strict=True))
    return " ".join(_sci(at.get(k)) for k in steps)


def twolevel_outcome(
    study: Study, detail: Mapping[str, Any], n_arms: int | None = None
) -> dict[str, Any] | None:
    """Where every finished run has per-problem records (None otherwise): per comparison the
    two-level split, the crossed bootstrap and the plan; per arm sigma and the mismatch per
    step; the timing the plan used; where the arms and comparisons came from."""
    runs = detail["runs"]
    if not runs or any(d["records"] is None for d in runs):
        return None
    clock = timing(detail)
    target = study.target_mdd or DEFAULT_TARGET_MDD
    arms = n_arms or len(study.arms)
    comparisons = []
    for a, b, device in study.comparisons:
        cond = DEVICES[device]
        recs = {
            arm: {d["seed"]: d["records"][cond]["value"] for d in runs if d["arm"] == arm}
            for arm in (a, b)
        }
        entry: dict[str, Any] = {"a": a, "b": b, "device": device, "condition": cond}
        if not set(recs[a]) & set(recs[b]):
            entry.update(seeds=[], P=0, diff_per_seed=[], components=None, bootstrap=None)
            entry.update(plan=None, reason="no seed finished in both arms")
            comparisons.append(entry)
            continue
        x, y, seeds, problems = twolevel.from_records(recs[a], recs[b])
        comp = twolevel.components(x, y)
        boot = twolevel.bootstrap_ci(x, y, reps=BOOTSTRAP_REPS, seed=0)
        entry.update(seeds=seeds, P=len(problems), diff_per_seed=comp["diff_per_seed"])
        entry.update(components=comp, bootstrap=boot, plan=None, reason=comp["reason"])
        if comp["sigma2_seed"] is None:
            entry["plan_reason"] = comp["reason"]
        elif clock["seconds_per_run"] is None or clock["seconds_per_problem"] is None:
            entry["plan_reason"] = "no run timing (metrics.jsonl timing_s/*, wall_time_s)"
        else:
            entry["plan"] = twolevel.plan(
                comp["sigma2_seed"],
                comp["sigma2_prob"],
                comp["sigma2_res"],
                target,
                clock["seconds_per_run"],
                clock["seconds_per_problem"],
                arms=arms,
            )
        comparisons.append(entry)
    per_arm = {}
    for name in dict.fromkeys(d["arm"] for d in runs):
        mine = [d for d in runs if d["arm"] == name]
        sigma = _per_step_mean([d["per_step"]["aqn_sigma"] for d in mine])
        mismatch = _per_step_mean([d["per_step"]["mismatch"] for d in mine])
        per_arm[name] = {
            "seeds": sorted(d["seed"] for d in mine),
            "aqn_sigma_per_step": sigma,
            "mismatch_per_step": mismatch,
        }
    return {
        "config": study.source,
        "names": dict(study.names),
        "target_mdd": target,
        "target_mdd_source": (
            "config.compare.target_mdd"
            if study.target_mdd
            else f"default {DEFAULT_TARGET_MDD} (config.compare.target_mdd is 0: off)"
        ),
        "plan_arms": arms,
        "bootstrap_reps": BOOTSTRAP_REPS,
        "timing": clock,
        "comparisons": comparisons,
        "arms": per_arm,
        "unfinished": list(detail["unfinished"]),
    }


# -- provenance -------------------------------------------------------------------------------
def _commit() -> str:
    """The commit of the repository holding this package (not the working directory's)."""
    import aqn_jax

    here = os.path.dirname(os.path.abspath(aqn_jax.__file__))
    try:
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _machine() -> str:
    """This CPU as `cpu` records it: its model name, family and model, and the flags that set
    XLA:CPU's matmul speed and rounding (the study's seeds pair only on one machine class)."""
    from aqn_jax.compute_dtype import cpu_flags

    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor's block
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown"
    flags = ",".join(cpu_flags() or ()) or "none of avx2/avx512/amx"
    return (
        f"{info.get('model name', 'unknown')}, family {info.get('cpu family', '?')} model"
        f" {info.get('model', '?')}; flags {flags}"
    )


# -- the plot and the tables ------------------------------------------------------------------
def plot(result: Mapping[str, Any], path: str) -> str:
    """Each run's faulty-device accuracy at step 0 and at the end, per arm, with the arm's
    mean and interval; beside it the clean device's; with per-problem records a third panel:
    each comparison's per-seed paired differences, its mean and crossed-bootstrap interval,
    zero marked. `path`: the file (PNG whatever its name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    two = result.get("twolevel")
    if two:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        axes[1].sharey(axes[0])
    else:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    names = list(result["arms"])
    for ax, device in zip(axes[:2], ("faulty", "clean"), strict=True):
        for i, name in enumerate(names):
            finals = [r[f"{device}_final"] for r in result["runs"] if r["arm"] == name]
            ax.scatter([i] * len(finals), finals, color="C0", alpha=0.6, zorder=3)
            d = result["arms"][name][f"{device}_final"]
            if d["mean"] is not None:
                low = d["ci_low"] if d["ci_low"] is not None else d["mean"]
                high = d["ci_high"] if d["ci_high"] is not None else d["mean"]
                ax.errorbar(
                    i + 0.15,
                    d["mean"],
                    yerr=[[d["mean"] - low], [high - d["mean"]]],
                    fmt="s",
                    color="k",
                    capsize=4,
                )
        if result["runs"]:
            ax.axhline(result["runs"][0][f"{device}_step0"], color="gray", ls="--", label="step 0")
        labels = [f"{n}\n{len(result['arms'][n]['seeds'])} seeds" for n in names]
        ax.set_xticks(range(len(names)), labels)
        ax.set_ylim(0.0, 1.0)  # an accuracy: a t interval over two seeds runs far past it
        ax.set_title(f"final greedy accuracy, {device} device")
        ax.legend(loc="lower right")
    axes[0].set_ylabel("accuracy")
    if two:
        ax = axes[2]
        cs = two["comparisons"]
        for i, c in enumerate(cs):
            ds = c["diff_per_seed"]
            ax.scatter([i] * len(ds), ds, color="C0", alpha=0.6, zorder=3)
            boot = c["bootstrap"] or {}
            if boot.get("ci") is not None:
                lo, hi = boot["ci"]
                ax.errorbar(
                    i + 0.15,
                    boot["diff"],
                    yerr=[[boot["diff"] - lo], [hi - boot["diff"]]],
                    fmt="s",
                    color="k",
                    capsize=4,
                )
            elif ds:
                ax.scatter([i + 0.15], [float(np.mean(ds))], marker="s", color="k")
        ax.axhline(0.0, color="gray", ls="--")
        ax.set_xlim(-0.5, len(cs) - 0.5)
        ax.set_xticks(
            range(len(cs)),
            [f"{c['a']} −\n{c['b']}\n({c['device']}, {len(c['seeds'])} seeds)" for c in cs],
            fontsize=8,
        )
        ax.set_title("paired difference per seed, 95% crossed bootstrap")
        ax.set_ylabel("accuracy difference")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
    return path


def _num(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _sci(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1e}"


def _interval(d: Mapping[str, Any]) -> str:
    """`mean [low, high]` of a `stats.describe`, or the mean alone under two seeds."""
    if d["ci_low"] is None:
        return _num(d["mean"])
    return f"{_num(d['mean'])} [{_num(d['ci_low'])}, {_num(d['ci_high'])}]"


def table(result: Mapping[str, Any]) -> str:
    """The outcome as markdown: the arms (final accuracies with their 95% intervals over
    seeds, AQN's sigma and its effect on the rollout, the share of groups with a signal), the
    paired comparisons (with why one is untested) and every run; then, where they exist, the
    two-level statistics and the sequential stopping reason."""
    runs = result["runs"]
    lines = [
        f"SRDD's layers: {result['srdd_layers']}. Step 0 (every arm): faulty device "
        + (
            f"{_num(runs[0]['faulty_step0'])}, clean device {_num(runs[0]['clean_step0'])}."
            if runs
            else "n/a."
        ),
        "",
        "| arm | seeds | faulty device, final | clean device, final | AQN σ, max |"
        " rollout vs train, mean abs Δ log ppl | groups with a signal, per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, arm in result["arms"].items():
        signal = arm["signal_per_step"]
        shown = " ".join(f"{s:.2f}" for s in signal) if signal else "n/a"
        lines.append(
            f"| {name} | {len(arm['seeds'])} | {_interval(arm['faulty_final'])} | "
            f"{_interval(arm['clean_final'])} | {_sci(arm['aqn_sigma_max'])} | "
            f"{_sci(arm['mismatch_mean'])} | {shown} |"
        )
    lines += [
        "",
        "| a − b | device | seeds | mean diff [95% CI] | p | p (Holm) | Hedges' g | MDD |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in result["comparisons"]:
        p = stats.format_p(c["p"]) if c["p"] is not None or not c["reason"] else c["reason"]
        ci = "" if c["ci"][0] is None else f" [{_num(c['ci'][0])}, {_num(c['ci'][1])}]"
        lines.append(
            f"| {c['a']} − {c['b']} | {c['device']} | {len(c['seeds'])} | "
            f"{_num(c['mean_diff'])}{ci} | {p} | "
            f"{stats.format_p(c['p_holm'])} | {_num(c['g'], 2)} | {_num(c['mdd'])} |"
        )
    lines += [
        "",
        "| arm | seed | steps | faulty device (n) | clean device (n) |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['arm']} | {r['seed']} | {r['steps']} | "
            f"{_num(r['faulty_step0'])} → {_num(r['faulty_final'])} ({r['n']}) | "
            f"{_num(r['clean_step0'])} → {_num(r['clean_final'])} ({r['n_clean']}) |"
        )
    if result.get("twolevel"):
        lines += _twolevel_table(result["twolevel"])
    if result.get("sequential"):
        seq = result["sequential"]
        lines += ["", f"Sequential stopping (sequential.json): {seq['reason']}."]
    if result.get("machines"):
        lines += ["", "Machine class per seed (each run's machine.json; a seed's arms on one):", ""]
        lines += [f"- seed {seed}: {cls}" for seed, cls in result["machines"].items()]
    return "\n".join(lines) + "\n"


def _plan_cell(c: Mapping[str, Any]) -> str:
    plan = c.get("plan")
    if plan is None:
        return c.get("plan_reason") or c.get("reason") or "n/a"
    best = plan["best"]
    if best is None:
        return plan["reason"]
    return f"S={best['S']}, P={best['P']}: MDD {_num(best['mdd'])}, {best['cost_s'] / 3600:.1f} h"


def _twolevel_table(two: Mapping[str, Any]) -> list[str]:
    clock = two["timing"]
    lines = [
        "",
        f"Two-level (seeds x problems; arms and comparisons from {two['config']}): the per-seed"
        " paired differences, Var(D)'s seed and problem parts, the crossed bootstrap's 95%"
        f" interval, and the cheapest (S seeds, P problems) for MDD <= {two['target_mdd']}"
        f" ({two['target_mdd_source']}) at {_num(clock['seconds_per_run'], 0)} s training a run"
        f" and {_num(clock['seconds_per_problem'], 2)} s a problem, {two['plan_arms']} arms.",
        "",
        "| a − b | device | S x P | per-seed diffs | mean diff [95% bootstrap] | seed part |"
        " problem part | seed share | plan |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in two["comparisons"]:
        comp, boot = c["components"] or {}, c["bootstrap"] or {}
        diffs = " ".join(f"{d:+.3f}" for d in c["diff_per_seed"]) or "n/a"
        ci = boot.get("ci")
        shown = _num(boot.get("diff")) + ("" if ci is None else f" [{_num(ci[0])}, {_num(ci[1])}]")
        lines.append(
            f"| {c['a']} − {c['b']} | {c['device']} | {len(c['seeds'])} x {c['P']} | {diffs} |"
            f" {shown} | {_sci(comp.get('seed_part'))} | {_sci(comp.get('problem_part'))} |"
            f" {_num(comp.get('seed_share'), 2)} | {_plan_cell(c)} |"
        )
    lines += [
        "",
        "| arm | seeds | AQN σ per step | rollout vs train, mean abs Δ log ppl per step |",
    ]
    lines += ["|---|---|---|---|"]
    for name, arm in two["arms"].items():
        steps = arm["aqn_sigma_per_step"]["step"]
        sig = " ".join(_sci(v) for v in arm["aqn_sigma_per_step"]["mean"]) or "n/a"
        mis = _aligned(arm["mismatch_per_step"], steps) or "n/a"
        lines.append(f"| {name} | {len(arm['seeds'])} | {sig} | {mis} |")
    if two["unfinished"]:
        lines += ["", f"Unfinished runs (left out): {', '.join(two['unfinished'])}."]
    return lines


# -- the command ------------------------------------------------------------------------------
def out_base(out: str) -> str:
    """`--out` without a trailing .json / .md / .png (`x.json` means x)."""
    for suffix in SUFFIXES:
        if out.endswith(suffix):
            return out[: -len(suffix)]
    return out


def check_out(out: str, given: str, workdir: str) -> None:
    """The out folder exists and is writable, outside the workdir, and no target is a
    directory (or anything but a file)."""
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.basename(out):
        raise Refused(f"--out={given}: no file name (the path without .json / .png / .md)")
    if not os.path.isdir(folder):
        raise Refused(f"--out={given}: no such folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK) or not os.stat(folder).st_mode & 0o222:
        raise Refused(f"--out={given}: folder {folder} is read-only")
    real_out = os.path.realpath(folder)
    for root in _read_roots(workdir):
        if real_out == root or real_out.startswith(root.rstrip(os.sep) + os.sep):
            raise Refused(
                f"--out={given}: inside the workdir it reads ({workdir}); write the outcome"
                " elsewhere"
            )
    for suffix in SUFFIXES:
        path = out + suffix
        if os.path.lexists(path) and not os.path.isfile(path):
            raise Refused(f"--out={given}: {path} exists and is not a file (a directory?)")


def _read_roots(workdir: str) -> set[str]:
    """The real paths the outcome reads under: the workdir, and the targets of the symbolic
    links in it, in runs/ and in runs/<arm>/ (a merged workdir links each arm's runs)."""
    roots = {os.path.realpath(workdir)}
    levels = [workdir, os.path.join(workdir, "runs")]
    levels += [os.path.join(levels[1], arm) for arm in _listdir(levels[1])]
    for level in levels:
        for entry in _listdir(level):
            path = os.path.join(level, entry)
            if os.path.islink(path):
                roots.add(os.path.realpath(path))
    return roots


def write_all(result: Mapping[str, Any], out: str) -> list[str]:
    """`<out>.json`, `.png` and `.md`, each written under a temporary name beside its target,
    then all moved into place (`os.replace`) once all three were produced."""
    folder, base = os.path.dirname(os.path.abspath(out)), os.path.basename(out)
    tmp = {s: os.path.join(folder, f".{base}{s}.tmp{os.getpid()}") for s in SUFFIXES}
    try:
        try:
            with open(tmp[".json"], "w") as f:
                json.dump(result, f, indent=2)
            plot(result, tmp[".png"])
            with open(tmp[".md"], "w") as f:
                f.write(table(result))
        except OSError as e:
            raise Refused(f"--out={out}: cannot write {e.filename or folder} ({e.strerror})") from e
        for s in SUFFIXES:
            os.replace(tmp[s], out + s)
    finally:
        for path in tmp.values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    return [out + s for s in SUFFIXES]


def run(workdir: str, out: str, config: str | None = None, cpu: str | None = None) -> dict:
    """The command's work: every check, then the three files (module docstring)."""
    base = out_base(out)
    _check_workdir(workdir)
    check_out(base, out, workdir)
    study = study_config(workdir, config)
    got = collect(workdir, study)
    detail = got.pop("_detail")
    by_seed = detail["machines"]
    classes = sorted(set(by_seed.values()))
    result = {
        **got,
        **outcome(got["runs"], study.comparisons),
        "commit": _commit(),
        # the machine classes the runs recorded (machine.json), else --cpu or this machine's
        "cpu": cpu or "; ".join(classes) or _machine(),
    }
    if by_seed:
        result["machines"] = by_seed
    two = twolevel_outcome(study, detail)
    if two is not None:
        result["twolevel"] = two
    if detail["sequential"] is not None:
        result["sequential"] = detail["sequential"]
    write_all(result, base)
    result["_out"] = base
    return result


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m aqn_jax.study.outcome", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--workdir", required=True, help="the compare job's workdir")
    p.add_argument("--out", required=True, help="the path without .json / .png / .md")
    p.add_argument(
        "--config",
        default=None,
        help="FILE[:ARG]: the study's config, for a workdir without config.json",
    )
    p.add_argument("--cpu", default=None, help="the machine the runs ran on (default: this one)")
    args = p.parse_args(argv)
    try:
        result = run(args.workdir, args.out, args.config, args.cpu)
    except Refused as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for c in result["comparisons"]:
        print(
            f"{c['a']} - {c['b']} ({c['device']} device, seeds {c['seeds']}): "
            f"{c['mean_diff']} p_holm {c['p_holm']} g {c['g']} mdd {c['mdd']}"
        )
    for c in (result.get("twolevel") or {}).get("comparisons", []):
        comp, boot = c["components"] or {}, c["bootstrap"] or {}
        print(
            f"{c['a']} - {c['b']} two-level ({len(c['seeds'])} seeds x {c['P']} problems): "
            f"seed part {comp.get('seed_part')} problem part {comp.get('problem_part')} "
            f"ci {boot.get('ci')}"
        )
    out = result["_out"]
    print(f"wrote {out}.json, .png and .md ({len(result['runs'])} runs)")


if __name__ == "__main__":
    main()
