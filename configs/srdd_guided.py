"""Arm `srdd_guided` of the embedded study (aqn_jax/experiment.py).

The deadzone at layer 4; SRDD runs first and AQN is injected on every layer at seed 001's per-
layer sigma map (aqn.layers='srdd'; layer 4 gets sigma x1.5).

  python -m aqn_jax.launch --config=configs/srdd_guided.py
  python -m aqn_jax.launch --config=configs/srdd_guided.py:smoke     # < 1 minute, a wiring check

Expected: prints the SRDD verdict; srdd.json's sigma map is in summary.json (aqn_layer_sigmas).
Run time on 2 CPU cores: about 4-5 minutes (configs/targeted.py measured 4 min 20 s, including
the first-use SFT of 39 s and the SRDD diagnosis; WORKSPACE.md); every arm shares the SFT
through its cache (runs/cache/). `:smoke`: about 30 s.
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("srdd_guided", arg)
