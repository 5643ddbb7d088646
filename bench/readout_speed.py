"""The log-prob readout alone, at Qwen2.5-0.5B's head (896 x 151,936): the full-logits path
(the head on every position of prompt and response, log-softmax over the response slice: the
product before issue 51) against `aqn_jax/logprobs.py`'s chunked readout (the response
positions only, `chunk` positions of every row at a time, each chunk rematerialised), forward
and backward (the gradient of sum(logp) + 0.01 sum(entropy) with respect to the hidden states and
the head), side by side in one process so that the machine's load falls on both alike.

  python bench/readout_speed.py [--rows 2] [--prompt 192] [--response 256]
      [--chunks 32,128,256] [--dtypes float32,bfloat16] [--reps 5] [--record]

Method: each variant is jitted and run once to compile; then `--reps` rounds, each timing every
variant once in a rotated order (block-interleaved), `block_until_ready` on the gradients;
medians. Prints `BENCH readout_speed_<dtype>_c<chunk> ratio=<full s / chunked s>` (> 1: the
chunked readout is faster) and the load average; --record appends the table to WORKSPACE.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aqn_jax.logprobs import chunked_logprobs, logprobs_from_logits  # noqa: E402

D, V = 896, 151_936  # Qwen2.5-0.5B's hidden size and vocabulary


def variants(rows, prompt, response, chunks, dtype):
    S = prompt + response

    def full(x_NSD, w_DV, tokens_NR):
        logits = jnp.einsum("nsd,dv->nsv", x_NSD, w_DV, preferred_element_type=jnp.float32)
        lp, ent = logprobs_from_logits(logits[:, prompt - 1 : S - 1], tokens_NR, 1.0)
        return jnp.sum(lp) + 0.01 * jnp.sum(ent)

    def chunked(c):
        def loss(x_NSD, w_DV, tokens_NR):
            def head(x, _part):
                return jnp.einsum("nsd,dv->nsv", x, w_DV, preferred_element_type=jnp.float32), {}

            lp, ent, _ = chunked_logprobs(head, x_NSD[:, prompt - 1 : S - 1], tokens_NR, 1.0, c)
            return jnp.sum(lp) + 0.01 * jnp.sum(ent)

        return loss

    out = {"full": jax.jit(jax.grad(full, argnums=(0, 1)))}
    for c in chunks:
        out[f"c{c}"] = jax.jit(jax.grad(chunked(c), argnums=(0, 1)))
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (rows, S, D), jnp.float32).astype(dtype)
    w = (jax.random.normal(k2, (D, V), jnp.float32) * D**-0.5).astype(dtype)
    tokens = jax.random.randint(k3, (rows, response), 0, V)
    return out, (x, w, tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=192)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--chunks", default="32,128,256")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    chunks = [int(c) for c in a.chunks.split(",")]
    from common import cpu_flags  # bench/common.py (the script's folder is on sys.path)

    flags = cpu_flags().replace(" ", ",")
    table = []
    for name in a.dtypes.split(","):
        fns, args = variants(a.rows, a.prompt, a.response, chunks, jnp.dtype(name))
        for fn in fns.values():
            jax.block_until_ready(fn(*args))
        times = {k: [] for k in fns}
        keys = list(fns)
        load0 = os.getloadavg()[0]
        for r in range(a.reps):
            for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
                t0 = time.perf_counter()
                jax.block_until_ready(fns[k](*args))
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        load = f"{load0:.2f}-{os.getloadavg()[0]:.2f}"
        for c in chunks:
            ratio = med["full"] / med[f"c{c}"]
            print(
                f"BENCH readout_speed_{name}_c{c} ratio={ratio:.3f} full_s={med['full']:.3f}"
                f" chunked_s={med[f'c{c}']:.3f} rows={a.rows} prompt={a.prompt}"
                f" response={a.response} load={load} flags={flags}",
                flush=True,
            )
            table.append((name, c, med["full"], med[f"c{c}"], ratio, load))
    if a.record:
        lines = [
            f"### bench/readout_speed.py — the 0.5B head's readout, fwd+bwd, {a.rows} rows x"
            f" ({a.prompt} + {a.response}) positions, median of {a.reps} (flags {flags})",
            "",
            "| dtype | chunk | full s | chunked s | ratio (full / chunked) | load |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {d} | {c} | {f:.3f} | {s:.3f} | {r:.3f} | {ld} |" for d, c, f, s, r, ld in table
        ]
        with open(
            os.path.join(os.path.dirname(os.path.dirname(__file__)), "WORKSPACE.md"), "a"
        ) as f:
            f.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
