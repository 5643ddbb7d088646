"""Arm `deadzone` of the embedded study (aqn_jax/experiment.py).

A deadzone flushing the 75% smallest |h| of the residual stream after layer 4 (severity
'quantile', chosen from the measured severity curve), in every phase, and no AQN: the lower
bound.

  python -m aqn_jax.launch --config=configs/deadzone.py
  python -m aqn_jax.launch --config=configs/deadzone.py:smoke     # < 1 minute, a wiring check

Expected: the fault costs ~0.31 greedy accuracy at the start (clean 0.797, faulty 0.484 on 128
problems); RL on the faulty device wins part of it back (12 steps: 0.484 -> 0.516) and the
printed line says how much.
Run time on 2 CPU cores: about 4 minutes (a 30-step run took 227 s on one core of two; the SFT
warm start ships with the package, aqn_jax/assets, so no SFT runs; WORKSPACE.md issue 14).
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("deadzone", arg)
