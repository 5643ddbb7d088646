"""Robustness evaluation of a policy: test-split accuracy under a matrix of device conditions,
and the held-out loss (the metric of the original system's controlled test: docs/ARCHITECTURE.md,
"The original system's experiments") with the fault off and on.

Conditions (`config.evaluate`): the hardware fault of `config.faults` off / on, crossed with a
perturbation of every decoder linear: none, relative Gaussian noise on the outputs
(`noise_levels`, e.g. 5% and 10%: y + scale * randn * |y|) and MXFP4 fake quantisation of the
inputs (OCP MX: blocks of 32 along the contraction axis, E2M1 elements, power-of-two scale).
Names: 'clean', 'clean+noise5%', 'clean+mxfp4', 'fault', 'fault+noise10%', ...

Programs are shared where the maths allows: every noise level (0 included, which adds exactly
0) is one compiled program with the level as a traced value, so the matrix compiles
2 (fault off / on) x 2 (noise, MXFP4) samplers, not one per condition.

A caller that evaluates one run after another (the `compare` job) passes a cache of programs
(`programs`, keyed by everything that defines them: model config, sampling parameters, buckets,
the plan's injections, the mesh), so the matrix is traced and compiled once.

What the evaluation reads of an experiment config is converted once, at the job, into an
`EvalSpec` (`spec.eval_spec(config)`, which validates it); the library functions take that.

Decoding: greedy (`samples=1`, the accuracy verl reports as mean@1), or `samples=n` completions
per prompt at `config.rollout.temperature` with their mean accuracy (mean@n).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from aqn_jax import quant_base
from aqn_jax.data.gsm8k import Example
from aqn_jax.data.tokenizers import Tokenizer
from aqn_jax.faults.intercept import FaultPlan, Injection, step_key
from aqn_jax.faults.sites import LINEAR_KINDS, SiteSelector
from aqn_jax.faults.transforms import Noise, Quantize, Scale
from aqn_jax.files import write_json, write_jsonl
from aqn_jax.forward import token_nll
from aqn_jax.metrics import SAMPLES_FILE
from aqn_jax.models.registry import ModelConfig, causal_lm, family_of
from aqn_jax.rewards import METHODS, score_batch
from aqn_jax.rl.sampler import Sampler, SamplingParams
from aqn_jax.rl.scoring import eval_scores
from aqn_jax.rl.sft import sft_sequences

EVAL_NOISE = "eval_noise"  # the traced relative-noise level of the noise conditions


def check_evaluate(ev: Any) -> None:
    """Raise naming the field."""
    fault = (ev.fault,) if isinstance(ev.fault, bool) else tuple(ev.fault)
    if not fault or any(not isinstance(f, bool) for f in fault):
        raise ValueError(f"config.evaluate.fault={ev.fault!r}; allowed: (False,), (True,), both")
    for fmt in tuple(ev.get("weight_formats", ())):
        if fmt not in quant_base.WEIGHT_FORMATS[1:]:
            raise ValueError(
                f"config.evaluate.weight_formats={tuple(ev.weight_formats)!r}; allowed: a tuple of"
                f" {quant_base.WEIGHT_FORMATS[1:]}"
            )
    levels = tuple(ev.noise_levels)
    if any(not 0 <= float(x) <= 1 for x in levels):
        raise ValueError(f"config.evaluate.noise_levels={levels}; each must be in [0, 1]")
    if not levels and not ev.mxfp4:
        raise ValueError(
            "config.evaluate.noise_levels=() and mxfp4=False leave no condition; use"
            " noise_levels=(0.0,) for the unperturbed device"
        )
    for field in ("size", "batch_size", "clean_size"):
        if ev.get(field, 0) < 0:
            raise ValueError(f"config.evaluate.{field}={ev[field]}; must be >= 0 (0 = default)")
    if ev.samples < 1:
        raise ValueError(f"config.evaluate.samples={ev.samples}; must be >= 1 (1 = greedy)")
    if ev.step < -1:
        raise ValueError(f"config.evaluate.step={ev.step}; must be a step >= 0 or -1 (latest)")


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What the robustness evaluation reads of an experiment config (`eval_spec`)."""

    conditions: tuple[Condition, ...]
    samples: int  # 1 = greedy; n: n completions per prompt at `temperature` (mean@n)
    batch_size: int
    loss_faults: tuple[bool, ...]  # the held-out loss with the fault off / on; () = none
    max_new_tokens: int
    temperature: float
    buckets: tuple[int, ...]
    max_prompt_len: int
    seed: int
    reward_method: str
    share_prompt: bool = True  # config.rollout.share_prompt (mean@n: one prefill per prompt)
    share_prefix: bool = True  # config.rollout.share_prefix (the prompts' common prefix once)
    retire_rows: bool = True  # config.rollout.retire_rows (greedy: finished rows retired)
    clean_size: int = 0  # config.evaluate.clean_size: the fault-off conditions' first examples


