"""Arm `clean` of the embedded study (aqn_jax/experiment.py).

No fault, no AQN: the upper bound of the study (the accelerator is healthy).

  python -m aqn_jax.launch --config=configs/clean.py
  python -m aqn_jax.launch --config=configs/clean.py:smoke     # < 1 minute, a wiring check

Expected: val acc rises above the SFT start; faulty-device and clean validation are equal (no
fault).
Run time on 2 CPU cores: see RUNTIME below (measured, WORKSPACE.md); SFT is shared through its
cache (runs/cache/) by every arm.
"""

from aqn_jax.experiment import arm_config

RUNTIME = "measured in WORKSPACE.md"


def get_config(arg=None):
    return arm_config("clean", arg)
