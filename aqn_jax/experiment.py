"""The embedded experiment: its base config, the smoke shrink, and the study's arms.

`configs/<arm>.py` files are thin wrappers (`arm_config(name, arg)`), so that the `compare`
job and the tests build exactly the configs the command line runs.

Arms (the original design notes: a deadzone at the middle layer; `config.study_fault` names the
fault the arms share: `deadzone` by default, `noise` for the original design notes' study):
  clean        no fault, no AQN (the upper bound)
  deadzone     the fault, no AQN (the lower bound; in a noise study: the noise, no AQN)
  global_aqn   the fault, AQN on every layer (the config's schedule: epoch_aware by default)
  global_qerl  the fault, AQN on every layer with QeRL's global decay (schedule 'qerl')
  targeted     the fault, AQN only on the layers SRDD locates (aqn.layers='located')
  healthy      the fault, AQN on every layer but the faulty one (the original notes' control)
  srdd_guided  the fault, AQN on every layer at SRDD's per-layer sigma map (aqn.layers='srdd')

The mismatch study's arms (issue 29; aqn_jax/rl/rollout_correction.py), each the fault plus:
  uncorrected   nothing (RL off-policy as it is)
  tis           verl's / tunix's token TIS, cap 2 (PRESETS['token_tis'])
  trl_mask      TRL's default sequence mask, cap 3 (PRESETS['trl_sequence_mask'])
  geo_rs        verl's geometric rejection [0.999, 1.001] (PRESETS['geometric_rs'])
  aqn_qerl      AQN in QeRL's form: RMSNorm-weight noise on the rollout model, every layer,
                QeRL's schedule (itself a rollout-only perturbation)
  aqn_qerl_tis  both

Scenarios (`apply_scenario`; DESIGN.md "Two devices, one policy"): which device runs which fault.
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
    distributed_config,
    evaluate_config,
    lora_section,
    mesh_config,
    planner_config,
    sft_config,
)
from aqn_jax.data.config import data_config
from aqn_jax.diagnosis.config import diagnosis_config
from aqn_jax.faults.config import FAULT_KINDS, faults_config
from aqn_jax.models.config import model_section
from aqn_jax.registry import Registry
from aqn_jax.rl.config import correction_config
from aqn_jax.rl.losses import policy_loss_config
from aqn_jax.rl.rollout_correction import PRESETS
from aqn_jax.sdc.config import sdc_config

FAULT_LAYER = 4  # the middle of the tiny model's 8 layers


def base_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.job = "train"  # the job to run (aqn_jax/jobs/<job>.py): train | compare | evaluate | ...
    config.arm = "clean"  # the study arm (apply_arm); informational in the run's outputs
    # The fault every arm but clean runs on: deadzone (config.faults.deadzone) | noise
    # (config.faults.noise: the original design notes' hardware error model).
    config.study_fault = "deadzone"  # deadzone | noise
    config.seed = 0  # RL seed: data order, sampling, fault noise (int; the study uses 0-4)
    # Resuming a workdir whose checkpoints were made under another config is refused, naming
    # the changed fields; True continues with the new values (recorded in
    # config_overrides.jsonl).
    config.resume_override = False  # bool

    config.model = model_section()  # preset tiny, or a local HF snapshot in hf_path
    config.tokenizer_path = ""  # '' = the embedded character tokenizer (or hf_path's)

    config.data = data_config()  # data paths or the embedded task (aqn_jax/data/config.py)
    # One operation on one-digit amounts, split by question text: under 200 distinct equations,
    # so a chain split would ask the tiny model to infer arithmetic facts it never saw (0.34 test
    # vs 0.94 train accuracy after SFT); a question split asks it to read the story's numbers
    # and operation (aqn_jax/data/arithmetic.py; WORKSPACE.md, issue 14).
    config.data.task.digits = 1  # digits of the task's amounts (1-4)
    config.data.task.steps = 1  # operations per problem (1-4)
    config.data.task.split_by = "question"  # question | chain: what train and test never share
    config.data_batch = ml_collections.ConfigDict()  # the RL batch
    config.data_batch.prompts = 16  # prompts per RL step (verl train_batch_size)

    # The warm start (cached; this setting's result ships in aqn_jax/assets, made by
    # configs/warm_start.py): every train problem, 600 steps of 32, loss ~0.015.
    config.sft = sft_config()  # the SFT warm start (aqn_jax/warm_start.py)
    config.sft.steps = 600  # optimizer steps
    config.sft.batch_size = 32  # sequences per step
    config.sft.examples = 4096  # train examples used (the first N)
    config.sft.seed = 0  # one warm start whatever config.seed (the model a researcher brings)

    config.rollout = ml_collections.ConfigDict()  # generation (verl actor_rollout_ref.rollout)
    config.rollout.n = 5  # samples per prompt (GRPO group)
    config.rollout.temperature = 1.0  # sampling temperature (1.0; 0 = greedy)
    config.rollout.top_k = 0  # 0 = off
    config.rollout.top_p = 1.0  # nucleus mass (1.0 = off)
    config.rollout.max_new_tokens = 24  # answers are ~17 characters + EOS
    # The task's chat prompts are 24-69 characters long (mean 38): one bucket of 72 pads far
    # less than 96 would (every RL row is bucket + max_new_tokens; WORKSPACE.md, issue 8).
    config.rollout.max_prompt_len = 72  # tokens; longer train prompts are dropped
    config.rollout.prompt_buckets = (72,)  # padded prompt widths, tokens (one program each)
    # Each distinct prompt prefilled once for its n samples (off where a fault's values would
    # differ: `FaultPlan.split_refusals`).
    config.rollout.share_prompt = True

    config.algo = ml_collections.ConfigDict()  # the RL objective (verl algorithm / actor)
    config.algo.estimator = "grpo"  # grpo | drgrpo | gae (PPO with a critic)
    policy_loss_config(config.algo)  # policy_loss (ppo | gspo) and each loss's clip range
    config.algo.loss_agg_mode = "token-mean"  # how token losses average (rl/losses.AGG_MODES)
    config.algo.use_kl_loss = True  # KL to the reference policy as a loss term (GRPO)
    config.algo.kl_loss_coef = 0.001  # its weight (0.001)
    config.algo.kl_type = "low_var_kl"  # low_var_kl | kl | mse | abs
    config.algo.use_kl_in_reward = False  # KL as a per-token reward penalty (PPO)
    config.algo.kl_coef = 0.001  # KL-in-reward coefficient
    config.algo.entropy_coeff = 0.0  # entropy bonus weight (0 = none)
    config.algo.gamma = 1.0  # GAE discount per token (1.0)
    config.algo.lam = 1.0  # GAE lambda (1.0)
    # Rollout correction (aqn_jax/rl/rollout_correction.py): sampler vs trainer log-probs.
    correction_config(config.algo)

    config.actor = ml_collections.ConfigDict()  # the policy's optimizer and PPO batching
    # 3e-5: from the shipped warm start, 1e-4 lowered the clean device's greedy accuracy
    # (0.797 -> 0.719 in 12 steps; 0.832 -> 0.801 / 0.758 in 30) while 3e-5 held it (0.789)
    # and won back 10% of the fault's cost in 12 steps (WORKSPACE.md, issue 14).
    config.actor.lr = 3e-5  # AdamW learning rate
    config.actor.warmup_steps = 0  # RL steps of linear warmup
    config.actor.schedule = "constant"  # constant | warmup_constant | cosine
    config.actor.weight_decay = 0.01  # decoupled AdamW weight decay
    config.actor.grad_clip = 1.0  # global-norm clip (0 = off)
    config.actor.ppo_epochs = 1  # passes over each RL batch
    config.actor.mini_batch_prompts = 8  # PPO mini-batch, in prompts (x n rows)
    config.actor.micro_batch_rows = 40  # gradient-accumulation chunk, in rows
    # The old log-probs of the PPO ratio. 'auto': when the update is on-policy (one epoch, one
    # mini-batch, no rollout correction, no KL in the reward, no SDC), they are the update's
    # own log-probs, detached (TRL's and verl's shortcut: ratio 1 exactly), with no separate
    # forward pass; 'always': a separate pass before the update, as with several mini-batches.
    config.actor.old_logp_pass = "auto"
    # The passes over rollout rows compute a group's prompt once (`forward.SharedPrompt`), and
    # the update does not run micro-batches of rows without an advantage (exact with no
    # entropy bonus, KL loss or critic); each is off, with the reason logged, where it would
    # change the result.
    config.actor.share_prompt = True
    config.actor.skip_zero_advantage = True

    config.critic = ml_collections.ConfigDict()  # used by estimator='gae'
    config.critic.lr = 1e-4  # AdamW learning rate
    config.critic.lr_warmup_steps = 0  # RL steps of linear warmup
    config.critic.schedule = "constant"  # constant | warmup_constant | cosine
    config.critic.weight_decay = 0.01  # decoupled AdamW weight decay
    config.critic.grad_clip = 1.0  # global-norm clip (0 = off)
    config.critic.cliprange_value = 0.5  # value clip around the old values (0.5)
    config.critic.warmup_steps = 0  # RL steps that update only the critic
    config.critic.faults = False  # run the hardware faults in the critic too

    config.trainer = ml_collections.ConfigDict()  # the loop
    config.trainer.total_steps = 30  # RL steps (used when total_epochs = 0)
    config.trainer.total_epochs = 0  # > 0: this many passes over the train split instead
    config.trainer.val_every = 10  # 0 = only at the start and the end
    config.trainer.val_size = 256  # test examples per validation
    config.trainer.val_batch_size = 64  # prompts per validation batch
    # Checked before every save (no checkpoint of a diverged run): params and optimizer state
    # finite, the pre-clip gradient norm <= max_grad_norm (the embedded runs stay under 10),
    # every |param| <= max_param_abs. 0 turns a bound off.
    config.trainer.max_grad_norm = 1e4  # pre-clip actor gradient norm bound
    config.trainer.max_param_abs = 1e4  # |param| bound

    config.checkpoint = ml_collections.ConfigDict()  # Orbax checkpoints under <workdir>/checkpoints
    config.checkpoint.every = 0  # 0 = only at the end
    config.checkpoint.keep = 2  # the latest N kept
    # What the last step saves: state (resumable) | params (params only, a third of the state's
    # bytes under AdamW: an evaluation-sized run) | none (no checkpoint at the end).
    config.checkpoint.final = "state"
    # hf: at the end, <workdir>/export/ is an HF snapshot of the trained policy (LoRA merged:
    # W + alpha/rank A B over the dequantised base) with config.json and the tokenizer, which
    # transformers and `configs/evaluate.py --config.model.hf_path=` load | none.
    config.checkpoint.export = "none"
    # LoRA adapters on a frozen base (QeRL mode; aqn_jax/lora.py): rank 0 = full fine-tuning.
    config.lora = lora_section()

    config.mesh = mesh_config()  # devices as (data, fsdp, tensor) (aqn_jax/parallel.py)
    config.distributed = distributed_config()  # several hosts (launch/*.py set it)
    config.planner = planner_config()  # per-device memory plan, checked before compiling
    config.diagnosis = diagnosis_config()  # SRDD (aqn_jax/diagnosis/srdd.py)
    config.evaluate = evaluate_config()  # job `evaluate` (the robustness matrix)

    config.faults = faults_config()  # the simulated hardware (aqn_jax/faults/config.py)
    config.faults.deadzone.layers = str(FAULT_LAYER)  # the faulty layer
    # The operating point, chosen from the measured severity curve of the shipped warm start
    # (configs/severity.py; WORKSPACE.md, issue 14): flushing the 75% smallest |h| of layer 4's
    # output takes greedy accuracy 0.832 -> 0.508 and the held-out loss 0.033 -> 0.62, a cost
    # RL can win back from (0.9 leaves 0.105; the seed's 0.01 of the max flushes 5%, no cost).
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
    # The baseline of the original design notes (configs/compare.py): QeRL's global decay.
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


def apply_arm(config: ml_collections.ConfigDict, arm: str) -> ml_collections.ConfigDict:
    """Set what arm `arm` (ARMS) sets on `config`, on the fault `config.study_fault`."""
    entry = ARMS.get(arm)
    fault = FAULT_KINDS.check(config.get("study_fault", "deadzone"), "config.study_fault")
    if entry.targets_fault and not FAULT_KINDS.get(fault).aqn_target:
        allowed = tuple(k for k, v in FAULT_KINDS.items() if v.aqn_target)
        raise ValueError(
            f"config.study_fault={fault!r}; allowed with arm {arm!r} (AQN placed by the fault's"
            f" layers): {allowed}"
        )
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
