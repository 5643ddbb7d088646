"""The run's spec: an experiment config parsed once, at the job boundary, into frozen typed
parts (`RunSpec`, which `checks.check_train` returns), so that every library function below the
job takes the spec or the part of it that it needs, never the ConfigDict.

The builders of the parts live here, each reading the config sections its part needs and
taking the parts it builds on: `step_spec` (the step programs' `StepSpec`, with config.algo's
`Hyper`), `loop_spec` (the RL loop's `LoopSpec`), `job_spec` (the planner's `JobSpec`, from the
`StepSpec` and the device's `FaultPlan`), `srdd_spec` (the diagnosis's `SrddSpec`),
`summary_spec` (what summary.json says of the config), `trainer_spec` / `checkpoint_spec`,
`warm_start_spec` (the warm start's `WarmStartSpec`, over the parsed model) and the
evaluation's `eval_spec` / `decode_spec`. They refuse nothing themselves: the checks are the
boundary's (`checks.check_train`, which calls them; the evaluate and compare jobs check
config.evaluate first). A section's own parser stays beside its defaults and refuses that
section's fields (`rl.config.Hyper.of`, `lora.lora_spec`, `faults.config.fault_plan`,
`sdc.guard.guard_spec`, `rl.optim.OptimizerSpec.of`, `data.config.DataSpec.of`,
`aqn.config.AqnSpec.of`, `warm_start.SftSpec.of`, `models.factory.model_config`). What needs
the raw ConfigDict stays at the boundary: config.json and the resume comparison
(`training.run`) and the warm start's cache key (`warm_start_spec`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax

from aqn_jax import parallel
from aqn_jax.aqn.config import AqnSchedule, AqnSpec
from aqn_jax.aqn.plan import needs_srdd, place_aqn
from aqn_jax.config import planner_config
from aqn_jax.data.config import DataSpec
from aqn_jax.data.gsm8k import Example
from aqn_jax.data.tokenizers import Tokenizer
from aqn_jax.diagnosis.srdd import SrddSpec
from aqn_jax.evaluation import DecodeSpec, EvalSpec, conditions
from aqn_jax.faults.config import kind_of
from aqn_jax.faults.intercept import FaultPlan
from aqn_jax.lora import LoraSpec, lora_spec
from aqn_jax.models.factory import model_config
from aqn_jax.models.registry import ModelConfig
from aqn_jax.planner import JobSpec, MemoryPlan, reachable_buckets
from aqn_jax.report import SummarySpec
from aqn_jax.rl import advantages as adv_lib
from aqn_jax.rl.config import Hyper, flag
from aqn_jax.rl.optim import OptimizerSpec
from aqn_jax.rl.step import StepSpec, share_refusals
from aqn_jax.rl.trainer import LoopSpec
from aqn_jax.sdc.guard import GuardSpec, guard_spec
from aqn_jax.warm_start import SftSpec, WarmStartSpec, sft_seed


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    """config.trainer: the loop's length, validation and the sanity bounds of a checkpoint."""

    total_steps: int
    total_epochs: int  # > 0: that many passes over the train split instead of total_steps
    val_every: int  # 0: at the start and the end only
    val_size: int
    val_batch_size: int
    max_grad_norm: float  # 0: no bound (`checkpoint.check_sane`)
    max_param_abs: float

    def steps(self, batches_per_epoch: int) -> int:
        """RL steps of the run: total_epochs full passes when set, else total_steps."""
        epochs = self.total_epochs
        return epochs * int(batches_per_epoch) if epochs > 0 else self.total_steps

    @property
    def bounds(self) -> dict[str, float]:
        """What `checkpoint.check_sane` reads."""
        return {"max_grad_norm": self.max_grad_norm, "max_param_abs": self.max_param_abs}


def trainer_spec(trainer: Any) -> TrainerSpec:
    """config.trainer, typed (checked by `checks.check_trainer`)."""
    return TrainerSpec(
        total_steps=int(trainer.total_steps),
        total_epochs=int(trainer.get("total_epochs", 0)),
        val_every=int(trainer.val_every),
        val_size=int(trainer.val_size),
        val_batch_size=int(trainer.val_batch_size),
        max_grad_norm=float(trainer.get("max_grad_norm", 0) or 0),
        max_param_abs=float(trainer.get("max_param_abs", 0) or 0),
    )


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """config.checkpoint: how often, how many kept, what the last one holds, the export."""

    every: int
    keep: int
    final: str  # checkpoint.FINAL
    export: str  # checks.EXPORTS: 'hf' writes a transformers snapshot at the end


