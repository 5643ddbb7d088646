"""One RL run (GRPO / PPO) of the warm-started policy on the simulated faulty device: the body of
job `train` (`jobs/train.py`) and of every run of a compare study (`jobs/compare.py`), which
call `run(config, workdir)` as a library function.

Sections in execution order: check the whole config (no compile, nothing written) -> warm
start (the SFT, cached) -> diagnose (SRDD, when the AQN arm needs it: aqn.layers 'located' or
'srdd') -> fault plan and its manifest -> shard and initialise the state -> restore (or
validate at step 0) -> the RL loop (validation every `trainer.val_every`, checkpoints every
`checkpoint.every`) -> summary.json and report.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
import time

import jax
import numpy as np

from aqn_jax import parallel, quant_base
from aqn_jax.checkpoint import (
    ABANDONED,
    Checkpointer,
    Preemption,
    base_changed,
    check_resumable,
    check_resume_base,
    check_resume_config,
    check_resume_warm_start,
    check_sane,
    record_override,
)
from aqn_jax.checks import check_train
from aqn_jax.diagnosis import srdd
from aqn_jax.export import EXPORT_DIR, check_target, export_policy, plain_policy
from aqn_jax.faults.config import with_abft
from aqn_jax.faults.intercept import FaultPlan
from aqn_jax.files import put_step_records
from aqn_jax.forward import trace_manifest
from aqn_jax.lora import fingerprint as lora_fingerprint
from aqn_jax.metrics import VALIDATION_SAMPLES, open_run, progress
from aqn_jax.models.registry import causal_lm, family_of
from aqn_jax.report import print_summary, run_summary, write_run_report
from aqn_jax.rl import step as rl_step
from aqn_jax.rl.trainer import Trainer, TrainerParts, prompt_batcher
from aqn_jax.sdc.guard import RollbackNeeded
from aqn_jax.sdc.telemetry import fault_fired, guard_hint
from aqn_jax.spec import RunSpec
from aqn_jax.warm_start import cached_sft, warm_start

EXPORT_FIELD = "the export of config.checkpoint.export='hf'"  # what its refusals name


def run(config, workdir: str) -> None:
    """The run's stages: set up (check, warm start, diagnose, fault plan, programs), begin
    (restore or validate at step 0), the loop, finish (export, summary). `config` is read here
    once (`check_train`: the `RunSpec` every stage takes), and only for config.json and the
    resume comparison after that."""
    t_start = time.perf_counter()
    r, state = _set_up(config, workdir)
    state, start, writer, history, ahead = _begin(r, state)
    state = _loop(r, state, start, writer, history, ahead)
    _finish(r, state, history, t_start)


@dataclasses.dataclass(frozen=True)
class _Run:
    """What the stages of one run share, set up (`_set_up`)."""

    spec: RunSpec
    workdir: str
    warm: tuple  # (model config, the warm start's float params: the manifest's, the export's)
    sft_info: dict
    base_print: str | None  # a LoRA run's frozen base (weight format: fingerprint)
    diagnosis: dict | None  # SRDD's report, where it ran (`spec.diagnose`)
    plan: FaultPlan  # the device's faults with the treatment (AQN) and ABFT placed
    loop: Trainer  # the RL steps and validations over the jitted step programs
    ckpt: Checkpointer

    @property
    def primary(self) -> bool:
        return jax.process_index() == 0

    @property
    def static(self) -> rl_step.Static:
        return self.loop.static

    @property
    def total(self) -> int:
        """The run's RL steps."""
        return self.loop.static.total_steps

    @property
    def val_size(self) -> int:
        return min(self.spec.trainer.val_size, len(self.spec.test_examples))

    def validate(self, state, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        params = rl_step.policy_weights(self.static, state)
        val_bs = self.spec.trainer.val_batch_size
        records: list[dict] = []
        v = self.loop.eval_accuracy(params, step, self.val_size, val_bs, records=records)
        if self.primary:  # per problem and device; a resumed run's repeat replaces its lines
            put_step_records(os.path.join(self.workdir, VALIDATION_SAMPLES), step, records)
        v["timing_s/testing"] = time.perf_counter() - t0
        return v


def _levers_off(
    static, plan, rollout_share: bool, prefix_share: bool = False, retire: bool = False
) -> list[str]:
    """The step-cost levers asked for and off, one line each with the reason."""
    lines = list(static.levers_off)
    if rollout_share and static.h.n > 1:
        why = plan.split_refusals("rollout", split=False)
        lines += [f"config.rollout.share_prompt off: {w}" for w in why]
    if prefix_share:
        for phase in ("rollout", "eval"):
            why = plan.prefix_refusals(phase)
            lines += [f"config.rollout.share_prefix off ({phase}): {w}" for w in why]
    if retire:  # the greedy decodes: the validation on the faulty device
        why = plan.prefix_refusals("eval")
        lines += [f"config.rollout.retire_rows off (eval): {w}" for w in why]
    return lines


def _set_up(config, workdir: str) -> tuple[_Run, rl_step.RLState]:
    """Check the config (every field, no compile), warm start (then the config is recorded: a
    refused resume writes nothing), diagnose, the fault plan, the step programs; (the run, the
    initial train state)."""
    spec = check_train(config, workdir)
    if spec.checkpoint.export == "hf":  # an existing one must be an export
        check_target(os.path.join(workdir, EXPORT_DIR), EXPORT_FIELD, workdir)
    print(spec.memory.table())
    # A layout change named, even overridden.
    override = bool(config.get("resume_override", False))
    changes = check_resume_config(config.to_json_best_effort(), override, workdir)
    check_resumable(workdir)  # a finished params-only run: refused before anything is written
    ws = spec.warm_start
    check_resume_warm_start(workdir, ws.key, ws.sft is None or cached_sft(ws, workdir) is not None)
    model_cfg, params, sft_info = warm_start(ws, workdir, train=spec.train_examples)
    float_params, weight_format = params, spec.weight_format
    base_print = None
    if spec.lora.enabled:
        # QeRL mode: the warm start is the frozen base (its decoder linears packed in the
        # format), and a checkpoint holds its fingerprint instead of its bytes.
        base_print = f"{weight_format}:{lora_fingerprint(params)}"
        params = quant_base.pack(params, weight_format, family_of(model_cfg).site_of)
    check_resume_base(workdir, base_print)  # another base (overridden fields): refused here
    if jax.process_index() == 0:
        if changes:
            record_override(workdir, changes)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))
    diagnosis, plan = _fault_plan(spec, workdir, params)
    state, loop = _programs(spec, plan, params)
    ck = spec.checkpoint
    ckpt = Checkpointer(workdir, ck.every, ck.keep, ck.final)
    warm = (model_cfg, float_params)
    r = _Run(spec, workdir, warm, sft_info, base_print, diagnosis, plan, loop, ckpt)
    _manifest(r, state)
    return r, state


