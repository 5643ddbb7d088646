"""One train run of the mismatch study: a scenario (which device runs which fault) and
an arm (which rollout correction, with or without AQN), on the embedded model.

  python -m aqn_jax.launch --config=configs/mismatch.py:<scenario>,<arm>[,smoke]
  (no argument: both_call,tis)

Scenarios (aqn_jax/experiment.py `apply_scenario`):
  lowprec_rollout  (a) MXFP4 on every linear input of the rollout (and evaluation) device, a
                   clean trainer
  deadzone_rollout (a') the study's deadzone (layer 4, 75% flushed) on the rollout and evaluation
                   device only, a clean trainer
  both_call        (b) the study's deadzone (layer 4, 75% flushed) on every phase, statistic per
                   module call: the sampler and the trainer disagree (0.5 nats per token)
  both_causal      (c) a deadzone (layer 4, 0.2 of the max) on every phase with a causal
                   statistic: they agree to float noise (the negative control)
Arms: clean, uncorrected, tis, trl_mask, geo_rs, aqn_qerl, aqn_qerl_tis (experiment.py); or any
correction by hand: --config.algo.rollout_is=token --config.algo.rollout_rs=geometric ...

Every run logs verl's `rollout_corr/*` mismatch metrics (metrics.jsonl, TensorBoard, report.md)
whether a correction is on or not. The study over arms and seeds: configs/compare.py:mismatch_study
(results: docs/compare_results.md).

  python -m aqn_jax.launch --config=configs/mismatch.py:both_call,tis,smoke   # < 1 minute
"""

from aqn_jax.experiment import ARMS, SCENARIOS, apply_arm, apply_scenario, base_config

DEFAULT = ("both_call", "tis")  # with no argument (or just ',smoke'): the seed's setting, TIS


def get_config(arg=None):
    parts = [p for p in (arg or "").split(",") if p]
    smoke = "smoke" in parts
    names = [p for p in parts if p != "smoke"] or list(DEFAULT)
    if len(names) != 2 or names[0] not in SCENARIOS or names[1] not in ARMS:
        raise ValueError(
            f"--config=configs/mismatch.py:{arg}; expected <scenario>,<arm>[,smoke] with a"
            f" scenario of {SCENARIOS.names()} and an arm of {ARMS.names()}"
        )
    config = base_config("smoke" if smoke else None)
    apply_scenario(config, names[0])
    return apply_arm(config, names[1])
