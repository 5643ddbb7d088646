"""Run logging: one JSON row per step (`metrics.jsonl`), TensorBoard event files (tensorboardX,
no TensorFlow), and tqdm progress bars. Only process 0 writes (multi-host runs)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    def __init__(self, workdir: str, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, METRICS_FILE)
        self._tb = None
        if self.enabled and tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items() if k != "step"}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, int(step))
            self._tb.flush()

    def rewrite(self, rows) -> None:
        """Replace metrics.jsonl by `rows` (a resumed run drops what it will recompute)."""
        if not self.enabled:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


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
        return [json.loads(line) for line in f if line.strip()]


def progress(total: int, desc: str, enabled: bool | None = None):
    """A tqdm bar (stderr), off on processes other than 0."""
    from tqdm.auto import tqdm

    if enabled is None:
        enabled = jax.process_index() == 0
    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)