def _fault_plan(spec: RunSpec, workdir: str, params) -> tuple[dict | None, FaultPlan]:
    """SRDD where the AQN arm needs it, then the fault plan (hardware faults + AQN, ABFT).
    (SRDD's report or None, the plan)"""
    diagnosis = None
    if spec.diagnose:
        diagnosis = srdd.run_srdd(
            spec.srdd, spec.model, params, spec.device, spec.train_examples, spec.tokenizer, workdir
        )
        verdict = diagnosis["verdict"]
        print(
            f"SRDD: {verdict['message']} (confidence {verdict['confidence']:.3f}); srdd.json"
            f" in {workdir}"
        )
    plan = spec.plan(
        srdd_sigmas=None if diagnosis is None else srdd.sigmas_of(diagnosis),
        srdd_layers=None if diagnosis is None else diagnosis["verdict"]["layers"],
    )
    sdc = spec.sdc  # SDC detection: ABFT checks after the faults
    if sdc.abft or sdc.abft_backward:
        plan = with_abft(plan, forward=sdc.abft, backward=sdc.abft_backward)
    print(plan.describe())
    return diagnosis, plan


def _manifest(r: _Run, state) -> None:
    """manifest.json: the plan's hits in each phase, traced on the policy's weights as the
    device reads them (a LoRA run's packed base with its adapters)."""
    plan, weights = r.plan, rl_step.policy_weights(r.static, state)
    model = causal_lm(r.warm[0])
    manifest = {
        phase: trace_manifest(plan, model, weights, phase)
        for phase in ("rollout", "train", "eval")
        if plan.active(phase)
    }
    if r.primary:
        with open(os.path.join(r.workdir, "manifest.json"), "w") as f:
            f.write(plan.manifest_json(manifest))


