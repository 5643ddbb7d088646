"""Prefill throughput of our jitted Flax Qwen2 forward vs transformers' PyTorch Qwen2ForCausalLM.

Purpose: on the same CPU, same config and the same random f32 weights, time a full forward
(logits for every position) of a batch of random token ids with a full attention mask, for
the `tiny` preset and the Qwen2.5-0.5B architecture, and set the throughput against the f32
matmul peak of each framework measured in the same process. Also checks that both frameworks
give the same logits on the benchmark batch.

Command (from the repository root):

    .venv/bin/python bench/forward.py [--presets tiny,qwen2p5_0p5b] [--batch 4] [--seq 256]
        [--repeats R] [--record]

Method:
  * Weights: numpy N(0, 0.02) float32 for every matrix, embedding and bias, 1.0 for the
    RMSNorm weights. Written with `save_hf_checkpoint` into a temporary directory and loaded
    by `transformers.Qwen2ForCausalLM.from_pretrained(..., dtype=torch.float32)` (the default
    attention implementation, sdpa), so both frameworks hold identical weights; the
    directory (~2 GB for 0.5B) is deleted afterwards.
  * Ours: `jax.jit(lambda p, ids, m: model.apply({"params": p}, ids, attention_mask=m))`,
    one warm-up call (compile, excluded), then the median of R calls with
    `.block_until_ready()`.
  * Torch: `torch.set_num_threads(os.cpu_count())`, `model.eval()`, `torch.inference_mode()`,
    one warm-up call, then the median of R calls. `logits_to_keep=0` keeps all positions.
  * The timed calls alternate in blocks (ours x k, torch x k, ... 3 blocks each; the first
    call of each block is dropped) so that a slow spell of the host
    (other processes, throttling of the VM's vCPUs) does not fall on one framework only.
  * Peaks: best of 7 f32 2048x2048 matmuls, jitted `jnp.dot` (XLA) and `torch.mm`
    alternating, measured before and after the forwards; the larger of the two is used.
  * The machine is a small VM that others may share: the 1-min load average before the run
    is printed (and recorded), with a WARNING above 0.5.
  * FLOPs of one forward (analytic, 2 per multiply-add): per token and layer the q, k, v, o,
    gate, up and down projections; per sequence and layer the attention scores and the
    probs @ V product counted in FULL, 2*2*T*T*N*H (not halved for causality: our forward
    computes the masked half too; torch's sdpa may skip it, which then shows as a higher
    percentage of peak); the lm_head 2*D*V per token. Embedding lookups, norms, RoPE, softmax
    and activations are not counted.

Prints informational lines as it goes (load, compile time, logit difference, times, peaks),
then at the end, per preset, exactly one line

    BENCH forward_<preset> ratio=<ours_tok_s/torch_tok_s> ours_tok_s=.. torch_tok_s=..
        ours_pct_peak=.. torch_pct_peak=.. batch=4 seq=256 dtype=f32

(on one line), where ours_pct_peak is % of the XLA peak and torch_pct_peak % of the torch
peak, plus one line

    BENCH matmul_peak ratio=<xla/torch> xla_gflops=.. torch_gflops=..

With --record (only then) a markdown table of the results is appended to WORKSPACE.md in the
repository root under `### bench/forward.py — <date> <cpu model, cores>` with the command line.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse
import gc
import statistics
import tempfile
import time

import jax
import numpy as np
import torch
import transformers
from common import check_load, random_params, record, time_calls
from torch_ref import MATMUL_N, MATMUL_TRIES, matmul_peaks, setup_torch

from aqn_jax.models.hf import save_hf_checkpoint
from aqn_jax.models.qwen2 import PRESETS, Qwen2Config, Qwen2ForCausalLM

DEFAULT_REPEATS = {"tiny": 5, "qwen2p5_0p5b": 3}
BLOCKS = 3  # timed blocks per framework
# Max |logit| difference allowed between the frameworks (N(0, 0.02) weights, f32).
LOGIT_TOL = 1e-3


def attention_flops(cfg: Qwen2Config, batch: int, seq: int) -> float:
    """Scores (QK^T) and probs @ V of all layers, full T x T (not halved for causality)."""
    N, H = cfg.num_attention_heads, cfg.resolved_head_dim
    return cfg.num_hidden_layers * batch * 2 * 2 * seq * seq * N * H


def forward_flops(cfg: Qwen2Config, batch: int, seq: int) -> float:
    """FLOPs of one forward over [batch, seq] (2 per MAC, attention counted in full)."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.resolved_head_dim
    tokens = batch * seq
    proj_macs = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F  # q, k, v, o, gate, up, down
    projections = cfg.num_hidden_layers * 2 * proj_macs * tokens
    return projections + attention_flops(cfg, batch, seq) + 2 * D * V * tokens


