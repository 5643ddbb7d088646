"""Arm `global_aqn` of the embedded study (aqn_jax/experiment.py).

The deadzone at layer 4, with AQN (relative Gaussian noise y + sigma*randn*|y| at every decoder
layer's output, rollout only, sigma 0.05 -> 0.0005 epoch-aware) on all layers.

  python -m aqn_jax.launch --config=configs/global_aqn.py
  python -m aqn_jax.launch --config=configs/global_aqn.py:smoke     # < 1 minute, a wiring check

Measured (3 seeds, 30 steps, `configs/compare.py:aqn_between`, the default AQN form; WORKSPACE.md
issue 14): 0.526 ± 0.024 on the faulty device and 0.794 ± 0.012 clean (128 problems), within
one SD of the no-AQN deadzone arm (0.527 ± 0.020).
Run time on 2 CPU cores: 257-287 s per 30-step run on one core of two, 460-634 s beside other
work (the SFT warm start ships with the package, aqn_jax/assets, so no SFT runs).
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("global_aqn", arg)
