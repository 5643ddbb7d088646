"""Issue 17: the quantile deadzone's threshold, by a sort (the old code) and by the bit-pattern
search (`ops.kth_smallest_nonneg`), on the shapes the embedded study meets.

  python bench/quantile.py [--record]

Each shape: |N(0, 1)| float32 values, q = 0.75; the k-th smallest of the tensor (the default
`granularity='tensor'`) or of each row (`'token'`); jitted, warmed up, then the two sides
interleaved call by call, median of R calls each. The results are asserted bit-equal before any
time is taken. Prints `BENCH quantile_threshold ratio=<sort time / search time>` per shape.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from aqn_jax.faults import ops  # noqa: E402

# (name, shape, granularity): the update's micro-batch at layer 4 (40 rows x 96 positions x
# hidden 128), the rollout's prefill (80 x 72 x 128), one decode step (80 x 1 x 128), and the
# same micro-batch per token.
SHAPES = (
    ("update_microbatch", (40, 96, 128), "tensor"),
    ("rollout_prefill", (80, 72, 128), "tensor"),
    ("decode_step", (80, 1, 128), "tensor"),
    ("update_per_token", (40, 96, 128), "token"),
)
Q = 0.75


def by_sort(x, granularity):
    """The old `_quantile_threshold`: sort, then index."""
    flat = x.reshape(1, -1) if granularity == "tensor" else x
    n = flat.shape[-1]
    k = jnp.clip(jnp.floor(jnp.float32(Q) * n).astype(jnp.int32), 0, n - 1)
    return jax.lax.dynamic_index_in_dim(jnp.sort(flat, axis=-1), k, axis=-1, keepdims=True)


def by_search(x, granularity):
    """The deadzone's own threshold (`ops.deadzone_threshold`, severity 'quantile')."""
    return ops.deadzone_threshold(x, Q, granularity=granularity, severity="quantile")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    from common import check_load, cpu_description, record

    load = check_load()
    print(cpu_description(), load)
    rows, lines = [], []
    for name, shape, gran in SHAPES:
        x = jnp.abs(jax.random.normal(jax.random.key(0), shape, jnp.float32))
        sort_fn = jax.jit(lambda v, g=gran: by_sort(v, g))
        search_fn = jax.jit(lambda v, g=gran: by_search(v, g))
        a, b = np.asarray(sort_fn(x)).ravel(), np.asarray(search_fn(x)).ravel()
        assert np.array_equal(a.view(np.int32), b.view(np.int32)), name  # bit-equal first
        times = {"sort": [], "search": []}
        for _ in range(args.reps):  # interleaved
            for side, fn in (("sort", sort_fn), ("search", search_fn)):
                t0 = time.perf_counter()
                fn(x).block_until_ready()
                times[side].append(time.perf_counter() - t0)
        med = {s: statistics.median(t) for s, t in times.items()}
        ratio = med["sort"] / med["search"]
        line = (
            f"BENCH quantile_threshold ratio={ratio:.1f} shape={name} granularity={gran}"
            f" sort_ms={med['sort'] * 1e3:.2f} search_ms={med['search'] * 1e3:.2f}"
        )
        print(line, flush=True)
        lines.append(line)
        rows.append(
            f"| {name} {list(shape)} | {gran} | {med['sort'] * 1e3:.2f} |"
            f" {med['search'] * 1e3:.2f} | {ratio:.1f} |"
        )
    if args.record:
        table = [
            "| shape | granularity | sort ms | bit search ms | ratio (sort / search) |",
            "|---|---|---|---|---|",
            *rows,
        ]
        intro = (
            f"q = {Q}, |N(0,1)| float32, jitted, medians of {args.reps} interleaved calls;"
            f" results bit-equal; load before: {load}.\n\n" + "\n".join(f"`{x}`" for x in lines)
        )
        print("recorded in", record("bench/quantile.py", intro, table))


if __name__ == "__main__":
    main()
