"""Overhead of fault and AQN injection on a jitted forward+backward training step.

Purpose: the cost of each fault/AQN setting relative to the same step with no plan, for the
`tiny` preset and the Qwen2.5-0.5B architecture (random weights, short sequence). Targets from
the issue: global AQN <= 1.05x, targeted AQN <= 1.01x (the original system reports 5-10%).

Command (from the repository root):

    .venv/bin/python bench/fault_overhead.py [--presets tiny,qwen2p5_0p5b] [--repeats R]
        [--record]

Method: one jitted step per variant, `value_and_grad` of the next-token cross entropy with the
plan entered inside the jitted function (phase `train`, every injection active in `train`),
AQN sigma passed as a traced scalar, telemetry on (`fault_stats` mutable and returned, as the
trainer logs it). Plans come from `build_plan` on config overrides, i.e. the code path the jobs
use. Compile excluded; the timed calls go round-robin over the variants (R rounds) so that a
slow spell of the host hits all of them; the median per variant is divided by the no-fault
median.

Variants: deadzone at one layer; AQN (activation form, relative noise on the layer output)
targeted at one layer; AQN activation form on all layers; AQN QeRL form (noise on every
RMSNorm weight) on all layers; noisy linear (operator level, forward and backward error) on
every linear; MXFP4 fake quantisation on every linear input.

Prints `BENCH fault_overhead_<preset>_<variant> ratio=<t_variant / t_none> ...` per variant;
with --record appends the table to WORKSPACE.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from common import check_load, random_params, record

from aqn_jax.aqn.config import AQN_SIGMA, aqn_config
from aqn_jax.aqn.plan import build_plan
from aqn_jax.faults.config import faults_config
from aqn_jax.faults.intercept import step_key
from aqn_jax.models.qwen2 import PRESETS, Qwen2Config, Qwen2ForCausalLM

SHAPES = {"tiny": (8, 128), "qwen2p5_0p5b": (1, 64)}  # (batch, seq)
DEFAULT_REPEATS = {"tiny": 21, "qwen2p5_0p5b": 9}


def variants(num_layers: int) -> dict[str, dict]:
    """Config overrides per variant (dotted paths under the config root)."""
    mid = str(num_layers // 2)
    aqn = {"aqn.enabled": True, "aqn.phases": ("train",), "aqn.schedule": "constant"}
    return {
        "none": {},
        "deadzone_1layer": {"faults.deadzone.enabled": True, "faults.deadzone.layers": mid},
        "aqn_targeted_1layer": {**aqn, "aqn.layers": mid},
        "aqn_global": {**aqn, "aqn.layers": "all"},
        "aqn_qerl_global": {**aqn, "aqn.layers": "all", "aqn.form": "norm_weight"},
        "noisy_linear_fwd_bwd": {
            "faults.noise.enabled": True,
            "faults.noise.backward": True,
            "faults.noise.scale": 0.05,
        },
        "mxfp4_linear_inputs": {"faults.quant.enabled": True},
    }


def make_config(overrides: dict) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict({"faults": faults_config(), "aqn": aqn_config()})
    config.update_from_flattened_dict(overrides)
    return config


def make_step(model, plan):
    def loss_fn(params, ids, key, sigma):
        with plan.apply("train", key=key, values={AQN_SIGMA: sigma}):
            logits, state = model.apply({"params": params}, ids[:, :-1], mutable=["fault_stats"])
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()
        return nll, state

    @jax.jit
    def step(params, ids, key, sigma):
        (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, ids, key, sigma)
        return loss, grads, state

    return step


def bench_preset(name: str, repeats: int) -> dict[str, float]:
    config = Qwen2Config.preset(name)
    batch, seq = SHAPES[name]
    params = jax.device_put(random_params(config))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq + 1)))
    model = Qwen2ForCausalLM(config)
    key, sigma = step_key(0, 0, "train"), jnp.float32(0.05)
    steps = {}
    for variant, overrides in variants(config.num_hidden_layers).items():
        c = make_config(overrides)
        plan = build_plan(c.faults, c.aqn, config.num_hidden_layers)
        steps[variant] = make_step(model, plan)
        t0 = time.perf_counter()
        jax.block_until_ready(steps[variant](params, ids, key, sigma))
        print(f"{name}/{variant}: compile + first call {time.perf_counter() - t0:.1f}s", flush=True)
    times: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(repeats):
        for variant, step in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(step(params, ids, key, sigma))
            times[variant].append(time.perf_counter() - t0)
    return {v: statistics.median(t) for v, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,qwen2p5_0p5b")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--record", action="store_true", help="append a table to WORKSPACE.md")
    args = parser.parse_args(argv)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    for p in presets:
        if p not in SHAPES:
            parser.error(
                f"unknown preset {p!r}; allowed: {', '.join(s for s in PRESETS if s in SHAPES)}"
            )
    load = check_load()
    lines, table = (
        [],
        [
            "| preset | batch x seq | variant | median step s | ratio to no faults |",
            "|---|---|---|---|---|",
        ],
    )
    for name in presets:
        medians = bench_preset(name, args.repeats or DEFAULT_REPEATS[name])
        batch, seq = SHAPES[name]
        base = medians["none"]
        for variant, t in medians.items():
            table.append(f"| {name} | {batch}x{seq} | {variant} | {t:.4f} | {t / base:.3f} |")
            if variant != "none":
                lines.append(
                    f"BENCH fault_overhead_{name}_{variant} ratio={t / base:.3f}"
                    f" step_s={t:.4f} base_step_s={base:.4f} batch={batch} seq={seq}"
                )
    print("\n".join(lines))
    if args.record:
        intro = (
            "Jitted forward+backward (next-token CE) with the plan active in phase train,"
            " telemetry returned, sigma traced; median of round-robin timed calls; ratio = step"
            f" time with the variant / without faults. Load average before the run: {load}."
        )
        print(f"recorded in {record('bench/fault_overhead.py', intro, table)}")


if __name__ == "__main__":
    main()