@dataclasses.dataclass(frozen=True)
class Condition:
    name: str
    fault: bool
    kind: str  # 'none' (noise level 0) | 'noise' | 'mxfp4'
    level: float = 0.0
    weights: str = "none"  # the policy's decoder linears in this format (quant_base)


def conditions(ev: Any) -> list[Condition]:
    out = []
    faults = (ev.fault,) if isinstance(ev.fault, bool) else tuple(ev.fault)
    for fault in faults:
        base = "fault" if fault else "clean"
        for level in ev.noise_levels:
            level = float(level)
            if level == 0:  # the unperturbed device (see condition_plan)
                out.append(Condition(base, fault, "none"))
            else:
                out.append(Condition(f"{base}+noise{level * 100:g}%", fault, "noise", level))
        if ev.mxfp4:
            out.append(Condition(f"{base}+mxfp4", fault, "mxfp4"))
        for fmt in tuple(ev.get("weight_formats", ())):
            out.append(Condition(f"{base}+weights_{fmt}", fault, "none", weights=fmt))
    return out


def condition_plan(hw: FaultPlan, fault: bool, kind: str) -> FaultPlan:
    """The hardware plan (or none) followed by the perturbation of every decoder linear.

    Kind 'none' (noise level 0) has no perturbation: it runs the device's own program, the one
    the trainer's validation runs. The noise program at a traced level of 0 gives the same
    greedy tokens, with log-probs within float32 rounding (it fuses differently;
    tests/test_evaluate.py checks it on one layer's linears: a level scales each site's draw),
    but it draws a Gaussian at every linear of every decode step, and
    XLA:CPU takes ~22 s to compile that sampler for the tiny model against ~1.5 s for the plain
    one."""
    base = [i for i in hw.injections if "eval" in i.phases] if fault else []
    if kind == "none":
        return FaultPlan(base)
    sites = "all"
    if kind == "noise":
        inj = Injection(
            "eval_noise",
            SiteSelector(LINEAR_KINDS, sites, "output"),
            Noise("relative_gaussian", Scale(1.0, value=EVAL_NOISE)),
            ("eval",),
        )
    else:
        inj = Injection(
            "eval_mxfp4",
            SiteSelector(LINEAR_KINDS, sites, "input"),
            Quantize("mxfp4"),
            ("eval",),
        )
    return FaultPlan([*base, inj])


def robustness(
    spec: EvalSpec,
    model_cfg: ModelConfig,
    params,
    tokenizer: Tokenizer,
    examples: Sequence[Example],
    hardware: FaultPlan,
    mesh=None,
    log=print,
    programs: dict | None = None,
) -> dict[str, Any]:
    """Accuracy (and the held-out loss) of `params` on `examples` under every condition of
    `spec`, `hardware` being the device's fault plan (its phase-'eval' injections are the
    fault). Returns {"conditions": {name: {acc, n, samples}}, "loss": {...}, "wall_time_s"}.
    `programs`: the caller's cache of compiled programs (`program`), kept between calls that
    share shapes (a study's runs); None compiles afresh."""
    t0 = time.perf_counter()
    n_layers = model_cfg.num_hidden_layers
    gen = causal_lm(dataclasses.replace(model_cfg, remat=False))
    if jnp.dtype(model_cfg.dtype) != jnp.dtype(model_cfg.param_dtype):
        params = jax.tree_util.tree_map(lambda x: x.astype(model_cfg.dtype), params)
    sp = _eval_sampling(spec, tokenizer)
    fault_key = step_key(spec.seed, 0, "eval")
    results: dict[str, Any] = {}
    samplers: dict[tuple[bool, str], Sampler] = {}
    for cond in spec.conditions:
        key = (cond.fault, cond.kind)
        if key not in samplers:
            plan = condition_plan(hardware, cond.fault, cond.kind)
            plan.validate(n_layers)
            samplers[key] = program(
                programs,
                ("sampler", gen.config, sp, spec.buckets, repr(plan.injections), mesh),
                lambda plan=plan: Sampler(gen, sp, plan, spec.buckets, phase="eval", mesh=mesh),
            )
        cut = spec.clean_size if not cond.fault and spec.clean_size else len(examples)
        results[cond.name] = _condition(
            spec, cond, samplers[key], params, model_cfg, tokenizer, examples[:cut], fault_key
        )
        n = results[cond.name]["n"]
        log(f"  {cond.name:<18} acc {results[cond.name]['acc']:.3f} (n={n})")
    out: dict[str, Any] = {"conditions": results}
    if spec.loss_faults:
        out["loss"] = {
            ("fault" if f else "clean"): heldout_loss(
                causal_lm(model_cfg),
                params,
                hardware if f else FaultPlan(),
                examples,
                tokenizer,
                spec.batch_size,
                fault_key,
                programs,
            )
            for f in spec.loss_faults
        }
    out["wall_time_s"] = time.perf_counter() - t0
    return out


