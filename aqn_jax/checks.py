"""The boundary of an RL run: its config checked without a compile, every field named when it is
wrong, before anything is trained or written, and parsed once into the run's `RunSpec`
(`check_train`: the refusals here, the typed parts from `spec.py`'s builders, which refuse
nothing of their own); the prompt-length checks the `evaluate` job shares."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence

import jax
import numpy as np

from aqn_jax import parallel, planner, quant_base
from aqn_jax.aqn.config import AqnSpec
from aqn_jax.aqn.plan import place_aqn
from aqn_jax.checkpoint import check_final
from aqn_jax.data.config import DataSpec, load_split
from aqn_jax.data.gsm8k import Example, tokenize_prompts
from aqn_jax.diagnosis.srdd import check_config as check_diagnosis
from aqn_jax.experiment import ARMS
from aqn_jax.faults import formats
from aqn_jax.faults.config import FAULT_KINDS, check_bit_dtypes, fault_plan
from aqn_jax.faults.intercept import FaultPlan
from aqn_jax.faults.sites import expand_kinds
from aqn_jax.lora import LoraSpec, check_ranks
from aqn_jax.models.factory import model_config
from aqn_jax.models.hf import abstract_params
from aqn_jax.models.registry import family_of
from aqn_jax.planner import check_planner
from aqn_jax.rl.advantages import ESTIMATORS
from aqn_jax.rl.optim import LR_SCHEDULES, check_optimizer
from aqn_jax.rl.sampler import check_rollout
from aqn_jax.rl.step import StepSpec
from aqn_jax.spec import (
    RunSpec,
    checkpoint_spec,
    job_spec,
    loop_spec,
    planner_section,
    run_diagnosis,
    srdd_spec,
    step_spec,
    summary_spec,
    trainer_spec,
    warm_start_spec,
)
from aqn_jax.warm_start import check_sft_cache, tokenizer_for


def check_prompt_lengths(rollout, val_size: int, tokenizer, test_examples) -> None:
    """Validation prompts must fit the largest prompt bucket (training drops longer ones).
    `rollout`: config.rollout; `val_size`: the validation prompts (config.trainer.val_size)."""
    size = min(int(val_size), len(test_examples))
    lengths = [len(tokenizer.encode_chat(ex.prompt_messages)) for ex in test_examples[:size]]
    _check_val_lengths(rollout, val_size, lengths, len(test_examples))


def _check_val_lengths(rollout, val_size: int, lengths, test_size: int) -> None:
    if not len(lengths):
        raise ValueError(
            f"config.trainer.val_size={val_size} with {test_size} test"
            " examples: no validation prompt; val_size must be >= 1 and the test split non-empty"
        )
    longest = max(lengths)
    limit = min(max(rollout.prompt_buckets), int(rollout.max_prompt_len))
    if longest > limit:
        raise ValueError(
            f"the longest validation prompt has {longest} tokens > {limit}: raise"
            f" config.rollout.prompt_buckets={tuple(rollout.prompt_buckets)} and"
            f" config.rollout.max_prompt_len={rollout.max_prompt_len}"
        )


def split_examples(data: DataSpec, split: str, cache: dict | None = None) -> list[Example]:
    """The examples of `split` ('train' | 'test') of `data`, loaded once per data section and
    file in `cache` when given (the compare job checks one config per arm on the same data)."""
    key = ("examples", *_split_key(data, split))
    if cache is not None and key in cache:
        return cache[key]
    examples = load_split(data, split)
    if cache is not None:
        cache[key] = examples
    return examples


def prompt_lengths(
    data: DataSpec,
    examples: Sequence[Example],
    tokenizer,
    tokenizer_path: str,
    split: str,
    cache: dict | None = None,
) -> np.ndarray:
    """The token count of every prompt of `examples` (`split` of `data`: 'train' | 'test') as
    the batcher counts it (chat template, generation prompt). `cache`, when given, keeps them
    per data section, file and `tokenizer_path` (where `tokenizer` was loaded from)."""
    key = ("lengths", *_split_key(data, split), tokenizer_path)
    if cache is not None and key in cache:
        return cache[key]
    ids = tokenize_prompts(examples, tokenizer)
    lengths = np.array([len(t) for t in ids], np.int64)
    if cache is not None:
        cache[key] = lengths
    return lengths


def _split_key(data: DataSpec, split: str) -> tuple:
    """What a split's examples depend on: the data section and its file's stamp."""
    path = os.path.expanduser(data.path(split)) if data.path(split) else ""
    stamp = (os.stat(path).st_mtime_ns, os.path.getsize(path)) if path else None
    section = json.dumps(dataclasses.asdict(data), sort_keys=True, default=str)
    return (split, section, stamp)


def check_instruction(data, tokenizer) -> None:
    """config.data.instruction (of `data`: a DataSpec, or config.data) in characters
    `tokenizer` encodes (the embedded one knows printable ASCII only: anything else would be an
    unknown token in every prompt)."""
    instruction = str(getattr(data, "instruction", ""))
    unknown = tokenizer.unknown_chars(instruction)
    if unknown:
        raise ValueError(
            f"config.data.instruction={instruction!r}: the tokenizer cannot encode"
            f" {''.join(unknown)!r} (each would be an unknown token); allowed: the characters it"
            " encodes (the embedded tokenizer: printable ASCII)"
        )


def check_train_prompts(lengths, rollout, data: DataSpec, prompts: int) -> int:
    """The train prompts the batcher drops (longer than config.rollout.max_prompt_len), counted
    and printed; refused when config.data.drop_long_prompts is False, when too few are left for
    one batch of `prompts` (config.data_batch.prompts), or when one it keeps would not fit the
    sampler's largest prompt bucket. `lengths`: every train prompt's token count
    (`prompt_lengths`); `rollout`: config.rollout. Returns the number dropped."""
    limit = int(rollout.max_prompt_len)
    lengths = np.asarray(lengths, np.int64)
    total, long = len(lengths), lengths > limit
    dropped = int(long.sum())
    where = f"config.rollout.max_prompt_len={limit}"
    buckets = f"config.rollout.prompt_buckets={tuple(rollout.prompt_buckets)}"
    what = (
        f"{dropped} of {total} train prompts are longer than {where} tokens"
        f" (up to {int(lengths.max(initial=0))})"
    )
    if dropped and not data.drop_long_prompts:
        raise ValueError(
            f"config.data.drop_long_prompts=False and {what}; raise config.rollout.max_prompt_len"
            f" and {buckets}, or set config.data.drop_long_prompts=True to train without them"
        )
    kept, prompts = total - dropped, int(prompts)
    shots = data.shots
    if shots and total < prompts:
        raise ValueError(
            f"config.data.shots={shots} takes the first {shots} train problems for every prompt,"
            f" leaving {total} to train on; must leave >= config.data_batch.prompts={prompts}:"
            " lower shots or give a larger train split"
        )
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
    top = max(int(b) for b in rollout.prompt_buckets)
    unfit = int(((lengths > top) & ~long).sum())
    if unfit:
        raise ValueError(
            f"{buckets}: {unfit} train prompts are longer than its largest bucket {top} and within"
            f" {where}, so the sampler could not pad them; add a bucket >= {limit}"
        )
    return dropped


def check_trainer(trainer, checkpoint) -> None:
    """config.trainer and config.checkpoint: the loop's counts and sizes."""
    tr = trainer
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
    ck = checkpoint
    if ck.every < 0:
        raise ValueError(f"config.checkpoint.every={ck.every}; must be >= 0 (0 = only at the end)")
    if ck.keep < 1:
        raise ValueError(f"config.checkpoint.keep={ck.keep}; must be >= 1")
    check_final(ck.get("final", "state"))


