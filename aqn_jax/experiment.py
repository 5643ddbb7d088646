"""The embedded experiment: its base config, the smoke shrink, and the study's arms.

`configs/<arm>.py` files are thin wrappers (`arm_config(name, arg)`), so that the `compare`
job and the tests build exactly the configs the command line runs.

Arms (the original system's study, docs/ARCHITECTURE.md "The original system's experiments": a
deadzone at the middle layer; `config.study_fault` names the fault the arms share: `deadzone` by
default, `noise` for its noise study):
  clean        no fault, no AQN (the upper bound)
  deadzone     the fault, no AQN (the lower bound; in a noise study: the noise, no AQN)
  global_aqn   the fault, AQN on every layer (the config's schedule: epoch_aware by default)
  global_qerl  the fault, AQN on every layer with QeRL's global decay (schedule 'qerl')
  targeted     the fault, AQN only on the layers SRDD locates (aqn.layers='located')
  healthy      the fault, AQN on every layer but the faulty one (the controlled test's control)
  srdd_guided  the fault, AQN on every layer at SRDD's per-layer sigma map (aqn.layers='srdd')

The mismatch study's arms (aqn_jax/rl/rollout_correction.py), each the fault plus:
  uncorrected   nothing (RL off-policy as it is)
  tis           verl's / tunix's token TIS, cap 2 (PRESETS['token_tis'])
  trl_mask      TRL's default sequence mask, cap 3 (PRESETS['trl_sequence_mask'])
  geo_rs        verl's geometric rejection [0.999, 1.001] (PRESETS['geometric_rs'])
  aqn_qerl      AQN in QeRL's form: RMSNorm-weight noise on the rollout model, every layer,
                QeRL's schedule (itself a rollout-only perturbation)
  aqn_qerl_tis  both

Scenarios (`apply_scenario`; docs/ARCHITECTURE.md): which device runs which fault.
  lowprec_rollout  (a) rollout and evaluation on a low-precision device (MXFP4 on every linear
                   input), training clean: verl's FP8 / QeRL's FP4 rollout
  deadzone_rollout (a') the study's deadzone (layer 4, 75% flushed) on the rollout and evaluation
                   device only, training clean
  both_call        (b) the study's deadzone on every phase, its statistic per module call: the
                   seed's setting; sampler and trainer differ by ~0.5 nats per token
  both_causal      (c) a deadzone on every phase with a causal statistic (each row's tokens so
                   far): sampler and trainer agree to float noise, the negative control
"""

import dataclasses

import ml_collections

from aqn_jax.aqn.config import aqn_config
from aqn_jax.config import (
    checkpoint_config,
    distributed_config,
    evaluate_config,
    lora_section,
    mesh_config,
    planner_config,
    sft_config,
    trainer_config,
)
from aqn_jax.data.config import data_config
from aqn_jax.diagnosis.config import diagnosis_config
from aqn_jax.faults.config import FAULT_KINDS, faults_config
from aqn_jax.models.config import model_section
from aqn_jax.registry import Registry
from aqn_jax.rl.config import (
    actor_config,
    algo_config,
    critic_config,
    data_batch_config,
    rollout_config,
)
from aqn_jax.rl.rollout_correction import PRESETS
from aqn_jax.sdc.config import sdc_config

FAULT_LAYER = 4  # the middle of the tiny model's 8 layers