def _programs(spec: RunSpec, plan: FaultPlan, params) -> tuple[rl_step.RLState, Trainer]:
    """Shard and initialise the state by logical axes, jit the step programs once, and the loop
    (`Trainer`) over them on the device `plan`. (the state, the loop)"""
    mesh = parallel.make_mesh(spec.mesh_axes)
    batcher = prompt_batcher(spec.loop, spec.train_examples, spec.tokenizer)
    total = spec.trainer.steps(batcher.batches_per_epoch)
    static = rl_step.static_from(spec.step, spec.model, plan, spec.device, total)
    loop = spec.loop
    for line in _levers_off(static, plan, loop.share_prompt, loop.share_prefix, loop.retire_rows):
        print(line)
    sh = rl_step.shardings(static, mesh)
    lora_key = jax.random.fold_in(jax.random.key(spec.seed), 0x10AA)
    state, ref_params = rl_step.init_state(static, params, sh, lora_key)
    rep, ref_sh = sh.replicated, sh.replicated if ref_params is None else sh.params
    prepare = jax.jit(
        functools.partial(rl_step.prepare_step, static),
        in_shardings=(sh.state, ref_sh, sh.rows, sh.scores, rep, rep),
        out_shardings=(sh.rows, rep),
    )
    guarded = static.sdc is not None and static.sdc.guard.on
    update = jax.jit(
        functools.partial(rl_step.update_step, static),
        in_shardings=(sh.state, sh.rows, rep, rep),
        out_shardings=(sh.state, rep),
        donate_argnums=() if guarded else 0,  # a guard may keep the state before the step
    )
    parts = TrainerParts(
        spec=spec.loop,
        static=static,
        shardings=sh,
        prepare=prepare,
        update=update,
        ref_params=ref_params,
        batcher=batcher,
        tokenizer=spec.tokenizer,
        test_examples=spec.test_examples,
        hardware_plan=spec.device,
    )
    return state, Trainer(parts)


def _begin(r: _Run, state):
    """Restore the latest complete checkpoint, or validate at step 0; the step programs
    compile ahead meanwhile. (state, the last step done, the metrics writer, the rows so far,
    the compile ahead: None when no step is left)"""
    # Orbax never lists a half-written checkpoint; the per-step outputs then hold exactly the
    # rows up to it, or none (metrics.open_run).
    ckpt, batcher = r.ckpt, r.loop.batcher
    restored = ckpt.restore_latest(rl_step.saveable(state))
    start = 0 if restored is None else int(restored[0])
    if restored is not None and restored[2].get("base") != r.base_print:  # an earlier step's
        ckpt.close()
        raise ValueError(
            base_changed(f"{ckpt.directory}/{start}", restored[2].get("base"), r.base_print)
        )
    writer, history = open_run(r.workdir, None if restored is None else start)
    if restored is not None:
        _, saved, meta = restored
        state = saved.replace(base=state.base)
        batcher.load_state(meta["data"])
        print(f"resumed from {ckpt.directory}/{start} (RL step {start} of {r.total})")
    # The step programs (generate, prepare, update) compiled ahead for the next batch's shapes,
    # in a thread while step 0 validates: on an accelerator the validation runs on the device
    # meanwhile; on a CPU with a warm compile cache what is left (tracing, lowering, loading)
    # hides behind it, while a cold compile competes with it for the cores.
    ahead = Ahead(r.loop, state, batcher, start + 1) if start < r.total else None
    if restored is None:
        try:
            val0 = r.validate(state, 0)
        except SystemExit:  # SIGTERM (sigterm_exits_143): no RL step yet, nothing to save
            _abandon(ahead, writer, ckpt)
            raise
        writer.write(0, val0)
        history = [{"step": 0, **val0}]
    print(val_line(0, history[0]))
    return state, start, writer, history, ahead


