"""The RL loop's host side: GRPO (and Dr.GRPO) or PPO with a critic (GAE), on the faulty device.

One step (DESIGN.md's data path):

  prompts -> rollout (phase `rollout`: hardware faults + AQN at this step's sigma)
          -> rewards (verl GSM8K scorer) -> `prepare` (old / reference log-probs and values,
             advantages; phase `train`) -> rollout correction (sampler vs trainer log-probs:
             IS weights, rejection, bypass; `rollout_corr/*` metrics) -> `update` (PPO epochs
             over mini-batches)
          -> metrics (verl names); validation every `val_every` steps (the job's loop).

`Trainer` only orchestrates: it draws the batches, samples, scores, calls the jitted programs
of aqn_jax/rl/step.py (jitted by the train job, which also owns the train state) and turns
their outputs into the step's metrics.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from aqn_jax import parallel, quant_base
from aqn_jax.aqn.config import AQN_SIGMA, AqnSchedule
from aqn_jax.data.gsm8k import Example, PromptBatcher
from aqn_jax.data.tokenizers import Tokenizer
from aqn_jax.faults.bitfaults import SDC_ATTEMPT, SDC_BIT, SDC_STEP, traced_bit
from aqn_jax.faults.intercept import FaultPlan, step_key, summarize_stats
from aqn_jax.models.registry import causal_lm
from aqn_jax.rewards import score_batch
from aqn_jax.rl.scoring import eval_scores

from .guard import Guard, RollbackNeeded
from .rollout_correction import correct
from .sampler import SampleOutput, Sampler, SamplingParams
from .step import (
    FAULT_STATS,
    OLD_LOGP,
    SDC_KINDS,
    RLState,
    Shardings,
    Static,
    policy_weights,
    sdc_site_counts,
)

# Folded into a recomputed attempt's train key (attempt >= 1): a stream apart from the passes'.
ATTEMPT_TAG = 1 << 30


class _Train(NamedTuple):
    """One attempt at a step's training: the next state and what the metrics read of it."""

    state: RLState
    prep: Any
    train_stats: Any
    corr: Any
    mets: dict
    old_logp: np.ndarray
    t_prep: float
    t_corr: float
    t_upd: float


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """What the RL loop reads of an experiment config besides `Static` (`loop_spec`)."""

    seed: int
    prompts: int  # prompts per step
    max_prompt_len: int
    buckets: tuple[int, ...]
    temperature: float
    top_k: int
    top_p: float
    reward_method: str
    aqn: AqnSchedule


def prompt_batcher(spec: LoopSpec, train_examples: Sequence[Example], tokenizer: Tokenizer):
    """The train split in RL batches of `spec.prompts` (longer prompts dropped)."""
    return PromptBatcher(
        train_examples,
        tokenizer,
        spec.prompts,
        spec.seed,
        max_prompt_len=spec.max_prompt_len,
        buckets=spec.buckets,
        drop_long=True,
    )


