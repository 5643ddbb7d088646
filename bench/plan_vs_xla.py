"""The planner's update memory per decoder layer against XLA's buffer assignment.

  python bench/plan_vs_xla.py [--arch qwen2p5_0p5b] [--rows 2] [--bucket 128] [--new 256]
      [--record]

One micro-batch's gradient (the update's token-mean cross-entropy over the response, the
planner's 'activations' program) is compiled on this backend at L = 2 and L = 4 decoder layers
of the arch's widths, with a small vocabulary (1,024) so that the logits do not hide the layers;
(temp(4) - temp(2)) / 2 / tokens is what one layer keeps per token. It is printed beside the
planner's model: `saved_layer_bytes` (activations) plus, when the compute dtype is narrower than
the f32 params, the layer's weights in the compute dtype per token (`compute_weights`). Compute
dtypes float32 and bfloat16, over float32 params. Prints
`BENCH plan_vs_xla_layer ratio=<XLA / plan> dtype=..` (<= 1: the plan bounds XLA's temp).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from common import record

from aqn_jax.models.hf import abstract_params
from aqn_jax.models.qwen2 import Qwen2Config, Qwen2ForCausalLM, saved_layer_bytes
from aqn_jax.rl.step import response_logits, token_logprobs


def layer_bytes(arch: str, dtype: str, rows: int, bucket: int, new: int) -> dict[str, float]:
    temps, cfg = {}, None
    for layers in (2, 4):
        cfg = Qwen2Config.preset(
            arch, num_hidden_layers=layers, dtype=dtype, tie_word_embeddings=False, vocab_size=1024
        )
        model = Qwen2ForCausalLM(cfg)

        def ce(p, x, model=model):
            logits = response_logits(model.apply({"params": p}, x), bucket, new)
            return -jnp.mean(token_logprobs(logits, x[:, bucket:], 1.0))

        x = jax.ShapeDtypeStruct((rows, bucket + new), jnp.int32)
        stats = jax.jit(jax.grad(ce)).lower(abstract_params(cfg), x).compile().memory_analysis()
        temps[layers] = int(stats.temp_size_in_bytes)
    tokens = rows * (bucket + new)
    xla = (temps[4] - temps[2]) / 2 / tokens
    acts = saved_layer_bytes(cfg, 1, bucket + new)
    # One layer's weights (everything but the embeddings and the head), in the compute dtype.
    n_layer = sum(x.size for x in jax.tree.leaves(abstract_params(cfg)["layers_0"]))
    weights = n_layer * jnp.dtype(dtype).itemsize / tokens if dtype != cfg.param_dtype else 0.0
    return {"xla": xla, "activations": acts, "compute_weights": weights}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen2p5_0p5b")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--bucket", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    table = [
        "| compute dtype | XLA temp / layer / token | planner: activations | + compute_weights |"
        " XLA / plan |",
        "|---|---|---|---|---|",
    ]
    for dtype in ("float32", "bfloat16"):
        r = layer_bytes(args.arch, dtype, args.rows, args.bucket, args.new)
        plan = r["activations"] + r["compute_weights"]
        ratio = r["xla"] / plan
        print(
            f"BENCH plan_vs_xla_layer ratio={ratio:.3f} dtype={dtype} arch={args.arch}"
            f" xla_b={r['xla']:.0f} activations_b={r['activations']}"
            f" compute_weights_b={r['compute_weights']:.0f} backend={jax.default_backend()}",
            flush=True,
        )
        table.append(
            f"| {dtype} | {r['xla']:.0f} B | {r['activations']} B | {r['compute_weights']:.0f} B"
            f" | {ratio:.3f} |"
        )
    print("\n".join(table))
    if args.record:
        record(
            "bench/plan_vs_xla.py",
            f"One micro-batch's gradient, {args.arch} widths, {args.rows} rows x"
            f" {args.bucket} + {args.new} positions, f32 params; per decoder layer and token.",
            table,
        )


if __name__ == "__main__":
    main()
