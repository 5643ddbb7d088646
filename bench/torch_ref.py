"""Shared by the benchmarks that compare against PyTorch / transformers: the versions line and
the f32 matmul peak of both frameworks measured in the same process."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from common import cpu_description, time_calls

MATMUL_N = 2048
MATMUL_TRIES = 7


def setup_torch() -> None:
    """All cores for torch, no progress bars, and print what runs on which machine."""
    torch.set_num_threads(os.cpu_count())
    transformers.utils.logging.disable_progress_bar()
    print(
        f"machine: {cpu_description()}; jax {jax.__version__} ({jax.default_backend()}),"
        f" torch {torch.__version__} ({torch.get_num_threads()} threads),"
        f" transformers {transformers.__version__}"
    )


def matmul_peaks(
    n: int = MATMUL_N, tries: int = MATMUL_TRIES, dtype: str = "float32"
) -> tuple[float, float]:
    """Best-of-`tries` n x n matmul GFLOP/s for XLA (jitted jnp.dot) and torch.mm, operands in
    `dtype` (float32 or bfloat16; XLA accumulates bf16 products in f32, as the model does).

    The two frameworks' tries alternate, so that a slow spell of a shared host hits both.
    """
    flops = 2.0 * n**3
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    ja, jb = jax.device_put(a).astype(dtype), jax.device_put(b).astype(dtype)
    ta, tb = (
        torch.from_numpy(a).to(getattr(torch, dtype)),
        torch.from_numpy(b).to(getattr(torch, dtype)),
    )
    xla_times, torch_times = [], []
    with torch.inference_mode():
        dot(ja, jb).block_until_ready()
        torch.mm(ta, tb)
        for _ in range(tries):
            xla_times += time_calls(lambda: dot(ja, jb).block_until_ready(), 1)
            torch_times += time_calls(lambda: torch.mm(ta, tb), 1)
    return flops / min(xla_times) / 1e9, flops / min(torch_times) / 1e9