def make_ours(cfg: Qwen2Config, params_np: dict, ids: np.ndarray, mask: np.ndarray):
    """A no-argument call of our jitted forward on the batch (blocks until done)."""
    model = Qwen2ForCausalLM(cfg)
    params = jax.device_put(params_np)
    fwd = jax.jit(lambda p, ids, m: model.apply({"params": p}, ids, attention_mask=m))
    j_ids, j_mask = jax.device_put(ids), jax.device_put(mask)
    return lambda: fwd(params, j_ids, j_mask).block_until_ready()


def make_torch(ckpt: str, ids: np.ndarray, mask: np.ndarray):
    """Same for transformers' Qwen2ForCausalLM loaded from the checkpoint directory."""
    hf = transformers.Qwen2ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    hf.eval()
    t_ids, t_mask = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask)

    def forward():
        with torch.inference_mode():
            return hf(input_ids=t_ids, attention_mask=t_mask, logits_to_keep=0).logits

    return forward, hf.config._attn_implementation


def bench_preset(name: str, batch: int, seq: int, repeats: int) -> dict:
    cfg = Qwen2Config.preset(name)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, size=(batch, seq), dtype=np.int32)
    mask = np.ones((batch, seq), np.int32)
    t0 = time.perf_counter()
    params_np = random_params(cfg)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params_np))
    print(f"{name}: {n_params / 1e6:.1f}M params, built in {time.perf_counter() - t0:.1f}s")

    # The checkpoint directory lives until the torch model is gone (its weights may be
    # memory-mapped from the safetensors file).
    ckpt_dir = tempfile.TemporaryDirectory(prefix="bench_forward_")
    save_hf_checkpoint(ckpt_dir.name, cfg, params_np)
    torch_call, attn = make_torch(ckpt_dir.name, ids, mask)
    print(f"{name}: torch attn_implementation={attn}")
    ours_call = make_ours(cfg, params_np, ids, mask)
    del params_np
    gc.collect()

    # Warm-up (compile for ours), also the logits compared below.
    t0 = time.perf_counter()
    ours_logits = np.asarray(ours_call())
    print(f"{name}: jax compile + first call {time.perf_counter() - t0:.1f}s")
    ref = torch_call()
    assert tuple(ref.shape) == (batch, seq, cfg.vocab_size), tuple(ref.shape)
    ref_logits = ref.numpy().copy()
    del ref
    diff = float(np.abs(ours_logits - ref_logits).max())
    scale = float(np.abs(ref_logits).max())
    print(f"{name}: max |logit diff| {diff:.2e} (max |logit| {scale:.2f}), tolerance {LOGIT_TOL}")
    del ours_logits, ref_logits
    gc.collect()
    assert diff <= LOGIT_TOL, f"{name}: logits differ by {diff:.2e} > {LOGIT_TOL}"

    # Timed calls alternate between the frameworks in blocks, so that a slow spell of the
    # (possibly shared or throttled) host does not fall on one of them only. Blocks, not single
    # calls: torch's OpenMP threads keep spinning after a call and slow down an XLA call that
    # follows at once (measured: ours 46 ms interleaved per call vs 39 ms in blocks on tiny);
    # the first call of each block absorbs that hand-over and is not counted.
    ours_times, torch_times = [], []
    block = max(1, (repeats + BLOCKS - 1) // BLOCKS)
    while len(ours_times) < repeats:
        ours_times += time_calls(ours_call, block + 1)[1:]
        torch_times += time_calls(torch_call, block + 1)[1:]
    ours_times, torch_times = ours_times[:repeats], torch_times[:repeats]
    del ours_call, torch_call
    jax.clear_caches()
    gc.collect()
    ckpt_dir.cleanup()

    tokens = batch * seq
    ours_s, torch_s = statistics.median(ours_times), statistics.median(torch_times)
    print(
        f"{name}: ours times {[round(t, 4) for t in ours_times]} s,"
        f" torch times {[round(t, 4) for t in torch_times]} s"
    )
    return dict(
        preset=name,
        flops=forward_flops(cfg, batch, seq),
        attn_flops=attention_flops(cfg, batch, seq),
        ours_s=ours_s,
        torch_s=torch_s,
        ours_tok_s=tokens / ours_s,
        torch_tok_s=tokens / torch_s,
        diff=diff,
        repeats=repeats,
    )


def record_results(
    results: list[dict], peaks: tuple[float, float], batch: int, seq: int, load: str
):
    xla, tt = peaks
    table = [
        "| preset | R | ours tok/s | torch tok/s | ratio | ours GFLOP/s (% XLA peak)"
        " | torch GFLOP/s (% torch peak) | max logit diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        og, tg = r["flops"] / r["ours_s"] / 1e9, r["flops"] / r["torch_s"] / 1e9
        table.append(
            f"| {r['preset']} | {r['repeats']} | {r['ours_tok_s']:.1f} | {r['torch_tok_s']:.1f}"
            f" | {r['ours_tok_s'] / r['torch_tok_s']:.3f} | {og:.1f} ({100 * og / xla:.1f}%)"
            f" | {tg:.1f} ({100 * tg / tt:.1f}%) | {r['diff']:.2e} |"
        )
    table.append(
        f"| matmul peak f32 {MATMUL_N}² | best of {MATMUL_TRIES} | XLA {xla:.1f} GFLOP/s"
        f" | torch {tt:.1f} GFLOP/s | {xla / tt:.3f} | | | |"
    )
    intro = (
        f"Prefill, batch={batch} seq={seq}, f32, full attention mask, median of R calls;"
        " FLOPs analytic (attention counted in full, not causal-halved); % of peak against"
        f" each framework's own f32 matmul peak. Load average before the run: {load}."
    )
    return record("bench/forward.py", intro, table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,qwen2p5_0p5b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed calls (default: 5 tiny, 3 others)"
    )
    parser.add_argument("--record", action="store_true", help="append a table to WORKSPACE.md")
    args = parser.parse_args(argv)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    for p in presets:
        if p not in PRESETS:
            parser.error(f"unknown preset {p!r}; allowed: {', '.join(PRESETS)}")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")

    setup_torch()

    # Other processes on the machine distort every number here (torch's OpenMP threads suffer
    # most); the load average before the run shows whether the machine was quiet.
    load = check_load()
    # Peaks before and after the forwards; the larger of the two is used (the host is shared
    # and a slow spell lowers a best-of-N; see the printed values for the spread).
    before = matmul_peaks()
    print(f"matmul peak before: xla {before[0]:.1f} torch {before[1]:.1f} GFLOP/s")
    results = []
    for name in presets:
        repeats = args.repeats or DEFAULT_REPEATS.get(name, 3)
        r = bench_preset(name, args.batch, args.seq, repeats)
        results.append(r)
        og, tg = r["flops"] / r["ours_s"] / 1e9, r["flops"] / r["torch_s"] / 1e9
        print(
            f"{name}: {r['flops'] / 1e9:.1f} GFLOP per forward, of which attention"
            f" {100 * r['attn_flops'] / r['flops']:.1f}% (counted in full);"
            f" ours {og:.1f} GFLOP/s, torch {tg:.1f} GFLOP/s",
            flush=True,
        )
        gc.collect()
    after = matmul_peaks()
    print(f"matmul peak after: xla {after[0]:.1f} torch {after[1]:.1f} GFLOP/s")
    peaks = xla, tt = max(before[0], after[0]), max(before[1], after[1])
    for r in results:
        og, tg = r["flops"] / r["ours_s"] / 1e9, r["flops"] / r["torch_s"] / 1e9
        print(
            f"BENCH forward_{r['preset']} ratio={r['ours_tok_s'] / r['torch_tok_s']:.3f}"
            f" ours_tok_s={r['ours_tok_s']:.1f} torch_tok_s={r['torch_tok_s']:.1f}"
            f" ours_pct_peak={100 * og / xla:.1f} torch_pct_peak={100 * tg / tt:.1f}"
            f" batch={args.batch} seq={args.seq} dtype=f32"
        )
    print(f"BENCH matmul_peak ratio={xla / tt:.3f} xla_gflops={xla:.1f} torch_gflops={tt:.1f}")
    if args.record:
        print(f"recorded in {record_results(results, peaks, args.batch, args.seq, load)}")


if __name__ == "__main__":
    main()
