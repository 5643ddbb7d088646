"""Job `train`: RL (GRPO / PPO) of the warm-started policy on the simulated faulty device.

Order: validate the whole config (no compile, nothing written) -> SFT warm start (cached) ->
SRDD diagnosis when the AQN arm needs it (aqn.layers 'located' or 'srdd') -> fault plan and its
manifest -> validation at step 0 -> RL steps (validation every `trainer.val_every`, checkpoints
every `checkpoint.every`) -> final validation, checkpoint, summary.json and report.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np

from aqn_jax import parallel, planner
from aqn_jax.checkpoint import Checkpointer
from aqn_jax.data.config import check_data, load_split
from aqn_jax.data.gsm8k import tokenize_prompts
from aqn_jax.diagnosis import srdd
from aqn_jax.faults.config import build_plan, needs_srdd
from aqn_jax.jobs import check_required
from aqn_jax.jobs.pretrain import check_sft, check_sft_cache, tokenizer_for, warm_start
from aqn_jax.metrics import open_run, progress
from aqn_jax.models.factory import model_config
from aqn_jax.models.qwen2 import Qwen2ForCausalLM
from aqn_jax.report import write_run_report
from aqn_jax.rl.optim import check_optimizer
from aqn_jax.rl.sampler import check_rollout
from aqn_jax.rl.trainer import Trainer, hyper_from


def check_prompt_lengths(config, tokenizer, test_examples) -> None:
    """Validation prompts must fit the largest prompt bucket (training drops longer ones)."""
    size = min(int(config.trainer.val_size), len(test_examples))
    lengths = [len(tokenizer.encode_chat(ex.prompt_messages)) for ex in test_examples[:size]]
    _check_val_lengths(config, lengths, len(test_examples))


def _check_val_lengths(config, lengths, test_size: int) -> None:
    if not len(lengths):
        raise ValueError(
            f"config.trainer.val_size={config.trainer.val_size} with {test_size} test"
            " examples: no validation prompt; val_size must be >= 1 and the test split non-empty"
        )
    longest = max(lengths)
    limit = min(max(config.rollout.prompt_buckets), int(config.rollout.max_prompt_len))
    if longest > limit:
        raise ValueError(
            f"the longest validation prompt has {longest} tokens > {limit}: raise"
            f" config.rollout.prompt_buckets={tuple(config.rollout.prompt_buckets)} and"
            f" config.rollout.max_prompt_len={config.rollout.max_prompt_len}"
        )


_LENGTHS: dict = {}  # (split, data, tokenizer) -> prompt lengths: the compare job validates 7 arms


def prompt_lengths(config, tokenizer, split: str) -> np.ndarray:
    """The token count of every prompt of `split` ('train' | 'test') as the batcher counts it
    (chat template, generation prompt), remembered per data section, file and tokenizer."""
    data = config.data
    path = os.path.expanduser(data[f"{split}_path"]) if data[f"{split}_path"] else ""
    stamp = (os.stat(path).st_mtime_ns, os.path.getsize(path)) if path else None
    tok = config.tokenizer_path or config.model.hf_path
    key = (split, json.dumps(data.to_dict(), sort_keys=True, default=str), stamp, tok)
    if key not in _LENGTHS:
        if len(_LENGTHS) >= 4:  # a few configs' splits at a time: bounded memory
            _LENGTHS.clear()
        ids = tokenize_prompts(load_split(data, split), tokenizer)
        _LENGTHS[key] = np.array([len(t) for t in ids], np.int64)
    return _LENGTHS[key]


def check_train_prompts(config, lengths) -> int:
    """The train prompts the batcher drops (longer than config.rollout.max_prompt_len), counted
    and printed; refused when config.data.drop_long_prompts is False, when too few are left for
    one batch, or when one it keeps would not fit the sampler's largest prompt bucket. `lengths`:
    every train prompt's token count (`prompt_lengths`). Returns the number dropped."""
    ro = config.rollout
    limit = int(ro.max_prompt_len)
    lengths = np.asarray(lengths, np.int64)
    total, long = len(lengths), lengths > limit
    dropped = int(long.sum())
    where = f"config.rollout.max_prompt_len={limit}"
    buckets = f"config.rollout.prompt_buckets={tuple(ro.prompt_buckets)}"
    what = (
        f"{dropped} of {total} train prompts are longer than {where} tokens"
        f" (up to {int(lengths.max(initial=0))})"
    )
    if dropped and not config.data.get("drop_long_prompts", True):
        raise ValueError(
            f"config.data.drop_long_prompts=False and {what}; raise config.rollout.max_prompt_len"
            f" and {buckets}, or set config.data.drop_long_prompts=True to train without them"
        )
    kept, prompts = total - dropped, int(config.data_batch.prompts)
    if total < prompts:
        raise ValueError(
            f"config.data_batch.prompts={prompts}; must be <= the {total} prompts of the train"
            " split (config.data.train_path, or config.data.train_size for the embedded task)"
        )
    if kept < prompts:
        raise ValueError(
            f"{what}, and the {kept} left are fewer than config.data_batch.prompts={prompts} (one"
            f" batch); raise config.rollout.max_prompt_len and {buckets} to at least"
            f" {int(np.sort(lengths)[prompts - 1])}"
        )
    if dropped:
        print(f"{what}: dropped (config.data.drop_long_prompts=True); {kept} train prompts left")
    top = max(int(b) for b in ro.prompt_buckets)
    unfit = int(((lengths > top) & ~long).sum())
    if unfit:
        raise ValueError(
            f"{buckets}: {unfit} train prompts are longer than its largest bucket {top} and within"
            f" {where}, so the sampler could not pad them; add a bucket >= {limit}"
        )
    return dropped


