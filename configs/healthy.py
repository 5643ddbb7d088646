"""Arm `healthy` of the embedded study (aqn_jax/experiment.py).

The deadzone at layer 4 and AQN on every layer except it (seed 001's control: is targeted AQN's
gain only 'not hurting the healthy layers'?).

  python -m aqn_jax.launch --config=configs/healthy.py
  python -m aqn_jax.launch --config=configs/healthy.py:smoke     # < 1 minute, a wiring check

Expected: trains like global_aqn; the statistics are in the compare job.
Run time on 2 CPU cores: see RUNTIME below (measured, WORKSPACE.md); SFT is shared through its
cache (runs/cache/) by every arm.
"""

from aqn_jax.experiment import arm_config

RUNTIME = "measured in WORKSPACE.md"


def get_config(arg=None):
    return arm_config("healthy", arg)