class Trainer:
    """Runs the RL steps and validations of one run over the jitted `prepare` and `update`
    (`step.prepare_step` / `step.update_step`, jitted with the shardings `sh`). The train state
    is the caller's: `step(state, t)` returns the next one (`update` donates the old)."""

    def __init__(
        self,
        spec: LoopSpec,
        static: Static,
        sh: Shardings,
        prepare,
        update,
        ref_params: Any,
        batcher: PromptBatcher,
        tokenizer: Tokenizer,
        test_examples: Sequence[Example],
        hardware_plan: FaultPlan,
    ):
        self.spec = spec
        self.static = static
        self.prepare, self.update, self.ref_params = prepare, update, ref_params
        self.batcher = batcher
        self.tokenizer = tokenizer
        self.test_examples = list(test_examples)
        self.mesh = sh.replicated.mesh
        self.seed = spec.seed
        buckets = spec.buckets
        sampling = SamplingParams(
            max_new_tokens=static.max_new,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            temperature=spec.temperature,
            top_k=spec.top_k,
            top_p=spec.top_p,
            n=static.h.n,
            vocab_size=tokenizer.vocab_size,
        )
        greedy = dataclasses.replace(sampling, temperature=0.0, top_k=0, top_p=1.0, n=1)
        # Generation has no backward pass: the samplers' model does not remat.
        gen = causal_lm(dataclasses.replace(static.model_cfg, remat=False))
        mesh = self.mesh
        self.rollout_sampler = Sampler(gen, sampling, static.plan, buckets, mesh=mesh)
        self.clean_sampler = Sampler(gen, greedy, FaultPlan(), buckets, phase="eval", mesh=mesh)
        # On a clean device both validations are the same program: compile it once.
        self.val_sampler = (
            Sampler(gen, greedy, hardware_plan, buckets, phase="eval", mesh=mesh)
            if hardware_plan.active("eval")
            else self.clean_sampler
        )
        # bf16 compute with fp32 master weights: the update keeps the fp32 params (each matmul
        # casts its kernel); generation gets one bf16 copy per step (the inference engine's
        # weights), which equals what every traced cast produces.
        sdc = static.sdc
        self.guard = Guard(sdc.guard) if sdc is not None and sdc.guard.on else None
        self.first_attempt: dict[int, int] = {}  # step -> its first attempt after a rollback
        self.rolled_back = False  # the next step's metrics say so
        # What a non-finite step's error names: the bit faults the device runs.
        self.sdc_note = "; ".join(
            inj.describe() for inj in static.plan.injections if inj.name in SDC_KINDS[:3]
        )
        self._cast = None
        model_cfg = static.model_cfg
        if jnp.dtype(model_cfg.dtype) != jnp.dtype(model_cfg.param_dtype):
            dt = jnp.dtype(model_cfg.dtype)
            # A packed base keeps its codes and dequantises to dt (its tree's static dtype
            # changes, so the output shardings are the inputs', propagated).
            self._cast = jax.jit(
                lambda p: quant_base.cast(p, dt),
                out_shardings=None if static.lora.enabled else sh.params,
            )

    def generation_weights(self, params):
        """The policy's weights for generation: the params in the compute dtype."""
        return params if self._cast is None else self._cast(params)

    def rollout(self, params, batch, step: int, sigma: float, attempt: int = 0):
        """The step's rollout; a regenerated one (`attempt` >= 1, the guard's) samples with
        the same key and draws its faults anew, as a recomputed update does."""
        key = jax.random.fold_in(jax.random.key(self.seed), step)
        fault_key = step_key(self.seed, step, "rollout")
        if attempt:
            fault_key = jax.random.fold_in(fault_key, ATTEMPT_TAG + attempt)
        return self.rollout_sampler(
            self.generation_weights(params),
            batch["input_ids"],
            batch["attention_mask"],
            jax.random.fold_in(key, 0),
            fault_key=fault_key,
            values=self.step_values(step, sigma, attempt),
        )

    def step_values(self, step: int, sigma: float, attempt: int = 0) -> dict[str, np.ndarray]:
        """The traced per-step values the programs read: AQN's sigma and `sdc_values`."""
        return {AQN_SIGMA: np.float32(sigma), **self.sdc_values(step, attempt)}

    def sdc_values(self, step: int, attempt: int) -> dict[str, np.ndarray]:
        """The RL step and attempt as traced values, for bit faults planted at given steps
        (`bitfaults.SDC_STEP`); none when the plan has no such fault (the programs are then
        unchanged)."""
        names = self.static.plan.value_names()
        out = {}
        if SDC_STEP in names:
            out.update({SDC_STEP: np.float32(step), SDC_ATTEMPT: np.float32(attempt)})
        if SDC_BIT in names:
            out[SDC_BIT] = np.float32(traced_bit(self.static.plan))
        return out

    def step(self, state: RLState, step: int) -> tuple[RLState, dict[str, float]]:
        """One RL step: the next state and the step's metrics (host floats)."""
        t_step = time.perf_counter()
        batch = self.batcher.next_batch()
        sigma = self.spec.aqn.sigma(step, self.static.total_steps)
        # After a rollback a step starts past the attempts that failed (fresh fault draws).
        first = attempt = self.first_attempt.get(step, 0)
        truths = [g for g in batch["ground_truth"] for _ in range(self.static.h.n)]
        rejected_rollout, t_regen = np.zeros(2), 0.0  # (flips, ABFT rows) of rejected rollouts
        t0 = time.perf_counter()
        while True:
            out = self.rollout(policy_weights(self.static, state), batch, step, sigma, attempt)
            texts = [
                self.tokenizer.decode(t[m > 0])
                for t, m in zip(out.tokens, out.response_mask, strict=True)
            ]
            scores = score_batch(texts, truths, method=self.spec.reward_method)
            tb = train_batch(out, scores)
            bad_rollout = None
            if self.guard is not None:
                totals = rollout_totals(out.fault_stats, int(tb["rmask"].sum(1).max()))
                bad_rollout = self.guard.rollout_verdict(tb["sampler_logp"], tb["rmask"], totals[1])
            if bad_rollout is None or self.guard.spec.mode == "skip":
                break
            # guard=recompute: the same prompts and sampling key, the next attempt's faults.
            rejected_rollout += totals
            attempt += 1
            if attempt - first > self.guard.spec.max_recomputes:
                raise RollbackNeeded(step, bad_rollout)
            print(f"RL step {step}: {bad_rollout}; generating it again (attempt {attempt})")
            t_regen = time.perf_counter() - t0
        t_gen = time.perf_counter() - t0
        train = self._train(state, step, tb, sigma, attempt)
        sdc: dict[str, float] = {}
        if self.guard is not None:
            train, sdc = self._guarded(state, step, tb, sigma, train, first, attempt, bad_rollout)
            sdc["timing_s/sdc_recompute"] += t_regen
        state, prep, train_stats, corr, mets, old_logp, t_prep, t_corr, t_upd = train

        rmask = tb["rmask"]
        lengths = rmask.sum(1)
        drift = np.abs(old_logp - tb["sampler_logp"])[rmask > 0]
        adv = parallel.to_host(prep["advantages"])
        rewards = parallel.to_host(prep["token_rewards"]).sum(1)
        eos = (tb["tokens"] == self.tokenizer.eos_id).any(1)
        m: dict[str, float] = {
            "step": float(step),
            "critic/score/mean": float(scores.mean()),
            "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            # GRPO's signal: the share of prompts whose n samples did not all score the same
            # (a group of equal scores has zero advantage and no gradient).
            "critic/groups_with_advantage": float(
                np.mean(np.ptp(np.reshape(scores, (-1, self.static.h.n)), axis=1) > 0)
            ),
            "critic/rewards/mean": float(rewards.mean()),
            "critic/advantages/mean": float(adv[rmask > 0].mean()),
            "critic/advantages/max": float(adv[rmask > 0].max()),
            "critic/advantages/min": float(adv[rmask > 0].min()),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": float(np.mean(~eos)),
            "prompt_length/mean": float(batch["prompt_len"].mean()),
            "training/rollout_logprob_diff_mean": float(drift.mean()),
            "training/rollout_logprob_diff_max": float(drift.max()),
            "aqn/sigma": float(sigma),
            "timing_s/gen": t_gen,
            "timing_s/old_log_prob": t_prep,
            "timing_s/update": t_upd,
            "timing_s/rollout_corr": t_corr,
            "timing_s/step": time.perf_counter() - t_step,
            "data/epoch": float(batch["epoch"]),
        }
        if self.static.use_critic:
            vals = parallel.to_host(prep["values"])
            m["critic/values/mean"] = float(vals[rmask > 0].mean())
            m["critic/returns/mean"] = float(parallel.to_host(prep["returns"])[rmask > 0].mean())
        m.update(corr.metrics)
        m.update(mets)
        if self.static.sdc is not None:
            m.update(sdc_metrics(m, out.fault_stats, sdc, rejected_rollout))
        for name, v in summarize_stats(out.fault_stats).items():
            if name.endswith("/mean"):
                m[f"faults/rollout/{name.removesuffix('/mean')}"] = v
        for name, v in summarize_stats(
            jax.tree_util.tree_map(parallel.to_host, train_stats)
        ).items():
            if name.endswith("/mean"):
                m[f"faults/train/{name.removesuffix('/mean')}"] = v
        if sdc.get("sdc/guard_skipped"):  # the rejected attempt's non-finite values, dropped
            m = {k: v for k, v in m.items() if math.isfinite(v)}
        # The sdc/ diagnostics describe the fault, not the run's state: the gradient norm the
        # optimizer received is inf when a flipped exponent overflows it, and global-norm
        # clipping then makes that update zero, not NaN (the guard still acts on it).
        check_finite(
            step,
            {k: v for k, v in m.items() if not k.startswith("sdc/")},
            self.sdc_note,
            fault_fired(m),
        )
        return state, m

    def _train(self, state: RLState, step: int, tb, sigma: float, attempt: int) -> _Train:
        """Prepare, rollout correction and update of one attempt at a step (the rollout `tb` is
        the step's, whatever the attempt)."""
        t0 = time.perf_counter()
        dev, scores_dev = self._device_rows(tb)
        train_key = step_key(self.seed, step, "train")
        if attempt:  # a recomputed step draws its faults anew: (seed, step, attempt, phase)
            train_key = jax.random.fold_in(train_key, ATTEMPT_TAG + attempt)
        values = self.step_values(step, sigma, attempt)
        prep, train_stats = self.prepare(state, self.ref_params, dev, scores_dev, train_key, values)
        prep = jax.block_until_ready(prep)
        t_prep = time.perf_counter() - t0
        fused = self.static.fused_old_logp  # the update's own log-probs are the old ones
        # Rollout correction (rl/rollout_correction.py): the sampler's log-probs against the
        # trainer's; IS weights, the loss mask without rejected tokens, bypass's old policy.
        t0 = time.perf_counter()
        corr = None
        if not fused:
            old_logp = parallel.to_host(prep["old_logp"])
            corr = correct(old_logp, tb["sampler_logp"], tb["rmask"], self.static.h.correction)
        upd = self._update_rows(dev, prep, corr)
        t_corr = time.perf_counter() - t0
        t0 = time.perf_counter()
        state, mets = self.update(state, upd, train_key, values)
        if fused:  # no correction acts (Hyper.on_policy): its metrics from the update's pass
            old_logp = parallel.to_host(mets.pop(OLD_LOGP))
            train_stats = mets.pop(FAULT_STATS)
            t1 = time.perf_counter()
            corr = correct(old_logp, tb["sampler_logp"], tb["rmask"], self.static.h.correction)
            t_corr += time.perf_counter() - t1
        mets = {k: float(parallel.to_host(v)) for k, v in mets.items()}
        t_upd = time.perf_counter() - t0
        if self.static.sdc is not None and self.static.sdc.sites:  # prepare's passes, in all
            passes = self.static.h.mini_batches * self.static.h.micro_batches
            counts = sdc_site_counts(jax.tree_util.tree_map(parallel.to_host, train_stats))
            mets["sdc/injected_prepare"] = float(counts["flips"]) * passes
            mets["sdc/detected_abft_train"] = (
                float(counts["abft"]) * passes + mets["sdc/detected_abft_update"]
            )
        return _Train(state, prep, train_stats, corr, mets, old_logp, t_prep, t_corr, t_upd)

    def _device_rows(self, tb):
        """(the rollout's train rows, its scores) on the mesh, as `prepare` takes them."""
        dev = parallel.put_batch({k: v for k, v in tb.items() if k != "scores"}, self.mesh)
        return dev, parallel.put_batch(tb["scores"], self.mesh)

    def _update_rows(self, dev, prep, corr=None) -> dict:
        """The update's rows: the rollout's (`dev`), prepare's outputs (`prep`) and the rollout
        correction's (`corr`, None when the update's own pass gives the old log-probs): its IS
        weights, its loss mask and bypass's old policy, where they act."""
        upd = {k: dev[k] for k in ("ids", "mask", "tokens", "rmask")}
        upd.update({k: prep[k] for k in ("old_logp", "advantages", "ref_logp") if k in prep})
        if self.static.use_critic:
            upd.update(values=prep["values"], returns=prep["returns"])
        if corr is not None:
            for key, value in (
                ("is_weights", corr.is_weights),
                ("rmask", corr.loss_mask),
                ("old_logp", corr.old_logp),
            ):
                if value is not None:
                    upd[key] = parallel.put_batch(value, self.mesh)
        return upd

    def compile_step(self, state: RLState, prompt_shape: tuple[int, int], step: int) -> None:
        """Lower and compile generate, prepare and update for a batch of prompts of
        `prompt_shape` ([prompts, length]) as `step(state, step)` will call them: its inputs
        built by the step's own builders from zeros of those shapes (the values do not matter,
        only shapes, dtypes and shardings), so that the step runs compiled (the jits' caches)."""
        static = self.static
        sampler, rows = self.rollout_sampler, prompt_shape[0] * static.h.n
        bucket = sampler.bucket(prompt_shape[1])
        values = self.step_values(step, self.spec.aqn.sigma(step, static.total_steps))
        key = step_key(self.seed, step, "rollout")  # any key: only its type and shape matter
        weights = self.generation_weights(policy_weights(static, state))
        sampler.compile(weights, rows, bucket, (key, key), values)
        ids, tokens = np.zeros((rows, bucket), np.int32), np.zeros((rows, static.max_new), np.int32)
        out = SampleOutput(ids, ids, tokens, tokens.astype(np.float32), tokens + 1, {})
        tb = train_batch(out, np.zeros(rows, np.float32))
        dev, scores = self._device_rows(tb)
        train_key = step_key(self.seed, step, "train")
        prepared = self.prepare.lower(state, self.ref_params, dev, scores, train_key, values)
        prep = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            prepared.compile().out_info[0],
        )
        corr = None
        if not static.fused_old_logp:
            rmask = tb["rmask"]
            corr = correct(tb["sampler_logp"], tb["sampler_logp"], rmask, static.h.correction)
        upd = self._update_rows(dev, prep, corr)
        self.update.lower(state, upd, train_key, values).compile()

    def _guarded(
        self,
        state: RLState,
        step: int,
        tb,
        sigma: float,
        train: _Train,
        first: int,
        attempt: int,
        bad_rollout: str | None = None,
    ):
        """The guard's verdict on each attempt (rl/guard.py): skip, recompute with a fresh
        fault draw, or ask the job for a rollback; (the accepted attempt, sdc/* metrics).
        `train` is attempt `attempt` of the step's attempts from `first`; `bad_rollout` (skip
        mode only): why its rollout was rejected, which skips its update."""
        t0, skipped = time.perf_counter(), False
        rejected = {"sdc/injected_rejected": 0.0, "sdc/detected_abft_rejected": 0.0}
        while (reason := bad_rollout or self.guard.verdict(train.mets)) is not None:
            if self.guard.spec.mode == "skip":  # the update is dropped; the step counts
                skipped = True
                train = train._replace(state=state.replace(step=train.state.step))
                print(f"RL step {step}: {reason}; update skipped (config.sdc.guard=skip)")
                break
            # What fired in the rejected attempt still counts (sdc/injected includes it).
            rejected["sdc/injected_rejected"] += sum(
                train.mets.get(f"sdc/injected_{k}", 0.0) for k in ("prepare", "update", "tree")
            )
            rejected["sdc/detected_abft_rejected"] += train.mets.get("sdc/detected_abft_train", 0.0)
            attempt += 1
            if attempt - first > self.guard.spec.max_recomputes:
                raise RollbackNeeded(step, reason)
            print(f"RL step {step}: {reason}; recomputing (attempt {attempt})")
            train = self._train(state, step, tb, sigma, attempt)
        if not skipped:
            self.guard.accept(train.mets)
        rolled, self.rolled_back = self.rolled_back, False
        return train, {
            **rejected,
            "sdc/rolled_back": float(rolled),
            "sdc/recomputed": float(attempt - first),
            "sdc/guard_skipped": float(skipped),
            "timing_s/sdc_recompute": time.perf_counter() - t0 if attempt > first else 0.0,
        }

    def note_rollback(self, step: int) -> None:
        """The job rolled back to a checkpoint because `step` failed every recompute: when the
        run reaches it again, its attempts continue past those (fresh draws); a second
        rollback of the same step raises (a fault no recompute cures)."""
        if step in self.first_attempt:
            raise FloatingPointError(
                f"RL step {step}: failed every recompute again after a rollback (a permanent"
                f" fault? {self.sdc_note or 'no bit fault configured'})"
            )
        self.first_attempt[step] = self.guard.spec.max_recomputes + 1
        self.rolled_back = True

    # -- validation ------------------------------------------------------------------------------
    def eval_accuracy(self, params, step: int, size: int, batch_size: int) -> dict[str, float]:
        """Greedy accuracy on the first `size` test examples: on the faulty device (hardware
        faults, no AQN: `val-core/...`) and on a clean device (`val-clean/...`)."""
        examples = self.test_examples[:size]
        weights = self.generation_weights(params)
        out = {}
        for prefix, sampler in (("val-core", self.val_sampler), ("val-clean", self.clean_sampler)):
            scores = eval_scores(
                sampler,
                weights,
                examples,
                self.tokenizer,
                batch_size,
                self.spec.max_prompt_len,
                fault_key=step_key(self.seed, step, "eval"),
                values=self.sdc_values(step, 0) or None,
                method=self.spec.reward_method,
            )
            by_source: dict[str, list[float]] = {}
            for ex, s in zip(examples, scores, strict=True):
                by_source.setdefault(ex.data_source, []).append(float(s))
            for source, vals in by_source.items():
                out[f"{prefix}/{source}/acc/mean@1"] = float(np.mean(vals))
            out[f"{prefix}/acc"] = float(np.mean(scores))
        return out


