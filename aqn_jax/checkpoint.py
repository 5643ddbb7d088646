"""Orbax checkpoints of an RL run: train state (params, optimizer state, step) + JSON metadata
(data position, config, metrics so far), every N steps and at the end, keeping the latest K.
Around them: the check that a resumed run keeps its config (`check_resume_config`), the
sanity check before a save (`check_sane`) and the SIGTERM request for a last save
(`Preemption`).

Saves are atomic in Orbax (a step directory appears only once complete), so an interrupted
save is never picked up by `latest_step`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging

CHECKPOINT_DIR = "checkpoints"
# What the end of a run saves (config.checkpoint.final): the whole train state (resumable), the
# params only (what evaluation and the study read: a third of the bytes under AdamW), or nothing.
FINAL = ("state", "params", "none")


def check_final(final: str) -> None:
    """`config.checkpoint.final`, before anything is written."""
    if final not in FINAL:
        raise ValueError(
            f"config.checkpoint.final={final!r}; allowed: {list(FINAL)} (state: resumable;"
            " params: params only; none: no checkpoint at the end)"
        )


class Checkpointer:
    def __init__(self, workdir: str, every: int, keep: int, final: str = "state"):
        check_final(final)
        self.final = final
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

    def save(self, step: int, state: Any, meta: dict, final: bool = False) -> None:
        """Save `state` and `meta` as checkpoint `step`. `final` (the run's last step): as
        `self.final` says; a params-only final checkpoint is marked in its meta."""
        if final and self.final == "none":
            return
        if final and self.final == "params":
            state, meta = {"params": state.params}, {**meta, "final": "params"}
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
        try:
            out = self.manager.restore(
                int(step),
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception:
            _quiet_failed_restore()
            raise
        return out["state"], out["meta"]

    def restore_host(
        self, step: int, step_field: str = "config.evaluate.step"
    ) -> tuple[dict, dict]:
        """(state as a tree of numpy arrays, meta) of checkpoint `step`, whatever the mesh and
        the number of processes that saved it (e.g. to evaluate or compare runs). An unreadable
        checkpoint (corrupted or half-deleted files) is a ValueError naming it and what to do
        (`step_field`: the field that picks another step)."""
        path = os.path.join(self.directory, str(int(step)), "state")
        try:
            item = ocp.StandardCheckpointer().metadata(path).item_metadata
            if item is None:  # Orbax warns and returns None for missing or unreadable metadata
                raise ValueError(f"no readable metadata in {path}")
            tree = item.tree
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
        except Exception as e:  # noqa: BLE001 - any failure to read means unusable
            _quiet_failed_restore()
            others = sorted(s for s in self.manager.all_steps() if s != int(step))
            raise ValueError(
                f"checkpoint {self.directory}/{int(step)} is unreadable ({type(e).__name__}:"
                f" {_plain(e)[:160]}); choose another step with --{step_field}=N (other"
                f" checkpoints: {others}), or rerun the train"
                " job on that workdir: it moves an unreadable checkpoint aside and resumes from"
                " the previous one"
            ) from e
        return jax.device_get(out["state"]), out["meta"]

    def meta(self, step: int) -> dict:
        """Checkpoint `step`'s JSON metadata alone ({} when unreadable)."""
        try:
            out = self.manager.restore(
                int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )
        except Exception:  # noqa: BLE001 - an unreadable one is restore_latest's to report
            return {}
        return dict(out["meta"] or {})

    def restore_latest(self, abstract_state: Any, log=print) -> tuple[int, Any, dict] | None:
        """(step, state, meta) of the newest checkpoint that reads back; an unreadable one
        (corrupted files) is reported, set aside (never deleted) and the previous one tried.
        One of another layout than `abstract_state` (`layout_change`) is a ValueError naming
        the difference, and stays where it is.
        None when there is none: the run starts afresh, and `metrics.open_run` moves the
        outputs of the earlier start aside."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        if steps and self.meta(steps[0]).get("final") == "params":
            raise ValueError(_params_only(self.directory, steps[0]))
        errors = []
        for step in steps:
            changed = self.layout_change(step, abstract_state)
            if changed is not None:  # readable, of another layout: named, left in place
                raise ValueError(
                    f"checkpoint {self.directory}/{step} holds a train state of another layout"
                    f" than this config's ({changed}): the config changed the model or its"
                    " adapters; use a new --workdir"
                )
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

    def layout_change(self, step: int, abstract_state: Any) -> str | None:
        """What differs between checkpoint `step`'s saved tree (its metadata) and
        `abstract_state`: a leaf only one side has, or a shape; None when they agree or the
        metadata is unreadable (then the checkpoint is)."""
        path = os.path.join(self.directory, str(int(step)), "state")
        try:
            item = ocp.StandardCheckpointer().metadata(path).item_metadata
            saved = _shapes(item.tree)
        except Exception:  # noqa: BLE001 - unreadable: restore_latest's to report
            return None
        wanted = _shapes(abstract_state)
        for key in sorted(saved.keys() | wanted.keys()):
            if key not in wanted:
                return f"{key} saved, not in this config's state"
            if key not in saved:
                return f"{key} in this config's state, not saved"
            if saved[key] != wanted[key]:
                return f"{key}: saved shape {saved[key]}, this config's {wanted[key]}"
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _plain(error: BaseException) -> str:
    """An exception's message on one line without object reprs (`<bound method ...>`, which
    Orbax's and pybind11's messages carry)."""
    text, previous = " ".join(str(error).split()), None
    while text != previous:  # innermost first: reprs nest
        previous, text = text, re.sub(r"<[^<>]*>", "", text)
    return " ".join(text.split())


def _shapes(tree) -> dict[str, tuple]:
    """{'a/b/c': shape} of a tree's array leaves (dicts and dataclass fields alike)."""

    def name(k) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)

    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))
    return {
        "/".join(name(k) for k in path): tuple(leaf.shape)
        for path, leaf in leaves
        if hasattr(leaf, "shape")
    }


