"""What the RL step reports of silent data corruption: the update's SDC settings (`SdcSpec`),
the bits flipped and the rows ABFT flagged at module sites (`site_counts`), the backward ABFT
probe (`abft_accumulate`), the update's, the train passes' and the rollout's totals, the step's
sdc/* metrics, and the traced values the bit faults read (`step_values`).

Which injections count is read from their transforms (`counts_flips`, `counts_detections`,
aqn_jax/faults/transforms.py), never from a list of kind names: a new bit-level kind counts
once its transform says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from aqn_jax import parallel
from aqn_jax.faults.bitfaults import (
    PRODUCTS,
    SDC_ATTEMPT,
    SDC_BIT,
    SDC_STEP,
    abft_probe,
    backward_probe,
    traced_bit,
)
from aqn_jax.faults.intercept import FaultPlan
from aqn_jax.faults.sites import LINEAR_KINDS

from . import trees
from .guard import GuardSpec


def sdc_kinds(plan: FaultPlan) -> frozenset[str]:
    """The injections of `plan` whose telemetry is SDC's: their transforms count the bits they
    flip or the rows they flag (the bit-level kinds and ABFT)."""
    return frozenset(
        inj.name
        for inj in plan.injections
        if inj.transform.counts_flips or inj.transform.counts_detections
    )


def flip_note(plan: FaultPlan) -> str:
    """The bit faults `plan` runs, described ('' = none): what a non-finite step's error
    names."""
    return "; ".join(inj.describe() for inj in plan.injections if inj.transform.counts_flips)


@dataclasses.dataclass(frozen=True)
class SdcSpec:
    """Silent data corruption in the update (`sdc_spec`): the bit faults on the gradients and
    on the AdamW moments, whether the step reports the guard's metrics and the counts of the
    bit faults and ABFT at module sites (`sites`)."""

    gradient: tuple = ()  # (TreeBits, SiteSelector) pairs
    moments: tuple = ()
    guard: GuardSpec = GuardSpec()  # config.sdc; when on: sdc/update_rms and sdc/moments_ok
    sites: bool = False  # bit faults or ABFT at module calls of the train passes
    moment_bound: float | None = None  # trees.moment_bound of the actor's clip
    abft_backward: bool = False  # config.sdc.abft_backward: `abft_accumulate`'s probe
    kinds: frozenset = frozenset()  # the plan's injections that count (`sdc_kinds`)

    @property
    def trees(self) -> bool:
        return bool(self.gradient or self.moments)


def sdc_spec(
    guard: GuardSpec, grad_clip: float, plan: FaultPlan, total_updates: int
) -> SdcSpec | None:
    """The update's SDC settings from the plan's train-phase injections and config.sdc
    (`guard`); None when there is nothing to do (the update's program is then unchanged)."""
    train = [inj for _, inj in plan.active("train")]
    tree_faults = {
        target: tuple(
            (inj.transform, inj.sites)
            for inj in train
            if inj.transform.level == "tree" and inj.transform.target == target
        )
        for target in ("gradient", "optimizer")
    }
    kinds = sdc_kinds(plan)
    sites = any(inj.name in kinds for inj in train if inj.transform.level != "tree")
    sites = sites or guard.abft_backward
    if not (tree_faults["gradient"] or tree_faults["optimizer"] or sites or guard.on):
        return None
    return SdcSpec(
        gradient=tree_faults["gradient"],
        moments=tree_faults["optimizer"],
        guard=guard,
        sites=sites,
        moment_bound=trees.moment_bound(grad_clip, total_updates),
        abft_backward=guard.abft_backward,
        kinds=kinds,
    )


def step_values(plan: FaultPlan, sdc: SdcSpec | None, step: int, attempt: int) -> dict:
    """The traced values the bit faults read: the RL step and the attempt for faults planted at
    given steps (`bitfaults.SDC_STEP`) and for the tree faults' keys (`trees`: a recomputed
    step draws anew, a transient gradient or moment fault included), the bit of a `traced_bit`
    fault. None of them when the plan needs none (the programs are then unchanged)."""
    names = plan.value_names()
    out = {}
    if SDC_STEP in names or (sdc is not None and sdc.trees):
        out.update({SDC_STEP: np.float32(step), SDC_ATTEMPT: np.float32(attempt)})
    if SDC_BIT in names:
        out[SDC_BIT] = np.float32(traced_bit(plan))
    return out


def site_counts(fault_stats, kinds, backward: bool = False) -> dict[str, jax.Array]:
    """{'flips': bits flipped, 'abft': rows ABFT flagged} summed over the sites of a
    `fault_stats` tree (the `flips` and `detected` of the injections `kinds`; `bwd_flips`, the
    backward products', with `backward`: the passes that were differentiated)."""
    out = {"flips": jnp.zeros((), jnp.float32), "abft": jnp.zeros((), jnp.float32)}
    for path, v in jax.tree_util.tree_leaves_with_path(fault_stats):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        kind, _, stat = str(names[-1] if names else "").partition(".")
        if kind in kinds and stat == "bwd_flips" and backward:
            stat = "flips"
        if kind in kinds and stat in ("flips", "detected"):
            key = "flips" if stat == "flips" else "abft"
            out[key] = out[key] + jnp.sum(jnp.asarray(v, jnp.float32))
    return out


def loss_counts(sdc: SdcSpec | None, fault_stats) -> dict[str, jax.Array]:
    """A differentiated pass's flips and ABFT detections, as a loss's metrics (none without
    SDC at module sites)."""
    if sdc is None or not sdc.sites:
        return {}
    counts = site_counts(fault_stats, sdc.kinds, backward=True)
    return {"sdc_flips": counts["flips"], "sdc_abft": counts["abft"]}


def abft_accumulate(accumulate: Callable, num_layers: int, loss_fn, params, mb, denom, base):
    """`accumulate(loss_fn, params, mb, denom, base)` (rl/step.py's) with backward ABFT
    (config.sdc.abft_backward): also the rows its checks flagged in the backward products, as
    metrics `sdc_abft_bwd/<layer>/<kind>/<dx|dw>` (summed over the micro-batches). A backward
    pass cannot sow: each checked linear adds its count to the cotangent of a probe of zeros
    (`bitfaults.backward_probe`) differentiated beside the params, so the counts leave the
    backward pass as that probe's gradient."""

    def probed(pp, mic, d, k):
        with backward_probe(pp[1]):
            return loss_fn(pp[0], mic, d, k)

    probe = abft_probe(num_layers)
    (grads, counts), mets = accumulate(probed, (params, probe), mb, denom, base)
    for (layer, j, p), _ in np.ndenumerate(np.zeros(probe.shape)):
        mets[f"sdc_abft_bwd/{layer}/{LINEAR_KINDS[j]}/{PRODUCTS[p]}"] = counts[layer, j, p]
    return grads, mets


def update_metrics(sdc: SdcSpec, updates: int, micro_batches: int, before, after, mets) -> dict:
    """The update's SDC metrics (`before` and `after`: the train states around it, `mets`: its
    metrics, means over its `updates` of `micro_batches` passes each): bits flipped (module
    sites: summed over every pass; trees: gradients and moments), ABFT rows flagged, and for the
    guard the update's RMS and whether every AdamW moment is in range (`trees.moment_bound`)."""
    out = {}
    passes = updates * micro_batches  # the per-pass means back to totals
    if sdc.sites:
        out["sdc/injected_update"] = mets.pop("actor/sdc_flips") * passes
        out["sdc/detected_abft_update"] = mets.pop("actor/sdc_abft") * passes
    if sdc.abft_backward:  # per update (summed over its passes): back to the step's totals
        for name in [k for k in mets if k.startswith("actor/sdc_abft_bwd/")]:
            layer, kind, product = name.split("/")[2:]
            n = mets.pop(name) * updates
            site = f"sdc/detected_abft_bwd/layers_{layer}/{kind}"
            out[site] = out.get(site, 0.0) + n
            out[f"sdc/detected_abft_{product}"] = out.get(f"sdc/detected_abft_{product}", 0.0) + n
            out["sdc/detected_abft_update"] = out["sdc/detected_abft_update"] + n
    if sdc.trees:
        flips = trees.tree_fault_flips(after.opt_state) - trees.tree_fault_flips(before.opt_state)
        out["sdc/injected_tree"] = flips.astype(jnp.float32)
    if sdc.guard.on:
        deltas = [
            (a.astype(jnp.float32) - b.astype(jnp.float32))
            for a, b in zip(
                jax.tree_util.tree_leaves(after.params),
                jax.tree_util.tree_leaves(before.params),
                strict=True,
            )
        ]
        n = sum(d.size for d in deltas)
        out["sdc/update_rms"] = jnp.sqrt(sum(jnp.sum(d * d) for d in deltas) / n)
        if sdc.moment_bound is not None:
            ok = trees.moments_in_range(after.opt_state, sdc.moment_bound)
            out["sdc/moments_ok"] = ok.astype(jnp.float32)
    return out


def train_counts(sdc: SdcSpec | None, train_stats, mets: Mapping[str, float], passes: int):
    """The train passes' totals of one attempt (host floats): `sdc/injected_prepare` (the
    prepare passes' flips: `train_stats`, on the device, holds their means over its `passes`
    chunks) and `sdc/detected_abft_train` (theirs and the update's, from `mets`); none without
    SDC at module sites."""
    if sdc is None or not sdc.sites:
        return {}
    counts = site_counts(jax.tree_util.tree_map(parallel.to_host, train_stats), sdc.kinds)
    return {
        "sdc/injected_prepare": float(counts["flips"]) * passes,
        "sdc/detected_abft_train": float(counts["abft"]) * passes
        + mets["sdc/detected_abft_update"],
    }


def rollout_totals(kinds, rollout_stats, longest: int) -> np.ndarray:
    """(bits flipped, rows ABFT flagged) over a rollout, summed over the sites of the
    injections `kinds`. The sampler reports each stat as its mean over its forward calls: the
    prefill and one call per decode step, as many as the longest response has tokens (every
    decode step has a live row, and a row's tokens are consecutive), so a total is that mean
    times 1 + `longest`, rounded (the counts are whole)."""
    counts = site_counts(rollout_stats, kinds)
    calls = 1.0 + longest
    return np.array([round(float(counts["flips"]) * calls), round(float(counts["abft"]) * calls)])


def sdc_metrics(
    kinds,
    m: Mapping[str, float],
    rollout_stats,
    guard: Mapping[str, float],
    rejected_rollout=(0, 0),
) -> dict:
    """The step's sdc/* metrics: `injected` (bits flipped in the train passes and the
    optimizer's trees, exact, the guard's rejected attempts included), `injected_rollout` and
    `detected_abft_rollout` (totals over the step's rollout (`rollout_totals`), plus those of
    the rollouts the guard rejected, `rejected_rollout`), `detected_abft` (rows ABFT flagged in
    the train passes, rejected attempts included), the guard's counts (`guard`)."""
    flips, abft = rollout_totals(kinds, rollout_stats, int(m["response_length/max"]))
    out = {
        "sdc/injected": sum(
            m.get(k, 0.0)
            for k in ("sdc/injected_prepare", "sdc/injected_update", "sdc/injected_tree")
        )
        + guard.get("sdc/injected_rejected", 0.0),
        "sdc/injected_rollout": float(flips + rejected_rollout[0]),
        "sdc/detected_abft": m.get("sdc/detected_abft_train", 0.0)
        + guard.get("sdc/detected_abft_rejected", 0.0),
        "sdc/detected_abft_rollout": float(abft + rejected_rollout[1]),
    }
    out.update(guard)
    return out


def guard_hint(faults: str) -> str:
    """What survives the bit faults `faults` (a plan's description, `flip_note`; '' = none)."""
    if not faults:
        return ""
    return (
        f"; the device runs bit faults ({faults}): config.sdc.guard=skip or recompute survives"
        " a corrupted step"
    )


# The sdc/ metrics that say a bit fault fired in a step, and the ones shown with them.
FIRED = ("sdc/injected", "sdc/injected_rollout")
SHOWN = (*FIRED, "sdc/grad_norm", "sdc/update_rms", "sdc/detected_abft")


def fault_fired(metrics: Mapping[str, float]) -> str | None:
    """'sdc/injected=1, sdc/grad_norm=inf, ...' when a bit fault fired in the step these
    metrics describe (a bit flipped in its train passes, trees or rollout), else None."""
    if not any(metrics.get(k, 0.0) > 0 for k in FIRED):
        return None
    return ", ".join(f"{k}={metrics[k]:.4g}" for k in SHOWN if k in metrics)