def train_batch(out, scores) -> dict[str, np.ndarray]:
    """The rollout as train rows: prompt + response ids and masks, the response tokens and
    their sampler log-probs, the scores."""
    ids = np.concatenate([out.prompt_ids, out.tokens], axis=1).astype(np.int32)
    mask = np.concatenate([out.prompt_mask, out.response_mask], axis=1).astype(np.int32)
    return {
        "ids": ids,
        "mask": mask,
        "tokens": out.tokens.astype(np.int32),
        "rmask": out.response_mask.astype(np.int32),
        "sampler_logp": out.logprobs.astype(np.float32),
        "scores": scores.astype(np.float32),
    }


def check_finite(
    step: int, metrics: Mapping[str, float], faults: str = "", fired: str | None = None
) -> None:
    """Raise naming the step and the metric on NaN/Inf (the run stops; nothing is saved);
    `faults`: the bit faults the device runs, named in the error with the guard that would
    survive them; `fired` (`fault_fired` of the step's metrics): said first, the cause."""
    bad = [k for k, v in metrics.items() if not math.isfinite(v)]
    if bad:
        first = f"a bit fault fired in this step ({fired}), then " if fired else ""
        raise FloatingPointError(
            f"RL step {step}: {first}non-finite metric(s) {bad} (e.g. {bad[0]}="
            f"{metrics[bad[0]]}){guard_hint(faults)}"
        )


