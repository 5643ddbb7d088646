"""Job `model_summary`: build (or load) the model, print its parameter table and the fault plan,
run one forward on the clean and on the faulty device, and profile the clean residual stream
(per layer: max, median, 99th percentile of |h|, where the max sits).

The placeholder main job until the RL job exists: it exercises the preset or the HF loader,
the tokenizer's chat template, the fault plan of `config.faults`/`config.aqn` (its manifest
of hit modules per phase, its telemetry) and a jitted forward; writes `model_summary.json`
and `manifest.json`.
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

from aqn_jax.aqn.config import AQN_SIGMA, aqn_sigma
from aqn_jax.aqn.plan import build_plan
from aqn_jax.diagnosis.profile import format_profile, residual_profile
from aqn_jax.faults.intercept import step_key, summarize_stats
from aqn_jax.forward import forward, trace_manifest
from aqn_jax.models.factory import load_params, logical_axes, model_config
from aqn_jax.models.registry import causal_lm, layer_name
from aqn_jax.warm_start import tokenizer_for


def _check_config(config):
    """Every check that needs no compile, so bad input fails at once."""
    model_cfg = model_config(config.model)
    tokenizer = tokenizer_for(config.tokenizer_path, config.model.hf_path, model_cfg.vocab_size)
    if not config.prompt:
        raise ValueError("config.prompt='' ; give a non-empty user message")
    if config.phase not in ("rollout", "train", "eval"):
        raise ValueError(f"config.phase={config.phase!r}; allowed: ('rollout', 'train', 'eval')")
    plan = build_plan(config.faults, config.aqn, model_cfg.num_hidden_layers)
    return model_cfg, tokenizer, plan


def run(config, workdir: str) -> None:
    """The job's stages: check, load, the parameter table, the fault manifest of every phase,
    the clean and faulty forwards with the residual profile, the summary."""
    model_cfg, tokenizer, plan = _check_config(config)
    params = load_params(model_cfg, config.model.hf_path, config.seed)
    source = (
        config.model.hf_path or f"preset {config.model.preset} (random init, seed {config.seed})"
    )
    rows, total = _param_table(model_cfg, params, source)
    model = causal_lm(model_cfg)
    _write_manifest(plan, model, params, workdir)
    measured = _forwards(config, model, params, plan, tokenizer)
    summary = dict(
        source=source,
        config=dataclasses.asdict(model_cfg),
        param_count=total,
        params=rows,
        **measured,
        devices=[str(d) for d in jax.devices()],
    )
    out = os.path.join(workdir, "model_summary.json")
    with open(out, "w") as f:
        json.dump(summary, f, indent=2)
    logging.info("wrote %s", out)
    print(f"wrote {out}")


def _param_table(model_cfg, params, source: str) -> tuple[list[dict], int]:
    """Print the parameter table (layer 0 in full); (its rows, the parameter count)."""
    flat_params = traverse_util.flatten_dict(params, sep="/")
    flat_axes = traverse_util.flatten_dict(logical_axes(model_cfg), sep="/")
    total = sum(int(np.prod(v.shape)) for v in flat_params.values())
    rows = []
    print(f"{type(causal_lm(model_cfg)).__name__} ({model_cfg.model_type}) from {source}")
    print(f"{'param':48s} {'shape':>16s} {'dtype':>9s}  logical axes")
    first = layer_name(model_cfg, 0)
    layer_prefix = first.removesuffix("0")
    for path in sorted(flat_params, key=lambda p: _layer_order(p, layer_prefix)):
        value = flat_params[path]
        rows.append(
            dict(path=path, shape=list(value.shape), dtype=str(value.dtype), axes=flat_axes[path])
        )
        # Layer 0 in full; the other layers have the same shapes.
        if not path.startswith(layer_prefix) or path.startswith(f"{first}/"):
            shape, dtype = str(tuple(value.shape)), str(value.dtype)
            print(f"{path:48s} {shape:>16s} {dtype:>9s}  {flat_axes[path]}")
    if model_cfg.num_hidden_layers > 1:
        last = layer_name(model_cfg, model_cfg.num_hidden_layers - 1)
        print(f"({layer_name(model_cfg, 1)} .. {last}: as {first})")
    print(f"total parameters: {total:,}")
    return rows, total


def _write_manifest(plan, model, params, workdir: str) -> None:
    """The manifest of every phase, traced abstractly before anything compiles (an injection
    that hits no module raises here); printed and written to manifest.json."""
    print(plan.describe())
    manifest = {}
    for phase in ("rollout", "train", "eval"):
        if plan.active(phase):
            hits = manifest[phase] = trace_manifest(plan, model, params, phase)
            for name, paths in hits.items():
                shown = ", ".join(paths[:4]) + (
                    f", ... ({len(paths)} sites)" if len(paths) > 4 else ""
                )
                print(f"  [{phase}] {name}: {shown}")
    with open(os.path.join(workdir, "manifest.json"), "w") as f:
        f.write(plan.manifest_json(manifest))


def _forwards(config, model, params, plan, tokenizer) -> dict:
    """The prompt's forward on the faulty and the clean device, and the clean residual
    profile; printed, and returned as the summary's measured fields."""
    messages = [{"role": "user", "content": config.prompt}]
    ids = np.asarray([tokenizer.encode_chat(messages)], np.int32)
    # This step's AQN sigma (as at step config.step of a config.total_steps-step run), traced.
    sigma = np.float32(aqn_sigma(config.aqn, config.step, config.total_steps))

    def summary_forward(params, ids, sigma, faulty: bool):
        return forward(
            model,
            params,
            ids,
            plan=plan if faulty else None,
            phase=config.phase,
            key=step_key(config.seed, config.step, config.phase),
            values={AQN_SIGMA: sigma},
            mutable=["fault_stats"],
        )

    clean_fn = jax.jit(lambda p, ids, s: summary_forward(p, ids, s, False))
    faulty_fn = jax.jit(lambda p, ids, s: summary_forward(p, ids, s, True))
    t0 = time.perf_counter()
    faulty_fn.lower(params, ids, sigma).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits, state = faulty_fn(params, ids, sigma)
    logits = np.asarray(logits)
    forward_s = time.perf_counter() - t0
    clean = np.asarray(clean_fn(params, ids, sigma)[0])
    if not np.all(np.isfinite(logits)):
        raise FloatingPointError("model_summary: the forward pass produced non-finite logits")
    stats = summarize_stats(state.get("fault_stats", {}))
    # Ids past the tokenizer's vocabulary (the model's vocab is padded) are never produced.
    top = np.argsort(-logits[0, -1, : tokenizer.vocab_size])[:5]
    top = [(int(t), tokenizer.decode([t], skip_special_tokens=False)) for t in top]
    profile = residual_profile(model, params, ids)
    print(format_profile(profile))
    diff = float(np.abs(logits - clean).max())
    print(
        f"prompt: {ids.shape[1]} tokens; compile {compile_s:.2f}s, forward {forward_s * 1e3:.1f}ms"
    )
    print(
        f"phase {config.phase}, AQN sigma {float(sigma):g}: max |logit(faulty) - logit(clean)|"
        f" = {diff:.3g}"
    )
    for name, value in sorted(stats.items()):
        if name.endswith("/mean"):
            print(f"  {name}: {value:.4g}")
    print(f"top-5 next tokens: {top}")
    return dict(
        prompt_tokens=int(ids.shape[1]),
        compile_s=compile_s,
        forward_s=forward_s,
        top5_next_tokens=top,
        phase=config.phase,
        aqn_sigma=float(sigma),
        max_logit_diff_vs_clean=diff,
        fault_stats=stats,
        residual_profile=profile,
    )


def _layer_order(path: str, layer_prefix: str):
    head, _, rest = path.partition("/")
    if head.startswith(layer_prefix) and head.removeprefix(layer_prefix).isdigit():
        return (1, int(head.removeprefix(layer_prefix)), rest)
    return (0 if head == "embed_tokens" else 2, 0, path)
