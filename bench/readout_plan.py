"""The planner's terms before and after the log-prob readout (issue 51), from shapes alone.

  python bench/readout_plan.py [--before DIR] [--out FILE]

DIR: a checkout of the commit before the readout (`git archive <commit> | tar -x -C DIR`); the
same measurements run there in a subprocess (PYTHONPATH=DIR) and print beside this tree's.
Nothing compiles or runs a model: `planner.estimate` of each setting.

  * 0.5B, 16 rows in one micro-batch: configs/qwen2p5_coder_0p5b_gsm8k.py:deadzone as committed
    (QeRL mode, 2 prompts x 8 samples x 256 new tokens, buckets up to 256, f32) with
    micro_batch_rows=16 on one CPU device: every component, the device total and the CPU RSS.
  * The largest micro-batch the plan fits in one GPU (capacity as JAX reports it; the planner's
    default headroom 0.9): the bench's GPU settings (bench/rl_step.py's `ours_gpu`, and
    bench/device/section_a.py's full / LoRA / NVFP4 settings; configs/clean.py, bf16 compute,
    8 prompts x 8 samples x 256 new tokens, mini-batches of 32 rows) at 0.5B and 1.5B, on an
    H100 (59 GiB) and an H200 (139 GiB); README's GPU command (the 0.5B config, 8 x 8 x 256 in
    one mini-batch of 64 rows, no remat); the 0.5B config on this project's 23.5 GiB CPU host
    (its CPU RSS, f32) and the 1.5B config (gsm8k_qwen2p5_1p5b.py) per device of 8 GPUs.

Prints `BENCH readout_plan_<what> ratio=<after / before> key=value...` and the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
H100, H200 = 59 * GIB, 139 * GIB  # bytes_limit as JAX reports it (issue 51)
GPU_SHAPE = dict(prompts=8, n=8, new=256)
GPU_SETTINGS = {  # name -> (arch, extra flags)
    "0p5b_full": ("qwen2p5_0p5b", {}),
    "0p5b_lora": ("qwen2p5_0p5b", {"lora.rank": 32}),
    "0p5b_nvfp4_lora": ("qwen2p5_0p5b", {"lora.rank": 32, "model.weight_format": "nvfp4"}),
    "1p5b_full": ("qwen2p5_1p5b", {}),
}


def _config(name: str, arg: str | None = None):
    path = ROOT / "configs" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_config_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def _set(config, flags: dict):
    for path, value in flags.items():
        *parents, leaf = path.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[leaf] = value
    return config


def _plan(config, devices: int = 1):
    from aqn_jax import planner
    from aqn_jax.faults.config import fault_plan
    from aqn_jax.models.factory import model_config
    from aqn_jax.spec import job_spec, step_spec

    model_cfg = model_config(config.model)
    device = fault_plan(config.faults, model_cfg.num_hidden_layers)
    return planner.estimate(job_spec(config, model_cfg, step_spec(config), device), devices)


def _largest_micro(config, capacity: int, devices: int = 1) -> tuple[int, float]:
    """(the largest micro_batch_rows dividing the mini-batch whose plan fits 0.9 x capacity,
    its total in GiB); (0, smallest total) when none does."""
    rows = int(config.actor.mini_batch_prompts) * int(config.rollout.n)
    best, smallest = (0, float("inf")), float("inf")
    for micro in (d for d in range(1, rows + 1) if rows % d == 0):
        config.actor.micro_batch_rows = micro
        total = _plan(config, devices).total
        smallest = min(smallest, total / GIB)
        if total <= 0.9 * capacity:
            best = (micro, total / GIB)
    return best if best[0] else (0, smallest)


def measure() -> dict:
    out = {}
    config = _config("qwen2p5_coder_0p5b_gsm8k", "deadzone")
    config.actor.micro_batch_rows = 16
    config.model.dtype = "float32"  # what dtype=auto picks on an AVX2 CPU
    plan = _plan(config)
    out["0p5b_16rows"] = {
        **{k: v / GIB for k, v in plan.components.items()},
        "total": plan.total / GIB,
        "cpu_rss": plan.cpu_rss / GIB,
    }
    for name, (arch, flags) in GPU_SETTINGS.items():
        for gpu, capacity in (("h100", H100), ("h200", H200)):
            config = _set(
                _config("clean"),
                {
                    "model.preset": arch,
                    "model.dtype": "bfloat16",
                    "data_batch.prompts": GPU_SHAPE["prompts"],
                    "rollout.n": GPU_SHAPE["n"],
                    "rollout.max_new_tokens": GPU_SHAPE["new"],
                    "actor.mini_batch_prompts": GPU_SHAPE["prompts"] // 2,
                    **flags,
                },
            )
            out[f"{name}_{gpu}"] = _largest_micro(config, capacity)
    # README's GPU command (the 0.5B config, one GPU, bf16: what dtype=auto picks there).
    for gpu, capacity in (("h100", H100), ("h200", H200)):
        config = _set(
            _config("qwen2p5_coder_0p5b_gsm8k", "deadzone"),
            {
                "model.remat": False,
                "model.dtype": "bfloat16",
                "data_batch.prompts": 8,
                "actor.mini_batch_prompts": 8,
            },
        )
        out[f"readme_gpu_{gpu}"] = _largest_micro(config, capacity)
    # The real-model configs on their hosts: the 0.5B one on this project's 23.5 GiB CPU host
    # (its CPU RSS, f32: what dtype=auto picks on an AVX2 CPU), the 1.5B one per device of 8
    # GPUs (its FSDP mesh over every device).
    config = _config("qwen2p5_coder_0p5b_gsm8k", "deadzone")
    config.model.dtype = "float32"
    rows = int(config.actor.mini_batch_prompts) * int(config.rollout.n)
    fits = []
    for micro in (d for d in range(1, rows + 1) if rows % d == 0):
        config.actor.micro_batch_rows = micro
        rss = _plan(config).cpu_rss
        if rss <= 0.9 * 25_276_510_208:
            fits.append((micro, rss / GIB))
    out["0p5b_config_cpu"] = fits[-1] if fits else (0, 0.0)
    for gpu, capacity in (("h100", H100), ("h200", H200)):
        config = _config("gsm8k_qwen2p5_1p5b")
        out[f"1p5b_config_8x{gpu}"] = _largest_micro(config, capacity, devices=8)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="", help="a checkout of the commit before issue 51")
    ap.add_argument("--json", action="store_true", help="print the measurements as JSON only")
    ap.add_argument("--out", default="", help="also write the table to this file")
    args = ap.parse_args()
    if args.json:
        print(json.dumps(measure()))
        return
    after = measure()
    before = None
    if args.before:
        env = {**os.environ, "PYTHONPATH": str(Path(args.before).resolve())}
        proc = subprocess.run(
            [sys.executable, __file__, "--json"],
            env=env,
            cwd=args.before,
            capture_output=True,
            text=True,
            check=True,
        )
        before = json.loads(proc.stdout.strip().splitlines()[-1])
    b = before or {}
    table = [
        "0.5B, 16 rows in one micro-batch (configs/qwen2p5_coder_0p5b_gsm8k.py:deadzone,"
        " micro_batch_rows=16), GiB per device:",
        "",
        "| component | before | after |",
        "|---|---|---|",
    ]
    for k, v in after["0p5b_16rows"].items():
        old = b.get("0p5b_16rows", {}).get(k)
        table.append(f"| {k} | {'' if old is None else f'{old:.2f}'} | {v:.2f} |")
        if old:
            print(f"BENCH readout_plan_0p5b_16rows_{k} ratio={v / old:.3f} before={old:.2f}"
                  f" after={v:.2f}")  # fmt: skip
    table += [
        "",
        "The largest micro_batch_rows the plan fits (0.9 x capacity), and its total in GiB:",
        "",
        "| setting | before | after |",
        "|---|---|---|",
    ]
    for k, (micro, total) in ((k, v) for k, v in after.items() if k != "0p5b_16rows"):
        old = b.get(k)
        old_s = "" if old is None else f"{old[0]} ({old[1]:.1f} GiB)"
        table.append(f"| {k} | {old_s} | {micro} ({total:.1f} GiB) |")
        if old and old[0]:
            print(
                f"BENCH readout_plan_{k} ratio={micro / old[0]:.3f} before={old[0]} after={micro}"
            )
    text = "\n".join(table)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
