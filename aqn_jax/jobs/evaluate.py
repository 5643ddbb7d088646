"""Job `evaluate`: a policy's test-split accuracy under the robustness matrix of
aqn_jax/evaluation.py (the fault off / on x no perturbation, relative noise on every linear
output, MXFP4 on every linear input) and its held-out loss; writes `evaluation.json`,
`evaluation.md` and the bar plot `evaluation.png` into the workdir.

  python -m aqn_jax.launch --config=configs/evaluate.py --config.evaluate.run=runs/targeted
  python -m aqn_jax.launch --config=configs/targeted.py --config.job=evaluate \
      --config.evaluate.run=runs/targeted --workdir=runs/targeted/eval

`config.evaluate.run` names a train run's workdir (its latest checkpoint, or `evaluate.step`);
empty, the warm start (the SFT cache or config.model) is evaluated. The model, tokenizer, data
and fault sections must describe the run's (use the run's own config file).
"""

from __future__ import annotations

import contextlib
import json
import os

import jax
import numpy as np

from aqn_jax import parallel
from aqn_jax.checkpoint import Checkpointer
from aqn_jax.checks import (
    check_block_widths,
    check_instruction,
    check_prompt_lengths,
)
from aqn_jax.data.config import check_data, load_split
from aqn_jax.evaluation import check_evaluate, robustness, write_evaluation
from aqn_jax.faults.config import fault_plan
from aqn_jax.jobs import run_policy
from aqn_jax.models.factory import logical_axes, model_config
from aqn_jax.models.hf import abstract_params
from aqn_jax.models.registry import ModelConfig
from aqn_jax.rewards import METHODS
from aqn_jax.spec import eval_spec, warm_start_spec
from aqn_jax.warm_start import tokenizer_for, warm_start


def check_config(config):
    ev = config.evaluate
    check_evaluate(ev)
    model_cfg = model_config(config.model)
    tokenizer = tokenizer_for(config.tokenizer_path, config.model.hf_path, model_cfg.vocab_size)
    check_data(config.data)
    check_instruction(config.data, tokenizer)
    fault_plan(config.faults, model_cfg.num_hidden_layers)
    check_block_widths(config.faults, model_cfg)
    if ev.run and not os.path.isdir(os.path.join(os.path.expanduser(ev.run), "checkpoints")):
        raise ValueError(
            f"config.evaluate.run={ev.run!r}: no checkpoints/ there; expected the workdir of a"
            " train run (or '' to evaluate the warm start)"
        )
    bs = int(ev.batch_size or config.trainer.val_batch_size)
    parallel.check_splits(config.mesh, jax.device_count(), {f"config.evaluate.batch_size={bs}": bs})
    return model_cfg, tokenizer


def run_status(run_dir: str, step: int) -> dict:
    """Whether `step` of the train run in `run_dir` is its end: the run wrote summary.json
    for that many steps. An unfinished (killed, running) run is evaluated at its latest
    checkpoint, and says so."""
    status = {"step": int(step), "finished": False, "total_steps": None}
    path = os.path.join(run_dir, "config.json")
    if os.path.isfile(path):
        with open(path) as f, contextlib.suppress(ValueError):
            status["total_steps"] = json.load(f).get("trainer", {}).get("total_steps")
    path = os.path.join(run_dir, "summary.json")
    if os.path.isfile(path):
        with open(path) as f, contextlib.suppress(ValueError):
            summary = json.load(f)
            status["total_steps"] = summary.get("steps", status["total_steps"])
            status["finished"] = summary.get("steps") == int(step)
    return status


