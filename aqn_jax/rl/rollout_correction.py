"""Rollout correction: the sampler's policy is not the trainer's (verl's `rollout_corr_helper.py`).

On a faulty or low-precision device the rollout computes π_rollout while the trainer computes
π_train (docs/ARCHITECTURE.md, "Two devices, one policy"): RL is off-policy. Per response token

    log ρ_t = log π_train(y_t) - log π_rollout(y_t)      (clamped to ±20 before any exp)

and the corrections of verl (`algorithm.rollout_correction`), TRL (`vllm_importance_sampling_*`)
and tunix (`sampler_is`) reweight or reject tokens by ρ. Here they run on the host once per RL step,
after the trainer's log-prob pass and before the update (where verl's driver runs them):

  truncated IS (`rollout_is`): w = min(ρ, C) at the token level, or w = min(exp Σ_t log ρ_t, C)
    per sequence broadcast over its tokens; detached; it multiplies the per-token policy-gradient
    loss (after PPO's clip and dual-clip, as verl's `compute_policy_loss`). Optionally normalised
    to mean 1 over the batch (`rollout_is_batch_normalize`).
  rejection (`rollout_rs`): the token, sequence (exp Σ) or geometric (exp mean) ratio outside
    [lower, upper] -> the token (or its whole sequence) leaves the loss and its denominator: the
    policy loss, the entropy and KL terms and the critic's value loss. The advantages are computed
    before, on every sampled token (a rejected sequence's score still counts in its group's
    statistics).
  bypass (`bypass_mode`): the PPO ratio's old policy is the rollout's log-probs (two policies, not
    three); the ratio then is the IS weight, so no extra weights (verl's `ppo_clip` bypass). The
    trainer's pass still runs: it gives the mismatch metrics, and rejection compares against it.

Each correction is one function registered in `CORRECTIONS` under its config.algo field, with the
levels that field takes (fn(log_ratio, mask, RolloutCorrection) -> Term), and each aggregation
level one function in `LEVELS`: adding either is writing one function. Presets (`PRESETS`) name
the published settings.

Where this departs from verl, on purpose: verl's bypass mode recomputes rejection against the
current policy in every mini-batch; here it is computed once per step against the trainer's
log-probs at the step's start (the same for the first mini-batch). `k3_kl` clamps log ρ to ±20
(verl does not clamp it; an overflow would stop the run as a non-finite metric).

Metrics (verl's names, logged whether a correction is on or not; `mismatch_metrics`):
`rollout_corr/{kl, k3_kl, chi2_token, chi2_seq, training_ppl, rollout_ppl, log_ppl_diff,
log_ppl_abs_diff, ppl_ratio}`, `rollout_corr/rollout_is_{mean, std, max, min, eff_sample_size,
ratio_fraction_high, ratio_fraction_low}` (at `rollout_is`'s level; with rollout_is='none' they
describe the token-level weights at `rollout_is_threshold` that a correction would apply),
`rollout_corr/rollout_rs_{masked_fraction, seq_masked_fraction}` and
`training/rollout_probs_diff_{max, mean, std}`, `training/rollout_actor_probs_pearson_corr`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import ml_collections
import numpy as np

from aqn_jax.registry import Registry

SAFETY_BOUND = 20.0  # |log ρ| bound before exp: exp(20) ≈ 4.9e8 (verl)

# The published settings, as config.algo fields (the mismatch study's arms pick them by name).
PRESETS: Registry[dict[str, Any]] = Registry("rollout-correction preset")
PRESETS.register("none", {})
# verl's and tunix's token TIS (verl's FP8-rollout recipe: "aligns with BF16"), cap 2.
PRESETS.register("token_tis", {"rollout_is": "token", "rollout_is_threshold": 2.0})
# TRL's default (`vllm_importance_sampling_mode='sequence_mask'`, cap 3.0): the sequence ratio as
# weight where it is <= 3, and the sequence dropped where it is above; no lower bound (1e-9 is
# below exp(-20), the smallest clamped ratio).
PRESETS.register(
    "trl_sequence_mask",
    {
        "rollout_is": "sequence",
        "rollout_is_threshold": 3.0,
        "rollout_rs": "sequence",
        "rollout_rs_threshold": 3.0,
        "rollout_rs_threshold_lower": 1e-9,
    },
)
# verl's geometric rejection preset [0.999, 1.001] (exp of the mean token log-ratio).
PRESETS.register(
    "geometric_rs",
    {"rollout_rs": "geometric", "rollout_rs_threshold": 1.001, "rollout_rs_threshold_lower": 0.999},
)
# IcePop: a token mask [0.5, 5] (later papers tighten the lower bound to 0.2).
PRESETS.register(
    "icepop",
    {"rollout_rs": "token", "rollout_rs_threshold": 5.0, "rollout_rs_threshold_lower": 0.5},
)
# verl's bypass: PPO's old policy = the rollout's log-probs.
PRESETS.register("bypass", {"bypass_mode": True})


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """The typed `config.algo` rollout-correction fields (`correction_from`)."""

    rollout_is: str = "none"
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str = "none"
    rollout_rs_threshold: float = 2.0
    rollout_rs_threshold_lower: float = 0.5  # resolved: 1 / upper unless given
    bypass_mode: bool = False

    @property
    def active(self) -> tuple[str, ...]:
        """The CORRECTIONS that act, in order."""
        return tuple(n for n in CORRECTIONS if getattr(self, n) != "none")

    @property
    def needs_rollout_logprobs(self) -> bool:
        return bool(self.active) or self.bypass_mode


DEFAULTS = RolloutCorrection()  # the section's defaults, read by correction_config and the parser


def correction_config(algo) -> None:
    """The rollout-correction fields of `config.algo` (off: verl's defaults), their values
    `RolloutCorrection`'s defaults."""
    algo.rollout_is = DEFAULTS.rollout_is  # none | token | sequence: truncated IS weights on PG
    algo.rollout_is_threshold = DEFAULTS.rollout_is_threshold  # C of min(w, C) (verl, tunix: 2)
    algo.rollout_is_batch_normalize = DEFAULTS.rollout_is_batch_normalize  # w / batch mean
    # none | token | sequence | geometric: reject ratios outside [lower, threshold]
    algo.rollout_rs = DEFAULTS.rollout_rs
    algo.rollout_rs_threshold = DEFAULTS.rollout_rs_threshold  # upper bound of the kept ratio
    # lower bound of the kept ratio; None = 1 / rollout_rs_threshold
    algo.rollout_rs_threshold_lower = ml_collections.config_dict.placeholder(float)
    algo.bypass_mode = DEFAULTS.bypass_mode  # PPO's old policy = the rollout's log-probs (verl)


def correction_from(algo, rollout) -> RolloutCorrection:
    """`config.algo`'s correction fields, checked (one line naming the field) against
    `config.rollout`: a correction needs the sampling log-probs of the tokens it corrects."""
    rollout_is, rollout_rs = (
        CORRECTIONS[field].levels.check(algo.get(field, getattr(DEFAULTS, field)))
        for field in ("rollout_is", "rollout_rs")
    )
    thresholds = {}
    for field in ("rollout_is_threshold", "rollout_rs_threshold"):
        value = algo.get(field, getattr(DEFAULTS, field))
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ValueError(f"config.algo.{field}={value!r}; must be a finite number > 0")
        thresholds[field] = float(value)
    upper = thresholds["rollout_rs_threshold"]
    lower = algo.get("rollout_rs_threshold_lower", None)
    if lower is None and upper < 1.0:  # the lower bound the user did not set: 1 / upper > upper
        raise ValueError(
            f"config.algo.rollout_rs_threshold={upper}; must be >= 1 while"
            " config.algo.rollout_rs_threshold_lower is unset (it defaults to 1 / threshold ="
            f" {1.0 / upper:g}, and [1 / threshold, threshold] keeps nothing), or set"
            f" rollout_rs_threshold_lower <= {upper}"
        )
    if lower is None:
        lower = 1.0 / upper
    elif not (isinstance(lower, int | float) and math.isfinite(lower) and lower > 0):
        raise ValueError(
            f"config.algo.rollout_rs_threshold_lower={lower!r}; must be a finite number > 0"
            " (or None: 1 / rollout_rs_threshold)"
        )
    if lower > upper:
        raise ValueError(
            f"config.algo.rollout_rs_threshold_lower={lower} > config.algo.rollout_rs_threshold="
            f"{upper}; the kept ratios are [lower, upper]"
        )
    rc = RolloutCorrection(
        rollout_is=rollout_is,
        rollout_is_threshold=thresholds["rollout_is_threshold"],
        rollout_is_batch_normalize=bool(
            algo.get("rollout_is_batch_normalize", DEFAULTS.rollout_is_batch_normalize)
        ),
        rollout_rs=rollout_rs,
        rollout_rs_threshold=upper,
        rollout_rs_threshold_lower=float(lower),
        bypass_mode=bool(algo.get("bypass_mode", DEFAULTS.bypass_mode)),
    )
    if rc.rollout_is_batch_normalize and rollout_is == "none":
        raise ValueError(
            "config.algo.rollout_is_batch_normalize=True normalises IS weights, and"
            " config.algo.rollout_is='none'; set rollout_is to 'token' or 'sequence'"
        )
    if rc.bypass_mode and rollout_is != "none":
        raise ValueError(
            f"config.algo.rollout_is={rollout_is!r} with config.algo.bypass_mode=True: in bypass"
            " the PPO ratio π_θ/π_rollout already is the IS weight (verl's ppo_clip bypass);"
            " set rollout_is='none' (rejection, rollout_rs, still applies)"
        )
    if rc.needs_rollout_logprobs:
        what = (
            "config.algo.bypass_mode=True"
            if rc.bypass_mode
            else (f"config.algo.{rc.active[0]}={getattr(rc, rc.active[0])!r}")
        )
        if float(rollout.temperature) == 0.0:
            raise ValueError(
                f"{what} corrects by the rollout's sampling log-probs, and"
                " config.rollout.temperature=0 samples greedily (no sampling probability): use a"
                " temperature > 0, or no correction"
            )
        for field, off in (("top_k", 0), ("top_p", 1.0)):
            if rollout.get(field, off) != off:
                raise ValueError(
                    f"{what} corrects by the rollout's log-probs, which are of the unfiltered"
                    f" distribution, and config.rollout.{field}={rollout[field]} filters it: set"
                    f" {field}={off}, or no correction"
                )
    return rc


# -- levels: how per-token log-ratios aggregate into the log weight of a token --------------------
# A correction's config field names the level it aggregates at (`register_correction`'s levels).
LEVELS: Registry[Callable[[np.ndarray, np.ndarray], np.ndarray]] = Registry(
    "rollout-correction level"
)


def _masked_sum(x, mask, axis=None, keepdims=False):
    return np.sum(x * mask, axis=axis, keepdims=keepdims)


def _masked_mean(x, mask, axis=None, keepdims=False):
    """verl_F.masked_mean: sum(x * mask) / (sum(mask) + 1e-8)."""
    return _masked_sum(x, mask, axis, keepdims) / (
        np.sum(mask, axis=axis, keepdims=keepdims) + 1e-8
    )


@LEVELS.register("token")
def _token(log_ratio_NT, mask_NT):
    """Each token its own ratio ρ_t: [N, T]."""
    return log_ratio_NT


@LEVELS.register("sequence")
def _sequence(log_ratio_NT, mask_NT):
    """The sequence's likelihood ratio Π_t ρ_t: [N, 1] (unbiased; high variance)."""
    return _masked_sum(log_ratio_NT, mask_NT, axis=-1, keepdims=True)


@LEVELS.register("geometric")
def _geometric(log_ratio_NT, mask_NT):
    """The geometric mean of the sequence's ratios, exp(mean_t log ρ_t): [N, 1]."""
    return _masked_mean(log_ratio_NT, mask_NT, axis=-1, keepdims=True)


def level_weights(level: str, log_ratio_NT, mask_NT):
    """(the level's log ratio, unclamped: [N, T] or [N, 1]; its weight exp(clamp(., ±20))
    broadcast to [N, T])."""
    log_w = LEVELS.get(level)(log_ratio_NT, mask_NT)
    w = np.exp(np.clip(log_w, -SAFETY_BOUND, SAFETY_BOUND))
    return log_w, np.broadcast_to(w, log_ratio_NT.shape)


# -- corrections: each one function -> Term ------------------------------------------------------
class Term(NamedTuple):
    weights: np.ndarray | None  # [N, T] multiplies the per-token PG loss (None: no weights)
    keep: np.ndarray | None  # [N, T] 1 = the token stays in the loss (None: all kept)
    metrics: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Correction:
    """A correction, registered under the config.algo field that chooses its level."""

    apply: Callable[[np.ndarray, np.ndarray, RolloutCorrection], Term]
    levels: Registry[str]  # config.algo.<name>'s values: 'none' (off), the LEVELS it takes


CORRECTIONS: Registry[Correction] = Registry("rollout-correction field")


def register_correction(name: str, levels: tuple[str, ...]):
    """`@register_correction(field, levels)` on fn(log_ratio_NT, mask_NT, rc) -> Term: the
    correction config.algo.<field> turns on at one of `levels` (names in LEVELS)."""

    def wrap(fn):
        choices = Registry(f"config.algo.{name}")
        for level in ("none", *(LEVELS.check(level) for level in levels)):
            choices.register(level, level)
        CORRECTIONS.register(name, Correction(fn, choices))
        return fn

    return wrap


def is_statistics(level: str, log_ratio_NT, mask_NT, threshold: float) -> dict[str, float]:
    """verl's `compute_is_metrics` of the (untruncated) weights at `level`: mean, std, max, min,
    ESS = 1 / E[(w / E w)^2] and the fractions beyond [1/C, C] (std and ESS on weights clamped to
    [1/C, C]); means over valid tokens, sequence fractions over sequences."""
    log_w, w = level_weights(level, log_ratio_NT, mask_NT)
    w = w * mask_NT
    lower = 1.0 / threshold
    m: dict[str, float] = {"rollout_is_mean": float(_masked_mean(w, mask_NT))}
    if level == "token":
        valid = mask_NT > 0
        m["rollout_is_ratio_fraction_high"] = float(_masked_mean(w > threshold, mask_NT))
        m["rollout_is_ratio_fraction_low"] = float(_masked_mean(w < lower, mask_NT))
        m["rollout_is_max"] = float(np.max(w, initial=-np.inf, where=valid))
        m["rollout_is_min"] = float(np.min(w, initial=np.inf, where=valid))
    else:
        m["rollout_is_max"] = float(np.exp(min(np.max(log_w), SAFETY_BOUND)))
        m["rollout_is_min"] = float(np.exp(np.min(log_w)))
        m["rollout_is_ratio_fraction_high"] = float(np.mean(log_w > np.log(threshold)))
        m["rollout_is_ratio_fraction_low"] = float(np.mean(log_w < np.log(lower)))
    clamped = np.clip(w, lower, threshold)
    mean = _masked_mean(clamped, mask_NT)
    if np.sum(mask_NT) > 1:
        var = _masked_mean(np.square(clamped), mask_NT) - np.square(mean)
        m["rollout_is_std"] = float(np.sqrt(max(var, 0.0)))
    else:
        m["rollout_is_std"] = 0.0
    m["rollout_is_eff_sample_size"] = float(
        1.0 / _masked_mean(np.square(clamped / (mean + 1e-8)), mask_NT)
    )
    return m


@register_correction("rollout_is", ("token", "sequence"))
def truncated_is(log_ratio_NT, mask_NT, rc: RolloutCorrection) -> Term:
    """Truncated importance sampling (TIS): w = min(ρ, C) at `rc.rollout_is`'s level, 0 on
    padding; with `rollout_is_batch_normalize`, divided by its batch mean (token level: over
    tokens; sequence level: over sequences)."""
    level, cap = rc.rollout_is, rc.rollout_is_threshold
    metrics = is_statistics(level, log_ratio_NT, mask_NT, cap)
    w = np.minimum(level_weights(level, log_ratio_NT, mask_NT)[1] * mask_NT, cap)
    if rc.rollout_is_batch_normalize:
        if level == "token":
            mean = _masked_mean(w, mask_NT)
        else:
            per_seq = _masked_mean(w, mask_NT, axis=-1)
            rows = (np.sum(mask_NT, axis=-1) > 0).astype(w.dtype)
            mean = np.sum(per_seq * rows) / max(np.sum(rows), 1e-8)
        metrics["rollout_is_batch_norm_factor"] = float(mean) if mean > 1e-8 else 1.0
        if mean > 1e-8:
            w = w / mean
    return Term(w.astype(np.float32), None, metrics)


@register_correction("rollout_rs", ("token", "sequence", "geometric"))
def rejection(log_ratio_NT, mask_NT, rc: RolloutCorrection) -> Term:
    """Rejection sampling: keep the tokens whose ratio at `rc.rollout_rs`'s level lies in
    [lower, upper] (a sequence level keeps or drops whole sequences)."""
    _, w = level_weights(rc.rollout_rs, log_ratio_NT, mask_NT)
    keep = ((w >= rc.rollout_rs_threshold_lower) & (w <= rc.rollout_rs_threshold)).astype(
        np.float32
    )
    rejected = np.sum((1.0 - keep) * mask_NT, axis=-1) > 0
    metrics = {
        "rollout_rs_masked_fraction": float(_masked_mean(1.0 - keep, mask_NT)),
        "rollout_rs_seq_masked_fraction": float(np.mean(rejected)),
    }
    return Term(None, keep, metrics)


# -- the mismatch metrics and the step's correction ----------------------------------------------
def mismatch_metrics(train_logp_NT, rollout_logp_NT, mask_NT) -> dict[str, float]:
    """verl's off-policy diagnostics (`compute_offpolicy_metrics`) and its probability-space
    debug metrics, of the trainer's vs the sampler's log-probs on the response tokens."""
    t, r, mask = (np.asarray(a, np.float64) for a in (train_logp_NT, rollout_logp_NT, mask_NT))
    log_ratio = t - r
    lr = np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    mean_t = _masked_mean(t, mask, axis=-1)
    mean_r = _masked_mean(r, mask, axis=-1)
    log_ppl_diff = mean_r - mean_t  # = log(training_ppl / rollout_ppl) per sequence
    seq = np.clip(_masked_sum(log_ratio, mask, axis=-1), -SAFETY_BOUND, SAFETY_BOUND)
    m = {
        "rollout_corr/kl": _masked_mean(r - t, mask),  # KL(π_rollout || π_train), k1
        "rollout_corr/k3_kl": _masked_mean(np.exp(lr) - lr - 1.0, mask),
        "rollout_corr/chi2_token": _masked_mean(np.exp(2.0 * lr), mask) - 1.0,
        "rollout_corr/chi2_seq": np.mean(np.exp(2.0 * seq)) - 1.0,
        "rollout_corr/training_ppl": np.mean(np.exp(-mean_t)),
        "rollout_corr/rollout_ppl": np.mean(np.exp(-mean_r)),
        "rollout_corr/log_ppl_diff": np.mean(log_ppl_diff),
        "rollout_corr/log_ppl_abs_diff": np.mean(np.abs(log_ppl_diff)),
        "rollout_corr/ppl_ratio": np.mean(np.exp(log_ppl_diff)),
    }
    valid = np.asarray(mask_NT) > 0
    p_train = np.exp(np.asarray(train_logp_NT))[valid]
    p_rollout = np.exp(np.asarray(rollout_logp_NT))[valid]
    diff = np.abs(p_train - p_rollout)
    m["training/rollout_probs_diff_max"] = np.max(diff)
    m["training/rollout_probs_diff_mean"] = np.mean(diff)
    m["training/rollout_probs_diff_std"] = np.std(diff, ddof=1) if diff.size > 1 else 0.0
    if np.std(p_train) > 0 and np.std(p_rollout) > 0:
        m["training/rollout_actor_probs_pearson_corr"] = np.corrcoef(p_train, p_rollout)[0, 1]
    else:  # a constant side: correlation is undefined; 1 when the two sides agree exactly
        m["training/rollout_actor_probs_pearson_corr"] = float(np.array_equal(p_train, p_rollout))
    return {k: float(v) for k, v in m.items()}


class Corrected(NamedTuple):
    """What the update takes from the correction: IS weights (None: no IS), the loss mask with
    rejected tokens removed (None: no rejection), the PPO old log-probs (None: the trainer's),
    and the step's `rollout_corr/` and `training/` metrics."""

    is_weights: np.ndarray | None
    loss_mask: np.ndarray | None
    old_logp: np.ndarray | None
    metrics: dict[str, float]


def correct(train_logp_NT, rollout_logp_NT, mask_NT, rc: RolloutCorrection) -> Corrected:
    """The step's correction (`rc.active` in order: weights multiply, masks intersect) and
    metrics, from the trainer's and the sampler's log-probs of the response tokens."""
    if not np.any(mask_NT):
        raise ValueError("rollout correction: the batch has no response token")
    mask = np.asarray(mask_NT, np.float32)
    log_ratio = np.asarray(train_logp_NT, np.float32) - np.asarray(rollout_logp_NT, np.float32)
    metrics = mismatch_metrics(train_logp_NT, rollout_logp_NT, mask)
    corr: dict[str, float] = {
        "rollout_rs_masked_fraction": 0.0,
        "rollout_rs_seq_masked_fraction": 0.0,
    }
    if rc.rollout_is == "none":  # what token TIS at the threshold would apply
        corr.update(is_statistics("token", log_ratio, mask, rc.rollout_is_threshold))
    weights = keep = None
    for name in rc.active:
        term = CORRECTIONS[name].apply(log_ratio, mask, rc)
        corr.update(term.metrics)
        if term.weights is not None:
            weights = term.weights if weights is None else weights * term.weights
        if term.keep is not None:
            keep = term.keep if keep is None else keep * term.keep
    metrics.update({f"rollout_corr/{k}": float(v) for k, v in corr.items()})
    loss_mask = None if keep is None else (mask * keep).astype(np.asarray(mask_NT).dtype)
    old = np.asarray(rollout_logp_NT, np.float32) if rc.bypass_mode else None
    return Corrected(weights, loss_mask, old, metrics)
