"""Arm `healthy` of the embedded study (aqn_jax/experiment.py).

The deadzone at layer 4 and AQN on every layer except it (the control of the original system's
controlled test, docs/ARCHITECTURE.md "The original system's experiments":
is targeted AQN's gain only 'not hurting the healthy layers'?).

  python -m aqn_jax.launch --config=configs/healthy.py
  python -m aqn_jax.launch --config=configs/healthy.py:smoke     # < 1 minute, a wiring check

Results of the default study (5 seeds, 30 steps): docs/compare_results.md.
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("healthy", arg)
