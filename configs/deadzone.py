"""Arm `deadzone` of the embedded study (aqn_jax/experiment.py).

A deadzone flushing the 75% smallest |h| of the residual stream after layer 4 (severity
'quantile', chosen from the severity curve), in every phase, and no AQN: the lower bound.

  python -m aqn_jax.launch --config=configs/deadzone.py
  python -m aqn_jax.launch --config=configs/deadzone.py:smoke     # < 1 minute, a wiring check

Expected: the fault's cost at the start and the share of it RL won back, printed at the end.
Results of the default study (5 seeds, 30 steps): docs/compare_results.md.
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("deadzone", arg)
