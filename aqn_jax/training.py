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

import functools
import json
import os
import threading
import time

import jax
import numpy as np

from aqn_jax import parallel, quant_base
from aqn_jax.aqn.config import AQN_SIGMA
from aqn_jax.aqn.plan import build_plan, needs_srdd
from aqn_jax.checkpoint import (
    ABANDONED,
    Checkpointer,
    Preemption,
    base_changed,
    check_resumable,
    check_resume_base,
    check_resume_config,
    check_sane,
    record_override,
)
from aqn_jax.checks import check_train
from aqn_jax.data.config import load_split
from aqn_jax.diagnosis import srdd
from aqn_jax.export import EXPORT_DIR, check_target, export_policy
from aqn_jax.faults.config import with_abft
from aqn_jax.faults.intercept import step_key
from aqn_jax.lora import fingerprint as lora_fingerprint
from aqn_jax.lora import merged as lora_merged
from aqn_jax.metrics import open_run, progress
from aqn_jax.models.registry import causal_lm, family_of, init_cache
from aqn_jax.report import print_summary, run_summary, summary_spec, write_run_report
from aqn_jax.rl import sampler as rl_sampler
from aqn_jax.rl import step as rl_step
from aqn_jax.rl.guard import RollbackNeeded, guard_spec
from aqn_jax.rl.rollout_correction import correct
from aqn_jax.rl.trainer import (
    Trainer,
    fault_fired,
    guard_hint,
    loop_spec,
    prompt_batcher,
    train_batch,
)
from aqn_jax.warm_start import warm_start