def _loop(r: _Run, state, start: int, writer, history: list, ahead: Ahead | None):
    """The RL steps after `start`: validation every trainer.val_every, a checkpoint when due;
    a guard's rollback goes back to the last checkpoint (the loop's start without one)."""
    stop, ckpt, loop, batcher, total = Preemption(), r.ckpt, r.loop, r.loop.batcher, r.total
    bar = progress(total, "RL")
    bar.update(start)
    # The loop's first state and data position: a rollback's target without a checkpoint (a
    # guard keeps the update from donating the state, so these buffers stay valid).
    first = state, batcher.state(), start + 1
    fired: dict[int, str] = {}  # steps since the last save in which a bit fault fired
    try:
        step = start + 1
        while step <= total:
            # The first step's time includes the wait for the compile ahead (what it did not hide).
            wait = ahead.wait(stop) if step == start + 1 and ahead is not None else 0.0
            try:
                state, m = loop.step(state, step)
            except RollbackNeeded as e:  # the guard's last resort (config.sdc.guard)
                state, data, step = loop.recovery.rollback(
                    e, functools.partial(_latest, r, state), first
                )
                batcher.load_state(data)
                for t in [t for t in fired if t >= step]:  # to be redone
                    del fired[t]
                del history[step:]  # the rows of the steps to redo: one row a step stays
                writer.rewind(history)
                continue
            m["timing_s/step"] += wait
            if fault_fired(m):
                fired[step] = fault_fired(m)
            every = r.spec.trainer.val_every
            if step == total or (every and step % every == 0):
                m.update(r.validate(state, step))
                bar.write(val_line(step, m))
            writer.write(step, m)
            history.append(m)
            bar.update(1)
            acc = _last_val(history)["val-core/acc"]
            bar.set_postfix(reward=f"{m['critic/score/mean']:.3f}", acc=f"{acc:.3f}")
            if ckpt.due(step) or step == total or stop.requested:
                _save(r, step, state, m, fired, resumable=stop.requested)
            if stop.requested:  # also at the last step: the rerun finishes (export, summary)
                print(f"SIGTERM: saved RL step {step} to {ckpt.directory}; rerun to resume")
                raise SystemExit(143)
            step += 1
    finally:  # also on a crash: SIGTERM given back, async saves finished
        stop.close()
        if ahead is not None:
            ahead.close()  # a crash before step 1 leaves no compile thread running
        bar.close()
        ckpt.close()
        writer.close()
    return state


def _latest(r: _Run, state):
    """(the state, the data position, the step to run next) of the last checkpoint, or None
    without one: a rollback's target (`Recovery.rollback`)."""
    got = r.ckpt.restore_latest(rl_step.saveable(state))
    if got is None:
        return None
    back, restored, meta = got
    return restored.replace(base=state.base), meta["data"], int(back) + 1


def _save(r: _Run, step: int, state, m: dict, fired: dict[int, str], resumable=False) -> None:
    """Checkpoint `step` if the run is sane (`check_sane`; else it raises and nothing is
    saved), naming the bit faults that fired since the last save. `resumable` (a SIGTERM):
    the whole state even at the last step, whatever config.checkpoint.final says, since the
    rerun resumes there to finish the run."""
    saved = rl_step.saveable(state)
    cause = "; ".join(f"a bit fault fired in RL step {t} ({f})" for t, f in fired.items())
    hint = guard_hint(r.loop.recovery.note)
    check_sane(step, saved, m, r.spec.trainer.bounds, cause, hint)  # else nothing is saved
    fired.clear()
    meta = {"step": step, "data": r.loop.batcher.state(), "base": r.base_print}
    if r.base_print is not None:  # a LoRA run: the warm start its base came from
        meta["warm_start"] = r.spec.warm_start.key
    r.ckpt.save(step, saved, meta, step == r.total and not resumable)


def _last_val(history: list) -> dict:
    """The latest validation's metrics (val-* and its timing) among the rows."""
    return next(
        {k: v for k, v in row.items() if k.startswith(("val-", "timing_s/testing"))}
        for row in reversed(history)
        if "val-core/acc" in row
    )


