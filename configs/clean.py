"""Arm `clean` of the embedded study (aqn_jax/experiment.py).

No fault, no AQN: the upper bound of the study (the accelerator is healthy).

  python -m aqn_jax.launch --config=configs/clean.py
  python -m aqn_jax.launch --config=configs/clean.py:smoke     # < 1 minute, a wiring check

Measured results and run times: docs/study_embedded.md.
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("clean", arg)
