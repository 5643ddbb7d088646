"""Arm `clean` of the embedded study (aqn_jax/experiment.py).

No fault, no AQN: the upper bound of the study (the accelerator is healthy).

  python -m aqn_jax.launch --config=configs/clean.py
  python -m aqn_jax.launch --config=configs/clean.py:smoke     # < 1 minute, a wiring check

Expected: val acc holds near the warm start's (0.832 on 256 problems; RL at lr 3e-5 keeps it);
faulty-device and clean validation are equal (no fault).
Run time on 2 CPU cores: about 4 minutes (a 30-step run took 227 s on one core of two; the SFT
warm start ships with the package, aqn_jax/assets, so no SFT runs; WORKSPACE.md issue 14).
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("clean", arg)