def _params_only(directory: str, step: int) -> str:
    return (
        f"{directory}/{step} is the params-only final checkpoint of a finished run"
        " (config.checkpoint.final='params'): nothing to resume; evaluate it with"
        " --config.evaluate.run, or choose another --workdir"
    )


def _latest_meta(workdir: str) -> tuple[str, dict]:
    """(the latest checkpoint's directory, its meta); ('', {}) without one. An unreadable meta
    is restore_latest's to report."""
    if not os.path.isdir(os.path.join(workdir, CHECKPOINT_DIR)):
        return "", {}
    ckpt = Checkpointer(workdir, 0, 1)
    try:
        steps = sorted(ckpt.manager.all_steps())
        meta = ckpt.meta(steps[-1]) if steps else {}
    finally:
        ckpt.close()
    return (f"{ckpt.directory}/{steps[-1]}" if steps else ""), meta


def check_resume_base(workdir: str, base_print: str | None) -> None:
    """A LoRA run's latest checkpoint holds the fingerprint of the base its adapters were
    trained over (`meta['base']`): another base is refused (one line) before anything is
    written. No checkpoint, or an unreadable meta (restore_latest's to report): nothing to
    check."""
    where, meta = _latest_meta(workdir)
    if meta and meta.get("base") != base_print:
        raise ValueError(base_changed(where, meta.get("base"), base_print))


def check_resume_warm_start(workdir: str, key: str, cached: bool) -> None:
    """Before the warm start: a LoRA run's latest checkpoint also names the warm start its
    base came from (`meta['warm_start']`, its cache key). Another one that would have to
    train is refused here, in one line, before it trains and writes its cache entry (the base
    fingerprint, `check_resume_base`, could only refuse it after). A cached or shipped one is
    loaded and left to the fingerprint; a checkpoint without the key (older runs, full
    fine-tuning) to `check_resume_base` as before."""
    where, meta = _latest_meta(workdir)
    saved = meta.get("warm_start") if meta else None
    if saved is None or saved == key or cached:
        return
    raise ValueError(
        f"{where} was trained over base {meta.get('base')}, from warm start sft-{saved}, but"
        f" this run's warm start is sft-{key}, not cached (config.model / config.sft /"
        " config.data changed; it would train, then be refused); use a new --workdir"
    )


def base_changed(where: str, saved: str | None, base_print: str | None) -> str:
    return (
        f"{where} was trained over base {saved} but this run's base is {base_print}"
        " (config.model / config.sft / weight_format changed); use a new --workdir"
    )


