"""The real Qwen2.5-Coder-0.5B GRPO step at the arith operating point, with the step-cost levers
off and on, on the same batch.

  python bench/real_step.py --hf-path=/models/qwen05 [--settings off,on] [--reps 2] [--record]
  python bench/real_step.py --hf-path=/models/qwen05 --validation=128   # the validation's prefill

The config is `configs/qwen2p5_coder_0p5b_gsm8k.py:deadzone,arith` (4 prompts x 8 samples, the
192-token prompt bucket, 64 new tokens, LoRA r32, the per-token deadzone at layer 15,
`dtype=auto`). Settings, each in its own process (its peak RSS its own), interleaved over the
repetitions (off, on, off, on, ...):
  off      config.rollout.share_prompt, config.actor.share_prompt, skip_zero_advantage False
  on       all three True (the defaults)
  rollout / share / skip   only that lever on
The first process draws one rollout of the train split's first batch and saves it (prompts,
responses, masks, sampler log-probs); every process then, after compiling its programs
(`Trainer.compile_step`, not timed):
  * generation: the rollout of the same prompts with the same keys (the decode is the same
    program either way; with share_prompt the prefill runs once per prompt);
  * the update (prepare + update) on the saved batch twice, with the rewards set so that
    2 of the 4 groups are silent (all 0: the arith run's median share of groups with a
    signal, 0.5), then with no silent group.
Prints each process's seconds, and per setting the median over the repetitions, then
`BENCH real_step ratio=<off step s / on step s>` (step = generation + update at half silent),
with the ratio at no silent group, the rows with a signal and the peak RSS. `--record` appends
the table to WORKSPACE.md with the CPU's flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

SETTINGS = {
    "off": (False, False, False),
    "on": (True, True, True),
    "rollout": (True, False, False),
    "share": (False, True, False),
    "skip": (False, False, True),
}
# Rewards per group of 8: two groups silent (all 0), two with a signal; and none silent.
HALF = np.array([1, 0, 1, 0, 0, 1, 0, 0] * 2 + [0] * 16, np.float32)
NONE = np.array([1, 0, 1, 0, 0, 1, 0, 0] * 4, np.float32)


def _config(hf_path: str, setting: str):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
    import qwen2p5_coder_0p5b_gsm8k as preset

    config = preset.get_config("deadzone,arith")
    config.model.hf_path = hf_path
    rollout, share, skip = SETTINGS[setting]
    config.rollout.share_prompt = rollout
    config.actor.share_prompt = share
    config.actor.skip_zero_advantage = skip
    return config


def child(args) -> None:
    """One setting in this process: compile, then time generation and the two updates."""
    import jax

    from aqn_jax import training
    from aqn_jax.rl import step as rl_step
    from aqn_jax.rl.trainer import train_batch

    config = _config(args.hf_path, args.child)
    with tempfile.TemporaryDirectory() as workdir:
        r, state = training._set_up(config, workdir)
    loop, static = r.loop, r.static
    batch = loop.batcher.next_batch()
    loop.compile_step(state, batch, 1)
    weights = rl_step.policy_weights(static, state)
    t0 = time.perf_counter()
    out = loop.rollout(weights, batch, 1)
    t_gen = time.perf_counter() - t0
    if not os.path.exists(args.batch):  # the first process: the batch every process updates on
        tb = train_batch(out, HALF)
        np.savez(args.batch, **tb)
    saved = dict(np.load(args.batch))
    result = {"setting": args.child, "gen_s": t_gen, "levers_off": list(static.levers_off)}
    for name, scores in (("half", HALF), ("none", NONE)):
        tb = {**saved, "scores": scores}
        got = loop._train(state, 1, tb, 0)
        jax.block_until_ready(got.state.params)
        state = got.state
        result[f"prepare_{name}_s"] = got.t_prep + got.t_corr
        result[f"update_{name}_s"] = got.t_upd
        result[f"rows_{name}"] = got.mets.get("actor/rows_updated", float(len(scores)))
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print("RESULT " + json.dumps(result), flush=True)


def validation(args) -> None:
    """A greedy validation of `--validation` held-out problems on the clean device (the
    config's batch of 32), timed in full (64 new tokens) and as its prefill alone (one new
    token: the prefill and one decode step), each after a compile; and how many of the prompt
    tokens every problem shares at its start and end (the chat template, the worked example,
    the instruction)."""
    from aqn_jax import compute_dtype
    from aqn_jax.data.config import load_split
    from aqn_jax.evaluation import greedy_sampling
    from aqn_jax.models.hf import load_hf_checkpoint
    from aqn_jax.models.registry import causal_lm
    from aqn_jax.rl.sampler import Sampler
    from aqn_jax.rl.scoring import eval_scores
    from aqn_jax.warm_start import tokenizer_for

    config = _config(args.hf_path, "on")
    dtype = compute_dtype.choose()[0]  # config.model.dtype='auto'
    model_cfg, params = load_hf_checkpoint(args.hf_path, dtype)
    tok = tokenizer_for(config.tokenizer_path, config.model.hf_path, model_cfg.vocab_size)
    test = load_split(config.data, "test")[: args.validation]
    ids = [tok.encode_chat(ex.prompt_messages) for ex in test]
    head = next(i for i in range(min(map(len, ids))) if any(x[i] != ids[0][i] for x in ids))
    tail = next(i for i in range(1, min(map(len, ids))) if any(x[-i] != ids[0][-i] for x in ids))
    model_cfg = dataclasses.replace(model_cfg, remat=False)
    seconds = {}
    for new in (64, 1):
        sampler = Sampler(
            causal_lm(model_cfg),
            greedy_sampling(new, tok),
            buckets=tuple(config.rollout.prompt_buckets),
            phase="eval",
        )
        bs, width = int(config.trainer.val_batch_size), int(config.rollout.max_prompt_len)
        eval_scores(sampler, params, test[:bs], tok, bs, width)  # compile
        t0 = time.perf_counter()
        eval_scores(sampler, params, test, tok, bs, width)
        seconds[new] = time.perf_counter() - t0
    lens = sorted(map(len, ids))
    print(
        f"VALIDATION problems={len(test)} dtype={dtype} full_s={seconds[64]:.1f}"
        f" prefill_s={seconds[1]:.1f} prefill_share={seconds[1] / seconds[64]:.2f}"
        f" prompt_tokens={lens[0]}-{lens[-1]} (median {lens[len(lens) // 2]})"
        f" common_prefix={head} common_suffix={tail - 1}"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf-path", required=True)
    p.add_argument("--settings", default="off,on")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--record", action="store_true")
    p.add_argument(
        "--validation", type=int, default=0, help="time a greedy validation of this many problems"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.validation:
        return validation(args)
    settings = args.settings.split(",")
    bad = [s for s in settings if s not in SETTINGS]
    if bad or not os.path.isdir(args.hf_path):
        sys.exit(
            f"--settings={args.settings!r} (allowed: {tuple(SETTINGS)}) or --hf-path not a dir"
        )
    sys.path.insert(0, os.path.dirname(__file__))
    from common import check_load, cpu_description, cpu_flags, record

    load = check_load()
    results: dict[str, list[dict]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        batch = os.path.join(tmp, "batch.npz")
        for rep in range(args.reps):
            for s in settings:
                cmd = [sys.executable, __file__, f"--hf-path={args.hf_path}", f"--child={s}"]
                proc = subprocess.run(
                    [*cmd, f"--batch={batch}"], capture_output=True, text=True, check=False
                )
                line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode or not line:
                    sys.exit(f"setting {s} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                res = json.loads(line[0][7:])
                print(f"rep {rep} {s}: " + json.dumps(res), flush=True)
                results[s].append(res)

    def med(s, k):
        return float(np.median([r[k] for r in results[s]]))

    table = [
        "| setting | gen s | prepare+update s (2 of 4 groups silent) | rows run | step s | "
        "prepare+update s (none silent) | step s (none silent) | peak RSS GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    steps = {}
    for s in settings:
        half = med(s, "prepare_half_s") + med(s, "update_half_s")
        none = med(s, "prepare_none_s") + med(s, "update_none_s")
        steps[s] = (med(s, "gen_s") + half, med(s, "gen_s") + none)
        table.append(
            f"| {s} | {med(s, 'gen_s'):.1f} | {half:.1f} | {med(s, 'rows_half'):.0f} |"
            f" {steps[s][0]:.1f} | {none:.1f} | {steps[s][1]:.1f} |"
            f" {max(r['peak_rss_gib'] for r in results[s]):.2f} |"
        )
    print("\n".join(table))
    if "off" in steps and "on" in steps:
        ratio = steps["off"][0] / steps["on"][0]
        ratio_none = steps["off"][1] / steps["on"][1]
        rss = [max(r["peak_rss_gib"] for r in results[s]) for s in ("off", "on")]
        print(
            f"BENCH real_step ratio={ratio:.2f} ratio_none_silent={ratio_none:.2f}"
            f" step_off_s={steps['off'][0]:.1f} step_on_s={steps['on'][0]:.1f}"
            f" rss_off_gib={rss[0]:.2f} rss_on_gib={rss[1]:.2f} reps={args.reps}"
        )
    if args.record:
        intro = (
            f"The real 0.5B arith step, levers off/on on one batch ({args.reps} reps,"
            f" interleaved, medians); CPU flags: {cpu_flags()}; {cpu_description()};"
            f" load before: {load}."
        )
        record("bench/real_step.py", intro, table)


if __name__ == "__main__":
    main()