def base_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The embedded experiment: each section's defaults, with the task, warm start and fault
    this experiment sets (a tiny model learns one-digit arithmetic on a faulty device)."""
    config = ml_collections.ConfigDict()
    config.job = "train"  # the job to run (aqn_jax/jobs/<job>.py): train | compare | evaluate | ...
    # The study arm (apply_arm): it records the arm in the run's outputs; the command line may
    # not change it (`after_overrides`: another arm is another config).
    config.arm = "clean"
    # The fault every arm but clean runs on: deadzone (config.faults.deadzone) | noise
    # (config.faults.noise: the original system's hardware error model, docs/ARCHITECTURE.md).
    # Given on the command line, it moves an arm config's fault to that kind (`after_overrides`).
    config.study_fault = "deadzone"  # deadzone | noise
    config.seed = 0  # RL seed: data order, sampling, fault noise (int; the study uses 0-4)
    # Resuming a workdir whose checkpoints were made under another config is refused, naming
    # the changed fields; True continues with the new values (recorded in
    # config_overrides.jsonl).
    config.resume_override = False  # bool
    config.model = model_section()  # preset tiny, or a local HF snapshot in hf_path
    config.tokenizer_path = ""  # '' = the embedded character tokenizer (or hf_path's)
    config.data = data_config()  # data paths or the embedded task (aqn_jax/data/config.py)
    # One operation on one-digit amounts, split by question text: the model reads the story's
    # numbers and operation rather than recalls equations it never saw (data/arithmetic.py).
    config.data.task.digits = 1  # digits of the task's amounts (1-4)
    config.data.task.steps = 1  # operations per problem (1-4)
    config.data.task.split_by = "question"  # question | chain: what train and test never share
    config.data_batch = data_batch_config()  # the RL batch
    # The warm start (cached; this setting's result ships in aqn_jax/assets, made by
    # configs/warm_start.py): every train problem, 600 steps of 32.
    config.sft = sft_config()  # the SFT warm start (aqn_jax/warm_start.py)
    config.sft.steps = 600  # optimizer steps
    config.sft.batch_size = 32  # sequences per step
    config.sft.examples = 4096  # train examples used (the first N)
    config.sft.seed = 0  # one warm start whatever config.seed (the model a researcher brings)
    config.rollout = rollout_config()  # generation (aqn_jax/rl/config.py)
    config.algo = algo_config()  # the RL objective (aqn_jax/rl/config.py)
    config.actor = actor_config()  # the policy's optimizer and PPO batching
    config.critic = critic_config()  # used by estimator='gae'
    config.trainer = trainer_config()  # the loop
    config.checkpoint = checkpoint_config()  # Orbax checkpoints under <workdir>/checkpoints
    config.lora = lora_section()  # LoRA on a frozen base (QeRL mode); rank 0 = full fine-tuning
    config.mesh = mesh_config()  # devices as (data, fsdp, tensor) (aqn_jax/parallel.py)
    config.distributed = distributed_config()  # several hosts (launch/*.py set it)
    config.planner = planner_config()  # per-device memory plan, checked before compiling
    config.diagnosis = diagnosis_config()  # SRDD (aqn_jax/diagnosis/srdd.py)
    config.evaluate = evaluate_config()  # job `evaluate` (the robustness matrix)
    config.faults = faults_config()  # the simulated hardware (aqn_jax/faults/config.py)
    config.faults.deadzone.layers = str(FAULT_LAYER)  # the faulty layer
    # The operating point on the shipped warm start's severity curve (configs/severity.py): a
    # cost RL can win back from (flushing 75% of layer 4's smallest |h|).
    config.faults.deadzone.severity = "quantile"  # amax | quantile
    config.faults.deadzone.quantile = 0.75  # fraction of |h| flushed
    config.sdc = sdc_config()  # SDC detection and recovery: ABFT, step guards (sdc/guard.py)
    config.aqn = aqn_config()  # the treatment: AQN noise (aqn_jax/aqn/config.py)
    config.aqn.schedule = "epoch_aware"  # qerl | epoch_aware | constant | linear | cosine
    config.aqn.num_epochs = 2  # epochs of the epoch-aware decay
    if arg == "smoke":
        shrink(config)
    elif arg not in (None, ""):
        raise ValueError(f"--config=...:{arg}; allowed arguments: smoke")
    return config


def shrink(config: ml_collections.ConfigDict) -> None:
    """The smoke setting: every stage runs, in well under a minute on 2 cores."""
    config.sft.steps = 8
    config.sft.batch_size = 8
    config.sft.examples = 64
    config.data.train_size = 64
    config.data.test_size = 8
    config.data_batch.prompts = 4
    config.rollout.max_new_tokens = 12
    config.actor.mini_batch_prompts = 2
    config.actor.micro_batch_rows = 10
    config.trainer.total_steps = 2
    config.trainer.val_every = 1
    config.trainer.val_size = 8
    config.trainer.val_batch_size = 8
    config.diagnosis.num_prompts = 4


@dataclasses.dataclass(frozen=True)
class Arm:
    """What a study arm sets on the base config (`apply_arm`)."""

    # The study it belongs to: study (the default compare study) | baseline | correction (the
    # mismatch study) | qerl (QeRL Table 1's columns).
    group: str
    fault: bool = True  # the study's fault (config.study_fault) on
    aqn: bool = False  # AQN on
    layers: str | None = None  # config.aqn.layers (None: as configured)
    schedule: str | None = None  # config.aqn.schedule (None: as configured)
    qerl_form: bool = False  # AQN in QeRL's form: every RMSNorm weight, after the fault
    correction: str | None = None  # a rollout-correction preset (rl.rollout_correction.PRESETS)
    lora: bool | None = None  # LoRA adapters on (QeRL_RANK; None: as configured)
    weight_format: str = "none"  # the base's weight format, with `lora` set

    @property
    def targets_fault(self) -> bool:
        """AQN placed by the study fault's layers: the fault kind must be one AQN can target."""
        return self.aqn and self.layers in ("healthy", "located", "srdd")