def guard_hint(faults: str) -> str:
    """What survives the bit faults `faults` (a plan's description; '' = none)."""
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


def rollout_totals(rollout_stats, longest: int) -> np.ndarray:
    """(bits flipped, rows ABFT flagged) over a rollout, summed over sites. The sampler reports
    each stat as its mean over its forward calls: the prefill and one call per decode step, as
    many as the longest response has tokens (every decode step has a live row, and a row's
    tokens are consecutive), so a total is that mean times 1 + `longest`, rounded (the counts
    are whole)."""
    counts = sdc_site_counts(rollout_stats)
    calls = 1.0 + longest
    return np.array([round(float(counts["flips"]) * calls), round(float(counts["abft"]) * calls)])


def sdc_metrics(
    m: Mapping[str, float], rollout_stats, guard: Mapping[str, float], rejected_rollout=(0, 0)
) -> dict:
    """The step's sdc/* metrics: `injected` (bits flipped in the train passes and the
    optimizer's trees, exact, the guard's rejected attempts included), `injected_rollout` and
    `detected_abft_rollout` (totals over the step's rollout (`rollout_totals`), plus those of
    the rollouts the guard rejected, `rejected_rollout`), `detected_abft` (rows ABFT flagged in
    the train passes, rejected attempts included), the guard's counts (`guard`)."""
    flips, abft = rollout_totals(rollout_stats, int(m["response_length/max"]))
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
