"""Arm `clean` of the embedded study (aqn_jax/experiment.py).

No fault, no AQN: the upper bound of the study (the accelerator is healthy).

  python -m aqn_jax.launch --config=configs/clean.py
  python -m aqn_jax.launch --config=configs/clean.py:smoke     # < 1 minute, a wiring check

Measured (5 seeds, 30 steps, WORKSPACE.md issue 14, recovery study): validation accuracy
0.832 -> 0.823 ± 0.006 (256 problems; a small real drop, CI [0.815, 0.830]); the compare
evaluation's 128 other problems: 0.786 ± 0.012 clean, 0.519 ± 0.026 on the deadzone device.
Run time on 2 CPU cores (the default study, 6 arms x 5 seeds in 48 min, WORKSPACE.md issue 14):
152-272 s per 30-step run on one core of two, before this code's 1.7x faster deadzone step
(the SFT warm start ships with the package, aqn_jax/assets, so no SFT runs).
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("clean", arg)
