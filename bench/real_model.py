"""Our forward and greedy decode against transformers on a real pretrained LM (SmolLM2-135M-
Instruct, llama, 30 layers): logit parity on chat prompts, prefill tokens/s and greedy-decode
tokens/s at batch 8, on the same weights.

  python -m aqn_jax.models.gguf --out=/tmp/smollm2          # once (needs '.[gguf]')
  python bench/real_model.py --hf-path=/tmp/smollm2 [--batch 8] [--new-tokens 64] [--record]

Method:
  * Weights: the snapshot, loaded by our loader (`load_hf_checkpoint`) and by
    `transformers.AutoModelForCausalLM.from_pretrained(snapshot, dtype=float32)` (sdpa).
  * Parity: `batch` chat-formatted prompts of the embedded task (the model's ChatML template,
    left-padded to the longest), logits at every real position; max |diff| and argmax
    agreement.
  * Prefill: a full forward (logits at every position) of those left-padded prompts; ours
    jitted, torch `inference_mode`; tokens/s = real (unpadded) prompt tokens / wall time.
  * Greedy decode: `bench/generate.py`'s `bench_batch` on `--prompt-len` random token ids per
    row (full mask), exactly `--new-tokens` new tokens per row on both sides (eos can never be
    produced), prefill included; new tokens/s = B * N / wall time.
  * Timed calls alternate in blocks, the first of each block dropped; medians. torch runs with
    `torch.set_num_threads(cpu_count)` (`torch_ref.setup_torch`); the load before the run is
    printed.

Prints `BENCH real_prefill_b<B> ratio=<ours/torch tok/s>` and `BENCH real_decode_b<B>
ratio=<ours/torch new tok/s>`; with --record a table goes to WORKSPACE.md.

With `--gsm8k=DIR` (a directory holding GSM8K's test.jsonl) it measures greedy accuracy instead,
on real problems, as a user would run them:

  python bench/real_model.py --hf-path=/tmp/qwen05 --gsm8k=../shared/datasets/gsm8k \
      [--problems 16] [--batch 8] [--new-tokens 320] [--record]

  * the first `--problems` test problems in the model's chat template, left-padded, in batches
    of `--batch`; both sides decode greedily until every row has emitted the tokenizer's eos
    (or `--new-tokens`), ours with the Sampler (one program per batch shape), transformers with
    `generate(do_sample=False)`;
  * the completions are scored with verl's strict and flexible readings and the boxed one
    (aqn_jax/rewards.py); the share of identical completions is printed;
  * tokens/s = generated tokens (up to and including eos) / wall time of the whole set; ours is
    timed on its second pass (the first compiles), transformers on its only pass (a second
    would take as long again: ~5 tok/s per row on 2 cores).

Prints `BENCH real_gsm8k_b<B> ratio=<ours/torch tok/s> ours_acc_boxed=... torch_acc_boxed=...`.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import check_load, cpu_description, record, time_calls  # noqa: E402
from generate import BLOCKS, bench_batch  # noqa: E402
from torch_ref import setup_torch  # noqa: E402

from aqn_jax.data.arithmetic import ArithmeticTask  # noqa: E402
from aqn_jax.data.gsm8k import left_pad, load_examples  # noqa: E402
from aqn_jax.data.tokenizers import load_tokenizer  # noqa: E402
from aqn_jax.models.hf import load_hf_checkpoint  # noqa: E402
from aqn_jax.models.qwen2 import Qwen2ForCausalLM  # noqa: E402
from aqn_jax.rewards import METHODS, score_batch  # noqa: E402
from aqn_jax.rl.sampler import Sampler, SamplingParams  # noqa: E402


def chat_batch(tok, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """`batch` test prompts of the embedded task in the model's chat format, left-padded."""
    examples = ArithmeticTask().examples("test", batch)
    return left_pad([tok.encode_chat(ex.prompt_messages) for ex in examples], tok.pad_id)


