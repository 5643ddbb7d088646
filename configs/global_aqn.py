"""Arm `global_aqn` of the embedded study (aqn_jax/experiment.py).

The deadzone at layer 4, with AQN (relative Gaussian noise y + sigma*randn*|y| at every decoder
layer's output, rollout only, sigma 0.05 -> 0.0005 epoch-aware) on all layers.

  python -m aqn_jax.launch --config=configs/global_aqn.py
  python -m aqn_jax.launch --config=configs/global_aqn.py:smoke     # < 1 minute, a wiring check

Measured (the default study: 5 seeds, 30 steps; WORKSPACE.md issue 14): validation on the faulty
device 0.508 -> 0.544 ± 0.026 (+0.036, CI [+0.004, +0.068], 11.1% of the gap; 256 problems),
clean 0.820 ± 0.012; the compare evaluation (128 other problems) 0.527 ± 0.019 with the fault,
0.792 clean: the same as no AQN (deadzone arm 0.543 / 0.527 ± 0.020).
Run time on 2 CPU cores (the default study, 6 arms x 5 seeds in 48 min, WORKSPACE.md issue 14):
181-217 s per 30-step run on one core of two, before this code's 1.7x faster deadzone step
(the SFT warm start ships with the package, aqn_jax/assets, so no SFT runs).
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("global_aqn", arg)
