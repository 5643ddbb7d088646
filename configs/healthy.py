"""Arm `healthy` of the embedded study (aqn_jax/experiment.py).

The deadzone at layer 4 and AQN on every layer except it (the original design notes' control:
is targeted AQN's gain only 'not hurting the healthy layers'?).

  python -m aqn_jax.launch --config=configs/healthy.py
  python -m aqn_jax.launch --config=configs/healthy.py:smoke     # < 1 minute, a wiring check

Measured (2 seeds, 30 steps, WORKSPACE.md issue 14): 0.539 ± 0.011 on the faulty device and
0.797 clean (128 problems), within one SD of global_aqn (0.526 ± 0.024) and no AQN (0.527 ± 0.020).
Run time on 2 CPU cores: 257-287 s per 30-step run on one core of two, 440-540 s beside other
work (the SFT warm start ships with the package, aqn_jax/assets, so no SFT runs).
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("healthy", arg)