def check_trainer(config) -> None:
    """config.trainer and config.checkpoint: the loop's counts and sizes."""
    tr = config.trainer
    if tr.get("total_epochs", 0) < 0:
        raise ValueError(f"config.trainer.total_epochs={tr.total_epochs}; must be >= 0 (0 = steps)")
    if not tr.get("total_epochs", 0) and tr.total_steps < 1:
        raise ValueError(
            f"config.trainer.total_steps={tr.total_steps}; must be >= 1 (or set"
            " config.trainer.total_epochs > 0)"
        )
    if tr.val_every < 0:
        raise ValueError(f"config.trainer.val_every={tr.val_every}; must be >= 0 (0 = start/end)")
    if tr.val_size < 1:
        raise ValueError(f"config.trainer.val_size={tr.val_size}; must be >= 1 (test examples)")
    if tr.val_batch_size < 1:
        raise ValueError(f"config.trainer.val_batch_size={tr.val_batch_size}; must be >= 1")
    for name in ("max_grad_norm", "max_param_abs"):
        if not float(tr.get(name, 0)) >= 0:
            raise ValueError(f"config.trainer.{name}={tr.get(name)}; must be >= 0 (0 = no bound)")
    # The Checkpointer refuses these too, but only once the trainer is built (after the SFT).
    ck = config.checkpoint
    if ck.every < 0:
        raise ValueError(f"config.checkpoint.every={ck.every}; must be >= 0 (0 = only at the end)")
    if ck.keep < 1:
        raise ValueError(f"config.checkpoint.keep={ck.keep}; must be >= 1")


class Validated(tuple):
    """`validate`'s result: unpacks as (model config, tokenizer, hardware plan, memory plan);
    `train_prompts` / `train_prompts_dropped` count the train split and the prompts the batcher
    will drop as longer than config.rollout.max_prompt_len."""

    train_prompts: int
    train_prompts_dropped: int

    def __new__(cls, qcfg, tokenizer, hw, memory, *, train_prompts: int, dropped: int):
        self = super().__new__(cls, (qcfg, tokenizer, hw, memory))
        self.train_prompts, self.train_prompts_dropped = train_prompts, dropped
        return self