def check_resumable(workdir: str) -> None:
    """`restore_latest`'s refusal of a params-only final checkpoint, made before any work and
    before anything in the workdir is written (a workdir without checkpoints/ is not touched)."""
    if not os.path.isdir(os.path.join(workdir, CHECKPOINT_DIR)):
        return
    ckpt = Checkpointer(workdir, 0, 1)
    try:
        steps = sorted(ckpt.manager.all_steps())
        if steps and ckpt.meta(steps[-1]).get("final") == "params":
            raise ValueError(_params_only(ckpt.directory, steps[-1]))
    finally:
        ckpt.close()


def _quiet_failed_restore() -> None:
    """After a failed restore, the reads Orbax still had in flight complete on tensorstore's
    threads and call back into the asyncio loop Orbax has closed: each raises 'Event loop is
    closed' into `sys.unraisablehook`, which printed up to hundreds of tracebacks after the one
    line that reports the checkpoint. From the first failure on, those go to the debug log; any
    other unraisable exception still goes to the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "quiets_failed_restores", False):
        return

    def hook(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            logging.debug("after a failed checkpoint restore: %r (ignored)", exc)
            return
        previous(unraisable)

    hook.quiets_failed_restores = True
    sys.unraisablehook = hook


# Fields a resumed run may change: where things go and how often they are saved or reported,
# never what is trained. Anything else changed against the workdir's config.json is refused.
RESUME_FREE = (
    "checkpoint.every",
    "checkpoint.keep",
    "checkpoint.final",
    "sft.cache_dir",
    "resume_override",
)
RESUME_FREE_SECTIONS = ("distributed.", "planner.", "compare.", "evaluate.")
# Fields whose change makes a checkpoint's train state another shape or layout (or, for a LoRA
# run, the frozen base another one): refused even with resume_override, named, before anything
# is read or written; a checkpoint is never taken for unreadable because of them.
LAYOUT_FIELDS = {
    "lora.rank": "changes the adapters' shapes",
    "lora.target_modules": "changes which adapters the state holds",
    "lora.train_norms": "changes what the state trains",
    "model.preset": "changes the model's shapes",
    "model.num_layers": "changes the model's shapes",
    "model.weight_format": "changes the frozen base the adapters were trained over",
}


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resume_config(config_json: str, override: bool, workdir: str) -> dict:
    """A workdir with checkpoints is resumed only under the config it was started with
    (`config_json`: the config's `to_json_best_effort()`). Returns the changed fields
    {path: (old, new)} when `override` (config.resume_override) allows them; raises ValueError
    naming them otherwise. No checkpoint: nothing to check."""
    ckpt_dir = os.path.join(workdir, "checkpoints")
    path = os.path.join(workdir, "config.json")
    has_ckpt = os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))
    if not has_ckpt or not os.path.isfile(path):
        return {}
    with open(path) as f:
        try:
            old = _flat(json.load(f))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: unreadable ({e}); the run cannot be resumed safely") from e
    new = _flat(json.loads(config_json))
    # A field the workdir's config.json lacks is new in this version (its default applies):
    # not a change the user made. Both sides come from to_json_best_effort (tuples as lists).
    changed = {
        k: (old[k], new[k])
        for k in sorted(old)
        if k in new
        and old[k] != new[k]
        and k not in RESUME_FREE
        and not k.startswith(RESUME_FREE_SECTIONS)
    }
    layout = [k for k in changed if k in LAYOUT_FIELDS]
    if layout:
        k = layout[0]
        a, b = changed[k]
        raise ValueError(
            f"config.{k}: {a!r} -> {b!r} {LAYOUT_FIELDS[k]}; use a new --workdir (the"
            f" checkpoints in {workdir} cannot resume under it, even with resume_override)"
        )
    if changed and not override:
        shown = ", ".join(f"config.{k}: {a!r} -> {b!r}" for k, (a, b) in list(changed.items())[:6])
        more = f" (+{len(changed) - 6} more)" if len(changed) > 6 else ""
        raise ValueError(
            f"{workdir} holds checkpoints of a run with another config: {shown}{more}; resume"
            " with the same config, use another --workdir, or pass"
            " --config.resume_override=True to continue with the new values (recorded in"
            " config_overrides.jsonl)"
        )
    return changed


def record_override(workdir: str, changes: dict) -> None:
    """Append the fields a resumed run changed (`check_resume_config`) to config_overrides.jsonl."""
    row = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "changed": {k: {"from": a, "to": b} for k, (a, b) in changes.items()},
    }
    with open(os.path.join(workdir, "config_overrides.jsonl"), "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    print(f"resume with a changed config (override, recorded): {sorted(changes)}")


# Set when a SIGTERM abandoned a compile running in a thread (training.Ahead) with nothing to
# save: once the job's cleanup ran, launch ends the process with os._exit(143) instead of
# waiting for XLA to finish it (tens of seconds; a thread inside XLA cannot be stopped).
ABANDONED = threading.Event()
SAVE_AND_EXIT = (
    "SIGTERM: saving after the current RL step (a compile in progress finishes first), then"
    " exiting (143)"
)


class Preemption:
    """SIGTERM (a preempted job) asks for a final checkpoint after the current step. It says
    so when the signal arrives, also while the main thread is inside a compile (XLA's C++
    holds it; Python's handler runs only after): the signal's wakeup file descriptor is read
    by a thread of its own."""

    def __init__(self):
        self.requested = False
        self._previous = None
        self._wakeup = None
        # Not possible off the main thread (e.g. a test runner's worker): then no handler.
        with contextlib.suppress(ValueError):
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._wakeup = (signal.set_wakeup_fd(write, warn_on_full_buffer=False), read, write)
            threading.Thread(target=self._say, args=(read,), daemon=True).start()

    def _handle(self, signum, frame):
        self.requested = True

    @staticmethod
    def _say(read: int) -> None:
        """Print SAVE_AND_EXIT on the first SIGTERM written to the wakeup fd."""
        said = False
        while data := os.read(read, 64):  # until close() closes the write end
            if signal.SIGTERM in data and not said:
                print(SAVE_AND_EXIT, flush=True)
                said = True
        os.close(read)

    def close(self) -> None:
        """Give SIGTERM back to whoever had it: after the loop a SIGTERM must not be swallowed
        (the compare job's evaluation, a worker process asked to exit)."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if self._wakeup is not None:
            previous, _, write = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write)  # the reader sees the end of the pipe
            self._wakeup = None


@jax.jit
def _leaf_health(x):
    """(every element of one array finite, its max |x|): one small program per shape and dtype."""
    return jnp.all(jnp.isfinite(x)), jnp.max(jnp.abs(x))


def _state_health(state) -> tuple[bool, float]:
    """(every float of params and optimizer state finite, max |param|). A program per leaf
    shape (a model has ~10), each reused by every leaf and run of that shape: one program
    with a reduction per leaf (~300) took seconds to compile for each new state layout, a
    LoRA or full, a depth, an optimizer. All, any and max are exact in any grouping."""

    def floats(tree):
        return [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]

    params = [_leaf_health(x) for x in floats(state.params)]
    rest = [_leaf_health(x)[0] for x in floats(state.replace(params=None))]
    finite, biggest = jax.device_get(([f for f, _ in params] + rest, [m for _, m in params]))
    return bool(all(finite)), max(float(m) for m in biggest)


def check_sane(step: int, state, metrics, trainer_cfg, fired: str = "", hint: str = "") -> None:
    """Before a checkpoint is written: a diverged state stops the run, naming the step, and
    nothing is saved (the previous checkpoint stays the latest). `fired`: the bit faults that
    fired since the last save (their sdc/ metrics), named first as the cause, with `hint` (the
    guard that survives them) instead of the generic advice."""
    finite, params_max = _state_health(state)
    problems = []
    if not bool(finite):
        problems.append("non-finite params or optimizer state")
    grad = float(metrics.get("actor/grad_norm", 0.0))
    bound = float(trainer_cfg.get("max_grad_norm", 0) or 0)
    if bound and not grad <= bound:
        problems.append(f"actor/grad_norm={grad:.4g} > config.trainer.max_grad_norm={bound:g}")
    bound = float(trainer_cfg.get("max_param_abs", 0) or 0)
    if bound and not float(params_max) <= bound:
        problems.append(
            f"max |param| = {float(params_max):.4g} > config.trainer.max_param_abs={bound:g}"
        )
    if problems and fired:
        raise FloatingPointError(
            f"RL step {step}: not saved: {fired}, then {'; '.join(problems)}{hint}"
        )
    if problems:
        raise FloatingPointError(
            f"RL step {step}: not saved: {'; '.join(problems)} (the run diverged: lower"
            " config.actor.lr, or raise the bound if this is expected)"
        )
