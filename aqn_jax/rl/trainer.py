"""The RL loop's host side: GRPO (and Dr.GRPO) or PPO with a critic (GAE), on the faulty device.

One step (the data path of docs/ARCHITECTURE.md):

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from aqn_jax import parallel, quant_base
from aqn_jax.aqn.config import AQN_SIGMA, AqnSchedule
from aqn_jax.data.gsm8k import Example, PromptBatcher
from aqn_jax.data.tokenizers import Tokenizer
from aqn_jax.faults.intercept import FaultPlan, step_key, summarize_stats
from aqn_jax.models.registry import causal_lm
from aqn_jax.rewards import score_batch
from aqn_jax.rl.scoring import cap_line, eval_scores
from aqn_jax.sdc import telemetry
from aqn_jax.sdc.guard import GuardSpec
from aqn_jax.sdc.recovery import Attempted, Recovery
from aqn_jax.sdc.telemetry import guard_hint

from .advantages import ESTIMATORS
from .rollout_correction import correct
from .sampler import SampleOutput, Sampler, SamplingParams
from .step import FAULT_STATS, OLD_LOGP, RLState, Shardings, Static, policy_weights


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
    share_prompt: bool = True  # config.rollout.share_prompt: one prefill per distinct prompt
    share_prefix: bool = True  # config.rollout.share_prefix: the prompts' common prefix once
    retire_rows: bool = True  # config.rollout.retire_rows: greedy decodes retire finished rows


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


@dataclasses.dataclass(frozen=True)
class TrainerParts:
    """What `Trainer` runs: the loop's spec, the step programs (jitted by the train job with
    `shardings` over `static`), the reference policy, the data and the device."""

    spec: LoopSpec
    static: Static
    shardings: Shardings
    prepare: Callable | None  # jitted `step.prepare_step` (None: the step is not run)
    update: Callable | None  # jitted `step.update_step`
    ref_params: Any  # the frozen reference policy (placed); None without one
    batcher: PromptBatcher  # the train split in RL batches (`prompt_batcher`)
    tokenizer: Tokenizer
    test_examples: Sequence[Example]  # the validation's problems, in order
    hardware_plan: FaultPlan  # the device's faults alone: the validation's faulty device


class Trainer:
    """Runs the RL steps and validations of one run over the jitted `prepare` and `update`
    (`step.prepare_step` / `step.update_step`, jitted with the shardings of `parts`). The train
    state is the caller's: `step(state, t)` returns the next one (`update` donates the old)."""

    def __init__(self, parts: TrainerParts):
        spec, static, sh, tokenizer = parts.spec, parts.static, parts.shardings, parts.tokenizer
        hardware_plan = parts.hardware_plan
        self.spec = spec
        self.static = static
        self.prepare, self.update, self.ref_params = parts.prepare, parts.update, parts.ref_params
        self.batcher = parts.batcher
        self.tokenizer = tokenizer
        self.test_examples = list(parts.test_examples)
        self.mesh = sh.replicated.mesh
        self.seed = spec.seed
        buckets = spec.buckets
        sampling = SamplingParams(
            max_new_tokens=static.max_new,
            eos_id=tokenizer.eos_id,
            stop_ids=tokenizer.stop_ids,
            pad_id=tokenizer.pad_id,
            temperature=spec.temperature,
            top_k=spec.top_k,
            top_p=spec.top_p,
            n=static.h.n,
            vocab_size=tokenizer.vocab_size,
            share_prompt=spec.share_prompt,
            share_prefix=spec.share_prefix,
            retire_rows=spec.retire_rows,
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
        # The attempts of each step under config.sdc (aqn_jax/sdc/recovery.py); what a
        # non-finite step's error names: the bit faults the device runs (`recovery.note`).
        self.recovery = Recovery(
            GuardSpec() if static.sdc is None else static.sdc.guard,
            spec.seed,
            telemetry.sdc_kinds(static.plan),
            telemetry.flip_note(static.plan),
        )
        # bf16 compute with fp32 master weights: the update keeps the fp32 params (each matmul
        # casts its kernel); generation gets one bf16 copy per step (the inference engine's
        # weights), which equals what every traced cast produces.
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

    def rollout(self, params, batch, step: int, attempt: int = 0):
        """The step's rollout; a regenerated one (`attempt` >= 1, the guard's) samples with
        the same key and draws its faults anew, as a recomputed update does."""
        key = jax.random.fold_in(jax.random.key(self.seed), step)
        return self.rollout_sampler(
            self.generation_weights(params),
            batch["input_ids"],
            batch["attention_mask"],
            jax.random.fold_in(key, 0),
            fault_key=self.recovery.fault_key(step, "rollout", attempt),
            values=self.step_values(step, attempt),
        )

    def sigma(self, step: int) -> float:
        """AQN's sigma at RL step `step` (config.aqn's schedule)."""
        return self.spec.aqn.sigma(step, self.static.total_steps)

    def step_values(self, step: int, attempt: int = 0) -> dict[str, np.ndarray]:
        """The traced per-step values every program of the step reads, by name (the rollout's,
        prepare's and the update's passes and the optimizer's tree faults): AQN's sigma and
        the bit faults' (`telemetry.step_values`)."""
        sdc = telemetry.step_values(self.static.plan, self.static.sdc, step, attempt)
        return {AQN_SIGMA: np.float32(self.sigma(step)), **sdc}

    def step(self, state: RLState, step: int) -> tuple[RLState, dict[str, float]]:
        """One RL step: the next state and the step's metrics (host floats). Its attempts
        (the guard's regenerated rollouts and recomputed updates) are `self.recovery`'s."""
        t_step = time.perf_counter()
        batch = self.batcher.next_batch()
        truths = [g for g in batch["ground_truth"] for _ in range(self.static.h.n)]

        def rollout(attempt: int):
            out = self.rollout(policy_weights(self.static, state), batch, step, attempt)
            texts = [
                self.tokenizer.decode(t[m > 0])
                for t, m in zip(out.tokens, out.response_mask, strict=True)
            ]
            scores = score_batch(texts, truths, method=self.spec.reward_method)
            return out, train_batch(out, scores)

        got = self.recovery.step(
            step, rollout, lambda tb, attempt: self._train(state, step, tb, attempt)
        )
        train = got.train
        if got.skipped:  # the update is dropped: the state before the step, the step counted
            train = train._replace(state=state.replace(step=train.state.step))
        m = self._metrics(step, batch, got, train, t_step)
        # The sdc/ diagnostics describe the fault, not the run's state: the gradient norm the
        # optimizer received is inf when a flipped exponent overflows it, and global-norm
        # clipping then makes that update zero, not NaN (the guard still acts on it).
        check_finite(
            step,
            {k: v for k, v in m.items() if not k.startswith("sdc/")},
            self.recovery.note,
            telemetry.fault_fired(m),
        )
        return train.state, m

    def _metrics(
        self, step: int, batch, got: Attempted, train: _Train, t_step: float
    ) -> dict[str, float]:
        """The step's metrics (verl's names), in the order metrics.jsonl writes them: the
        rollout's and the advantages', the timings, the correction's and the update's, then the
        faults' (`_fault_metrics`). `got`: the recovery's attempt that stands; `train`: its
        training."""
        tb, prep = got.rows, train.prep
        scores, rmask = tb["scores"], tb["rmask"]
        lengths = rmask.sum(1)
        drift = np.abs(train.old_logp - tb["sampler_logp"])[rmask > 0]
        drift = drift[~np.isnan(drift)]  # the rows the skip did not run have no log-probs
        if not drift.size:  # a step without a signal ran no pass
            drift = np.zeros(1)
        adv = parallel.to_host(prep["advantages"])
        rewards = parallel.to_host(prep["token_rewards"]).sum(1)
        ended = tb["ended"]  # the rows the sampler ended on a stop id
        if not ended.any():
            print(
                cap_line(
                    f"step {step}: every one of {ended.size} responses",
                    self.rollout_sampler.sampling,
                )
            )
        m: dict[str, float] = {
            "step": float(step),
            "critic/score/mean": float(scores.mean()),
            "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            # GRPO's signal: the share of prompts whose n samples did not all score the same
            # (a group of equal rewards has zero advantage and no gradient; `step.live_rows`:
            # the groups the update sees).
            "critic/groups_with_advantage": self._signal(scores, prep),
            "critic/rewards/mean": float(rewards.mean()),
            "critic/advantages/mean": float(adv[rmask > 0].mean()),
            "critic/advantages/max": float(adv[rmask > 0].max()),
            "critic/advantages/min": float(adv[rmask > 0].min()),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": float(np.mean(~ended)),
            "prompt_length/mean": float(batch["prompt_len"].mean()),
            "training/rollout_logprob_diff_mean": float(drift.mean()),
            "training/rollout_logprob_diff_max": float(drift.max()),
            # The typical token: a deadzone's threshold crossed by one rounding moves a few
            # tokens' log-probs by O(0.01-0.1) and the mean with them, not the median.
            "training/rollout_logprob_diff_median": float(np.median(drift)),
            "aqn/sigma": float(self.sigma(step)),
            "timing_s/gen": got.t_gen,
            "timing_s/old_log_prob": train.t_prep,
            "timing_s/update": train.t_upd,
            "timing_s/rollout_corr": train.t_corr,
            "timing_s/step": time.perf_counter() - t_step,
            "data/epoch": float(batch["epoch"]),
        }
        if self.static.use_critic:
            vals = parallel.to_host(prep["values"])
            m["critic/values/mean"] = float(vals[rmask > 0].mean())
            m["critic/returns/mean"] = float(parallel.to_host(prep["returns"])[rmask > 0].mean())
        m.update(train.corr.metrics)
        m.update(train.mets)
        self._fault_metrics(m, got, train)
        if got.counts.get("sdc/guard_skipped"):  # the rejected attempt's non-finite values
            m = {k: v for k, v in m.items() if math.isfinite(v)}
        return m

    def _fault_metrics(self, m: dict[str, float], got: Attempted, train: _Train) -> None:
        """Add to `m` the guard's `sdc/` metrics (under config.sdc) and the faults' telemetry
        means of the rollout and of the training passes."""
        out = got.out
        if self.static.sdc is not None:
            m.update(
                telemetry.sdc_metrics(
                    self.static.sdc.kinds, m, out.fault_stats, got.counts, got.rejected_rollout
                )
            )
        for name, v in summarize_stats(out.fault_stats).items():
            if name.endswith("/mean"):
                m[f"faults/rollout/{name.removesuffix('/mean')}"] = v
        for name, v in summarize_stats(
            jax.tree_util.tree_map(parallel.to_host, train.train_stats)
        ).items():
            if name.endswith("/mean"):
                m[f"faults/train/{name.removesuffix('/mean')}"] = v

    def _signal(self, scores, prep) -> float:
        """The share of groups with an advantage: of a grouped estimator, the groups whose
        rewards differ (`step.live_rows`); else the groups whose scores differ."""
        n = self.static.h.n
        if ESTIMATORS[self.static.h.estimator].grouped:
            return float(np.mean(parallel.to_host(prep["live"])))
        return float(np.mean(np.ptp(np.reshape(scores, (-1, n)), axis=1) > 0))

    def _train(self, state: RLState, step: int, tb, attempt: int) -> _Train:
        """Prepare, rollout correction and update of one attempt at a step (the rollout `tb` is
        the step's, whatever the attempt; a recomputed one draws its faults anew)."""
        t0 = time.perf_counter()
        dev, scores_dev = self._device_rows(tb)
        train_key = self.recovery.fault_key(step, "train", attempt)
        values = self.step_values(step, attempt)
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
            # Rows that the skip did not run have no log-probs (NaN): the mismatch metrics are
            # the updated rows' (the skipped ones count as no mismatch).
            ran = np.where(np.isnan(old_logp), tb["sampler_logp"], old_logp)
            corr = correct(ran, tb["sampler_logp"], tb["rmask"], self.static.h.correction)
            t_corr += time.perf_counter() - t1
        mets = {k: float(parallel.to_host(v)) for k, v in mets.items()}
        t_upd = time.perf_counter() - t0
        passes = self.static.h.mini_batches * self.static.h.micro_batches  # prepare's chunks
        mets.update(telemetry.train_counts(self.static.sdc, train_stats, mets, passes))
        return _Train(state, prep, train_stats, corr, mets, old_logp, t_prep, t_corr, t_upd)

    def _device_rows(self, tb):
        """(the rollout's train rows, its scores) on the mesh, as `prepare` takes them."""
        dev = parallel.put_batch(
            {k: v for k, v in tb.items() if k not in ("scores", "ended")}, self.mesh
        )
        return dev, parallel.put_batch(tb["scores"], self.mesh)

    def _update_rows(self, dev, prep, corr=None) -> dict:
        """The update's rows: the rollout's (`dev`), prepare's outputs (`prep`) and the rollout
        correction's (`corr`, None when the update's own pass gives the old log-probs): its IS
        weights, its loss mask and bypass's old policy, where they act."""
        upd = {k: dev[k] for k in ("ids", "mask", "tokens", "rmask")}
        upd.update({k: prep[k] for k in ("old_logp", "advantages", "ref_logp") if k in prep})
        if self.static.skip:
            upd["live"] = prep["live"]
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

    def compile_step(self, state: RLState, batch, step: int) -> None:
        """Lower and compile generate, prepare and update for the step's batch of prompts
        (`batch`: its input_ids and attention_mask, [prompts, length]) as `step(state, step)`
        will call them: generate for the prompts' own layout (their shared prefix's length sets
        its shapes), prepare and update on inputs built by the step's own builders from zeros of
        those shapes (the values do not matter, only shapes, dtypes and shardings), so that the
        step runs compiled (the jits' caches)."""
        static = self.static
        ids, mask = np.asarray(batch["input_ids"]), np.asarray(batch["attention_mask"])
        sampler, rows = self.rollout_sampler, ids.shape[0] * static.h.n
        bucket = sampler.bucket(ids.shape[1])
        values = self.step_values(step)
        key = step_key(self.seed, step, "rollout")  # any key: only its type and shape matter
        weights = self.generation_weights(policy_weights(static, state))
        sampler.compile(weights, rows, bucket, (key, key), values, prompts=(ids, mask))
        ids, tokens = np.zeros((rows, bucket), np.int32), np.zeros((rows, static.max_new), np.int32)
        ended = np.zeros(rows, bool)
        out = SampleOutput(ids, ids, tokens, tokens.astype(np.float32), tokens + 1, {}, ended)
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

    # -- validation ------------------------------------------------------------------------------
    def eval_accuracy(
        self, params, step: int, size: int, batch_size: int, records: list | None = None
    ) -> dict[str, float]:
        """Greedy accuracy on the first `size` test examples: on the faulty device (hardware
        faults, no AQN: `val-core/...`) and on a clean device (`val-clean/...`). `records`,
        when given, receives each problem's record (`scoring.record`) under its device."""
        examples = self.test_examples[:size]
        weights = self.generation_weights(params)
        out = {}
        for prefix, sampler in (("val-core", self.val_sampler), ("val-clean", self.clean_sampler)):
            mine: list = []
            scores = eval_scores(
                sampler,
                weights,
                examples,
                self.tokenizer,
                batch_size,
                self.spec.max_prompt_len,
                fault_key=step_key(self.seed, step, "eval"),
                values=telemetry.step_values(self.static.plan, None, step, 0) or None,
                method=self.spec.reward_method,
                records=mine,
            )
            if records is not None:
                records.extend({"device": prefix, **r} for r in mine)
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
        "ended": np.asarray(out.ended, bool),
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
