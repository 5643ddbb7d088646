"""Arm `deadzone` of the embedded study (aqn_jax/experiment.py).

A deadzone flushing the 75% smallest |h| of the residual stream after layer 4 (severity
'quantile', chosen from the measured severity curve), in every phase, and no AQN: the lower
bound.

  python -m aqn_jax.launch --config=configs/deadzone.py
  python -m aqn_jax.launch --config=configs/deadzone.py:smoke     # < 1 minute, a wiring check

Measured (5 seeds, 30 steps, WORKSPACE.md issue 14, recovery study): the fault costs 0.324
accuracy at the start (clean 0.832, faulty 0.508 on 256 problems); RL on the faulty device wins
back +0.035 ± 0.020 (CI [+0.010, +0.060], 10.8% of the gap), the printed line says how much;
clean validation 0.819 ± 0.007. The compare evaluation (128 other problems): 0.527 ± 0.020 on
the faulty device, 0.791 ± 0.010 clean.
Run time on 2 CPU cores (the default study, 6 arms x 5 seeds in 48 min, WORKSPACE.md issue 14):
181-205 s per 30-step run on one core of two, before this code's 1.7x faster deadzone step
(the SFT warm start ships with the package, aqn_jax/assets, so no SFT runs).
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("deadzone", arg)
