"""The study (job `compare`): arms clean / deadzone / global_aqn / targeted / healthy /
srdd_guided x 5 seeds on the embedded task, each a full train run plus the robustness matrix,
sharing one SFT warm start and one SRDD diagnosis; Welch tests targeted vs global and healthy vs
global; report.md with plots and results.json. Results: docs/compare_results.md.

  python -m aqn_jax.launch --config=configs/compare.py
  python -m aqn_jax.launch --config=configs/compare.py:threshold_0.1   # sweep variants:
      threshold_0.01 | threshold_0.1 | threshold_0.2 | threshold_0.5 (the seed's statement:
      flush |h| < t * max|h|) | seed_regime (97% flushed, the seed's regime on a real LM)
      layer_early | layer_middle | layer_late (fault at layer 1 / 4 / 6) | two_layers (2 and 5)
      aqn_between | aqn_before_fault | aqn_norm_weight (AQN's form, targeted vs global_aqn)
      noise_study | noise_study_5pct (the original system's noise study: relative noise on every
      linear; arms deadzone = the noise without AQN, global_qerl, global_aqn = epoch-aware)
      mismatch_study | mismatch_study_mxfp4 | mismatch_study_call | mismatch_study_causal
      (the rollout corrections and AQN when the sampler's device is not the trainer's; arms
      uncorrected / tis / trl_mask / geo_rs / aqn_qerl / aqn_qerl_tis (+ clean); scenario (a)
      the deadzone, or MXFP4, on the rollout device only, (b) the deadzone on every phase with
      its per-call statistic, (c) the causal statistic: the negative control)
      qerl_study (QeRL mode's arms full / lora / nvfp4_lora / mxfp4_lora / nvfp4_lora_aqn)
  python -m aqn_jax.launch --config=configs/compare.py:smoke           # 2 arms x 2 seeds, tiny
  python -m aqn_jax.launch --config=configs/compare.py:layer_late,smoke

Re-running the same command reuses finished runs and resumes an interrupted one. Arms or seeds
(the comparisons and the reference arm must be among the arms):
--config.compare.arms='("targeted","global_aqn")' --config.compare.seeds='(0,1,2)'
--config.compare.comparisons='(("targeted","global_aqn"),)'.
"""

from aqn_jax.experiment import apply_scenario, arm_names, base_config
from aqn_jax.study.config import compare_config

VARIANTS = {
    "default": {},
    # The seed's statement of severity (a fraction of the tensor max), beside the default's
    # flushed fraction (quantile 0.75).
    **{f"threshold_{t}": {"threshold": t} for t in ("0.01", "0.1", "0.2", "0.5")},
    # The seed's own regime on a real LM: >= 96% of the stream flushed.
    "seed_regime": {"quantile": "0.97"},
    "layer_early": {"layers": "1"},
    "layer_middle": {"layers": "4"},
    "layer_late": {"layers": "6"},
    "two_layers": {"layers": "(2,5)"},
    # AQN's form, targeted vs global for each, at the default fault:
    # the seed's code (relative noise between two deadzone applications: it can never rescue
    # a flushed value), the seed's prose (noise relative to the pre-fault signal, then the
    # deadzone), QeRL's RMSNorm-weight noise.
    "aqn_between": {"aqn_order": "between"},
    "aqn_before_fault": {"aqn_order": "before_fault"},
    "aqn_norm_weight": {"aqn_form": "norm_weight", "aqn_order": "after_fault"},
    # The original system's noise study (docs/ARCHITECTURE.md, "The original system's
    # experiments"): relative noise on every linear output; no AQN vs QeRL's global decay vs
    # epoch-aware; each policy evaluated with 0 / 5 / 10 / 20% noise on a clean
    # device. The study runs at 10%: on the warm start 5% costs only 0.016 (inside the noise of
    # 256 problems) and 10% costs 0.078, about that study's 8.72 points at 5% on Qwen2.5-1.5B;
    # noise_study_5pct keeps its number.
    "noise_study": {"study_fault": "noise", "noise_scale": "0.10"},
    "noise_study_5pct": {"study_fault": "noise", "noise_scale": "0.05"},
    # The rollout corrections against AQN when the sampler's device is not the trainer's
    # (aqn_jax/rl/rollout_correction.py; scenarios in aqn_jax/experiment.py).
    # (a) the study's deadzone on the rollout (and evaluation) device only, a clean trainer:
    # 0.20 nats per token of mismatch; (a) with MXFP4 on every linear input gives 0.017.
    "mismatch_study": {"scenario": "deadzone_rollout"},
    "mismatch_study_mxfp4": {"scenario": "lowprec_rollout"},
    "mismatch_study_call": {"scenario": "both_call"},  # (b) the study's deadzone, per call
    "mismatch_study_causal": {"scenario": "both_causal"},  # (c) the negative control
    # QeRL mode's five arms (configs/qerl.py) on the study's faulty device, each
    # validated on it and on a clean device.
    "qerl_study": {"qerl": True},
}
MISMATCH_ARMS = ("clean", *arm_names("correction"))