def validate(config, workdir: str | None = None) -> Validated:
    """Every check that needs no compile; raises ValueError naming the field. Nothing is
    written. `workdir` locates the default SFT cache (<workdir>/../cache) for its check."""
    check_required(config)
    # The config's own values first (no file read): a typo fails in well under a second.
    check_rollout(config.rollout)
    hyper_from(config)  # data_batch / rollout.n / actor batch sizes, algo
    check_optimizer(config.actor, "warmup_steps", "config.actor")
    if config.algo.estimator == "gae":
        check_optimizer(config.critic, "lr_warmup_steps", "config.critic")
    check_trainer(config)
    qcfg = model_config(config.model)
    n = qcfg.num_hidden_layers
    tokenizer = tokenizer_for(config)
    check_data(config.data)
    if config.sft.enabled:
        check_sft(config.sft)
    srdd.check_config(config.diagnosis)
    hw = srdd.hardware_plan(config, n)  # fault layers within the model, fields valid
    # The AQN arm parses now; 'located' / 'srdd' get their layers from the diagnosis later.
    build_plan(config, n, srdd_sigmas=dict.fromkeys(range(n), 0.05), srdd_layers=[0])
    mesh_shape = parallel.mesh_shape(config.mesh, jax.device_count())
    divisor = mesh_shape[0] * mesh_shape[1]
    rows = int(config.data_batch.prompts) * int(config.rollout.n)
    if rows % divisor:
        raise ValueError(
            f"config.data_batch.prompts * config.rollout.n = {rows} rows do not split over the"
            f" data x fsdp = {divisor} devices of config.mesh"
        )
    if config.actor.micro_batch_rows % divisor:
        raise ValueError(
            f"config.actor.micro_batch_rows={config.actor.micro_batch_rows} does not split over"
            f" the data x fsdp = {divisor} devices of config.mesh"
        )
    if config.trainer.val_batch_size % divisor:
        raise ValueError(
            f"config.trainer.val_batch_size={config.trainer.val_batch_size} does not split over"
            f" the data x fsdp = {divisor} devices of config.mesh"
        )
    # Per-device memory from shapes alone; refuses (suggesting a mesh) when it cannot fit.
    memory = planner.check(config, qcfg, jax.device_count())
    # The data as the run will batch it: every train prompt tokenized, the validation prompts.
    train = prompt_lengths(config, tokenizer, "train")
    dropped = check_train_prompts(config, train)
    test = prompt_lengths(config, tokenizer, "test")
    _check_val_lengths(config, test[: int(config.trainer.val_size)], len(test))
    check_sft_cache(config, workdir)  # last: the SFT would train, then fail to be cached
    return Validated(qcfg, tokenizer, hw, memory, train_prompts=len(train), dropped=dropped)


# Fields a resumed run may change: where things go and how often they are saved or reported,
# never what is trained. Anything else changed against the workdir's config.json is refused.
RESUME_FREE = ("checkpoint.every", "checkpoint.keep", "sft.cache_dir", "resume_override")
RESUME_FREE_SECTIONS = ("distributed.", "planner.", "compare.", "evaluate.")


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resume_config(config, workdir: str) -> dict:
    """A workdir with checkpoints is resumed only under the config it was started with.
    Returns the changed fields {path: (old, new)} when `config.resume_override` allows them;
    raises ValueError naming them otherwise. No checkpoint: nothing to check."""
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
    new = _flat(json.loads(config.to_json_best_effort()))
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
    if changed and not config.get("resume_override", False):
        shown = ", ".join(f"config.{k}: {a!r} -> {b!r}" for k, (a, b) in list(changed.items())[:6])
        more = f" (+{len(changed) - 6} more)" if len(changed) > 6 else ""
        raise ValueError(
            f"{workdir} holds checkpoints of a run with another config: {shown}{more}; resume"
            " with the same config, use another --workdir, or pass"
            " --config.resume_override=True to continue with the new values (recorded in"
            " config_overrides.jsonl)"
        )
    return changed