def checkpoint_spec(checkpoint: Any) -> CheckpointSpec:
    """config.checkpoint, typed (checked by `checks.check_trainer` / `checks.check_qerl`)."""
    return CheckpointSpec(
        every=int(checkpoint.every),
        keep=int(checkpoint.keep),
        final=str(checkpoint.get("final", "state")),
        export=str(checkpoint.get("export", "none")),
    )


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One train run's config, parsed once and checked (`checks.check_train`): the parts each
    stage of the run reads. `algo` / `actor` / `critic` are the step's (`step`)."""

    model: ModelConfig  # config.model
    weight_format: str  # config.model.weight_format: the frozen base's storage (QeRL mode)
    lora: LoraSpec  # config.lora
    tokenizer: Tokenizer  # config.tokenizer_path, else the model's
    tokenizer_path: str  # where the tokenizer loads from (the export's)
    data: DataSpec  # config.data (`data.config.load_split` reads it; the warm start's)
    device: FaultPlan  # config.faults: the simulated hardware, without the treatment
    aqn: AqnSpec  # config.aqn: placed among the device's faults once SRDD ran (`plan`)
    sdc: GuardSpec  # config.sdc
    step: StepSpec  # config.algo / actor / critic / rollout: what the step programs read
    loop: LoopSpec  # what the RL loop reads besides the programs
    trainer: TrainerSpec
    checkpoint: CheckpointSpec
    mesh: tuple[int, int, int]  # config.mesh (data, fsdp, tensor) as given; -1 = the rest
    seed: int  # config.seed
    warm_start: WarmStartSpec  # config.model / tokenizer_path / data / sft and the cache key
    srdd: SrddSpec  # config.diagnosis
    diagnose: bool  # SRDD runs first: the AQN arm needs it, or config.diagnosis.always
    summary: SummarySpec  # what summary.json says of the config
    memory: MemoryPlan  # the planner's per-device plan (`planner.check`)
    # The splits of `data`, loaded once (`checks.check_train` tokenized them): the run's.
    train_examples: tuple[Example, ...] = dataclasses.field(repr=False)
    test_examples: tuple[Example, ...] = dataclasses.field(repr=False)
    train_prompts_dropped: int  # of the train split's, longer than config.rollout.max_prompt_len

    @property
    def train_prompts(self) -> int:
        """The train split's prompts."""
        return len(self.train_examples)

    @property
    def algo(self) -> Hyper:
        return self.step.h

    @property
    def actor(self) -> OptimizerSpec:
        return self.step.actor

    @property
    def critic(self) -> OptimizerSpec:
        return self.step.critic

    @property
    def mesh_axes(self) -> dict[str, int]:
        """config.mesh as `parallel.make_mesh` reads it."""
        return dict(zip(parallel.AXES, self.mesh, strict=True))

    def plan(self, srdd_sigmas=None, srdd_layers=None) -> FaultPlan:
        """The device's faults with the AQN injection placed among them (`aqn.plan.place_aqn`);
        the SRDD diagnosis's sigmas and located layers where the AQN arm takes them."""
        n = self.model.num_hidden_layers
        return place_aqn(self.device.injections, self.aqn, n, srdd_sigmas, srdd_layers)


def step_spec(config: Any) -> StepSpec:
    """What the step programs read: config.algo's `Hyper` (checked) with the batching, the
    optimizer sections, config.sdc and config.lora, typed."""
    return StepSpec(
        h=Hyper.of(
            config.algo,
            rollout=config.rollout,
            actor=config.actor,
            critic=config.critic,
            prompts=config.data_batch.prompts,
        ),
        actor=OptimizerSpec.of(config.actor, "warmup_steps", "config.actor"),
        critic=OptimizerSpec.of(config.critic, "lr_warmup_steps", "config.critic"),
        max_new=int(config.rollout.max_new_tokens),
        critic_faults=bool(config.critic.faults),
        seed=int(config.seed),
        guard=guard_spec(config.get("sdc")),
        lora=lora_spec(config.get("lora")),
        weight_format=str(config.model.get("weight_format", "none")),
    )


