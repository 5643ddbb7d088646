"""Job `export`: a run's trained policy as an HF snapshot (config.json, safetensors, the
tokenizer's files), for transformers, vLLM or `configs/evaluate.py --config.model.hf_path=`.

  python -m aqn_jax.launch --config=configs/export.py --config.export.run=runs/nvfp4_lora

`config.export.run` is a train run's workdir; its own `config.json` says the model, the warm
start, config.lora and the base's weight_format (the command's other sections are not read).
The latest checkpoint (or `export.step`) is exported: full fine-tuning as it is, a LoRA run's
adapters merged into its dequantised base (W + alpha/rank A B). Output: `export.out`, or
`<run>/export`; an existing `export.out` is replaced only when it is an earlier export holding
nothing but its own files (nothing else is ever deleted: `aqn_jax.export.check_target`). A
train run with `--config.checkpoint.export=hf` writes the same at its end.
"""

from __future__ import annotations

import json
import os

import ml_collections

from aqn_jax.checkpoint import Checkpointer
from aqn_jax.export import EXPORT_DIR, check_target, export_policy
from aqn_jax.jobs import run_policy


def check_config(
    config, workdir: str | None = None
) -> tuple[str, ml_collections.ConfigDict, int, str]:
    """(the run's directory, its config, the step to export, the output directory); one line
    naming the field. `workdir`: this command's own (--workdir), which the output must neither
    be nor hold. Writes nothing."""
    ex = config.export
    run = os.path.expanduser(str(ex.run or ""))
    if not run:
        raise ValueError("config.export.run=''; name a train run's workdir")
    path = os.path.join(run, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"config.export.run={ex.run!r}: no config.json there (not a run's workdir)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            run_config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"config.export.run={ex.run!r}: {path} is not valid JSON ({e}); it is the config"
            " a train run writes at its start: restore it, or name another run"
        ) from None
    if not isinstance(run_config, dict):
        raise ValueError(
            f"config.export.run={ex.run!r}: {path} holds a JSON {type(run_config).__name__},"
            " not a run's config (an object)"
        )
    run_config = ml_collections.ConfigDict(run_config)
    steps = []
    if os.path.isdir(os.path.join(run, "checkpoints")):  # else nothing is created there
        ckpt = Checkpointer(run, 0, 1)
        try:
            steps = sorted(ckpt.manager.all_steps())
        finally:
            ckpt.close()
    if not steps:
        raise ValueError(
            f"config.export.run={ex.run!r} has no checkpoint (it ended with"
            " checkpoint.final='none', or never reached one); nothing to export"
        )
    step = steps[-1] if int(ex.step) == -1 else int(ex.step)
    if step not in steps:
        raise ValueError(
            f"config.export.step={ex.step}; allowed: a step {ex.run} has a checkpoint of"
            f" ({', '.join(map(str, steps))}), or -1 (the latest)"
        )
    out = str(ex.out or os.path.join(run, EXPORT_DIR))
    out = check_target(out, "config.export.out", run, workdir)
    return run, run_config, step, out


def run(config, workdir: str) -> None:
    run_dir, run_config, step, out = check_config(config, workdir)
    ckpt = Checkpointer(run_dir, 0, 1)
    try:
        state, meta = ckpt.restore_host(step, "config.export.step")
    finally:
        ckpt.close()
    model_cfg, params = run_policy(run_config, state["params"], run_dir, meta.get("base"))
    tokenizer = run_config.get("tokenizer_path") or run_config.model.get("hf_path", "")
    export_policy(out, model_cfg, params, tokenizer)
    what = "LoRA merged into its base" if "lora" in state["params"] else "full fine-tuning"
    print(
        f"export: {out} ({run_dir} step {step}, {what}); evaluate with --config.model.hf_path={out}"
    )