def _record_override(workdir: str, changes: dict) -> None:
    row = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "changed": {k: {"from": a, "to": b} for k, (a, b) in changes.items()},
    }
    with open(os.path.join(workdir, "config_overrides.jsonl"), "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    print(f"resume with a changed config (override, recorded): {sorted(changes)}")


def run(config, workdir: str) -> None:
    t_start = time.perf_counter()
    checked = validate(config, workdir)
    qcfg, tokenizer, hw_plan, memory = checked
    print(memory.table())
    n_layers = qcfg.num_hidden_layers
    train_examples = load_split(config.data, "train")
    test_examples = load_split(config.data, "test")
    primary = jax.process_index() == 0
    changes = check_resume_config(config, workdir)
    if primary:
        if changes:
            _record_override(workdir, changes)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))

    qcfg, params, sft_info = warm_start(config, workdir)

    srdd_layers = srdd_sigmas = None
    if needs_srdd(config) or config.diagnosis.always:
        ids, mask = srdd.calibration_batch(
            train_examples,
            tokenizer,
            int(config.diagnosis.num_prompts),
            int(config.diagnosis.max_prompt_len),
        )
        base = float(config.diagnosis.base_sigma or config.aqn.sigma_start)
        report = srdd.diagnose(
            Qwen2ForCausalLM(qcfg), params, hw_plan, ids, mask, config.diagnosis, base
        )
        if primary:
            srdd.write_report(report, workdir)
        srdd_layers = report["verdict"]["layers"]
        srdd_sigmas = srdd.sigmas_of(report)
        print(
            f"SRDD: {report['verdict']['message']} (confidence"
            f" {report['verdict']['confidence']:.3f}); srdd.json in {workdir}"
        )

    plan = build_plan(config, n_layers, srdd_sigmas=srdd_sigmas, srdd_layers=srdd_layers)
    model = Qwen2ForCausalLM(qcfg)
    print(plan.describe())
    for phase in ("rollout", "train", "eval"):
        if plan.active(phase):
            plan.trace_manifest(model, params, phase)
    if primary:
        with open(os.path.join(workdir, "manifest.json"), "w") as f:
            f.write(plan.manifest_json())

    mesh = parallel.make_mesh(config.mesh)
    trainer = Trainer(
        config, qcfg, params, tokenizer, train_examples, test_examples, plan, hw_plan, mesh
    )
    total = trainer.total_steps
    ckpt = Checkpointer(workdir, int(config.checkpoint.every), int(config.checkpoint.keep))
    val_size = min(int(config.trainer.val_size), len(test_examples))
    val_bs = int(config.trainer.val_batch_size)

    def validate_now(step):
        t0 = time.perf_counter()
        v = trainer.validate(step, val_size, val_bs)
        v["timing_s/testing"] = time.perf_counter() - t0
        return v

    # Resume from the latest complete, readable checkpoint (Orbax never lists a half-written
    # one). The per-step outputs then hold exactly the rows up to it, or none (metrics.open_run).
    restored = ckpt.restore_latest(trainer.state)
    start = 0 if restored is None else int(restored[0])
    writer, history = open_run(workdir, None if restored is None else start)
    if restored is not None:
        _, trainer.state, meta = restored
        trainer.batcher.load_state(meta["data"])
        print(f"resumed from {ckpt.directory}/{start} (RL step {start} of {total})")
    else:
        val0 = validate_now(0)
        writer.write(0, val0)
        history = [{"step": 0, **val0}]
    val0 = {k: v for k, v in history[0].items() if k != "step"}
    last_val = next(
        {k: v for k, v in r.items() if k.startswith(("val-", "timing_s/testing"))}
        for r in reversed(history)
        if "val-core/acc" in r
    )
    print(
        f"step 0: val acc {val0['val-core/acc']:.3f} (faulty device),"
        f" {val0['val-clean/acc']:.3f} (clean)"
    )
    stop = _Preemption()
    bar = progress(total, "RL")
    bar.update(start)
    try:
        for step in range(start + 1, total + 1):
            m = trainer.step(step)
            if config.trainer.val_every and step % config.trainer.val_every == 0 and step < total:
                last_val = validate_now(step)
                m.update(last_val)
            if step == total:
                last_val = validate_now(step)
                m.update(last_val)
            writer.write(step, m)
            history.append(m)
            bar.update(1)
            bar.set_postfix(
                reward=f"{m['critic/score/mean']:.3f}", acc=f"{last_val['val-core/acc']:.3f}"
            )
            if ckpt.due(step) or step == total or stop.requested:
                check_sane(step, trainer.state, m, config.trainer)  # else nothing is saved
                ckpt.save(step, trainer.state, {"step": step, "data": trainer.batcher.state()})
            if stop.requested and step < total:
                print(f"SIGTERM: saved RL step {step} to {ckpt.directory}; rerun to resume")
                raise SystemExit(143)
    finally:  # also on a crash: SIGTERM given back, async saves finished
        stop.close()
        bar.close()
        ckpt.close()
        writer.close()

    fault_layers = _fault_layers(config, n_layers)
    aqn_inj = [inj for inj in plan.injections if inj.name == "aqn"]
    aqn_layers = None
    if aqn_inj:
        layers = aqn_inj[0].sites.layers
        aqn_layers = list(range(n_layers)) if layers == "all" else list(layers)
    summary = {
        "name": os.path.basename(os.path.abspath(workdir)),
        "fault_layers": fault_layers,
        "train_prompts_dropped": checked.train_prompts_dropped,  # longer than the bucket
        "srdd_located_layers": srdd_layers,
        "aqn_layers": aqn_layers,
        "aqn_layer_sigmas": srdd_sigmas if config.aqn.layers == "srdd" else None,
        "val_acc_start": val0["val-core/acc"],
        "val_acc_clean_start": val0["val-clean/acc"],
        "val_acc_end": last_val["val-core/acc"],
        "val_acc_clean_end": last_val["val-clean/acc"],
        # The fault's cost at the start (clean minus faulty device, same policy) and the share
        # of it RL won back on the faulty device (None without a cost to win back).
        "fault_gap_start": val0["val-clean/acc"] - val0["val-core/acc"],
        "recovered": _recovered(val0, last_val),
        "val_size": val_size,
        "steps": total,
        "final_reward_mean": float(
            np.mean([h["critic/score/mean"] for h in history[-5:] if "critic/score/mean" in h])
        ),
        "sft": sft_info,
        "wall_time_s": time.perf_counter() - t_start,
        "devices": jax.device_count(),
        "mesh": dict(
            zip(parallel.AXES, parallel.mesh_shape(config.mesh, jax.device_count()), strict=True)
        ),
    }
    if primary:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        report = write_run_report(workdir, summary, history)
        print(
            f"val acc (faulty device): {summary['val_acc_start']:.3f} ->"
            f" {summary['val_acc_end']:.3f};"
            f" clean: {summary['val_acc_clean_end']:.3f}; SRDD located {srdd_layers},"
            f" fault at {fault_layers}"
        )
        if summary["recovered"] is not None:
            print(
                f"the fault cost {summary['fault_gap_start']:.3f} accuracy at the start (clean"
                f" {summary['val_acc_clean_start']:.3f}, faulty {summary['val_acc_start']:.3f});"
                f" RL won back {100 * summary['recovered']:.0f}% of it"
            )
        print(f"report: {report}")


