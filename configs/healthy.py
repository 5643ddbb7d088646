"""Arm `healthy` of the embedded study (aqn_jax/experiment.py).

The deadzone at layer 4 and AQN on every layer except it (the original design notes' control:
is targeted AQN's gain only 'not hurting the healthy layers'?).

  python -m aqn_jax.launch --config=configs/healthy.py
  python -m aqn_jax.launch --config=configs/healthy.py:smoke     # < 1 minute, a wiring check

Measured results and run times: docs/study_embedded.md.
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("healthy", arg)
