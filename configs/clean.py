"""Arm `clean` of the embedded study (aqn_jax/experiment.py).

No fault, no AQN: the upper bound of the study (the accelerator is healthy).

  python -m aqn_jax.launch --config=configs/clean.py
  python -m aqn_jax.launch --config=configs/clean.py:smoke     # < 1 minute, a wiring check

Expected: val acc rises above the SFT start; faulty-device and clean validation are equal (no
fault).
Run time on 2 CPU cores: about 4-5 minutes (configs/targeted.py measured 4 min 20 s, including
the first-use SFT of 39 s and the SRDD diagnosis; WORKSPACE.md); every arm shares the SFT
through its cache (runs/cache/). `:smoke`: about 30 s.
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("clean", arg)