# The study arms, in report order: `config.compare.arms` and the configs name them from here.
ARMS: Registry[Arm] = Registry("arm")
for _name, _arm in {
    "clean": Arm("study", fault=False, layers="all"),  # the upper bound
    "deadzone": Arm("study", layers="all"),  # the fault, no AQN (the lower bound)
    "global_aqn": Arm("study", aqn=True, layers="all"),
    "targeted": Arm("study", aqn=True, layers="located"),  # the layers SRDD locates
    "healthy": Arm("study", aqn=True, layers="healthy"),  # all but the faulty layers
    "srdd_guided": Arm("study", aqn=True, layers="srdd"),  # SRDD's per-layer sigma map
    # The original system's noise-study baseline (configs/compare.py): QeRL's global decay.
    "global_qerl": Arm("baseline", aqn=True, layers="all", schedule="qerl"),
    # The mismatch study: the fault plus a rollout correction or QeRL's AQN.
    "uncorrected": Arm("correction", correction="none"),
    "tis": Arm("correction", correction="token_tis"),
    "trl_mask": Arm("correction", correction="trl_sequence_mask"),
    "geo_rs": Arm("correction", correction="geometric_rs"),
    "aqn_qerl": Arm(
        "correction",
        aqn=True,
        layers="all",
        schedule="qerl",
        qerl_form=True,
        correction="none",
    ),
    "aqn_qerl_tis": Arm(
        "correction",
        aqn=True,
        layers="all",
        schedule="qerl",
        qerl_form=True,
        correction="token_tis",
    ),
    # QeRL Table 1's columns (configs/qerl.py).
    "full": Arm("qerl", lora=False),
    "lora": Arm("qerl", lora=True),
    "nvfp4_lora": Arm("qerl", lora=True, weight_format="nvfp4"),
    "mxfp4_lora": Arm("qerl", lora=True, weight_format="mxfp4"),
    "nvfp4_lora_aqn": Arm(
        "qerl",
        lora=True,
        weight_format="nvfp4",
        aqn=True,
        layers="all",
        schedule="qerl",
        qerl_form=True,
    ),
}.items():
    ARMS.register(_name, _arm)


def arm_names(group: str) -> tuple[str, ...]:
    """The arms of one study (`Arm.group`), in registration order."""
    return tuple(name for name, arm in ARMS.items() if arm.group == group)


# QeRL mode's adapters on the embedded model: QeRL's scripts' rank 16 and alpha 16 (scale 1),
# every linear; the LoRA learning rate 10x the full fine-tuning one (verl's and "LoRA without
# regret"'s advice; QeRL: 1e-5 NVFP4-LoRA vs 5e-6 BF16-LoRA at 3B-7B, where full FT runs 1e-6).
QERL_RANK, QERL_ALPHA, QERL_LR_FACTOR = 16, 16.0, 10.0

# Scenarios (`apply_scenario`): which device (rollout / train / eval phases) runs which fault.
SCENARIOS: Registry = Registry("scenario")
# (c)'s deadzone: the causal statistic needs amax severity; 0.2 of the max costs the warm start
# 0.176 accuracy at layer 4 under scope call (configs/compare.py threshold_0.2).
CAUSAL_THRESHOLD = 0.2


