"""Arm `deadzone` of the embedded study (aqn_jax/experiment.py).

An MXFP4-style deadzone (threshold 0.01 of the tensor's amax) on the residual stream of layer 4,
in every phase, and no AQN: the lower bound.

  python -m aqn_jax.launch --config=configs/deadzone.py
  python -m aqn_jax.launch --config=configs/deadzone.py:smoke     # < 1 minute, a wiring check

Expected: RL still trains; validation on the faulty device stays at or below the clean arm's.
Run time on 2 CPU cores: about 4-5 minutes (configs/targeted.py measured 4 min 20 s, including
the first-use SFT of 39 s and the SRDD diagnosis; WORKSPACE.md); every arm shares the SFT
through its cache (runs/cache/). `:smoke`: about 30 s.
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("deadzone", arg)
