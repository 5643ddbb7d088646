"""Shared by the benchmark scripts: machine description, load check, WORKSPACE.md writer,
random weights."""

from __future__ import annotations

import datetime
import os
import shlex
import sys
import time
from pathlib import Path

import jax
import numpy as np

from aqn_jax import compute_dtype
from aqn_jax.models.hf import abstract_params
from aqn_jax.models.qwen2 import Qwen2Config

REPO = Path(__file__).resolve().parents[1]


def cpu_description() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def cpu_flags() -> str:
    """The CPU flags that decide bf16 and f32 matmul speed (`compute_dtype.BF16_FLAGS`).
    Machines differ between sessions, so every measurement records them."""
    have = compute_dtype.cpu_flags()
    if have is None:
        return "unknown"
    return " ".join(have) or "none of " + str(compute_dtype.BF16_FLAGS)


def check_load() -> str:
    """The 1/5/15-min load average, printed with a warning when the machine is busy: other
    processes distort every timing on a 2-core VM."""
    load = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    print(f"load average before (1, 5, 15 min): {load}")
    if os.getloadavg()[0] > 0.5:
        print("WARNING: the machine is busy (1-min load > 0.5); timings will be distorted")
    return load


def random_params(config: Qwen2Config, seed: int = 0) -> dict:
    """numpy params: N(0, 0.02) float32 everywhere, 1.0 for the RMSNorm weights."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_params(config))
    rng = np.random.default_rng(seed)
    out = []
    for path, leaf in leaves:
        if "norm" in jax.tree_util.keystr(path):
            value = np.ones(leaf.shape, np.float32)
        else:
            value = rng.standard_normal(leaf.shape, dtype=np.float32)
            value *= np.float32(0.02)
        out.append(value)
    return jax.tree_util.tree_unflatten(treedef, out)


def kv_bytes_per_token(cfg: Qwen2Config, itemsize: int = 4) -> int:
    """K and V of one token, all layers, `itemsize` bytes an element."""
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.resolved_head_dim * itemsize


def floor_seconds(
    cfg: Qwen2Config,
    n_params: int,
    batch: int,
    prompt: int,
    new: int,
    bw: float,
    peak: float,
    itemsize: int = 4,
) -> float:
    """Lower bound on one generate call (bench/generate.py's docstring says how); bw in B/s,
    peak FLOP/s, weights and KV cache of `itemsize` bytes an element."""
    N, H, L = cfg.num_attention_heads, cfg.resolved_head_dim, cfg.num_hidden_layers
    weight_bytes = itemsize * n_params
    # Prefill: every projection for every prompt token, the lm_head (tied table, V x D) for
    # the last position only (generation needs no other logits), causal attention (query i
    # attends over i + 1 keys).
    lm_head = cfg.vocab_size * cfg.hidden_size
    prefill_attn = 4 * batch * L * N * H * (prompt * (prompt + 1) // 2)
    prefill_flops = 2 * (n_params - lm_head) * batch * prompt + 2 * lm_head * batch + prefill_attn
    total = max(weight_bytes / bw, prefill_flops / peak)
    for t in range(1, new):  # decode steps feeding tokens 1 .. new-1 (token 0 from the prefill)
        c = prompt + t + 1  # tokens in the cache, this one included
        step_bytes = weight_bytes + batch * c * kv_bytes_per_token(cfg, itemsize)
        step_flops = 2 * n_params * batch + 4 * batch * L * N * H * c
        total += max(step_bytes / bw, step_flops / peak)
    return total


def xla_roofline(nbytes: int, n: int, tries: int = 5) -> dict[str, float]:
    """The default JAX device's read bandwidth, `bw` in B/s (best of `tries` jitted full sums
    over an f32 array of `nbytes`: decode reads every weight once a token), and its matmul peaks
    in FLOP/s (best of `tries` n x n products, `float32` and `bfloat16` operands with f32
    accumulation, as the model computes)."""
    import jax.numpy as jnp

    def best(fn, *args):
        fn(*args).block_until_ready()  # compile
        times = []
        for _ in range(tries):
            t0 = time.perf_counter()
            fn(*args).block_until_ready()
            times.append(time.perf_counter() - t0)
        return min(times)

    a = jnp.ones(nbytes // 4, jnp.float32)
    out = {"bw": nbytes / best(jax.jit(jnp.sum), a)}
    del a
    dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    for dtype in ("float32", "bfloat16"):
        x = jax.random.normal(jax.random.key(0), (n, n), dtype)
        out[dtype] = 2.0 * n**3 / best(dot, x, x)
    return out


def record(script: str, intro: str, table: list[str]) -> Path:
    """Append a section (heading with date and machine, the exact command, a table) to
    WORKSPACE.md. Append only: earlier records are never touched."""
    date = datetime.date.today().isoformat()
    lines = [
        "",
        f"### {script} — {date} {cpu_description()}",
        "",
        f"Command: `{shlex.join(['python', *sys.argv])}`",
        "",
        intro,
        "",
        *table,
    ]
    path = REPO / "WORKSPACE.md"
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")
    return path


def time_calls(fn, n: int) -> list[float]:
    """Wall time of each of n calls of fn (fn must block until its result is ready)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times
