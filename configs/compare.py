"""The study (job `compare`): arms clean / deadzone / global_aqn / targeted / healthy /
srdd_guided x 5 seeds on the embedded task, each a full train run plus the robustness matrix,
sharing one SFT warm start and one SRDD diagnosis; Welch tests targeted vs global and healthy vs
global; report.md with plots and results.json.

  python -m aqn_jax.launch --config=configs/compare.py
  python -m aqn_jax.launch --config=configs/compare.py:threshold_0.1   # sweep variants:
      threshold_0.01 | threshold_0.1 | threshold_0.2 | threshold_0.5 (the seed's statement:
      flush |h| < t * max|h|) | seed_regime (97% flushed, the seed's regime on a real LM)
      layer_early | layer_middle | layer_late (fault at layer 1 / 4 / 6) | two_layers (2 and 5)
      aqn_between | aqn_before_fault | aqn_norm_weight (AQN's form, targeted vs global_aqn)
      noise_study | noise_study_5pct (the original design notes: relative noise on every
      linear; arms deadzone = the noise without AQN, global_qerl, global_aqn = epoch-aware)
      mismatch_study | mismatch_study_mxfp4 | mismatch_study_call | mismatch_study_causal
      (issue 29: the rollout corrections and AQN when the sampler's device is not the
      trainer's; arms uncorrected / tis / trl_mask / geo_rs / aqn_qerl / aqn_qerl_tis (+ clean);
      scenario (a) the deadzone, or MXFP4, on the rollout device only, (b) the deadzone on
      every phase with its per-call statistic, (c) the causal statistic: the negative control)
      Measured (WORKSPACE.md issue 29; 12 RL steps, 5 seeds, evaluation on 128 problems):
      mismatch_study (a): faulty-device accuracy clean-rollout RL 0.503, uncorrected 0.539,
      tis 0.506, trl_mask 0.492, geo_rs 0.494 (rejects 98.9% of tokens), aqn_qerl 0.530,
      aqn_qerl_tis 0.506; the mismatch (0.21 nats per token) costs nothing, the corrections
      cost up to 0.047 of RL's gain, AQN adds nothing beyond TIS (MDD 0.042). 69 min for
      7 x 5 runs on 2 cores shared with other runs (not timed on a quiet machine).
      mismatch_study_causal (c): every arm
      identical per seed (kl < 5e-8): the corrections do nothing, as they must.
      qerl_study (issue 40: QeRL mode's arms full / lora / nvfp4_lora / mxfp4_lora /
      nvfp4_lora_aqn, 12 RL steps, 5 seeds; measured, WORKSPACE.md issue 40: faulty-device
      accuracy 0.516 / 0.508 / 0.511 / 0.481 / 0.497, no comparison significant (Holm p = 1.00,
      MDD 0.038-0.046); the NVFP4 base raises the policy's entropy by 0.014 (p = 0.01);
      80 min on 2 loaded cores, 84-98 s a run on quiet ones)
  python -m aqn_jax.launch --config=configs/compare.py:smoke           # 2 arms x 2 seeds, tiny
  python -m aqn_jax.launch --config=configs/compare.py:layer_late,smoke

Re-running the same command reuses finished runs and resumes an interrupted one. Arms or seeds:
--config.compare.arms='("targeted","global_aqn")' --config.compare.seeds='(0,1,2)'.

Measured before RL on the shipped warm start (clean greedy accuracy 0.832, configs/severity.py,
WORKSPACE.md issue 14), the faulty-device accuracy at layer 4 of each variant's fault:
default (75% flushed) 0.508; threshold_0.01 0.832 (5% flushed: no cost); threshold_0.1 0.828
(46%); seed_regime 0.004 (no reward left for RL); layer_early 0.387, layer_late 0.711 (75% at
layers 1 and 6). The RL study of each variant is recorded in WORKSPACE.md where it was run;
the old default (threshold 0.01, issue 8: ~53 min for 6 arms x 5 seeds) moved nothing.

Measured RL at each fault variant (WORKSPACE.md issue 14; arm targeted, seeds 0 and 1, 30 steps,
`--config.compare.arms='("targeted",)' --config.compare.seeds='(0,1)'`, idle machine, each
invocation 253-273 s with its own cold XLA cache); faulty-device validation (256 problems)
step 0 -> 30 per seed, and the share of the gap won back:
- threshold_0.01: no gap (0.832 at step 0); 0.824 / 0.816; SRDD still locates layer 4.
- threshold_0.1: gap 0.004: nothing to win back; 0.828 -> 0.801 / 0.816.
- threshold_0.2: gap 0.176; 0.656 -> 0.668 / 0.727 (7% / 40%).
- threshold_0.5 and seed_regime: gap 0.81-0.83, faulty accuracy 0.004-0.020, no reward, no
  recovery (0.008 / 0.035 and 0.004 / 0.004).
- layer_early (layer 1): gap 0.445; 0.387 -> 0.488 / 0.484 (23% / 22%): RL wins back most here.
- layer_middle: the default (layer 4), below.
- layer_late (layer 6): gap 0.121; 0.711 -> 0.695 / 0.656 (RL loses ground on this device).
- two_layers (2 and 5): gap 0.508; SRDD locates [2, 5]; 0.324 -> 0.398 / 0.395 (15% / 14%).

Measured (2 cores shared with other work, so upper bounds; WORKSPACE.md issue 14), 3 seeds,
evaluation on 128 problems with the fault:
- aqn_before_fault: 33 min for 2 arms x 3 seeds; targeted 0.521 ± 0.016, global_aqn
  0.531 ± 0.028 (difference −0.010, p = 0.62, MDD 0.077; 5 seeds per arm would detect 0.05);
  no AQN (the deadzone arm of the 5-seed recovery study) 0.527 ± 0.020: no effect of AQN.
- aqn_between: 18 min; targeted 0.516 ± 0.014, global_aqn 0.526 ± 0.024 (p = 0.56, MDD 0.066).
- aqn_norm_weight: 23 min for 2 arms x 3 seeds (245-333 s per run on a quieter machine);
  targeted 0.542 ± 0.046, global_aqn 0.526 ± 0.037 (+0.016, p = 0.67, MDD 0.13).
- noise_study (10%), 5 seeds: 48 min for seeds 0-2 and 55 min for seeds 3-4 (3 arms each, under
  load); no AQN 0.695 ± 0.031, global_qerl 0.692 ± 0.028, global_aqn (epoch-aware)
  0.684 ± 0.035 on the noisy device (p >= 0.62, MDD 0.061-0.068; 7-9 seeds per arm would detect
  0.05); on a clean device with 0 / 5 / 10 / 20% noise 0.77 / 0.76 / 0.69 / 0.41 for every arm.
- noise_study_5pct: 5% costs the warm start 0.016 before RL (0.832 -> 0.816 / 0.820 on the noisy
  device), inside the noise of 256 problems: a study there is null by construction. Measured
  with its no-AQN arm only (`--config.compare.arms='("deadzone",)' --config.compare.seeds='(0,1)'`,
  550 s): 30 RL steps on the noisy device take it to 0.793 / 0.797 and the clean device to
  0.816 / 0.820; evaluated at 0 / 5 / 10 / 20% noise 0.77 / 0.75 / 0.69 / 0.43.
- default (6 arms x 5 seeds): 48 min on an idle machine (2 workers, 152-272 s per run; before
  the 1.7x faster deadzone step of issue 17). RL on the faulty device wins back +0.035 (deadzone,
  CI [+0.010, +0.060]) / +0.036 (global_aqn) / +0.018 (targeted) / +0.030 (healthy) / +0.037
  (srdd_guided) of the 0.324 gap (256 problems); evaluation with the fault: targeted -
  global_aqn -0.025, p = 0.15, MDD 0.051; healthy - global_aqn -0.003, p = 0.82: no AQN effect.
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
    # AQN's form (issue 14 item 4), targeted vs global for each, at the default fault:
    # the seed's code (relative noise between two deadzone applications: it can never rescue
    # a flushed value), the seed's prose (noise relative to the pre-fault signal, then the
    # deadzone), QeRL's RMSNorm-weight noise.
    "aqn_between": {"aqn_order": "between"},
    "aqn_before_fault": {"aqn_order": "before_fault"},
    "aqn_norm_weight": {"aqn_form": "norm_weight", "aqn_order": "after_fault"},
    # The original design notes: relative noise on every linear output; no AQN vs QeRL's
    # global decay vs epoch-aware; each policy evaluated with 0 / 5 / 10 / 20% noise on a clean
    # device. On the shipped warm start 5% costs 0.016 accuracy (0.832 -> 0.816, inside the
    # noise of 256 problems) and 10% costs 0.078, the notes' 8.7 points on Qwen2.5-1.5B at 5%:
    # the study runs at 10%; noise_study_5pct keeps the notes' number.
    "noise_study": {"study_fault": "noise", "noise_scale": "0.10"},
    "noise_study_5pct": {"study_fault": "noise", "noise_scale": "0.05"},
    # Issue 29: the rollout corrections against AQN when the sampler's device is not the
    # trainer's (aqn_jax/rl/rollout_correction.py; scenarios in aqn_jax/experiment.py).
    # (a) the study's deadzone on the rollout (and evaluation) device only, a clean trainer:
    # 0.20 nats per token of mismatch; (a) with MXFP4 on every linear input gives 0.017.
    "mismatch_study": {"scenario": "deadzone_rollout"},
    "mismatch_study_mxfp4": {"scenario": "lowprec_rollout"},
    "mismatch_study_call": {"scenario": "both_call"},  # (b) the study's deadzone, per call
    "mismatch_study_causal": {"scenario": "both_causal"},  # (c) the negative control
    # Issue 40: QeRL mode's five arms (configs/qerl.py) on the study's faulty device, each
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
    if spec.get("study_fault") == "noise":
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
    if spec.get("qerl"):
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
    if "scenario" in spec:
        apply_scenario(config, spec["scenario"])
        control = spec["scenario"] == "both_causal"
        # The control needs no clean or AQN arm: every correction must do nothing there. With
        # a faulty trainer (both_call) the clean arm is not the reference of any question.
        config.compare.arms = {
            "both_causal": MISMATCH_ARMS[1:5],
            "both_call": MISMATCH_ARMS[1:],
        }.get(spec["scenario"], MISMATCH_ARMS)
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
    config.sft.seed = 0  # one warm start for every seed
    config.checkpoint.every = 10  # an interrupted run resumes (the job reuses finished ones)
    config.trainer.val_every = 0  # validation at the start and the end; evaluate does the rest
    config.evaluate.size = 128
    if smoke:
        if "scenario" in spec:
            config.compare.arms = ("uncorrected", "tis")
            config.compare.comparisons = (("tis", "uncorrected"),)
        elif spec.get("qerl"):
            config.compare.arms = ("lora", "nvfp4_lora")
            config.compare.comparisons = (("nvfp4_lora", "lora"),)
        elif "study_fault" not in spec:
            config.compare.arms = ("global_aqn", "targeted")
            config.compare.comparisons = (("targeted", "global_aqn"),)
        config.compare.seeds = (0, 1)
        config.checkpoint.every = 1
        config.evaluate.size = 8
        config.evaluate.noise_levels = (0.0, 0.1)
        config.evaluate.mxfp4 = False
    return config
