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
    """The CPU flags that decide bf16 and f32 matmul speed (`avx512_bf16`: native bf16 dot
    products; `amx_bf16`: tiles; without either XLA converts bf16 operands to f32). Machines
    differ between sessions, so every measurement records them."""
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return " ".join(w for w in wanted if w in have) or "none of " + str(wanted)
    except OSError:
        pass
    return "unknown"


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
