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
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse
import statistics
import sys
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
from aqn_jax.data.gsm8k import left_pad  # noqa: E402
from aqn_jax.data.tokenizers import load_tokenizer  # noqa: E402
from aqn_jax.models.hf import load_hf_checkpoint  # noqa: E402
from aqn_jax.models.qwen2 import Qwen2ForCausalLM  # noqa: E402


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


if __name__ == "__main__":
    main()