EXPORTS = ("none", "hf")
# Each field's dtypes for training ('auto' picks the compute dtype, `compute_dtype`).
TRAIN_DTYPES = {"param_dtype": ("float32", "bfloat16"), "dtype": ("float32", "bfloat16", "auto")}


def check_train_dtypes(model) -> None:
    """float16 weights or compute are refused for training: there is no loss scaling, and the
    SFT warm start's loss is NaN at its first step (QeRL mode or not; evaluation takes it)."""
    for field, allowed in TRAIN_DTYPES.items():
        value = model[field]
        if value == "float16":
            raise ValueError(
                f"config.model.{field}='float16': training in float16 overflows (no loss"
                f" scaling; the SFT's loss is NaN at step 1); allowed for training:"
                f" {list(allowed)} (the evaluate job takes float16)"
            )
        if value not in allowed:
            raise ValueError(
                f"config.model.{field}={value!r}; allowed for training: {list(allowed)}"
            )


def check_qerl(spec: LoraSpec, fmt: str, export: str, model_cfg, training: bool) -> None:
    """config.lora (`spec`, parsed), config.model.weight_format (`fmt`) and
    config.checkpoint.export (`export`), against the model's shapes (from `jax.eval_shape`:
    nothing compiles)."""
    quant_base.check_format(fmt)
    if export not in EXPORTS:
        raise ValueError(f"config.checkpoint.export={export!r}; allowed: {EXPORTS}")
    if fmt == "none" and not spec.enabled:
        return
    site_of = family_of(model_cfg).site_of
    shapes = abstract_params(model_cfg)
    if spec.enabled:
        check_ranks(spec, shapes, site_of)
    if fmt != "none":
        if training and not spec.enabled:
            raise ValueError(
                f"config.model.weight_format={fmt!r} freezes the base: training it needs"
                " config.lora.rank > 0 (QeRL mode), or weight_format='none' for full fine-tuning"
            )
        quant_base.check_model(shapes, fmt, site_of)