def loop_spec(config: Any) -> LoopSpec:
    """`config`'s rollout, batch, data and AQN fields the loop reads, typed (validated before,
    by `checks.check_train`)."""
    ro = config.rollout
    return LoopSpec(
        seed=int(config.seed),
        prompts=int(config.data_batch.prompts),
        max_prompt_len=int(ro.max_prompt_len),
        buckets=tuple(int(b) for b in ro.prompt_buckets),
        temperature=float(ro.temperature),
        top_k=int(ro.top_k),
        top_p=float(ro.top_p),
        share_prompt=flag(ro, "config.rollout", "share_prompt"),
        share_prefix=flag(ro, "config.rollout", "share_prefix"),
        retire_rows=flag(ro, "config.rollout", "retire_rows"),
        reward_method=str(config.data.reward_method),
        aqn=AqnSchedule.of(config.aqn),
    )


def job_spec(config: Any, model_cfg: ModelConfig, step: StepSpec, device: FaultPlan) -> JobSpec:
    """What the memory plan reads: the mesh, batch and planner fields of `config` (checked:
    `checks.check_train`), for the model `model_cfg`, the step programs' `step` and the device's
    fault plan `device`."""
    section = planner_section(config)
    ro, actor, h = config.rollout, config.actor, step.h
    return JobSpec(
        model=model_cfg,
        mesh=tuple(int(config.mesh[a]) for a in parallel.AXES),
        total_steps=int(config.trainer.total_steps),
        actor=step.actor,
        critic=step.critic if adv_lib.ESTIMATORS[h.estimator].critic else None,
        rows=int(config.data_batch.prompts) * int(ro.n),
        val_rows=int(config.trainer.val_batch_size),
        mini_batch_rows=int(actor.mini_batch_prompts) * int(ro.n),
        micro_batch_rows=int(actor.micro_batch_rows),
        max_new=step.max_new,
        buckets=reachable_buckets(ro),
        val_samplers=2 if device.active("eval") else 1,
        use_ref=h.use_ref,
        headroom=float(section.headroom),
        device_memory_gb=float(section.device_memory_gb),
        refuse=bool(section.enabled),
        lora=step.lora,
        weight_format=step.weight_format,
        # The update's shared prompt as the device's faults allow it (AQN acts in the rollout).
        share_n=h.n if h.share_prompt and not share_refusals(device) else 1,
    )


def planner_section(config: Any) -> Any:
    """config.planner, or its defaults where the config has none."""
    section = config.get("planner")
    return planner_config() if section is None else section


def srdd_spec(config: Any) -> SrddSpec:
    """`config.diagnosis`, with the base sigma `diagnosis.base_sigma` (0: `aqn.sigma_start`)."""
    diag = config.diagnosis
    return SrddSpec.of(diag, float(diag.base_sigma or config.aqn.sigma_start))


# config.algo's rollout-correction fields, as summary.json records them.
CORRECTION_FIELDS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_rs",
    "rollout_rs_threshold",
    "rollout_rs_threshold_lower",
    "bypass_mode",
)


def summary_spec(config: Any, device: FaultPlan, n_layers: int) -> SummarySpec:
    """config.aqn, algo and mesh as the summary reports them, and the layers of the hardware
    fault (`fault_layers` of the `device`'s plan)."""
    shape = parallel.mesh_shape(config.mesh, jax.device_count())
    return SummarySpec(
        n_layers=int(n_layers),
        fault_layers=tuple(fault_layers(device, n_layers)),
        srdd_sigmas=config.aqn.layers == "srdd",
        rollout_correction=tuple((k, config.algo.get(k)) for k in CORRECTION_FIELDS),
        mesh=tuple(zip(parallel.AXES, shape, strict=True)),
    )


def fault_layers(device: FaultPlan, n_layers: int) -> list[int]:
    """The layers of the run's hardware fault (`device`: config.faults' plan): those of the
    first injection whose fault kind sits at layers (`FaultKind.layered`), in the fault
    table's order (`faults.config.FAULT_KINDS`); [] when there is none."""
    for inj in device.injections:
        kind = kind_of(inj)
        if kind is not None and kind.layered:
            layers = inj.sites.layers
            return list(range(n_layers)) if layers == "all" else list(layers)
    return []