def alternate(ours, theirs, repeats: int) -> tuple[float, float]:
    a, b = [], []
    block = max(1, (repeats + BLOCKS - 1) // BLOCKS)
    while len(a) < repeats:
        a += time_calls(ours, block + 1)[1:]
        b += time_calls(theirs, block + 1)[1:]
    return statistics.median(a[:repeats]), statistics.median(b[:repeats])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-path", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--gsm8k", default="", help="GSM8K directory: greedy accuracy mode")
    ap.add_argument("--problems", type=int, default=16)
    args = ap.parse_args()
    setup_torch()
    load = check_load()
    print(cpu_description(), load)

    cfg, params = load_hf_checkpoint(args.hf_path)
    model = Qwen2ForCausalLM(cfg)
    weights = jax.device_put(params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.hf_path, dtype=torch.float32)
    hf.eval()
    tok = load_tokenizer(args.hf_path)
    if args.gsm8k:
        return gsm8k_greedy(args, cfg, model, weights, hf, tok, load)
    ids, mask = chat_batch(tok, args.batch)
    real = mask.astype(bool)

    fwd = jax.jit(lambda p, i, m: model.apply({"params": p}, i, attention_mask=m))
    t_ids, t_mask = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.int64))

    def ours():
        return fwd(weights, ids, mask).block_until_ready()

    def theirs():
        with torch.inference_mode():
            return hf(input_ids=t_ids, attention_mask=t_mask, logits_to_keep=0).logits

    a, b = np.asarray(ours()), theirs().numpy()
    diff = float(np.abs(a - b)[real].max())
    same_argmax = float((a.argmax(-1) == b.argmax(-1))[real].mean())
    print(
        f"parity on {args.batch} chat prompts ({int(mask.sum())} tokens, width {ids.shape[1]}):"
        f" max |logit diff| {diff:.2e} (max |logit| {np.abs(b).max():.1f}), argmax equal"
        f" {same_argmax:.4f}"
    )
    pre_ours, pre_torch = alternate(ours, theirs, args.repeats)
    n_real = int(mask.sum())
    print(f"prefill: ours {pre_ours:.4f}s, torch {pre_torch:.4f}s")

    d = bench_batch(
        cfg, model, weights, hf, "smollm2", args.batch, args.prompt_len, args.new_tokens,
        args.repeats,
    )  # fmt: skip
    lines = [
        f"BENCH real_prefill_b{args.batch} ratio={pre_torch / pre_ours:.3f}"
        f" ours_tok_s={n_real / pre_ours:.1f} torch_tok_s={n_real / pre_torch:.1f}"
        f" tokens={n_real} max_logit_diff={diff:.2e}",
        f"BENCH real_decode_b{args.batch} ratio={d['ours_tok_s'] / d['torch_tok_s']:.3f}"
        f" ours_tok_s={d['ours_tok_s']:.1f} torch_tok_s={d['torch_tok_s']:.1f}"
        f" new_tokens={args.new_tokens} prompt={args.prompt_len}"
        f" same_tokens={d['same_tokens']:.3f}",
    ]
    for line in lines:
        print(line)
    if args.record:
        table = [
            "| what | B | ours s | torch s | ours tok/s | torch tok/s | ratio |",
            "|---|---|---|---|---|---|---|",
            f"| prefill ({n_real} chat tokens, width {ids.shape[1]}) | {args.batch} |"
            f" {pre_ours:.3f} | {pre_torch:.3f} | {n_real / pre_ours:.0f} |"
            f" {n_real / pre_torch:.0f} | {pre_torch / pre_ours:.2f} |",
            f"| greedy decode ({args.prompt_len} + {args.new_tokens} new) | {args.batch} |"
            f" {d['ours_s']:.3f} | {d['torch_s']:.3f} | {d['ours_tok_s']:.1f} |"
            f" {d['torch_tok_s']:.1f} | {d['ours_tok_s'] / d['torch_tok_s']:.2f} |",
        ]
        parity = f"max |diff| {diff:.2e}, argmax equal {same_argmax:.4f}"
        how = f"f32, median of {args.repeats} calls per side, alternating blocks, load {load}"
        same = f"same greedy tokens {d['same_tokens']:.3f}"
        intro = f"SmolLM2-135M-Instruct ({args.hf_path}); {how}; parity {parity}; decode {same}."
        record("bench/real_model.py", intro, [*(f"`{x}`" for x in lines), "", *table])
        print("recorded in WORKSPACE.md")


