"""Orbax checkpoints of an RL run: train state (params, optimizer state, step) + JSON metadata
(data position, config, metrics so far), every N steps and at the end, keeping the latest K.

Saves are atomic in Orbax (a step directory appears only once complete), so an interrupted
save is never picked up by `latest_step`.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"


class Checkpointer:
    def __init__(self, workdir: str, every: int, keep: int):
        if every < 0:
            raise ValueError(f"config.checkpoint.every={every}; must be >= 0 (0 = only at the end)")
        if keep < 1:
            raise ValueError(f"config.checkpoint.keep={keep}; must be >= 1")
        self.every = int(every)
        self.directory = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=int(keep), create=True),
        )

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state: Any, meta: dict) -> None:
        self.manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, abstract_state)
        out = self.manager.restore(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        return out["state"], out["meta"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
