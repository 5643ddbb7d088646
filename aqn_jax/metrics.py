"""Run logging: one JSON row per step (`metrics.jsonl`), TensorBoard event files (tensorboardX,
no TensorFlow), and tqdm progress bars. Only process 0 writes (multi-host runs).

`open_run` is the one rule for a run's per-step outputs when it starts or resumes (the train
job, and through it every compare worker):
- resumed from checkpoint step k: `metrics.jsonl` is rewritten atomically to exactly its rows
  0..k (rows a killed run logged after k are dropped and recomputed) and the TensorBoard events
  are rebuilt from those rows. Rows 0..k must all be there, once each; otherwise the outputs
  cannot be made consistent with the checkpoint and the run refuses, naming the file.
- no checkpoint restored: the run starts at step 0 with no rows. Outputs of an earlier start in
  the workdir (a run killed before its first checkpoint, or whose checkpoints are all
  unreadable) are never appended to and never deleted: they are moved together into
  `previous/<UTC time>/` inside the workdir, and the move is printed.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping
from typing import Any

import jax

from aqn_jax.files import write_atomic

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PREVIOUS_DIR = "previous"
# Per-problem records: every validation's (with its step), and the final evaluation's.
VALIDATION_SAMPLES = "validation_samples.jsonl"
SAMPLES_FILE = "samples.jsonl"
# Everything a run writes per step or at its end (report.py, the train job, compare and evaluate
# jobs): the outputs that must agree with the checkpoints.
RUN_OUTPUTS = (
    METRICS_FILE,
    TENSORBOARD_DIR,
    "summary.json",
    "report.md",
    "training_curves.png",
    "evaluation.json",
    VALIDATION_SAMPLES,
    SAMPLES_FILE,
    "evaluation.md",
    "evaluation.png",
)


class MetricsWriter:
    """Appends one row per step to `metrics.jsonl` (and TensorBoard); made by `open_run`, which
    passes the rows the TensorBoard events must start from (`replay`)."""

    def __init__(self, workdir: str, tensorboard: bool = True, replay=None):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, METRICS_FILE)
        self._tb = None
        if self.enabled and tensorboard:
            self._open_tensorboard(os.path.join(workdir, TENSORBOARD_DIR), replay)

    def _open_tensorboard(self, tb_dir: str, replay) -> None:
        SummaryWriter = _summary_writer_class()
        if replay is not None:
            # Events are rebuilt from the rows: the old ones are set aside first, removed
            # once the rows are flushed (a kill in between is repaired by the next start).
            old = tb_dir + ".old"
            shutil.rmtree(old, ignore_errors=True)
            if os.path.exists(tb_dir):
                os.rename(tb_dir, old)
        self._tb = SummaryWriter(tb_dir)
        if replay is not None:
            for row in replay:
                _add_scalars(self._tb, row)
            self._tb.flush()
            shutil.rmtree(old, ignore_errors=True)

    def rewind(self, rows) -> None:
        """Back to `rows` (steps 0..k): a rollback (config.sdc) redoes the steps after k, so
        their rows are dropped from metrics.jsonl (atomically) and the TensorBoard events are
        rebuilt from `rows`; each step then has one row, its accepted attempt's."""
        if not self.enabled:
            return
        rows = [_row(r["step"], r) for r in rows]
        _write_rows(self.path, rows)
        if self._tb is not None:
            tb_dir = self._tb.logdir
            self._tb.close()
            self._open_tensorboard(tb_dir, rows)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        row = _row(step, metrics)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            _add_scalars(self._tb, row)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def open_run(
    workdir: str, restored_step: int | None, tensorboard: bool = True, log=print
) -> tuple[MetricsWriter, list[dict[str, Any]]]:
    """(writer, rows 0..restored_step) after applying the module docstring's rule; `[]` when
    nothing was restored. Raises ValueError when the rows of a restored run are incomplete."""
    primary = jax.process_index() == 0
    if restored_step is None:
        if primary:
            _move_aside(workdir, log)
        return MetricsWriter(workdir, tensorboard), []
    path = os.path.join(workdir, METRICS_FILE)
    rows = [r for r in read_metrics(workdir) if r["step"] <= restored_step]
    steps = [r["step"] for r in rows]
    if steps != list(range(restored_step + 1)):
        missing = sorted(set(range(restored_step + 1)) - set(steps))
        twice = sorted({s for s in steps if steps.count(s) > 1})
        raise ValueError(
            f"{path} does not hold exactly one row for each step 0..{restored_step} of the"
            f" restored checkpoint (missing steps {missing[:10]}, repeated steps {twice[:10]});"
            " the run's outputs cannot be made consistent with its checkpoints: move the workdir"
            " away to start afresh"
        )
    if primary:
        _write_rows(path, rows)
    return MetricsWriter(workdir, tensorboard, replay=rows), rows


def _write_rows(path: str, rows) -> None:
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def _move_aside(workdir: str, log) -> None:
    found = [name for name in RUN_OUTPUTS if os.path.lexists(os.path.join(workdir, name))]
    if not found:
        return
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = os.path.join(workdir, PREVIOUS_DIR, stamp)
    k = 1
    while os.path.exists(aside):
        k += 1
        aside = os.path.join(workdir, PREVIOUS_DIR, f"{stamp}-{k}")
    os.makedirs(aside)
    for name in found:
        os.rename(os.path.join(workdir, name), os.path.join(aside, name))
    log(
        f"no checkpoint to resume from in {workdir}: the outputs of an earlier start"
        f" ({', '.join(found)}) were moved to {aside}; starting afresh at step 0"
    )


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch: its writer imports torch when
    installed only to name torch.Tensor in type hints, which costs each run seconds and memory.
    We write Python floats only (`_add_scalars`), which never reach torch. A torch already
    imported is left as it is."""
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX catches
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def _add_scalars(tb, row: Mapping[str, Any]) -> None:
    for k, v in row.items():
        if k != "step" and isinstance(v, float) and math.isfinite(v):
            tb.add_scalar(tb_tag(k), v, int(row["step"]))


def tb_tag(name: str) -> str:
    """The TensorBoard tag of metric `name`: `@` spelled `_at_` (verl's `val-core/<source>/acc/
    mean@1` -> `.../mean_at_1`), any other character TensorBoard refuses as `_`, no leading `/`
    (tensorboardX's own rule, which it applies with an INFO line per call). metrics.jsonl keeps
    the name."""
    return re.sub(r"[^-/\w.]", "_", name.replace("@", "_at_")).lstrip("/")


def _row(step, metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items() if k != "step"}}


def _jsonable(v):
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    # The last element is "" after a complete row; anything else is a row a kill cut short.
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def progress(total: int, desc: str, enabled: bool | None = None):
    """A tqdm bar (stderr), off on processes other than 0."""
    from tqdm.auto import tqdm

    if enabled is None:
        enabled = jax.process_index() == 0
    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)