def run(config, workdir: str) -> None:
    t_start = time.perf_counter()
    primary = jax.process_index() == 0

    # ---------------------------------------------------------------------------------------
    # Check the config (every field, no compile) and record it
    # ---------------------------------------------------------------------------------------
    checked = check_train(config, workdir)
    model_cfg, tokenizer, hw_plan, memory = checked
    export_field = "the export of config.checkpoint.export='hf'"
    if config.checkpoint.get("export", "none") == "hf":  # an existing one must be an export
        check_target(os.path.join(workdir, EXPORT_DIR), export_field, workdir)
    print(memory.table())
    n_layers = model_cfg.num_hidden_layers
    described = summary_spec(config, n_layers)  # what summary.json says of the config
    train_examples = load_split(config.data, "train")
    test_examples = load_split(config.data, "test")
    changes = check_resume_config(config, workdir)  # a layout change named, even overridden
    check_resumable(workdir)  # a finished params-only run: refused before anything is written

    # ---------------------------------------------------------------------------------------
    # Warm start (then the config is recorded: a refused resume writes nothing)
    # ---------------------------------------------------------------------------------------
    model_cfg, params, sft_info = warm_start(checked.warm_start, workdir)
    float_params = params  # the warm start as it is: the manifest's trace, the export's base
    lora_spec = rl_step.lora_spec_of(config)
    weight_format = config.model.get("weight_format", "none")
    base_print = None
    if lora_spec.enabled:
        # QeRL mode: the warm start is the frozen base (its decoder linears packed in the
        # format), and a checkpoint holds its fingerprint instead of its bytes.
        base_print = f"{weight_format}:{lora_fingerprint(params)}"
        params = quant_base.pack(params, weight_format, family_of(model_cfg).site_of)
    check_resume_base(workdir, base_print)  # another base (overridden fields): refused here
    if primary:
        if changes:
            record_override(workdir, changes)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))

    # ---------------------------------------------------------------------------------------
    # Diagnose (SRDD) where the AQN arm needs it
    # ---------------------------------------------------------------------------------------
    diagnosis = srdd_sigmas = None
    if needs_srdd(config.aqn) or config.diagnosis.always:
        diagnosis = srdd.run_srdd(
            srdd.srdd_spec(config), model_cfg, params, hw_plan, train_examples, tokenizer, workdir
        )
        srdd_sigmas = srdd.sigmas_of(diagnosis)
        verdict = diagnosis["verdict"]
        print(
            f"SRDD: {verdict['message']} (confidence {verdict['confidence']:.3f}); srdd.json"
            f" in {workdir}"
        )

    # ---------------------------------------------------------------------------------------
    # Fault plan (hardware faults + AQN) and its manifest
    # ---------------------------------------------------------------------------------------
    plan = build_plan(
        config.faults,
        config.aqn,
        n_layers,
        srdd_sigmas=srdd_sigmas,
        srdd_layers=None if diagnosis is None else diagnosis["verdict"]["layers"],
    )
    sdc = guard_spec(config.get("sdc"))  # SDC detection: ABFT checks after the faults
    if sdc.abft or sdc.abft_backward:
        plan = with_abft(plan, forward=sdc.abft, backward=sdc.abft_backward)
    print(plan.describe())
    manifest = {
        phase: plan.trace_manifest(causal_lm(model_cfg), float_params, phase)
        for phase in ("rollout", "train", "eval")
        if plan.active(phase)
    }
    if primary:
        with open(os.path.join(workdir, "manifest.json"), "w") as f:
            f.write(plan.manifest_json(manifest))

    # ---------------------------------------------------------------------------------------
    # Shard & initialise: the state by logical axes, the step programs jitted once
    # ---------------------------------------------------------------------------------------
    mesh = parallel.make_mesh(config.mesh)
    spec = loop_spec(config)
    batcher = prompt_batcher(spec, train_examples, tokenizer)
    total = rl_step.total_steps_of(config.trainer, batcher.batches_per_epoch)
    static = rl_step.static_from(rl_step.step_spec(config), model_cfg, plan, hw_plan, total)
    sh = rl_step.shardings(static, mesh)
    lora_key = jax.random.fold_in(jax.random.key(int(config.seed)), 0x10AA)
    state, ref_params = rl_step.init_state(static, params, sh, lora_key)
    del params  # the state holds them (placed), or the base and the adapters
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
    loop = Trainer(
        spec, static, sh, prepare, update, ref_params, batcher, tokenizer, test_examples, hw_plan
    )
    ck = config.checkpoint
    ckpt = Checkpointer(workdir, int(ck.every), int(ck.keep), ck.get("final", "state"))
    val_size = min(int(config.trainer.val_size), len(test_examples))
    val_bs = int(config.trainer.val_batch_size)

    def eval_now(state, step):
        t0 = time.perf_counter()
        v = loop.eval_accuracy(rl_step.policy_weights(static, state), step, val_size, val_bs)
        v["timing_s/testing"] = time.perf_counter() - t0
        return v

    # ---------------------------------------------------------------------------------------
    # Restore the latest complete checkpoint, or validate at step 0
    # ---------------------------------------------------------------------------------------
    # Orbax never lists a half-written checkpoint; the per-step outputs then hold exactly the
    # rows up to it, or none (metrics.open_run).
    restored = ckpt.restore_latest(rl_step.saveable(state))
    start = 0 if restored is None else int(restored[0])
    if restored is not None and restored[2].get("base") != base_print:  # an earlier step's
        ckpt.close()
        raise ValueError(
            base_changed(f"{ckpt.directory}/{start}", restored[2].get("base"), base_print)
        )
    writer, history = open_run(workdir, None if restored is None else start)
    if restored is not None:
        _, saved, meta = restored
        state = saved.replace(base=state.base)
        batcher.load_state(meta["data"])
        print(f"resumed from {ckpt.directory}/{start} (RL step {start} of {total})")
    # The step programs (generate, prepare, update) compiled ahead for the next batch's shapes,
    # in a thread while step 0 validates: on an accelerator the validation runs on the device
    # meanwhile; on a CPU with a warm compile cache what is left (tracing, lowering, loading)
    # hides behind it, while a cold compile competes with it for the cores (WORKSPACE.md,
    # issue 41: measured on 2 cores both ways).
    ahead = Ahead(loop, state, batcher, start + 1) if start < total else None
    if restored is None:
        try:
            val0 = eval_now(state, 0)
        except SystemExit:  # SIGTERM (sigterm_exits_143): no RL step yet, nothing to save
            _abandon(ahead, writer, ckpt)
            raise
        writer.write(0, val0)
        history = [{"step": 0, **val0}]
    val0 = {k: v for k, v in history[0].items() if k != "step"}
    last_val = next(
        {k: v for k, v in r.items() if k.startswith(("val-", "timing_s/testing"))}
        for r in reversed(history)
        if "val-core/acc" in r
    )
    print(val_line(0, val0))

    # ---------------------------------------------------------------------------------------
    # Train loop
    # ---------------------------------------------------------------------------------------
    stop = Preemption()
    bar = progress(total, "RL")
    bar.update(start)
    # The loop's first state and data position: a rollback's target without a checkpoint (a
    # guard keeps the update from donating the state, so these buffers stay valid).
    state0, data0 = state, batcher.state()
    fired: dict[int, str] = {}  # steps since the last save in which a bit fault fired

    def rollback(e: RollbackNeeded):
        """The state and data position of the last checkpoint (the loop's first ones without
        one), and the step to run next."""
        loop.note_rollback(e.step)
        print(f"{e}")
        got = ckpt.restore_latest(rl_step.saveable(state))
        if got is None:
            batcher.load_state(data0)
            return state0, start + 1
        back, restored, meta = got
        batcher.load_state(meta["data"])
        return restored.replace(base=state.base), int(back) + 1

    try:
        step = start + 1
        while step <= total:
            # The first step's time includes the wait for the compile ahead (what it did not hide).
            wait = ahead.wait(stop) if step == start + 1 and ahead is not None else 0.0
            try:
                state, m = loop.step(state, step)
            except RollbackNeeded as e:  # the guard's last resort (config.sdc.guard)
                state, step = rollback(e)
                for t in [t for t in fired if t >= step]:  # to be redone
                    del fired[t]
                del history[step:]  # the rows of the steps to redo: one row a step stays
                writer.rewind(history)
                continue
            m["timing_s/step"] += wait
            if fault_fired(m):
                fired[step] = fault_fired(m)
            every = config.trainer.val_every
            if step == total or (every and step % every == 0):
                last_val = eval_now(state, step)
                m.update(last_val)
                bar.write(val_line(step, last_val))
            writer.write(step, m)
            history.append(m)
            bar.update(1)
            bar.set_postfix(
                reward=f"{m['critic/score/mean']:.3f}", acc=f"{last_val['val-core/acc']:.3f}"
            )
            if ckpt.due(step) or step == total or stop.requested:
                saved = rl_step.saveable(state)
                cause = "; ".join(
                    f"a bit fault fired in RL step {t} ({f})" for t, f in fired.items()
                )
                hint = guard_hint(loop.sdc_note)
                check_sane(step, saved, m, config.trainer, cause, hint)  # else nothing is saved
                fired.clear()
                meta = {"step": step, "data": batcher.state(), "base": base_print}
                ckpt.save(step, saved, meta, step == total)
            if stop.requested and step < total:
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

    # ---------------------------------------------------------------------------------------
    # Export (an HF snapshot of the trained policy, LoRA merged)
    # ---------------------------------------------------------------------------------------
    if ck.get("export", "none") == "hf" and primary:
        trained = jax.device_get(state.params)
        plain = (
            lora_merged(
                lora_spec,
                quant_base.pack(float_params, weight_format, family_of(model_cfg).site_of),
                trained,
            )
            if lora_spec.enabled
            else trained
        )
        out = export_policy(
            os.path.join(workdir, EXPORT_DIR),
            model_cfg,
            plain,
            config.tokenizer_path or config.model.hf_path,
            export_field,
        )
        print(f"export: {out} (transformers loads it; evaluate with --config.model.hf_path={out})")

    # ---------------------------------------------------------------------------------------
    # Summary
    # ---------------------------------------------------------------------------------------
    val = (val0, last_val, val_size)
    summary = run_summary(
        described, workdir, plan, diagnosis, history, val, total, sft_info, t_start
    )
    summary["train_prompts_dropped"] = checked.train_prompts_dropped  # longer than the bucket
    if primary:
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
        prompts = batcher.next_batch()["input_ids"]
        batcher.load_state(position)
        self._error: BaseException | None = None
        # A daemon, but never left running at an ordinary exit (`close` joins it): a SIGTERM
        # with nothing to save abandons it (`abandon`), and the process then ends by os._exit
        # (launch), never inside the interpreter's teardown.
        self._thread = threading.Thread(
            target=self._run, args=(loop, state, prompts.shape, step), daemon=True
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

    def _run(self, loop, state, shape, step) -> None:
        try:
            compile_step_programs(loop, state, shape, step)
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


def compile_step_programs(loop: Trainer, state, prompt_shape: tuple[int, int], step: int) -> None:
    """Lower and compile generate, prepare and update for `prompt_shape` ([prompts, length]) as
    `Trainer.step(state, step)` will call them."""
    static, mesh, seed = loop.static, loop.mesh, loop.spec.seed
    sampler = loop.rollout_sampler
    rows, bucket = prompt_shape[0] * static.h.n, sampler.bucket(prompt_shape[1])
    new = static.max_new
    sigma = np.float32(loop.spec.aqn.sigma(step, static.total_steps))
    key = step_key(seed, step, "rollout")  # any key: only its type and shape matter

    # generate: the Sampler's jit, with its prompts and KV cache as it places them; the cache is
    # made here too (its first call would make it) and left in the sampler's pool for the step.
    ids = np.zeros((rows, bucket), np.int32)
    make = lambda: init_cache(sampler.model.config, rows, bucket + new)  # noqa: E731
    shardings = rl_sampler._cache_sharding(mesh, jax.eval_shape(make))
    cache = sampler._caches.setdefault((rows, bucket), jax.jit(make, out_shardings=shardings)())
    sampler._program.lower(
        loop.generation_weights(rl_step.policy_weights(static, state)),
        *parallel.put_batch((ids, ids), mesh),
        (key, key),
        cache,
        {AQN_SIGMA: sigma, **loop.sdc_values(step, 0)},
    ).compile()

    # prepare: the rollout as train rows (`train_batch`), on the mesh as the step puts them
    tokens = np.zeros((rows, new), np.int32)
    out = rl_sampler.SampleOutput(ids, ids, tokens, tokens.astype(np.float32), tokens + 1, {})
    tb = train_batch(out, np.zeros(rows, np.float32))
    dev = parallel.put_batch({k: v for k, v in tb.items() if k != "scores"}, mesh)
    scores = parallel.put_batch(tb["scores"], mesh)
    train_key = step_key(seed, step, "train")
    values = {AQN_SIGMA: sigma, **loop.sdc_values(step, 0)}
    prepared = loop.prepare.lower(state, loop.ref_params, dev, scores, train_key, values).compile()

    # update: the prepared rows and the rollout correction's, as `Trainer.step` assembles them
    prep = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        prepared.out_info[0],
    )
    upd = {k: dev[k] for k in ("ids", "mask", "tokens", "rmask")}
    upd.update({k: prep[k] for k in ("old_logp", "advantages", "ref_logp") if k in prep})
    if static.use_critic:
        upd.update(values=prep["values"], returns=prep["returns"])
    corr = correct(tb["sampler_logp"], tb["sampler_logp"], tb["rmask"], static.h.correction)
    for name, value in (
        ("is_weights", corr.is_weights),
        ("rmask", corr.loss_mask),
        ("old_logp", corr.old_logp),
    ):
        if value is not None:
            upd[name] = parallel.put_batch(value, mesh)
    loop.update.lower(state, upd, train_key, values).compile()
