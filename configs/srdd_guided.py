"""Arm `srdd_guided` of the embedded study (aqn_jax/experiment.py).

The deadzone at layer 4; SRDD runs first and AQN is injected on every layer at the per-layer
sigma map of the original design notes (aqn.layers='srdd'; layer 4 gets sigma x1.5).

  python -m aqn_jax.launch --config=configs/srdd_guided.py
  python -m aqn_jax.launch --config=configs/srdd_guided.py:smoke     # < 1 minute, a wiring check

Expected: prints the SRDD verdict (layer 4, confidence 1.000); srdd.json's sigma map is in
summary.json (aqn_layer_sigmas). Measured results and run times: docs/study_embedded.md.
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("srdd_guided", arg)
