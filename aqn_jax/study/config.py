"""The sections of the study jobs' configs: `config.compare` (job `compare`: arms x seeds) and
`config.severity` (job `severity`: the deadzone severity curve), with their checks."""

from __future__ import annotations

import ml_collections

from aqn_jax.experiment import ARMS, arm_names
from aqn_jax.faults.fields import parse_layers


def compare_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.arms = arm_names("study")
    c.seeds = (0, 1, 2, 3, 4)
    # One seed leaves the report's tests (CIs, Welch, power) without a variance: refused unless
    # asked for (a quick look at one run per arm).
    c.allow_single_seed = False
    c.variant = "default"  # a name for the report (configs/compare.py sets it per sweep)
    c.reference_arm = "global_aqn"
    c.comparisons = (("targeted", "global_aqn"), ("healthy", "global_aqn"))
    c.compile_cache = True  # persistent XLA cache under the workdir (shared programs compile once)
    c.workers = 0  # runs in parallel processes: 0 = one per CPU core (CPU, single host), else 1
    # The warm start's robustness matrix once (every run's step 0: greedy decoding of one model
    # is deterministic), in baseline/evaluation.json.
    c.baseline = False
    # A study that stops at a precision (`jobs/compare.py`, `sequential`): with target_mdd > 0
    # the job adds seeds (every arm of a seed before the next) after `seeds` until every
    # comparison's minimum detectable difference on `target_condition` is at most target_mdd,
    # or `max_seeds` seeds have run.
    c.target_mdd = 0.0  # 0: off (the seeds as listed)
    c.max_seeds = 0  # with target_mdd: the most seeds (>= len(seeds))
    c.target_condition = "fault"  # the evaluation condition the MDDs are read on
    # Display names of the arms in the study's outcome (`aqn_jax/study/outcome.py`), {arm: name};
    # an arm not named here is shown under its own name.
    c.names = ml_collections.ConfigDict()
    # The outcome's comparisons on the clean device (`comparisons` are read on the faulty one):
    # what adapting to the fault costs elsewhere, e.g. (("deadzone", "clean"),).
    c.clean_comparisons = ()
    return c


def check_compare(cmp) -> None:
    arms = tuple(cmp.arms)
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise ValueError(
            f"config.compare.arms={arms}; allowed: non-empty subsets of {ARMS.names()}"
        )
    seeds = tuple(cmp.seeds)
    if not seeds or len(set(seeds)) != len(seeds) or any(int(s) < 0 for s in seeds):
        raise ValueError(f"config.compare.seeds={seeds}; expected distinct seeds >= 0")
    if len(seeds) < 2 and not cmp.get("allow_single_seed", False):
        raise ValueError(
            f"config.compare.seeds={seeds}: the study's tests (CIs, Welch, power) need >= 2 seeds"
            " per arm, e.g. --config.compare.seeds='(0,1)'; or"
            " --config.compare.allow_single_seed=True for a report without them"
        )
    for pair in cmp.comparisons:
        if len(pair) != 2 or any(a not in ARMS for a in pair):
            raise ValueError(f"config.compare.comparisons has {tuple(pair)}; expected arm pairs")
    for field in ("comparisons", "clean_comparisons"):
        pairs = [tuple(p) for p in cmp.get(field, ())]
        outside = [p for p in pairs if not set(p) <= set(arms)]
        if outside:
            raise ValueError(
                f"config.compare.{field} has {outside[0]}; allowed: pairs of"
                f" config.compare.arms={arms}"
            )
    ref = cmp.get("reference_arm", None)
    if ref is not None and ref not in arms:
        raise ValueError(f"config.compare.reference_arm={ref!r}; allowed: one of {arms}")
    if int(cmp.workers) < 0:
        raise ValueError(f"config.compare.workers={cmp.workers}; must be >= 0 (0 = one per core)")
    if len(set(arms)) != len(arms):
        raise ValueError(f"config.compare.arms={arms}; an arm is named twice")
    target, top = float(cmp.get("target_mdd", 0.0)), int(cmp.get("max_seeds", 0))
    if not target >= 0.0:
        raise ValueError(f"config.compare.target_mdd={target}; must be >= 0 (0 = off)")
    if target > 0.0:
        if top < len(seeds):
            raise ValueError(
                f"config.compare.max_seeds={top}; with target_mdd={target} it must be >="
                f" len(config.compare.seeds)={len(seeds)} (the seeds run first)"
            )
        if not cmp.comparisons:
            raise ValueError(
                f"config.compare.comparisons=(): with target_mdd={target} the stopping rule"
                " reads the comparisons; allowed: one or more pairs of config.compare.arms"
            )
    names = dict(cmp.get("names", {}) or {})
    stray = sorted(set(names) - set(ARMS.names()))
    if stray or len(set(names.values())) != len(names):
        raise ValueError(
            f"config.compare.names={names}; allowed: distinct display names of arms of"
            f" {ARMS.names()} (not arms: {stray})"
        )


def severity_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.layers = "all"  # decoder layers to sweep: 'all', 5, '(3,5)', '10:15'
    c.amax = (0.001, 0.01, 0.1)  # severity 'amax': flush |h| < t * amax (the original's)
    c.quantile = (0.25, 0.5, 0.75, 0.9)  # severity 'quantile': the fraction flushed
    c.size = 0  # test examples per point; 0 = config.trainer.val_size
    c.accuracy = True  # greedy accuracy per point (False: loss and flushed fraction only)
    return c


def check_severity(sev, num_layers: int):
    layers = parse_layers(sev.layers, "config.severity.layers", num_layers)
    points = []
    for mode, field in (("amax", "amax"), ("quantile", "quantile")):
        for v in tuple(sev[field]):
            if not 0.0 < float(v) < 1.0:
                raise ValueError(f"config.severity.{field} has {v}; each must be in (0, 1)")
            points.append((mode, float(v)))
    if not points:
        raise ValueError("config.severity.amax and config.severity.quantile are both empty")
    if sev.size < 0:
        raise ValueError(f"config.severity.size={sev.size}; must be >= 0 (0 = val_size)")
    return list(range(num_layers)) if layers == "all" else list(layers), points
