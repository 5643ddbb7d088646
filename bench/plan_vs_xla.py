"""The planner's update memory per decoder layer, and the log-prob readout's, against XLA's
buffer assignment.

  python bench/plan_vs_xla.py [--arch qwen2p5_0p5b] [--rows 2] [--bucket 128] [--new 256]
      [--chunk 32] [--record]

One micro-batch's gradient (the update's token-mean cross-entropy over the response, the
planner's 'activations' program) is compiled on this backend at L = 2 and L = 4 decoder layers
of the arch's widths, with a small vocabulary (1,024) so that the logits do not hide the layers;
(temp(4) - temp(2)) / 2 / tokens is what one layer keeps per token. It is printed beside the
planner's model: `saved_layer_bytes` (activations) plus, when the compute dtype is narrower than
the f32 params, the layer's weights in the compute dtype per token (`compute_weights`). Compute
dtypes float32 and bfloat16, over float32 params. Prints
`BENCH plan_vs_xla_layer ratio=<XLA / plan> dtype=..` (<= 1: the plan bounds XLA's temp).

The readout (`aqn_jax/logprobs.py`, issue 51): the head alone at the arch's widths and its real
vocabulary, on `rows` x `new` hidden states, `chunk` positions at a time; XLA's temp of the
gradient of a token-mean log-prob and entropy (in the head's weights too: full fine-tuning; in
the hidden states only: a frozen head, QeRL mode) and of the forward (prepare) beside the
planner's `activation_terms(...)['logits']` and `readout_bytes(..., 2)`. Prints
`BENCH plan_vs_xla_readout ratio=<XLA / plan> program=.. dtype=..`.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from common import record

from aqn_jax import planner
from aqn_jax.forward import Readout, forward
from aqn_jax.logprobs import chunked_logprobs
from aqn_jax.models.hf import abstract_params
from aqn_jax.models.qwen2 import Qwen2Config, Qwen2ForCausalLM, Qwen2Head, saved_layer_bytes


def layer_bytes(arch: str, dtype: str, rows: int, bucket: int, new: int) -> dict[str, float]:
    temps, cfg = {}, None
    for layers in (2, 4):
        cfg = Qwen2Config.preset(
            arch, num_hidden_layers=layers, dtype=dtype, tie_word_embeddings=False, vocab_size=1024
        )
        model = Qwen2ForCausalLM(cfg)

        def ce(p, x, model=model):
            logp, _ = forward(model, p, x, readout=Readout(x[:, bucket:], bucket - 1))
            return -jnp.mean(logp)

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


def readout_bytes(arch: str, dtype: str, rows: int, new: int, chunk: int) -> dict[str, dict]:
    """{program: {'xla': temp bytes, 'plan': the planner's}} of the readout alone (the head at
    the arch's widths and vocabulary): 'update' (the head trained), 'update_frozen_head' (the
    hidden states' gradient only) and 'prepare' (the forward)."""
    cfg = Qwen2Config.preset(arch, num_hidden_layers=1, dtype=dtype, logprob_chunk=chunk)
    head = Qwen2Head(cfg)
    params = abstract_params(cfg)
    hp = {k: params[k] for k in ("embed_tokens", "lm_head") if k in params}
    x = jax.ShapeDtypeStruct((rows, new, cfg.hidden_size), jnp.dtype(dtype))
    tokens = jax.ShapeDtypeStruct((rows, new), jnp.int32)

    def read(hp, x, t):
        fn = lambda x_c, part: (head.apply({"params": hp}, x_c), {})  # noqa: E731
        return chunked_logprobs(fn, x, t, 1.0, chunk)[:2]

    def loss(hp, x, t):
        logp, ent = read(hp, x, t)
        return -jnp.mean(logp) - 0.01 * jnp.mean(ent)

    def temp(fn):
        return jax.jit(fn).lower(hp, x, tokens).compile().memory_analysis().temp_size_in_bytes

    terms = lambda head_grad: planner.activation_terms(  # noqa: E731
        cfg, rows, 0, new, 1, False, head_grad=head_grad
    )["logits"]
    return {
        "update": {"xla": temp(jax.grad(loss, argnums=(0, 1))), "plan": terms(True)},
        "update_frozen_head": {"xla": temp(jax.grad(loss, argnums=1)), "plan": terms(False)},
        "prepare": {"xla": temp(read), "plan": planner.readout_bytes(cfg, rows, new, 1, 2)},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen2p5_0p5b")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--bucket", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=32)
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
    table += [
        "",
        f"The readout ({args.rows} rows x {args.new} positions, chunk {args.chunk}, the real"
        " vocabulary):",
        "",
        "| program | compute dtype | XLA temp | planner | XLA / plan |",
        "|---|---|---|---|---|",
    ]
    for dtype in ("float32", "bfloat16"):
        for program, r in readout_bytes(args.arch, dtype, args.rows, args.new, args.chunk).items():
            ratio = r["xla"] / r["plan"]
            print(
                f"BENCH plan_vs_xla_readout ratio={ratio:.3f} program={program} dtype={dtype}"
                f" arch={args.arch} xla_b={r['xla']} plan_b={r['plan']} chunk={args.chunk}"
                f" backend={jax.default_backend()}",
                flush=True,
            )
            table.append(
                f"| {program} | {dtype} | {r['xla'] / 2**20:.1f} MiB | {r['plan'] / 2**20:.1f} MiB"
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
