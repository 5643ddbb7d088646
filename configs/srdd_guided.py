"""Arm `srdd_guided` of the embedded study (aqn_jax/experiment.py).

The deadzone at layer 4; SRDD runs first and AQN is injected on every layer at the per-layer
sigma map of the original system (docs/ARCHITECTURE.md, "SRDD diagnosis"; aqn.layers='srdd';
layer 4 gets sigma x1.5).

  python -m aqn_jax.launch --config=configs/srdd_guided.py
  python -m aqn_jax.launch --config=configs/srdd_guided.py:smoke     # < 1 minute, a wiring check

Expected: prints the SRDD verdict (layer 4, confidence 1.000); srdd.json's sigma map is in
summary.json (aqn_layer_sigmas).
Results of the default study (5 seeds, 30 steps): docs/compare_results.md.
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("srdd_guided", arg)
