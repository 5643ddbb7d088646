"""Orbax checkpoints of an RL run: train state (params, optimizer state, step) + JSON metadata
(data position, config, metrics so far), every N steps and at the end, keeping the latest K.

Saves are atomic in Orbax (a step directory appears only once complete), so an interrupted
save is never picked up by `latest_step`.
"""

from __future__ import annotations

import os
import time
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

    def restore_host(self, step: int) -> tuple[dict, dict]:
        """(state as a tree of numpy arrays, meta) of checkpoint `step`, whatever the mesh and
        the number of processes that saved it (e.g. to evaluate or compare runs)."""
        path = os.path.join(self.directory, str(int(step)), "state")
        tree = ocp.StandardCheckpointer().metadata(path).item_metadata.tree
        device = jax.local_devices()[0]
        abstract = jax.tree_util.tree_map(
            lambda m: jax.ShapeDtypeStruct(
                m.shape, m.dtype, sharding=jax.sharding.SingleDeviceSharding(device)
            ),
            tree,
        )
        out = self.manager.restore(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        return jax.device_get(out["state"]), out["meta"]

    def restore_latest(self, abstract_state: Any, log=print) -> tuple[int, Any, dict] | None:
        """(step, state, meta) of the newest checkpoint that reads back; an unreadable one
        (corrupted files) is reported, set aside (never deleted) and the previous one tried.
        None when there is none: the run starts afresh, and `metrics.open_run` moves the
        outputs of the earlier start aside."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        errors = []
        for step in steps:
            try:
                state, meta = self.restore(step, abstract_state)
            except Exception as e:  # noqa: BLE001 - any failure to read means unusable
                errors.append(f"step {step}: {type(e).__name__}: {str(e)[:200]}")
                # Set it aside (never deleted) so that this step can be saved again.
                aside = os.path.join(self.directory, f"{step}.unreadable-{int(time.time())}")
                if jax.process_index() == 0:
                    os.rename(os.path.join(self.directory, str(step)), aside)
                log(
                    f"checkpoint {self.directory}/{step} is unreadable ({errors[-1]}); moved to"
                    f" {aside}; trying the previous one"
                )
                continue
            if errors:
                self.manager.reload()
            return step, state, meta
        if steps:
            self.manager.reload()
            log(f"no readable checkpoint in {self.directory}: none to resume from")
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