class _Preemption:
    """SIGTERM (a preempted job) asks for a final checkpoint after the current step."""

    def __init__(self):
        self.requested = False
        self._previous = None
        # Not possible off the main thread (e.g. a test runner's worker): then no handler.
        with contextlib.suppress(ValueError):
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def close(self) -> None:
        """Give SIGTERM back to whoever had it: after the loop a SIGTERM must not be swallowed
        (the compare job's evaluation, a worker process asked to exit)."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


@jax.jit
def _state_health(state):
    """(every float of params and optimizer state finite, max |param|), in one program."""

    def floats(tree):
        return [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]

    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in floats(state)]))
    return finite, jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in floats(state.params)]))


def check_sane(step: int, state, metrics, trainer_cfg) -> None:
    """Before a checkpoint is written: a diverged state stops the run, naming the step, and
    nothing is saved (the previous checkpoint stays the latest)."""
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
    if problems:
        raise FloatingPointError(
            f"RL step {step}: not saved: {'; '.join(problems)} (the run diverged: lower"
            " config.actor.lr, or raise the bound if this is expected)"
        )


def _recovered(start, end) -> float | None:
    gap = start["val-clean/acc"] - start["val-core/acc"]
    return (end["val-core/acc"] - start["val-core/acc"]) / gap if gap > 0 else None


def _fault_layers(config, n_layers):
    from aqn_jax.faults.config import parse_layers

    dz = config.faults.deadzone
    if dz.enabled:
        layers = parse_layers(dz.layers, "config.faults.deadzone.layers", n_layers)
        return list(range(n_layers)) if layers == "all" else list(layers)
    nz = config.faults.noise
    if nz.enabled:
        layers = parse_layers(nz.layers, "config.faults.noise.layers", n_layers)
        return list(range(n_layers)) if layers == "all" else list(layers)
    return []