def gsm8k_greedy(args, cfg, model, weights, hf, tok, load: str) -> None:
    """Greedy accuracy and generation speed on the first `args.problems` GSM8K test problems,
    ours against transformers `generate`, on the same weights and prompts."""
    examples = load_examples(Path(args.gsm8k) / "test.jsonl")[: args.problems]
    batches = []
    for start in range(0, len(examples), args.batch):
        chunk = examples[start : start + args.batch]
        batches.append(left_pad([tok.encode_chat(ex.prompt_messages) for ex in chunk], tok.pad_id))
    width = max(ids.shape[1] for ids, _ in batches)
    sp = SamplingParams(
        args.new_tokens,
        eos_id=tok.eos_id,
        stop_ids=tok.stop_ids,
        pad_id=tok.pad_id,
        temperature=0.0,
        vocab_size=tok.vocab_size,
    )
    sampler = Sampler(model, sp, buckets=(width,))  # one program: every batch padded to `width`
    key = jax.random.key(0)

    def ours() -> list[list[int]]:
        out = []
        for ids, mask in batches:
            res = sampler(weights, ids, mask, key)
            out += [t[m > 0].tolist() for t, m in zip(res.tokens, res.response_mask, strict=True)]
        return out

    def theirs() -> list[list[int]]:
        out = []
        for ids, mask in batches:
            with torch.inference_mode():
                ref = hf.generate(
                    input_ids=torch.from_numpy(ids.astype(np.int64)),
                    attention_mask=torch.from_numpy(mask.astype(np.int64)),
                    max_new_tokens=args.new_tokens,
                    do_sample=False,
                    eos_token_id=tok.eos_id,
                    pad_token_id=tok.pad_id,
                )
            for row in ref[:, ids.shape[1] :].numpy().tolist():
                end = row.index(tok.eos_id) + 1 if tok.eos_id in row else len(row)
                out.append(row[:end])
        return out

    t0 = time.perf_counter()
    ours()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    mine = ours()
    ours_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = theirs()
    torch_s = time.perf_counter() - t0
    truths = [ex.ground_truth for ex in examples]
    acc = {}
    for side, toks in (("ours", mine), ("torch", ref)):
        texts = [tok.decode(t) for t in toks]
        acc[side] = {m: float(np.mean(score_batch(texts, truths, method=m))) for m in METHODS}
    same = float(np.mean([a == b for a, b in zip(mine, ref, strict=True)]))
    n_ours, n_torch = sum(map(len, mine)), sum(map(len, ref))
    print(f"ours: compile + first pass {first:.1f}s, second {ours_s:.1f}s; torch {torch_s:.1f}s")
    line = (
        f"BENCH real_gsm8k_b{args.batch} ratio={(n_ours / ours_s) / (n_torch / torch_s):.3f}"
        f" ours_tok_s={n_ours / ours_s:.1f} torch_tok_s={n_torch / torch_s:.1f}"
        f" problems={len(examples)} new_tokens={args.new_tokens} same_completions={same:.3f}"
        + "".join(f" ours_acc_{m}={acc['ours'][m]:.3f}" for m in METHODS)
        + "".join(f" torch_acc_{m}={acc['torch'][m]:.3f}" for m in METHODS)
    )
    print(line)
    if args.record:
        table = [
            "| side | s | generated tokens | tok/s | " + " | ".join(METHODS) + " |",
            "|---|---|---|---|" + "---|" * len(METHODS),
        ]
        for side, s, n in (("ours", ours_s, n_ours), ("torch", torch_s, n_torch)):
            table.append(
                f"| {side} | {s:.1f} | {n} | {n / s:.1f} | "
                + " | ".join(f"{acc[side][m]:.3f}" for m in METHODS)
                + " |"
            )
        intro = (
            f"{args.hf_path}; the first {len(examples)} GSM8K test problems, greedy, batch"
            f" {args.batch}, up to {args.new_tokens} new tokens, eos stops a row; f32; load"
            f" {load}; identical completions {same:.3f}; ours timed on its second pass"
            f" (first, with compile: {first:.1f} s)."
        )
        record("bench/real_model.py --gsm8k", intro, [f"`{line}`", "", *table])
        print("recorded in WORKSPACE.md")


if __name__ == "__main__":
    main()