def _lanes(model_cfg, kinds, point: str) -> dict[str, set[int]]:
    """{module kind: the last-axis lengths of its `point` tensors} of `kinds` (from shapes)."""
    site_of = family_of(model_cfg).site_of
    params = abstract_params(model_cfg)
    hidden = model_cfg.hidden_size
    out: dict[str, set[int]] = {}
    for path in quant_base.linear_kernel_paths(params, site_of):
        n_in, n_out = quant_base.leaf_at(params, path).shape
        out.setdefault(site_of(path[:-1])[0], set()).add(n_in if point == "input" else n_out)
    out["lm_head"] = {hidden if point == "input" else model_cfg.vocab_size}
    # The rest (layer, attn, mlp, the norms, embed_tokens' output) carry the residual width;
    # embed_tokens' input is token ids, never quantised.
    return {k: out.get(k, {hidden}) for k in kinds if (k, point) != ("embed_tokens", "input")}


def check_block_widths(faults, model_cfg) -> None:
    """A block format's blocks (each fault kind with `block_format`: config.faults.quant,
    mx_scale_flip) divide the last axis of every tensor it quantises, from the model's widths
    (nothing traced); one line naming the field, the width and the block sizes allowed."""
    for name, kind in FAULT_KINDS.items():
        sec = faults.get(name)
        if not kind.block_format or sec is None or not sec.enabled:
            continue
        if sec.get("target", "activation") != "activation":
            continue
        block = formats.check_block_size(sec.format, int(sec.block_size))
        fixed = formats.FORMATS.get(sec.format, f"config.faults.{name}.format").block_size
        field = "block_size" if fixed is None else "format"
        lanes = _lanes(model_cfg, expand_kinds(sec.sites), sec.point)
        widths = sorted({w for ws in lanes.values() for w in ws})
        bad = next(((k, w) for k, ws in lanes.items() for w in sorted(ws) if w % block), None)
        if bad is not None:
            value = sec.format if field == "format" else block
            raise ValueError(
                f"config.faults.{name}.{field}={value!r}: blocks of {block} do not divide the"
                f" {bad[1]} lanes of {bad[0]}'s {sec.point} (the last axis); allowed: a block"
                f" size dividing {math.gcd(*widths)} (the widths hit: {widths})"
            )


def check_train(config, workdir: str | None = None, cache: dict | None = None) -> RunSpec:
    """Every check that needs no compile; raises ValueError naming the field. Nothing is
    written. The config parsed once: the run's `RunSpec`. `workdir` locates the default SFT
    cache (<workdir>/../cache) for its check; `cache` keeps the prompt lengths between calls
    (`prompt_lengths`)."""
    step = _check_values(config)  # the config's own values (no file read): a typo fails fast
    model_cfg = model_config(config.model)  # config.model parsed: once in a run
    export = config.get("checkpoint", {}).get("export", "none")
    check_qerl(step.lora, step.weight_format, export, model_cfg, training=True)
    tokenizer = tokenizer_for(config.tokenizer_path, config.model.hf_path, model_cfg.vocab_size)
    warm = warm_start_spec(config, model_cfg)  # config.data, and config.sft when enabled
    check_instruction(warm.data, tokenizer)
    device, aqn = _check_device(config, model_cfg)
    mesh, memory = _check_memory(config, model_cfg, step, device)
    (train, test), dropped = _check_prompts(config, warm.data, tokenizer, cache)
    check_sft_cache(warm, workdir)  # last: the SFT would train, then fail to be cached
    return RunSpec(
        model=model_cfg,
        weight_format=step.weight_format,
        lora=step.lora,
        tokenizer=tokenizer,
        tokenizer_path=config.tokenizer_path or config.model.hf_path,
        data=warm.data,
        device=device,
        aqn=aqn,
        sdc=step.guard,
        step=step,
        loop=loop_spec(config),
        trainer=trainer_spec(config.trainer),
        checkpoint=checkpoint_spec(config.checkpoint),
        mesh=mesh,
        seed=int(config.seed),
        warm_start=warm,
        srdd=srdd_spec(config),
        diagnose=run_diagnosis(config),
        summary=summary_spec(config, device, model_cfg.num_hidden_layers),
        memory=memory,
        train_examples=tuple(train),
        test_examples=tuple(test),
        train_prompts_dropped=dropped,
    )


