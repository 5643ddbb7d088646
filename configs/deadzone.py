"""Arm `deadzone` of the embedded study (aqn_jax/experiment.py).

An MXFP4-style deadzone (threshold 0.01 of the tensor's amax) on the residual stream of layer 4,
in every phase, and no AQN: the lower bound.

  python -m aqn_jax.launch --config=configs/deadzone.py
  python -m aqn_jax.launch --config=configs/deadzone.py:smoke     # < 1 minute, a wiring check

Expected: RL still trains; validation on the faulty device stays at or below the clean arm's.
Run time on 2 CPU cores: see RUNTIME below (measured, WORKSPACE.md); SFT is shared through its
cache (runs/cache/) by every arm.
"""

from aqn_jax.experiment import arm_config

RUNTIME = "measured in WORKSPACE.md"


def get_config(arg=None):
    return arm_config("deadzone", arg)
