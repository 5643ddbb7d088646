"""What the GPU learning run (bench/device/learn.sh) packs into $OUT as it goes.

  python bench/device/learn_pack.py summary WORKDIR [WORKDIR ...]   # one line a validation
  python bench/device/learn_pack.py adapter WORKDIR DEST --max-mib=15

`summary`: per arm (a train workdir), the validations so far (greedy accuracy on the faulty and
the clean device, with 95% Wilson intervals over the validation's problems) and the steps'
time, reward and advantages, from its metrics.jsonl and config.json.
`adapter`: the latest checkpoint's trainable params (in QeRL mode the LoRA adapters: 17.6 M
of them, 70 MB of f32 for Qwen2.5-0.5B at r32) as bf16 safetensors (35 MB), split by
bench/device/parts.py into parts of at most 15 MiB under DEST (what comes back from the device
is at most 16 MiB a file); `parts.py check --dir=DEST` then `cat DEST/*/part*.bin >
adapter.safetensors` joins it. Prints `step N` or `none` (no checkpoint yet). Runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import parts  # noqa: E402

from aqn_jax.study.sdc import wilson  # noqa: E402


def _rows(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(workdir: str) -> list[str]:
    """One line per validation and one for the steps of the arm in `workdir`."""
    arm = os.path.basename(os.path.normpath(workdir))
    with open(os.path.join(workdir, "config.json")) as f:
        config = json.load(f)
    rows = _rows(workdir)
    n = min(int(config["trainer"]["val_size"]), 1319)
    lines = []
    for r in rows:
        if "val-core/acc" not in r:
            continue
        cells = []
        for key, device in (("val-core/acc", "faulty"), ("val-clean/acc", "clean")):
            k = round(r[key] * n)
            lo, hi = wilson(k, n)
            cells.append(f"{device} {r[key]:.3f} [{lo:.3f}, {hi:.3f}]")
        lines.append(f"{arm} step {r['step']}: val (n={n}, greedy) " + ", ".join(cells))
    steps = [r for r in rows if "timing_s/step" in r]
    if steps:
        t = sorted(r["timing_s/step"] for r in steps)
        adv = ("critic/advantages/max", "critic/advantages/min")
        spread = [r for r in steps if r.get(adv[0], 0) > r.get(adv[1], 0)]
        lines.append(
            f"{arm}: {len(steps)} RL steps, s/step median {t[len(t) // 2]:.2f} (first"
            f" {steps[0]['timing_s/step']:.1f}), reward mean first"
            f" {steps[0].get('critic/score/mean', float('nan')):.3f} last"
            f" {steps[-1].get('critic/score/mean', float('nan')):.3f}, steps with a non-zero"
            f" advantage {len(spread)} of {len(steps)}, clipped last"
            f" {steps[-1].get('response_length/clip_ratio', float('nan')):.2f}"
        )
    return lines or [f"{arm}: no metrics yet"]


def latest_checkpoint(workdir: str) -> str | None:
    root = os.path.join(workdir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    steps = [int(s) for s in names if re.fullmatch(r"\d+", s)]
    return os.path.join(root, str(max(steps)), "state") if steps else None


def adapter(workdir: str, dest: str, max_mib: float) -> str:
    """The latest checkpoint's params as bf16 safetensors, split into `dest` (replaced)."""
    path = latest_checkpoint(workdir)
    if path is None:
        return "none"
    import jax
    import ml_dtypes
    import numpy as np
    import orbax.checkpoint as ocp
    from safetensors.numpy import save_file

    params = ocp.PyTreeCheckpointer().restore(path)["params"]
    flat = {
        "/".join(str(getattr(k, "key", k)) for k in keys): np.asarray(v)
        for keys, v in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    flat = {
        k: v.astype(ml_dtypes.bfloat16) if np.issubdtype(v.dtype, np.floating) else v
        for k, v in flat.items()
    }
    step = os.path.basename(os.path.dirname(path))
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(dest))) as tmp:
        file = os.path.join(tmp, f"adapter_step{step}.safetensors")
        save_file(flat, file, metadata={"step": step, "dtype": "bfloat16 (f32 master cast)"})
        parts.split([file], os.path.join(tmp, "parts"), max_mib)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.move(os.path.join(tmp, "parts"), dest)
    return f"step {step}: {len(flat)} tensors, {sum(v.size for v in flat.values()):,} params"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/device/learn_pack.py", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("summary").add_argument("workdirs", nargs="+")
    a = sub.add_parser("adapter")
    a.add_argument("workdir")
    a.add_argument("dest")
    a.add_argument("--max-mib", type=float, default=15.0)
    args = parser.parse_args(argv)
    if args.cmd == "summary":
        for w in args.workdirs:
            if os.path.isfile(os.path.join(w, "config.json")):
                print("\n".join(summary(w)))
            else:
                print(f"{os.path.basename(os.path.normpath(w))}: not started (no config.json)")
    else:
        print(adapter(args.workdir, args.dest, args.max_mib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
