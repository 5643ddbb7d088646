"""Job `model_summary`: build (or load) the model, print its parameter table, run one forward.

The placeholder main job until the RL job exists: it exercises the preset or the HF loader,
the tokenizer's chat template and a jitted forward, and writes `model_summary.json`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np
from absl import logging
from flax import traverse_util

from aqn_jax.data.tokenizers import load_tokenizer
from aqn_jax.models.factory import load_model, logical_axes, model_config
from aqn_jax.models.qwen2 import Qwen2ForCausalLM


def _validate(config):
    """Every check that needs no compile, so bad input fails at once."""
    qcfg = model_config(config.model)
    tokenizer_path = config.tokenizer_path or config.model.hf_path
    tokenizer = load_tokenizer(tokenizer_path or None)
    if tokenizer.vocab_size > qcfg.vocab_size:
        raise ValueError(
            f"config.tokenizer_path={tokenizer_path!r}: the tokenizer has {tokenizer.vocab_size}"
            f" ids but the model's vocab_size is {qcfg.vocab_size}"
        )
    if not config.prompt:
        raise ValueError("config.prompt='' ; give a non-empty user message")
    return qcfg, tokenizer


def run(config, workdir: str) -> None:
    qcfg, tokenizer = _validate(config)
    qcfg, params = load_model(config.model, config.seed)
    source = (
        config.model.hf_path or f"preset {config.model.preset} (random init, seed {config.seed})"
    )

    flat_params = traverse_util.flatten_dict(params, sep="/")
    flat_axes = traverse_util.flatten_dict(logical_axes(qcfg), sep="/")
    total = sum(int(np.prod(v.shape)) for v in flat_params.values())
    rows = []
    print(f"Qwen2ForCausalLM from {source}")
    print(f"{'param':48s} {'shape':>16s} {'dtype':>9s}  logical axes")
    for path in sorted(flat_params, key=_layer_order):
        value = flat_params[path]
        rows.append(
            dict(path=path, shape=list(value.shape), dtype=str(value.dtype), axes=flat_axes[path])
        )
        # Layer 0 in full; the other layers have the same shapes.
        if not path.startswith("layers_") or path.startswith("layers_0/"):
            shape, dtype = str(tuple(value.shape)), str(value.dtype)
            print(f"{path:48s} {shape:>16s} {dtype:>9s}  {flat_axes[path]}")
    if qcfg.num_hidden_layers > 1:
        print(f"(layers_1 .. layers_{qcfg.num_hidden_layers - 1}: as layers_0)")
    print(f"total parameters: {total:,}")

    messages = [{"role": "user", "content": config.prompt}]
    ids = np.asarray([tokenizer.encode_chat(messages)], np.int32)
    model = Qwen2ForCausalLM(qcfg)
    forward = jax.jit(lambda p, ids: model.apply({"params": p}, ids))
    t0 = time.perf_counter()
    forward.lower(params, ids).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits = np.asarray(forward(params, ids))
    forward_s = time.perf_counter() - t0
    if not np.all(np.isfinite(logits)):
        raise FloatingPointError("model_summary: the forward pass produced non-finite logits")
    # Ids past the tokenizer's vocabulary (the model's vocab is padded) are never produced.
    top = np.argsort(-logits[0, -1, : tokenizer.vocab_size])[:5]
    top = [(int(t), tokenizer.decode([t], skip_special_tokens=False)) for t in top]
    print(
        f"prompt: {ids.shape[1]} tokens; compile {compile_s:.2f}s, forward {forward_s * 1e3:.1f}ms"
    )
    print(f"top-5 next tokens: {top}")

    summary = dict(
        source=source,
        config=dataclasses.asdict(qcfg),
        param_count=total,
        params=rows,
        prompt_tokens=int(ids.shape[1]),
        compile_s=compile_s,
        forward_s=forward_s,
        top5_next_tokens=top,
        devices=[str(d) for d in jax.devices()],
    )
    out = os.path.join(workdir, "model_summary.json")
    with open(out, "w") as f:
        json.dump(summary, f, indent=2)
    logging.info("wrote %s", out)
    print(f"wrote {out}")


def _layer_order(path: str):
    head, _, rest = path.partition("/")
    if head.startswith("layers_"):
        return (1, int(head.removeprefix("layers_")), rest)
    return (0 if head == "embed_tokens" else 2, 0, path)
