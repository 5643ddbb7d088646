"""The products of one Qwen2.5-0.5B decode step against the machine's read bandwidth.

Purpose (issue 32, generation): the decode target is >= 60% of the bandwidth floor at batch 8.
A decode step is a chain of skinny products (B rows times every weight matrix), so the step
can only reach the floor if XLA:CPU's dot kernel reads weights near the memory bandwidth at
M = B rows. This bench measures exactly that, outside the sampler: one jitted program that runs
the 7 projections of each of the 24 decoder layers (distinct weights, 358M parameters: more
than any cache, so every call reads them from memory) on [B, 896] activations, with the
model's expression (`x @ W` with float32 accumulation, cast back), a SiLU gate and the
residual adds; and, alone, the tied lm_head [B, 896] x [151936, 896]^T.

Command (from the repository root):

    .venv/bin/python bench/decode_products.py [--cases bfloat16:8,float32:8,bfloat16:1,bfloat16:32]
        [--repeats 10] [--record]

Method: weights N(0, 0.02) in the case's dtype (bf16: the inference engine's bf16 weights),
one warm-up call (compile), then the best and the median of R calls. Read bandwidth: the best
of 5 jitted `jnp.sum` over a 1 GiB f32 array, in the same process. The floor of a call is its
weight bytes over that bandwidth (the activations are a few KB). Per case one line

    BENCH decode_products_<dtype>_b<B> ratio=<floor / best time> best_ms=.. median_ms=..
        weights_gb_s=.. sum_gb_s=.. lm_head_ms=.. lm_head_gb_s=..

(ratio: our speed over the bandwidth's; 1.0 would be the floor). With --record a table is
appended to WORKSPACE.md (`common.record`). The 1-min load average and the CPU flags are
printed with it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import check_load, cpu_flags, record

LAYERS, D, F, KV, V = 24, 896, 4864, 128, 151936  # Qwen2.5-0.5B
SHAPES = [(D, D), (D, KV), (D, KV), (D, D), (D, F), (D, F), (F, D)]  # q k v o gate up down
SUM_BYTES = 2**30


def _times(fn, *args, repeats: int) -> list[float]:
    jax.block_until_ready(fn(*args))  # compile
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return out


def read_bandwidth() -> float:
    """Bytes/s of the best of 5 jitted sums over a 1 GiB f32 array."""
    a = jax.device_put(np.ones(SUM_BYTES // 4, np.float32))
    return SUM_BYTES / min(_times(jax.jit(jnp.sum), a, repeats=5))


def _mm(x, w, dt):
    return jnp.einsum("bi,io->bo", x.astype(dt), w, preferred_element_type=jnp.float32).astype(dt)


def layers_program(dt):
    def run(x, weights):
        for layer in range(LAYERS):
            q, k, v, o, g, u, d = weights[7 * layer : 7 * layer + 7]
            attn = _mm(x, q, dt)
            # k and v are computed (and read) as in a decode step; their values feed the cache.
            kv = (_mm(x, k, dt).sum() + _mm(x, v, dt).sum()) * 0
            x = x + _mm(attn, o, dt) + kv
            x = x + _mm(jax.nn.silu(_mm(x, g, dt)) * _mm(x, u, dt), d, dt)
        return x

    return jax.jit(run)


def lm_head_program():
    return jax.jit(
        lambda x, table: jnp.einsum("bd,vd->bv", x, table, preferred_element_type=jnp.float32)
    )


def bench_case(dtype: str, batch: int, repeats: int, bw: float) -> dict:
    dt = jnp.dtype(dtype)
    rng = np.random.default_rng(0)
    weights = [
        jnp.asarray(rng.standard_normal(s, dtype=np.float32) * np.float32(0.02), dt)
        for _ in range(LAYERS)
        for s in SHAPES
    ]
    nbytes = sum(w.size * w.dtype.itemsize for w in weights)
    x = jnp.asarray(rng.standard_normal((batch, D), dtype=np.float32), dt)
    t = _times(layers_program(dt), x, weights, repeats=repeats)
    del weights
    table = jnp.asarray(rng.standard_normal((V, D), dtype=np.float32) * np.float32(0.02), dt)
    th = _times(lm_head_program(), x, table, repeats=max(3, repeats // 2))
    head_bytes = table.size * table.dtype.itemsize
    del table
    best = min(t)
    return dict(
        dtype=dtype,
        batch=batch,
        best_ms=best * 1e3,
        median_ms=statistics.median(t) * 1e3,
        gb_s=nbytes / best / 1e9,
        floor_ms=nbytes / bw * 1e3,
        ratio=(nbytes / bw) / best,
        head_ms=min(th) * 1e3,
        head_gb_s=head_bytes / min(th) / 1e9,
        mb=nbytes / 1e6,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="bfloat16:8,float32:8,bfloat16:1,bfloat16:32")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    cases = []
    for item in args.cases.split(","):
        dtype, batch = item.split(":")
        if dtype not in ("float32", "bfloat16"):
            raise SystemExit(f"--cases: dtype {dtype!r}; allowed: float32, bfloat16")
        cases.append((dtype, int(batch)))
    load = check_load()
    flags = cpu_flags()
    print(f"jax {jax.__version__}, devices {jax.devices()}; CPU flags: {flags}")
    bw = read_bandwidth()
    print(f"read bandwidth (jnp.sum over 1 GiB): {bw / 1e9:.1f} GB/s", flush=True)
    rows = []
    for dtype, batch in cases:
        r = bench_case(dtype, batch, args.repeats, bw)
        rows.append(r)
        suffix = "" if dtype == "float32" else "_bf16"
        print(
            f"BENCH decode_products{suffix}_b{batch} ratio={r['ratio']:.3f}"
            f" best_ms={r['best_ms']:.1f} median_ms={r['median_ms']:.1f}"
            f" weights_gb_s={r['gb_s']:.1f} sum_gb_s={bw / 1e9:.1f}"
            f" lm_head_ms={r['head_ms']:.1f} lm_head_gb_s={r['head_gb_s']:.1f}",
            flush=True,
        )
    if args.record:
        intro = (
            "The 7 projections x 24 layers of a Qwen2.5-0.5B decode step (distinct weights,"
            " one jitted program, model's expression with f32 accumulation) and the tied"
            " lm_head alone, on B rows; best of R calls; floor = weight bytes / the read"
            f" bandwidth of `jnp.sum` over 1 GiB, {bw / 1e9:.1f} GB/s in the same process;"
            f" ratio = floor / best. Load average before the run: {load}; CPU flags: {flags}."
        )
        table = [
            "| dtype | B | weights MB | best ms | median ms | floor ms | ratio |"
            " weights GB/s | lm_head ms | lm_head GB/s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ] + [
            f"| {r['dtype']} | {r['batch']} | {r['mb']:.0f} | {r['best_ms']:.1f} |"
            f" {r['median_ms']:.1f} | {r['floor_ms']:.1f} | {r['ratio']:.3f} |"
            f" {r['gb_s']:.1f} | {r['head_ms']:.1f} | {r['head_gb_s']:.1f} |"
            for r in rows
        ]
        print(f"recorded in {record('bench/decode_products.py', intro, table)}")


if __name__ == "__main__":
    main()