def _eval_sampling(spec: EvalSpec, tokenizer: Tokenizer) -> SamplingParams:
    """Greedy with one sample, else `spec.samples` at `spec.temperature`."""
    return SamplingParams(
        max_new_tokens=spec.max_new_tokens,
        eos_id=tokenizer.eos_id,
        stop_ids=tokenizer.stop_ids,
        pad_id=tokenizer.pad_id,
        temperature=0.0 if spec.samples == 1 else spec.temperature,
        n=spec.samples,
        vocab_size=tokenizer.vocab_size,
        share_prompt=spec.share_prompt,
        share_prefix=spec.share_prefix,
        retire_rows=spec.retire_rows,
    )


def _condition(
    spec: EvalSpec, cond, sampler, params, model_cfg, tokenizer, examples, fault_key
) -> dict[str, Any]:
    """One condition's accuracy on `examples` (under every answer reading too)."""
    values = {EVAL_NOISE: np.float32(cond.level)} if cond.kind == "noise" else {}
    texts: list[str] = []
    ended: list[bool] = []
    records: list[dict[str, Any]] = []
    weights = params
    if cond.weights != "none":  # the same program over the format's weights
        weights = quant_base.fake_quantized(params, cond.weights, family_of(model_cfg).site_of)
    scores = eval_scores(
        sampler,
        weights,
        examples,
        tokenizer,
        spec.batch_size,
        spec.max_prompt_len,
        fault_key=fault_key,
        values=values,
        key=jax.random.key(spec.seed),
        texts=texts,
        method=spec.reward_method,
        ended=ended,
        records=records,
    )
    truths = [ex.ground_truth for ex in examples for _ in range(spec.samples)]
    return {
        "acc": float(np.mean(scores)),
        # The same completions under every reading (strict, flexible, boxed).
        "acc_by_reading": {
            m: float(np.mean(score_batch(texts, truths, method=m))) for m in METHODS
        },
        "n": len(scores),
        # The share of completions cut at the token budget (no EOS): answers it may have cut.
        "clipped": float(1.0 - np.mean(ended)),
        "samples": spec.samples,
        "fault": cond.fault,
        "perturbation": cond.kind,
        "level": cond.level,
        # Per problem (and sample): `write_evaluation` moves these to samples.jsonl.
        "records": [{"condition": cond.name, **r} for r in records],
    }


def write_evaluation(directory: str, result: dict[str, Any], name: str = "evaluation.json") -> str:
    """`result` (`robustness`'s) as `directory/name`, its per-problem records as
    `directory/samples.jsonl` (one line a condition's problem and sample, in order), each
    written whole; the records file first, the JSON last (its presence marks a run
    evaluated). Returns the JSON's path."""
    rows = [r for c in result["conditions"].values() for r in c.pop("records", [])]
    result["samples_file"] = SAMPLES_FILE
    write_jsonl(os.path.join(directory, SAMPLES_FILE), rows)
    path = os.path.join(directory, name)
    write_json(path, result, default=str)
    return path


def greedy_sampling(max_new_tokens: int, tokenizer: Tokenizer) -> SamplingParams:
    """Greedy decoding at the run's response length (config.rollout.max_new_tokens; accuracy
    as verl's mean@1)."""
    return SamplingParams(
        max_new_tokens=int(max_new_tokens),
        eos_id=tokenizer.eos_id,
        stop_ids=tokenizer.stop_ids,
        pad_id=tokenizer.pad_id,
        temperature=0.0,
        vocab_size=tokenizer.vocab_size,
    )


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Greedy decoding of test problems as the trainer's validation runs it (`decode_spec`)."""

    max_new_tokens: int
    buckets: tuple[int, ...]
    batch_size: int
    max_prompt_len: int
    reward_method: str


