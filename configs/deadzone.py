"""Arm `deadzone` of the embedded study (aqn_jax/experiment.py).

A deadzone flushing the 75% smallest |h| of the residual stream after layer 4 (severity
'quantile', chosen from the measured severity curve), in every phase, and no AQN: the lower
bound.

  python -m aqn_jax.launch --config=configs/deadzone.py
  python -m aqn_jax.launch --config=configs/deadzone.py:smoke     # < 1 minute, a wiring check

Measured results and run times: docs/study_embedded.md.
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("deadzone", arg)