def get_config(arg=None):
    parts = [p for p in (arg or "").split(",") if p]
    smoke = "smoke" in parts
    names = [p for p in parts if p != "smoke"]
    if len(names) > 1 or (names and names[0] not in VARIANTS):
        raise ValueError(
            f"--config=configs/compare.py:{arg}; allowed: one of {list(VARIANTS)}, optionally"
            " followed by ',smoke'"
        )
    variant = names[0] if names else "default"
    config = base_config("smoke" if smoke else None)
    config.job = "compare"
    config.compare = compare_config()
    config.compare.variant = variant + (" (smoke)" if smoke else "")
    spec = VARIANTS[variant]
    _fault_variant(config, spec)
    if spec.get("study_fault") == "noise":
        _noise_study(config, spec)
    if spec.get("qerl"):
        _qerl_study(config, smoke)
    if "scenario" in spec:
        _mismatch_study(config, spec["scenario"], smoke)
    config.sft.seed = 0  # one warm start for every seed
    config.checkpoint.every = 10  # an interrupted run resumes (the job reuses finished ones)
    config.trainer.val_every = 0  # validation at the start and the end; evaluate does the rest
    config.evaluate.size = 128
    if smoke:
        _smoke(config, spec)
    return config


def _fault_variant(config, spec) -> None:
    """The deadzone's severity and layers, and AQN's form, of the sweep variants."""
    if "threshold" in spec:
        config.faults.deadzone.severity = "amax"
        config.faults.deadzone.threshold = float(spec["threshold"])
    if "quantile" in spec:
        config.faults.deadzone.quantile = float(spec["quantile"])
    if "layers" in spec:
        config.faults.deadzone.layers = spec["layers"]
    if "aqn_order" in spec or "aqn_form" in spec:
        config.aqn.order = spec.get("aqn_order", config.aqn.order)
        config.aqn.form = spec.get("aqn_form", config.aqn.form)
        config.compare.arms = ("targeted", "global_aqn")
        config.compare.comparisons = (("targeted", "global_aqn"),)


def _noise_study(config, spec) -> None:
    """The original system's noise study: relative noise on every linear, AQN's two decays."""
    config.study_fault = "noise"
    config.faults.noise.kind = "relative_gaussian"
    config.faults.noise.scale = float(spec["noise_scale"])
    config.faults.noise.sites = ("linear",)
    config.faults.noise.layers = "all"
    config.compare.arms = ("deadzone", "global_qerl", "global_aqn")
    config.compare.reference_arm = "deadzone"
    config.compare.comparisons = (
        ("global_aqn", "deadzone"),
        ("global_qerl", "deadzone"),
        ("global_aqn", "global_qerl"),
    )
    config.evaluate.noise_levels = (0.0, 0.05, 0.10, 0.20)
    config.evaluate.mxfp4 = False


def _qerl_study(config, smoke: bool) -> None:
    """QeRL mode's five arms on the study's faulty device."""
    config.compare.arms = arm_names("qerl")
    config.compare.reference_arm = "full"
    config.compare.comparisons = (
        ("nvfp4_lora", "lora"),
        ("nvfp4_lora_aqn", "nvfp4_lora"),
        ("lora", "full"),
    )
    # The budget of a 5 x 5 study on 2 cores: 12 RL steps, the evaluation on the faulty
    # and the clean device only.
    config.trainer.total_steps = 2 if smoke else 12
    if not smoke:
        config.trainer.val_size = 64
    config.evaluate.noise_levels = (0.0,)
    config.evaluate.mxfp4 = False


def _mismatch_study(config, scenario: str, smoke: bool) -> None:
    """The rollout corrections and AQN when the sampler's device is not the trainer's."""
    apply_scenario(config, scenario)
    control = scenario == "both_causal"
    # The control needs no clean or AQN arm: every correction must do nothing there. With
    # a faulty trainer (both_call) the clean arm is not the reference of any question.
    config.compare.arms = {
        "both_causal": MISMATCH_ARMS[1:5],
        "both_call": MISMATCH_ARMS[1:],
    }.get(scenario, MISMATCH_ARMS)
    config.compare.seeds = (0, 1, 2) if control else (0, 1, 2, 3, 4)
    config.compare.reference_arm = "uncorrected"
    config.compare.comparisons = (
        (("tis", "uncorrected"), ("trl_mask", "uncorrected"), ("geo_rs", "uncorrected"))
        if control
        else (("tis", "uncorrected"), ("aqn_qerl", "tis"), ("aqn_qerl_tis", "tis"))
    )
    # The study's budget (60 minutes on 2 cores): 12 RL steps, the evaluation on the
    # faulty and the clean device only.
    config.trainer.total_steps = 2 if smoke else 12
    if not smoke:  # the start/end curve points; evaluate.size gives the result
        config.trainer.val_size = 64
    config.evaluate.noise_levels = (0.0,)
    config.evaluate.mxfp4 = False


def _smoke(config, spec) -> None:
    """2 arms x 2 seeds, a tiny evaluation."""
    if "scenario" in spec:
        config.compare.arms = ("uncorrected", "tis")
        config.compare.comparisons = (("tis", "uncorrected"),)
    elif spec.get("qerl"):
        config.compare.arms = ("lora", "nvfp4_lora")
        config.compare.reference_arm = "lora"  # "full" is not among the smoke's arms
        config.compare.comparisons = (("nvfp4_lora", "lora"),)
    elif "study_fault" not in spec:
        config.compare.arms = ("global_aqn", "targeted")
        config.compare.comparisons = (("targeted", "global_aqn"),)
    config.compare.seeds = (0, 1)
    config.checkpoint.every = 1
    config.evaluate.size = 8
    config.evaluate.noise_levels = (0.0, 0.1)
    config.evaluate.mxfp4 = False
