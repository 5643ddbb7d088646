"""Arm `healthy` of the embedded study (aqn_jax/experiment.py).

The deadzone at layer 4 and AQN on every layer except it (seed 001's control: is targeted AQN's
gain only 'not hurting the healthy layers'?).

  python -m aqn_jax.launch --config=configs/healthy.py
  python -m aqn_jax.launch --config=configs/healthy.py:smoke     # < 1 minute, a wiring check

Expected: trains like global_aqn; the statistics are in the compare job.
Run time on 2 CPU cores: about 4-5 minutes (configs/targeted.py measured 4 min 20 s, including
the first-use SFT of 39 s and the SRDD diagnosis; WORKSPACE.md); every arm shares the SFT
through its cache (runs/cache/). `:smoke`: about 30 s.
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("healthy", arg)
