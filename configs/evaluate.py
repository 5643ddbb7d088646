"""Robustness evaluation of a policy on the embedded task (job `evaluate`).

Purpose: how a policy holds up on other devices: test accuracy with the deadzone of the
embedded study off and on, each crossed with relative noise of 5% / 10% on every linear output
and with MXFP4 on every linear input, plus the held-out loss.

  python -m aqn_jax.launch --config=configs/evaluate.py                # the SFT warm start
  python -m aqn_jax.launch --config=configs/evaluate.py --config.evaluate.run=runs/targeted

Expected: a line per condition and `runs/evaluate/{evaluation.json,evaluation.md,
evaluation.png}`. For a run trained with a different config (model, task), pass that run's
config file with --config.job=evaluate instead.
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    config = arm_config("deadzone", arg)  # the embedded study's device: deadzone at layer 4
    config.job = "evaluate"
    return config
