"""Arm `healthy` of the embedded study (aqn_jax/experiment.py).

The deadzone at layer 4 and AQN on every layer except it (the original design notes' control:
is targeted AQN's gain only 'not hurting the healthy layers'?).

  python -m aqn_jax.launch --config=configs/healthy.py
  python -m aqn_jax.launch --config=configs/healthy.py:smoke     # < 1 minute, a wiring check

Measured (the default study: 5 seeds, 30 steps; WORKSPACE.md issue 14): validation on the faulty
device 0.508 -> 0.538 ± 0.020 (+0.030, CI [+0.006, +0.055]; 256 problems), clean
0.822 ± 0.009; the compare evaluation (128 other problems) 0.523 ± 0.023 with the fault;
healthy - global_aqn -0.003, p = 0.82 (MDD 0.043).
Run time on 2 CPU cores (the default study, 6 arms x 5 seeds in 48 min, WORKSPACE.md issue 14):
176-191 s per 30-step run on one core of two, before this code's 1.7x faster deadzone step
(the SFT warm start ships with the package, aqn_jax/assets, so no SFT runs).
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("healthy", arg)
