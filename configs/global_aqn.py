"""Arm `global_aqn` of the embedded study (aqn_jax/experiment.py).

The deadzone at layer 4, with AQN (relative Gaussian noise y + sigma*randn*|y| at every decoder
layer's output, rollout only, sigma 0.05 -> 0.0005 epoch-aware) on all layers.

  python -m aqn_jax.launch --config=configs/global_aqn.py
  python -m aqn_jax.launch --config=configs/global_aqn.py:smoke     # < 1 minute, a wiring check

Expected: val acc on the faulty device near the deadzone arm's (single seeds differ by a few
points: compare arms with the compare job).
Run time on 2 CPU cores: about 4 minutes (a 30-step run took 227 s on one core of two; the SFT
warm start ships with the package, aqn_jax/assets, so no SFT runs; WORKSPACE.md issue 14).
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("global_aqn", arg)
