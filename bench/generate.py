"""Generation throughput of our jitted sampler vs transformers' `model.generate` (PyTorch CPU).

Purpose: on the same CPU, config and random weights, the new tokens per second of
`aqn_jax.rl.sampler.Sampler` (one jitted program: prefill + `lax.while_loop` of single-token
steps over a preallocated KV cache) against `transformers.Qwen2ForCausalLM.generate` (KV cache
on, greedy), for the `tiny` preset at batch 64 and the Qwen2.5-0.5B architecture at batch 8
(batch 32 on request), each in f32 and in bf16; for 0.5B also as a percentage of the time floor
this machine sets (memory bandwidth and the matmul peak of the case's dtype, measured in the
same process). Targets (issue 32): >= 60% of the floor at 0.5B batch 8, and >= 2x transformers
generate; the whole default run within 10 minutes on 2 cores.

Command (from the repository root):

    .venv/bin/python bench/generate.py [--configs tiny:64,qwen2p5_0p5b:8]
        [--dtypes float32,bfloat16] [--repeats R] [--prompt-len 32] [--new-tokens 64] [--record]

Method:
  * Weights: `common.random_params` (N(0, 0.02) f32, RMSNorm weights 1.0), written with
    `save_hf_checkpoint` into a temporary directory and loaded by
    `transformers.Qwen2ForCausalLM.from_pretrained(dir, dtype=torch.float32)`, so both
    frameworks hold identical weights. Consecutive configs of one preset share the weights and
    the torch models; everything is freed (del, gc.collect, jax.clear_caches) between configs.
  * dtype bfloat16: the inference engines' bf16 weights on both sides. Ours: the model config's
    `dtype='bfloat16'` (bf16 matmul inputs, f32 accumulation, softmax and logits; a bf16 KV
    cache) with the weights cast to bf16 once outside the timed call, as the trainer's
    `generation_weights` does; torch: the same f32 model `.to(torch.bfloat16)` (bf16 weights,
    activations and KV cache). Tokens are compared within a dtype.
  * Prompts: `--prompt-len` random token ids per row, all rows the same length, full attention
    mask (left padding would be a no-op).
  * Ours: `Sampler(model, SamplingParams(new_tokens, eos_id=-1, pad_id=0, temperature=0.0,
    vocab_size=None), buckets=(prompt_len,))`: greedy, the bucket is the prompt length exactly
    and eos_id -1 can never be produced, so the loop never exits early. Timed: the whole
    `sampler(weights, ids, mask, key)` call, outputs copied to host.
  * Torch: `torch.set_num_threads(os.cpu_count())`, `model.eval()`, `torch.inference_mode()`,
    `generate(input_ids, attention_mask, max_new_tokens=N, min_new_tokens=N, do_sample=False,
    use_cache=True, pad_token_id=0, eos_token_id=vocab_size)`: default attention (sdpa) and
    dynamic KV cache. eos_token_id = vocab_size cannot be produced either, so the min-length
    processor masks no logit and both sides take the argmax over the same logits.
  * Both sides must generate exactly N tokens per row: asserted (`response_mask.sum() == B*N`,
    torch output length prompt_len + N).
  * One warm-up call per framework (compile of ours excluded); its tokens are compared: the
    fraction of identical tokens over all B x N positions (random-weight models have near-ties,
    and one flipped argmax changes the rest of that row, so full agreement is not required),
    and the fraction of rows that agree on their first 4 tokens.
  * Timed calls alternate in blocks (ours x k, torch x k, ...; the first call of each block is
    dropped: torch's OpenMP threads spin after a call and slow an XLA call that follows at
    once); median of R calls per framework (default R = 3, 2 for 0.5B at batch 32).
  * new tokens/s = B * N / wall time of the whole call, PREFILL INCLUDED. Ratio = ours / torch.
  * Machine floor (0.5B, printed for every preset but tiny): read bandwidth = best of 5 full
    sums over a 1 GiB f32 array (jitted `jnp.sum` and `torch.sum`, the larger); f32 peak = best
    of 7 2048x2048 matmuls (jitted `jnp.dot` and `torch.mm`, the larger). Per decode step
    (one new token per row, attending over the c tokens in the cache incl. itself):
    max(bytes / bandwidth, FLOPs / peak) with bytes = (4 in f32, 2 in bf16) * all params
    (embedding/lm_head tied, counted once) + the K and V of c tokens of every layer and row in
    the same dtype, the peak that dtype's (bf16: 2048x2048 bf16 products, f32 accumulation),
    FLOPs = 2 * params * B +
    4 * B * layers * heads * head_dim * c (scores and probs @ V). Prefill: max(weights bytes /
    bandwidth, FLOPs / peak), FLOPs = 2 * params * B * P (the lm_head for the last position
    only: generation needs no other logits) + causal attention. The whole call:
    prefill + N - 1 decode steps (the prefill's logits give the first token; a program that
    ran N decode steps does one whose logits are never used). % of floor = floor / time * 100.
    (The first record, 2026-11-22, counted the prefill's lm_head for every prompt position,
    a floor ~7% higher for 0.5B b8 and ~10% for b32.)
  * The 1-min load average before the run is printed (and recorded), WARNING above 0.5.

Prints informational lines as it goes (load, bandwidth and peak, compile time, token
agreement, times), then per config exactly one line

    BENCH generate_<preset>_b<B>[_bf16] ratio=<ours/torch> ours_tok_s=.. torch_tok_s=..
        [pct_floor_ours=.. pct_floor_torch=..] same_tokens=<fraction> new_tokens=64 prompt=32

(on one line; the pct_floor fields for every preset but tiny), and per config with both dtypes
`BENCH generate_<preset>_b<B>_best ratio=<ours' best / torch's best>` naming each side's
dtype. With --record (only then) a markdown table is appended to WORKSPACE.md via
`common.record`.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse
import dataclasses
import gc
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from common import (
    check_load,
    cpu_flags,
    floor_seconds,
    random_params,
    record,
    time_calls,
)
from torch_ref import matmul_peaks, setup_torch

from aqn_jax.models.hf import save_hf_checkpoint
from aqn_jax.models.qwen2 import PRESETS, Qwen2Config, Qwen2ForCausalLM
from aqn_jax.rl.sampler import Sampler, SamplingParams

# The default run must finish within 10 minutes on 2 cores (issue 32): 0.5B at batch 32 is on
# request only, and 0.5B cases time 2 calls per side (each call decodes 64 tokens x 8 rows).
DEFAULT_CONFIGS = "tiny:64,qwen2p5_0p5b:8"
DEFAULT_DTYPES = "float32,bfloat16"
DEFAULT_REPEATS = 3
DEFAULT_REPEATS_SPECIAL = {("qwen2p5_0p5b", 8): 2, ("qwen2p5_0p5b", 32): 2}
BLOCKS = 3  # timed blocks per framework
PAD_ID = 0
FIRST_STEPS = 4  # rows agreeing on their first tokens are reported for this many steps
BW_BYTES = 2**30
BW_TRIES = 5


# --- machine floor ------------------------------------------------------------------------------
def best_time(fn, tries: int) -> float:
    fn()  # warm-up (compile)
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth() -> tuple[float, float]:
    """GB/s of a full sum over a 1 GiB f32 array: (jitted jnp.sum, torch.sum)."""
    a = np.random.default_rng(0).standard_normal(BW_BYTES // 4, dtype=np.float32)
    t_xla = _time_sum_xla(a)
    gc.collect()  # the device copy is gone before torch's pass
    with torch.inference_mode():
        ta = torch.from_numpy(a)  # shares a's memory
        t_torch = best_time(lambda: torch.sum(ta), BW_TRIES)
    return BW_BYTES / t_xla / 1e9, BW_BYTES / t_torch / 1e9


def _time_sum_xla(a: np.ndarray) -> float:
    ja = jax.device_put(a)
    total = jax.jit(jnp.sum)
    return best_time(lambda: total(ja).block_until_ready(), BW_TRIES)


# --- one preset ---------------------------------------------------------------------------------
def bench_batch(cfg, model, weights, hf, name, batch, prompt, new, repeats, dtype) -> dict:
    """Time ours and torch on one batch size in one dtype; the models are built by the caller."""
    name = name if dtype == "float32" else f"{name} {dtype}"
    V = cfg.vocab_size
    rng = np.random.default_rng(batch)
    ids = rng.integers(0, V, size=(batch, prompt), dtype=np.int32)
    mask = np.ones((batch, prompt), np.int32)

    sampler = Sampler(
        model,
        SamplingParams(new, eos_id=-1, pad_id=PAD_ID, temperature=0.0, vocab_size=None),
        buckets=(prompt,),
    )
    key = jax.random.key(0)

    def ours():
        return sampler(weights, ids, mask, key)

    t_ids, t_mask = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.int64))

    def theirs():
        with torch.inference_mode():
            return hf.generate(
                input_ids=t_ids,
                attention_mask=t_mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                use_cache=True,
                pad_token_id=PAD_ID,
                eos_token_id=V,  # cannot be produced: no early stop, no logit masked
            )

    t0 = time.perf_counter()
    out = ours()
    print(f"{name} b{batch}: ours compile + first call {time.perf_counter() - t0:.1f}s")
    assert out.tokens.shape == (batch, new), out.tokens.shape
    assert int(out.response_mask.sum()) == batch * new, int(out.response_mask.sum())
    ours_tokens = out.tokens.copy()
    t0 = time.perf_counter()
    ref = theirs()
    print(f"{name} b{batch}: torch first call {time.perf_counter() - t0:.1f}s")
    assert tuple(ref.shape) == (batch, prompt + new), tuple(ref.shape)
    assert np.array_equal(ref[:, :prompt].numpy(), ids)
    torch_tokens = ref[:, prompt:].numpy()
    same = ours_tokens == torch_tokens
    same_tokens = float(same.mean())
    first_rows = float(same[:, :FIRST_STEPS].all(axis=1).mean())
    per_step = same.mean(axis=0)
    print(
        f"{name} b{batch}: identical tokens {same_tokens:.4f} of {batch}x{new};"
        f" rows identical on the first {FIRST_STEPS} steps {first_rows:.3f};"
        f" per step (first 8) {[round(float(x), 3) for x in per_step[:8]]}"
    )
    if per_step[0] < 0.9:
        print(f"WARNING: only {per_step[0]:.3f} of the first tokens agree between frameworks")
    del out, ref

    # Blocks, first call of each dropped (see bench/forward.py).
    ours_times, torch_times = [], []
    block = max(1, (repeats + BLOCKS - 1) // BLOCKS)
    while len(ours_times) < repeats:
        ours_times += time_calls(ours, block + 1)[1:]
        torch_times += time_calls(theirs, block + 1)[1:]
    ours_times, torch_times = ours_times[:repeats], torch_times[:repeats]
    print(
        f"{name} b{batch}: ours times {[round(t, 3) for t in ours_times]} s,"
        f" torch times {[round(t, 3) for t in torch_times]} s",
        flush=True,
    )
    ours_s, torch_s = statistics.median(ours_times), statistics.median(torch_times)
    return dict(
        preset=name.split()[0],
        dtype=dtype,
        batch=batch,
        repeats=repeats,
        ours_s=ours_s,
        torch_s=torch_s,
        ours_tok_s=batch * new / ours_s,
        torch_tok_s=batch * new / torch_s,
        same_tokens=same_tokens,
        first_rows=first_rows,
    )


def bench_preset(name, batches, repeats_of, prompt, new, dtypes, bw, peaks) -> list[dict]:
    cfg = Qwen2Config.preset(name)
    t0 = time.perf_counter()
    params_np = random_params(cfg)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params_np))
    print(f"{name}: {n_params / 1e6:.1f}M params, built in {time.perf_counter() - t0:.1f}s")
    # The checkpoint directory lives until the torch model is gone (its weights may be
    # memory-mapped from the safetensors file).
    ckpt_dir = tempfile.TemporaryDirectory(prefix="bench_generate_")
    save_hf_checkpoint(ckpt_dir.name, cfg, params_np)
    sides = {}  # dtype -> (our model, our weights, torch model)
    for dtype in dtypes:
        hf = transformers.Qwen2ForCausalLM.from_pretrained(
            ckpt_dir.name, dtype=getattr(torch, dtype)
        )
        hf.eval()
        print(f"{name} {dtype}: torch attn_implementation={hf.config._attn_implementation}")
        model = Qwen2ForCausalLM(dataclasses.replace(cfg, dtype=dtype))
        weights = jax.device_put(params_np)
        if dtype != "float32":  # the generation weights: one cast, outside the timed calls
            weights = jax.tree_util.tree_map(lambda x, dt=dtype: x.astype(dt), weights)
        sides[dtype] = (model, weights, hf)
    del params_np
    gc.collect()

    results = []
    for batch in batches:
        for dtype in dtypes:
            model, weights, hf = sides[dtype]
            r = bench_batch(
                cfg, model, weights, hf, name, batch, prompt, new, repeats_of(batch), dtype
            )
            # The sampler and its KV cache died with bench_batch's frame.
            gc.collect()
            jax.clear_caches()
            itemsize = jnp.dtype(dtype).itemsize
            r["floor_s"] = floor_seconds(
                cfg, n_params, batch, prompt, new, bw, peaks[dtype], itemsize
            )
            results.append(r)
    del sides, weights, hf, model
    gc.collect()
    jax.clear_caches()
    ckpt_dir.cleanup()
    return results


# --- main ---------------------------------------------------------------------------------------
def _suffix(r: dict) -> str:
    return "" if r["dtype"] == "float32" else "_bf16"


def bench_line(r: dict, prompt: int, new: int) -> str:
    floor = ""
    if r["preset"] != "tiny":
        floor = (
            f" pct_floor_ours={100 * r['floor_s'] / r['ours_s']:.1f}"
            f" pct_floor_torch={100 * r['floor_s'] / r['torch_s']:.1f}"
        )
    return (
        f"BENCH generate_{r['preset']}_b{r['batch']}{_suffix(r)}"
        f" ratio={r['ours_tok_s'] / r['torch_tok_s']:.3f}"
        f" ours_tok_s={r['ours_tok_s']:.1f} torch_tok_s={r['torch_tok_s']:.1f}{floor}"
        f" same_tokens={r['same_tokens']:.3f} new_tokens={new} prompt={prompt}"
    )


def best_lines(results: list[dict]) -> list[str]:
    """Per (preset, batch) with several dtypes: each side's fastest dtype against the other's."""
    lines = []
    for key in dict.fromkeys((r["preset"], r["batch"]) for r in results):
        rs = [r for r in results if (r["preset"], r["batch"]) == key]
        if len(rs) < 2:
            continue
        o = max(rs, key=lambda r: r["ours_tok_s"])
        t = max(rs, key=lambda r: r["torch_tok_s"])
        lines.append(
            f"BENCH generate_{key[0]}_b{key[1]}_best ratio={o['ours_tok_s'] / t['torch_tok_s']:.3f}"
            f" ours_dtype={o['dtype']} torch_dtype={t['dtype']}"
            f" ours_tok_s={o['ours_tok_s']:.1f} torch_tok_s={t['torch_tok_s']:.1f}"
        )
    return lines


def record_results(results, prompt, new, load, bw, peaks, flags, lines):
    table = [
        "| preset | dtype | B | R | ours s | torch s | ours tok/s | torch tok/s | ratio | floor s"
        " | % floor ours | % floor torch | same tokens | rows same first 4 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        table.append(
            f"| {r['preset']} | {r['dtype']} | {r['batch']} | {r['repeats']} | {r['ours_s']:.3f}"
            f" | {r['torch_s']:.3f} | {r['ours_tok_s']:.1f} | {r['torch_tok_s']:.1f}"
            f" | {r['ours_tok_s'] / r['torch_tok_s']:.3f} | {r['floor_s']:.3f}"
            f" | {100 * r['floor_s'] / r['ours_s']:.1f} | {100 * r['floor_s'] / r['torch_s']:.1f}"
            f" | {r['same_tokens']:.3f} | {r['first_rows']:.3f} |"
        )
    peak_text = ", ".join(f"{d} {p / 1e9:.1f}" for d, p in peaks.items())
    intro = (
        f"Greedy generation, prompt {prompt} random tokens (full mask), exactly {new} new tokens"
        " per row, random weights (bf16: the f32 weights cast once; ours computes in bf16 with"
        " f32 accumulation, softmax and logits, torch in bf16), median of R calls; tok/s ="
        " B*new / wall time of the whole call (prefill included); ours = jitted Sampler, torch"
        " = transformers generate (KV cache, sdpa). Floor = prefill + (new-1) decode steps, each"
        " max(weights+KV bytes / read bandwidth, FLOPs / peak), bytes in the case's dtype, with"
        f" bandwidth {bw / 1e9:.1f} GB/s and peaks (GFLOP/s) {peak_text} measured in the same"
        " process (loose for tiny: its small matmuls cannot run at the 2048² peak). Same"
        f" tokens: fraction of identical tokens of the two frameworks over all B x {new}"
        f" positions. Load average before the run: {load}; CPU flags: {flags}.\n\n"
        + "\n".join(f"`{x}`" for x in lines)
    )
    return record("bench/generate.py", intro, table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="preset:batch,...")
    parser.add_argument("--dtypes", default=DEFAULT_DTYPES, help="float32,bfloat16 or one")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed calls (default 3; 2 for 0.5B)"
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--record", action="store_true", help="append a table to WORKSPACE.md")
    args = parser.parse_args(argv)
    configs: list[tuple[str, int]] = []
    for item in args.configs.split(","):
        if not item.strip():
            continue
        preset, _, batch = item.strip().partition(":")
        if preset not in PRESETS:
            parser.error(f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")
        if not batch.isdigit() or int(batch) < 1:
            parser.error(f"config {item!r}: expected preset:batch with batch >= 1")
        configs.append((preset, int(batch)))
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ("float32", "bfloat16")]
    if bad or not dtypes:
        parser.error(f"--dtypes={args.dtypes!r}; allowed: float32, bfloat16")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.prompt_len < 1 or args.new_tokens < 1:
        parser.error("--prompt-len and --new-tokens must be >= 1")

    setup_torch()
    load = check_load()
    flags = cpu_flags()
    print(f"CPU flags: {flags}")
    bw_xla, bw_torch = read_bandwidth()
    bw = max(bw_xla, bw_torch) * 1e9
    peaks = {}
    for dtype in dtypes:
        peak_xla, peak_torch = matmul_peaks(dtype=dtype)
        peaks[dtype] = max(peak_xla, peak_torch) * 1e9
        print(f"{dtype} matmul peak: jnp.dot {peak_xla:.1f}, torch.mm {peak_torch:.1f} GFLOP/s")
    print(f"read bandwidth: jnp.sum {bw_xla:.1f} GB/s, torch.sum {bw_torch:.1f} GB/s")

    def repeats_of(preset):
        return lambda b: args.repeats or DEFAULT_REPEATS_SPECIAL.get((preset, b), DEFAULT_REPEATS)

    t_start = time.perf_counter()
    results = []
    i = 0
    while i < len(configs):  # consecutive configs of one preset share weights and models
        preset = configs[i][0]
        batches = []
        while i < len(configs) and configs[i][0] == preset:
            batches.append(configs[i][1])
            i += 1
        for r in bench_preset(
            preset,
            batches,
            repeats_of(preset),
            args.prompt_len,
            args.new_tokens,
            dtypes,
            bw,
            peaks,
        ):
            results.append(r)
            print(
                f"{preset} {r['dtype']} b{r['batch']}: floor {r['floor_s']:.3f}s,"
                f" ours {r['ours_s']:.3f}s, torch {r['torch_s']:.3f}s",
                flush=True,
            )
        gc.collect()
    print(f"benchmark time {time.perf_counter() - t_start:.0f}s")
    lines = [bench_line(r, args.prompt_len, args.new_tokens) for r in results]
    lines += best_lines(results)
    for line in lines:
        print(line)
    if args.record:
        path = record_results(
            results, args.prompt_len, args.new_tokens, load, bw, peaks, flags, lines
        )
        print(f"recorded in {path}")


if __name__ == "__main__":
    main()