def _finish(r: _Run, state, history: list, t_start: float) -> None:
    """The export (an HF snapshot of the trained policy, LoRA merged, `export.plain_policy`)
    and summary.json / report.md."""
    spec, workdir = r.spec, r.workdir
    if spec.checkpoint.export == "hf" and r.primary:
        trained = jax.device_get(state.params)
        model_cfg, plain = plain_policy(spec.lora, spec.weight_format, trained, r.warm)  # merged
        out = export_policy(
            os.path.join(workdir, EXPORT_DIR), model_cfg, plain, spec.tokenizer_path, EXPORT_FIELD
        )
        print(f"export: {out} (transformers loads it; evaluate with --config.model.hf_path={out})")
    val0 = {k: v for k, v in history[0].items() if k != "step"}
    val = (val0, _last_val(history), r.val_size)
    summary = run_summary(
        spec.summary, workdir, r.plan, r.diagnosis, history, val, r.total, r.sft_info, t_start
    )
    summary["train_prompts_dropped"] = spec.train_prompts_dropped  # longer than the bucket
    if r.primary:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print_summary(summary, write_run_report(workdir, summary, history))


def _abandon(ahead, writer, ckpt) -> None:
    """A SIGTERM before the first RL step since the start or the last checkpoint: nothing to
    save, so the compile ahead (if still running) is abandoned, not waited for (launch ends
    the process once the job's cleanup ran)."""
    if ahead is not None and ahead.running():
        ahead.abandon()
    writer.close()
    ckpt.close()


def val_line(step: int, val: dict) -> str:
    """The one line a validation prints."""
    return (
        f"step {step}: val acc {val['val-core/acc']:.3f} (faulty device),"
        f" {val['val-clean/acc']:.3f} (clean)"
    )


class Ahead:
    """Compiles `loop`'s step programs (the rollout's generate, prepare and update) in a thread
    for the shapes of the batch step `step` will draw (peeked: the batcher is put back), so that
    the step runs compiled: `jit(f).lower(...).compile()` fills the jit's own cache. The inputs
    are what `Trainer.step` passes, built from zeros of those shapes (the values do not matter,
    only shapes, dtypes and shardings); an input that differed would only cost a compile inside
    the step (tests/test_train.py asserts there is none)."""

    def __init__(self, loop: Trainer, state, batcher, step: int):
        position = batcher.state()
        batch = batcher.next_batch()
        prompts = {k: np.asarray(batch[k]) for k in ("input_ids", "attention_mask")}
        batcher.load_state(position)
        self._error: BaseException | None = None
        # A daemon, but never left running at an ordinary exit (`close` joins it): a SIGTERM
        # with nothing to save abandons it (`abandon`), and the process then ends by os._exit
        # (launch), never inside the interpreter's teardown.
        self._thread = threading.Thread(
            target=self._run, args=(loop, state, prompts, step), daemon=True
        )
        self._abandoned = False
        self._thread.start()

    def running(self) -> bool:
        return self._thread.is_alive()

    def abandon(self) -> None:
        """Leave the compile to the process's end (checkpoint.ABANDONED tells launch)."""
        print(
            "SIGTERM during the compile: no RL step since the last checkpoint, nothing to save;"
            " exiting (143) without waiting for the compile",
            flush=True,
        )
        self._abandoned = True
        ABANDONED.set()

    def _run(self, loop, state, prompts, step) -> None:
        try:
            loop.compile_step(state, prompts, step)
        except BaseException as e:  # re-raised by `wait`, in the loop's thread
            self._error = e

    def wait(self, stop: Preemption | None = None) -> float:
        """Seconds spent waiting for the compile to finish; raises what it raised. A SIGTERM
        meanwhile (`stop.requested`; the first step has not run, nothing to save) abandons it
        and exits 143."""
        t0 = time.perf_counter()
        while self._thread.is_alive():
            self._thread.join(0.2)
            if stop is not None and stop.requested and self._thread.is_alive():
                self.abandon()
                raise SystemExit(143)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return time.perf_counter() - t0

    def close(self) -> None:
        if not self._abandoned:
            self._thread.join()