def prompt_dependence(
    spec: DecodeSpec,
    task,
    model_cfg: ModelConfig,
    params,
    tokenizer: Tokenizer,
    size: int,
    prompt_format=lambda examples: examples,
) -> dict[str, Any]:
    """Does the policy read its prompt? On the embedded task's test split (`task`, an
    `ArithmeticTask`: its numbers can be redrawn), no fault, greedy:
    - `acc`: accuracy on the first `size` problems;
    - `acc_redrawn`: accuracy on the same problems with every number drawn again
      (`ArithmeticTask.redrawn`): about `acc` for a policy that reads its numbers, far below
      for one that answers from the wording;
    - `answered_original`: among the redrawn problems whose answer changed, the share still
      answered with the original answer (a policy that reads its numbers: ~0);
    - `shared_completion`: the share of prompts whose completion is also the completion of a
      prompt with a different answer (a policy that guesses repeats itself across prompts).
    Both problem sets are asked through `prompt_format` (`data.config.with_prompt_format`).
    """
    gen = causal_lm(dataclasses.replace(model_cfg, remat=False))
    sp = greedy_sampling(spec.max_new_tokens, tokenizer)
    sampler = Sampler(gen, sp, FaultPlan(), spec.buckets, phase="eval")
    bs, limit, method = spec.batch_size, spec.max_prompt_len, spec.reward_method
    out: dict[str, Any] = {"n": size}
    texts: list[str] = []
    examples = prompt_format(task.examples("test", size))
    out["acc"] = float(
        np.mean(
            eval_scores(sampler, params, examples, tokenizer, bs, limit, texts=texts, method=method)
        )
    )
    redrawn = prompt_format(task.redrawn("test", size))
    texts_redrawn: list[str] = []
    out["acc_redrawn"] = float(
        np.mean(
            eval_scores(
                sampler, params, redrawn, tokenizer, bs, limit, texts=texts_redrawn, method=method
            )
        )
    )
    changed = [
        i
        for i, (a, b) in enumerate(zip(examples, redrawn, strict=True))
        if a.ground_truth != b.ground_truth
    ]
    stale = score_batch(
        [texts_redrawn[i] for i in changed],
        [examples[i].ground_truth for i in changed],
        method=method,
    )
    out["answered_original"] = float(np.mean(stale)) if changed else 0.0
    answers_of: dict[str, set[str]] = {}
    for text, ex in zip(texts, examples, strict=True):
        answers_of.setdefault(text.strip(), set()).add(ex.ground_truth)
    out["shared_completion"] = float(
        np.mean([len(answers_of[t.strip()]) > 1 for t in texts]) if texts else 0.0
    )
    return out


def heldout_loss(
    model: nn.Module,
    params,
    plan: FaultPlan,
    examples: Sequence[Example],
    tokenizer: Tokenizer,
    batch_size: int,
    fault_key,
    programs: dict | None = None,
) -> float:
    """Token-mean cross-entropy of the worked solutions (+ EOS) given the prompts, on the device
    of `plan` (phase 'eval'): the loss of the original system's controlled test
    (docs/ARCHITECTURE.md, "The original system's experiments"). `programs`: as in `robustness`."""
    data = sft_sequences(examples, tokenizer)

    def make():
        @jax.jit
        def batch_nll(params, ids, mask, loss_mask, key):
            return token_nll(model, params, ids, mask, loss_mask, plan=plan, phase="eval", key=key)

        return batch_nll

    batch_nll = program(programs, ("nll", model.config, model.head, repr(plan.injections)), make)
    total, count = 0.0, 0.0
    n = len(data.ids)
    for start in range(0, n, batch_size):
        sl = slice(start, start + batch_size)
        ids, mask, lm = data.ids[sl], data.mask[sl], data.loss_mask[sl]
        pad = batch_size - len(ids)
        if pad:  # one shape for every batch: padding rows carry no loss
            ids = np.concatenate([ids, np.repeat(ids[:1], pad, 0)])
            mask = np.concatenate([mask, np.repeat(mask[:1], pad, 0)])
            lm = np.concatenate([lm, np.zeros((pad, lm.shape[1]), lm.dtype)])
        s, c = batch_nll(params, ids, mask, lm, jax.random.fold_in(fault_key, start))
        total += float(s)
        count += float(c)
    return total / max(count, 1.0)


def program(programs: dict | None, key: tuple, make):
    """The jitted program (a Sampler or a jitted function) that `key` names, from the caller's
    cache `programs` (made by `make()` and kept there the first time); with no cache, a new one.
    `key` holds everything that decides the program: the model config, the sampling
    parameters, the buckets, the fault plan's injections and the mesh."""
    if programs is None:
        return make()
    if key not in programs:
        programs[key] = make()
    return programs[key]