def check_names(config) -> None:
    """The names a run records or reads whatever its sections' switches: config.arm (the study
    arm, `experiment.ARMS`) and config.study_fault (a `config.faults` kind) where the config has
    them, and the learning-rate schedules of the SFT and the critic (read only with the SFT on
    and estimator 'gae'). A bad name is refused even where nothing reads it now (a section
    switched off): it would be silently ignored."""
    if "arm" in config:
        ARMS.check(config.arm, "config.arm")
    if "study_fault" in config:
        FAULT_KINDS.check(config.study_fault, "config.study_fault")
    for section in ("sft", "critic"):
        if section in config:
            LR_SCHEDULES.check(config[section].schedule, f"config.{section}.schedule")


def _check_values(config) -> StepSpec:
    """The sections checked on their own values: the names (`check_names`), rollout, the
    step's (algo, actor, critic, sdc, lora), trainer, checkpoint and the model's dtypes.
    Returns the step programs' spec."""
    check_names(config)
    check_rollout(config.rollout)
    step = step_spec(config)  # data_batch / rollout.n / actor batch sizes, algo, sdc, lora
    check_optimizer(config.actor, "warmup_steps", "config.actor")
    if ESTIMATORS[step.h.estimator].critic:
        check_optimizer(config.critic, "lr_warmup_steps", "config.critic")
    check_trainer(config.trainer, config.checkpoint)
    check_train_dtypes(config.model)
    if step.guard.abft_backward and step.lora.enabled:
        raise ValueError(
            "config.sdc.abft_backward=True with config.lora.rank > 0: the backward checks cover"
            " a plain linear's dX and dW, not the adapter's terms; turn one of them off"
        )
    return step


def _check_device(config, model_cfg) -> tuple[FaultPlan, AqnSpec]:
    """The diagnosis, the simulated hardware (config.faults) against the model, and the AQN
    arm placed among its faults (with stand-in SRDD results: 'located' / 'srdd' get theirs from
    the diagnosis later). Returns (the device's fault plan, config.aqn typed)."""
    n = model_cfg.num_hidden_layers
    check_diagnosis(config.diagnosis)
    device = fault_plan(config.faults, n)  # fault layers within the model, fields valid
    check_block_widths(config.faults, model_cfg)
    check_bit_dtypes(config.faults, model_cfg.dtype, model_cfg.param_dtype)
    aqn = AqnSpec.of(config.aqn)
    place_aqn(device.injections, aqn, n, srdd_sigmas=dict.fromkeys(range(n), 0.05), srdd_layers=[0])
    return device, aqn


def _check_memory(config, model_cfg, step: StepSpec, device: FaultPlan):
    """The batches split over the mesh, and the per-device memory plan from shapes alone
    (`planner.check` refuses, suggesting a mesh, when it cannot fit). Returns (the mesh as
    configured, the plan)."""
    rows = int(config.data_batch.prompts) * int(config.rollout.n)
    micro, val = config.actor.micro_batch_rows, config.trainer.val_batch_size
    parallel.check_splits(
        config.mesh,
        jax.device_count(),
        {
            f"config.data_batch.prompts * config.rollout.n = {rows} rows": rows,
            f"config.actor.micro_batch_rows={micro}": micro,
            f"config.trainer.val_batch_size={val}": val,
        },
    )
    check_planner(planner_section(config))
    job = job_spec(config, model_cfg, step, device)
    return job.mesh, planner.check(job, jax.device_count())


def _check_prompts(
    config, data: DataSpec, tokenizer, cache: dict | None
) -> tuple[tuple[list[Example], list[Example]], int]:
    """The data as the run will batch it: both splits loaded (once: the run takes them from
    here), every train prompt tokenized (those too long dropped or refused), the validation
    prompts within the buckets. Returns ((train, test examples), train prompts dropped)."""
    tok_path = config.tokenizer_path or config.model.hf_path
    train = split_examples(data, "train", cache)
    lengths = prompt_lengths(data, train, tokenizer, tok_path, "train", cache)
    dropped = check_train_prompts(lengths, config.rollout, data, config.data_batch.prompts)
    test = split_examples(data, "test", cache)
    test_lengths = prompt_lengths(data, test, tokenizer, tok_path, "test", cache)
    val_size = config.trainer.val_size
    if val_size > len(test):
        raise ValueError(
            f"config.trainer.val_size={val_size}; must be <= the {len(test)} problems of the test"
            " split (config.data.test_path, or config.data.test_size for the embedded task)"
        )
    _check_val_lengths(config.rollout, val_size, test_lengths[: int(val_size)], len(test))
    return (train, test), dropped
