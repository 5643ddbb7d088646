"""Issue 19: where a deadzone flushes in rollout vs training, per scope, on the warm start.

  nice -n 10 python bench/fault_scope.py

The shipped warm start of the embedded study, its deadzone site (the residual stream after
layer 4), 64 test prompts, greedy decoding of 24 tokens. Layer 4's output before the fault
depends only on layers 0-4, so it is the same in both phases: one clean capture over prompt +
response gives it, and each phase's threshold is recomputed with the `ops` functions over the
tokens that phase's module call sees (training: the whole [B, T] tensor; cached decoding: the
prefill, then [B, 1] per step). Prints, over the real response tokens, the flushed fraction
in each phase and the share of flush decisions that differ. Also prints the amax threshold that
flushes 75% under `call` in teacher forcing (the amax operating point of the WORKSPACE table).
About a minute on 2 cores.
"""

from __future__ import annotations

import jax
import numpy as np

from aqn_jax.data.config import load_split
from aqn_jax.diagnosis.srdd import calibration_batch
from aqn_jax.experiment import arm_config
from aqn_jax.faults import ops
from aqn_jax.faults.intercept import FaultPlan, Injection
from aqn_jax.faults.sites import SiteSelector
from aqn_jax.faults.transforms import Deadzone
from aqn_jax.models.qwen2 import Qwen2ForCausalLM
from aqn_jax.rl.sampler import Sampler, SamplingParams
from aqn_jax.spec import warm_start_spec
from aqn_jax.warm_start import tokenizer_for, warm_start

LAYER = 4
SETTINGS = (
    ("quantile", 0.75, "call"),
    ("quantile", 0.75, "token"),
    ("amax", 0.2, "call"),
    ("amax", 0.2, "causal"),
    ("amax", 0.2, "token"),
)


def layer_output(model, params, ids, mask):
    _, st = model.apply(
        {"params": params},
        ids,
        attention_mask=mask,
        capture_intermediates=True,
        mutable=["intermediates"],
    )
    return np.asarray(st["intermediates"][f"layers_{LAYER}"]["__call__"][0][0])


def thresholds(h, mask, P, severity, frac, scope):
    """(training, rollout) thresholds, broadcast to h [B, L, D]."""

    def per_call(part):
        thr = ops.deadzone_threshold(part, frac, granularity="tensor", severity=severity)
        return np.broadcast_to(np.asarray(thr), part.shape)

    if scope == "token":  # one token at a time: the same in either phase
        thr = ops.deadzone_threshold(h, frac, granularity="token", severity=severity)
        return np.asarray(thr), np.asarray(thr)
    if scope == "causal":
        train = np.asarray(ops.causal_amax(h, mask)[0]) * frac
        amax, prior = ops.causal_amax(h[:, :P], mask[:, :P])
        parts = [np.asarray(amax)]
        for t in range(P, h.shape[1]):
            amax, prior = ops.causal_amax(h[:, t : t + 1], mask[:, t : t + 1], prior)
            parts.append(np.asarray(amax))
        return train, np.concatenate(parts, 1) * frac
    steps = [per_call(h[:, t : t + 1]) for t in range(P, h.shape[1])]
    return per_call(h), np.concatenate([per_call(h[:, :P]), *steps], 1)


def main():
    config = arm_config("deadzone")
    model_cfg, params, _ = warm_start(
        warm_start_spec(config), "/tmp/fault_scope_bench", verbose=False
    )
    tokenizer = tokenizer_for(config.tokenizer_path, config.model.hf_path, model_cfg.vocab_size)
    model = Qwen2ForCausalLM(model_cfg)
    examples = load_split(config.data, "test")[:128]
    ids, mask = calibration_batch(examples, tokenizer, 64, config.rollout.max_prompt_len)
    P = ids.shape[1]

    h = np.abs(layer_output(model, params, ids, mask))[mask > 0]
    print(
        f"amax threshold flushing 75% (call, teacher forcing): {np.quantile(h, 0.75) / h.max():.3f}"
    )

    sp = SamplingParams(
        24,
        eos_id=tokenizer.eos_id,
        stop_ids=tokenizer.stop_ids,
        pad_id=tokenizer.pad_id,
        temperature=0.0,
    )
    print(
        "| setting | scope | flushed, rollout | flushed, training | flush decisions that differ |"
    )
    print("|---|---|---|---|---|")
    for severity, frac, scope in SETTINGS:
        dz = Deadzone(frac, severity=severity, scope=scope)
        plan = FaultPlan([Injection("dz", SiteSelector(("layer",), (LAYER,), "output"), dz)])
        sampler = Sampler(model, sp, plan, buckets=(P,), phase="eval")
        out = sampler(params, ids, mask, jax.random.key(0))
        L = P + int(out.response_mask.any(0).sum())  # the decode steps the loop ran
        full = np.concatenate([out.prompt_ids, out.tokens], 1)[:, :L]
        fmask = np.concatenate([out.prompt_mask, out.response_mask], 1)[:, :L]
        h = layer_output(model, params, full, fmask)  # clean: before the fault
        train, rollout = thresholds(h, fmask, P, severity, frac, scope)
        real = np.zeros(fmask.shape, bool)
        real[:, P:] = fmask[:, P:] > 0  # the response tokens the drift metric covers
        f_train, f_roll = (np.abs(h) < train)[real], (np.abs(h) < rollout)[real]
        print(
            f"| {severity} {frac:g} | {scope} | {f_roll.mean():.3f} | {f_train.mean():.3f} |"
            f" {np.mean(f_train != f_roll):.3f} |"
        )


if __name__ == "__main__":
    main()