def apply_scenario(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    """Set `config.study_fault` and its fault section to scenario `name` (SCENARIOS)."""
    SCENARIOS.get(name)(config)
    return config


@SCENARIOS.register("lowprec_rollout")
def _lowprec_rollout(config: ml_collections.ConfigDict) -> None:
    """(a) MXFP4 on every linear input of the rollout and evaluation device; training clean."""
    config.study_fault = "quant"
    q = config.faults.quant
    q.format = "mxfp4"
    q.sites = ("linear",)
    q.layers = "all"
    q.point = "input"
    q.phases = ("rollout", "eval")  # the inference device; the trainer is clean


@SCENARIOS.register("deadzone_rollout")
def _deadzone_rollout(config: ml_collections.ConfigDict) -> None:
    """(a') the study's deadzone on the rollout and evaluation device only."""
    config.study_fault = "deadzone"
    config.faults.deadzone.phases = ("rollout", "eval")


@SCENARIOS.register("both_call")
def _both_call(config: ml_collections.ConfigDict) -> None:
    """(b) the study's deadzone on every phase, its statistic per module call."""
    config.study_fault = "deadzone"
    config.faults.deadzone.phases = ("rollout", "train", "eval")
    config.faults.deadzone.scope = "call"


@SCENARIOS.register("both_causal")
def _both_causal(config: ml_collections.ConfigDict) -> None:
    """(c) a deadzone on every phase with a causal statistic: the negative control."""
    config.study_fault = "deadzone"
    dz = config.faults.deadzone
    dz.phases = ("rollout", "train", "eval")
    dz.scope = "causal"
    dz.severity = "amax"
    dz.threshold = CAUSAL_THRESHOLD


def _arm_fault(config: ml_collections.ConfigDict, arm: str) -> tuple[Arm, str]:
    """Arm `arm`'s entry and the study fault it runs on (`config.study_fault`), checked: a kind
    of config.faults, one AQN can target where the arm places AQN by the fault's layers."""
    entry = ARMS.get(arm)
    fault = FAULT_KINDS.check(config.get("study_fault", "deadzone"), "config.study_fault")
    if entry.targets_fault and not FAULT_KINDS.get(fault).aqn_target:
        allowed = tuple(k for k, v in FAULT_KINDS.items() if v.aqn_target)
        raise ValueError(
            f"config.study_fault={fault!r}; allowed with arm {arm!r} (AQN placed by the fault's"
            f" layers): {allowed}"
        )
    return entry, fault


def apply_arm(config: ml_collections.ConfigDict, arm: str) -> ml_collections.ConfigDict:
    """Set what arm `arm` (ARMS) sets on `config`, on the fault `config.study_fault`."""
    entry, fault = _arm_fault(config, arm)
    config.arm = arm
    config.faults[fault].enabled = entry.fault
    if entry.lora is not None:
        config.lora.rank = QERL_RANK if entry.lora else 0
        config.lora.alpha = QERL_ALPHA
        config.model.weight_format = entry.weight_format
        if entry.lora:
            config.actor.lr = config.actor.lr * QERL_LR_FACTOR
    config.aqn.enabled = entry.aqn
    if entry.qerl_form:  # QeRL: noise on every RMSNorm weight of the rollout model
        config.aqn.form, config.aqn.order = "norm_weight", "after_fault"
    if entry.schedule is not None:
        config.aqn.schedule = entry.schedule
    if entry.layers is not None:
        config.aqn.layers = entry.layers
    if entry.correction is not None:
        for key, value in PRESETS[entry.correction].items():
            config.algo[key] = value
    return config


def arm_config(arm: str, arg: str | None = None) -> ml_collections.ConfigDict:
    return apply_arm(base_config(arg), arm)


def after_overrides(config, built, overrides) -> None:
    """The command line's overrides of the two fields get_config derives others from, applied
    after the flags (`launch.main`), in place. `built`: the config as its file's get_config
    returned it; `overrides`: the `--config.<field>` values given, flat ({'study_fault':
    'noise', 'faults.noise.enabled': True}).

    config.study_fault is honoured: on a config whose arm get_config applied (configs/<arm>.py,
    the GSM8K config's arms; any job but compare, which applies its arms after the flags), the
    arm's fault switch moves from the kind get_config saw to the kind named, as `apply_arm`
    sets and checks it (a kind AQN can target with arms targeted / healthy / srdd_guided): the
    old kind's section off, the new one on where the arm runs the fault. A section whose
    `enabled` the command line sets too keeps the value given. Refused in one line where
    get_config's config does not have its arm's switch (its faults were set otherwise).

    config.arm only records the arm get_config applied (the arm's fields are set by then): a
    different value would relabel the run and change nothing, so it is refused naming the
    arm's own config."""
    arm, was = config.get("arm"), built.get("arm")
    if "arm" in overrides and arm != was:
        raise ValueError(
            f"config.arm={arm!r}: it records the arm this config was built as and sets nothing;"
            f" allowed: {was!r} (another arm is another config: configs/<arm>.py, the config"
            " file's arm argument where it takes one, or config.compare.arms in job compare)"
        )
    before, after = built.get("study_fault"), config.get("study_fault")
    if "study_fault" not in overrides or before == after or config.get("job") == "compare":
        return
    if arm not in ARMS:  # no arm: nothing was derived from it (checks.check_names names it)
        return
    entry, fault = _arm_fault(config, arm)
    if bool(built.faults[before].enabled) != entry.fault:
        raise ValueError(
            f"config.study_fault={after!r}: this config's faults were not set by its arm {arm!r}"
            f" (config.faults.{before}.enabled={built.faults[before].enabled}), so nothing"
            f" moves with it; allowed: {before!r}, or set config.faults.<kind>.enabled directly"
        )
    if f"faults.{before}.enabled" not in overrides:
        config.faults[before].enabled = False
    if f"faults.{fault}.enabled" not in overrides:
        config.faults[fault].enabled = entry.fault