def run_diagnosis(config: Any) -> bool:
    """SRDD runs before the fault plan: the AQN arm needs it (aqn.layers 'located' / 'srdd'),
    or config.diagnosis.always."""
    return bool(needs_srdd(config.aqn) or config.diagnosis.always)


def warm_start_spec(config: Any, model_cfg: ModelConfig | None = None) -> WarmStartSpec:
    """The warm start's spec: config.model (`model_cfg`: parsed already, the run's; else parsed
    here), tokenizer_path, data and sft, typed (config.data and config.sft checked, the latter
    when enabled), and the cache key computed from them (the raw sections' `to_dict`: the job
    boundary keeps it)."""
    d = config.data
    seed = sft_seed(config.sft, config.seed)
    # num_layers at its default (0, the preset's depth) is left out: the keys of warm starts
    # made before the field existed, the shipped one included, stay what they were. The base's
    # weight_format is applied to the warm start after it is made (QeRL mode): not part of it;
    # logprob_chunk only regroups the log-probs' sums: not part of it either.
    model = {
        k: v
        for k, v in config.model.to_dict().items()
        if (k != "num_layers" or v) and k not in ("weight_format", "logprob_chunk")
    }
    parts = {
        "model": model,
        "tokenizer": config.tokenizer_path,
        "data": {
            "train_path": d.train_path,
            "task": d.task.to_dict(),
            "train_size": d.train_size,
            # The prompt's form (data.config.with_prompt_format) when it is not verl's: keys
            # made before these fields existed stay what they were.
            **{k: d.get(k) for k in ("shots", "instruction") if d.get(k)},
        },
        "sft": {k: v for k, v in config.sft.to_dict().items() if k not in ("cache_dir", "seed")},
        "seed": seed,
    }
    blob = json.dumps(parts, sort_keys=True, default=str)
    return WarmStartSpec(
        model=model_config(config.model) if model_cfg is None else model_cfg,
        hf_path=str(config.model.hf_path or ""),
        tokenizer_path=str(config.tokenizer_path or ""),
        data=DataSpec.of(d),
        sft=SftSpec.of(config.sft) if config.sft.enabled else None,
        seed=seed,
        cache_dir=str(config.sft.cache_dir or ""),
        key=hashlib.sha256(blob.encode()).hexdigest()[:16],
    )


def eval_spec(config: Any) -> EvalSpec:
    """`config.evaluate` (checked: `evaluation.check_evaluate`, which the jobs call first) with
    the rollout, trainer and data fields it reads, typed (nothing below reads the ConfigDict)."""
    ev = config.evaluate
    faults = (ev.fault,) if isinstance(ev.fault, bool) else tuple(ev.fault)
    return EvalSpec(
        conditions=tuple(conditions(ev)),
        samples=int(ev.samples),
        batch_size=int(ev.batch_size or config.trainer.val_batch_size),
        loss_faults=faults if ev.loss else (),
        max_new_tokens=int(config.rollout.max_new_tokens),
        temperature=float(config.rollout.temperature),
        share_prompt=flag(config.rollout, "config.rollout", "share_prompt"),
        share_prefix=flag(config.rollout, "config.rollout", "share_prefix"),
        retire_rows=flag(config.rollout, "config.rollout", "retire_rows"),
        clean_size=int(ev.get("clean_size", 0)),
        buckets=tuple(int(b) for b in config.rollout.prompt_buckets),
        max_prompt_len=int(config.rollout.max_prompt_len),
        seed=int(config.seed),
        reward_method=str(config.data.reward_method),
    )


def decode_spec(config: Any) -> DecodeSpec:
    """The rollout, trainer and data fields greedy validation reads."""
    return DecodeSpec(
        max_new_tokens=int(config.rollout.max_new_tokens),
        buckets=tuple(int(b) for b in config.rollout.prompt_buckets),
        batch_size=int(config.trainer.val_batch_size),
        max_prompt_len=int(config.rollout.max_prompt_len),
        reward_method=str(config.data.reward_method),
    )