def load_policy(config, workdir: str, model_cfg: ModelConfig | None = None):
    """(model config, host params, description, run status) of what config.evaluate names;
    `model_cfg` is config.model parsed already (`check_config`'s), else parsed here."""
    ev = config.evaluate
    model_cfg = model_config(config.model) if model_cfg is None else model_cfg
    if not ev.run:
        model_cfg, params, info = warm_start(warm_start_spec(config, model_cfg), workdir)
        source = "config.model" if info.get("sft") == "off" else f"SFT, cache {info['cache']}"
        return model_cfg, jax.device_get(params), f"warm start ({source})", None
    ckpt = Checkpointer(os.path.expanduser(ev.run), 0, 1)
    step = ckpt.latest_step() if ev.step < 0 else int(ev.step)
    if step is None or step not in ckpt.manager.all_steps():
        ckpt.close()
        raise ValueError(
            f"config.evaluate.step={ev.step}: {ev.run} has checkpoints"
            f" {sorted(ckpt.manager.all_steps())}"
        )
    state, meta = ckpt.restore_host(step)
    ckpt.close()
    params = state["params"]
    if "lora" in params:  # a QeRL-mode run: its adapters merged into its (quantised) base
        model_cfg, params = run_policy(config, params, workdir, meta.get("base"))
    want = jax.tree_util.tree_map(lambda a: a.shape, abstract_params(model_cfg))
    if jax.tree_util.tree_map(np.shape, params) != want:
        raise ValueError(
            f"config.evaluate.run={ev.run!r}: its checkpoint's params do not match config.model;"
            " evaluate with the run's own config file"
        )
    status = run_status(os.path.expanduser(ev.run), step)
    what = f"{ev.run} step {step}"
    if not status["finished"]:
        what += f" of {status['total_steps'] or '?'} (UNFINISHED run: not its final policy)"
    return model_cfg, params, what, status


def run(config, workdir: str) -> None:
    model_cfg, tokenizer = check_config(config)
    spec = eval_spec(config)
    size = int(config.evaluate.size or config.trainer.val_size)
    test = load_split(config.data, "test")[:size]
    check_prompt_lengths(config.rollout, len(test), tokenizer, test)
    model_cfg, params, what, status = load_policy(config, workdir, model_cfg)
    mesh = parallel.make_mesh(config.mesh)
    params = parallel.put_global(params, parallel.param_shardings(logical_axes(model_cfg), mesh))
    names = [c.name for c in spec.conditions]
    print(f"evaluating {what} on {len(test)} test examples; conditions: {names}")
    hardware = fault_plan(config.faults, model_cfg.num_hidden_layers)
    result = robustness(spec, model_cfg, params, tokenizer, test, hardware, mesh=mesh)
    result.update(
        policy=what,
        run=status,
        test_size=len(test),
        fault_config=config.faults.to_dict(),
        reward_method=config.data.reward_method,
    )
    if jax.process_index() == 0:
        write_evaluation(workdir, result)
        path = write_evaluation_report(result, workdir)
        print(f"report: {path}")


def write_evaluation_report(result: dict, workdir: str) -> str:
    """`evaluation.md` (the matrix as a table) and `evaluation.png` (grouped bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conds = result["conditions"]
    rows = sorted({("fault" if c["fault"] else "clean") for c in conds.values()})
    cols = []
    for name in conds:
        col = name.split("+", 1)[1] if "+" in name else "none"
        if col not in cols:
            cols.append(col)

    def cell(row, col):
        name = row if col == "none" else f"{row}+{col}"
        return conds.get(name, {}).get("acc")

    lines = [
        f"# Robustness evaluation: {result['policy']}",
        "",
        f"{result['test_size']} test examples; accuracy"
        f" ({METHODS.get(result.get('reward_method', 'strict')).title}), mean@"
        f"{next(iter(conds.values()))['samples']}; {result['wall_time_s']:.0f}s.",
        "",
        "| device | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for row in rows:
        vals = [cell(row, c) for c in cols]
        lines.append(
            f"| {row} | " + " | ".join("n/a" if v is None else f"{v:.3f}" for v in vals) + " |"
        )
    if "loss" in result:
        lines += ["", "Held-out loss (answer-token cross-entropy):", ""]
        lines += [f"- {k}: {v:.4f}" for k, v in result["loss"].items()]
    lines += ["", "![robustness](evaluation.png)", ""]
    fig, ax = plt.subplots(figsize=(1.6 * len(cols) + 3, 4))
    width = 0.8 / max(len(rows), 1)
    for i, row in enumerate(rows):
        ys = [cell(row, c) or 0.0 for c in cols]
        ax.bar(np.arange(len(cols)) + i * width, ys, width, label=f"fault {row}")
    ax.set_xticks(np.arange(len(cols)) + width * (len(rows) - 1) / 2, cols)
    ax.set_ylabel("test accuracy")
    ax.set_title(result["policy"])
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "evaluation.png"), dpi=100)
    plt.close(fig)
    path = os.path.join(workdir, "evaluation.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path
