"""Arm `srdd_guided` of the embedded study (aqn_jax/experiment.py).

The deadzone at layer 4; SRDD runs first and AQN is injected on every layer at the per-layer
sigma map of the original design notes (aqn.layers='srdd'; layer 4 gets sigma x1.5).

  python -m aqn_jax.launch --config=configs/srdd_guided.py
  python -m aqn_jax.launch --config=configs/srdd_guided.py:smoke     # < 1 minute, a wiring check

Expected: prints the SRDD verdict (layer 4, confidence 1.000); srdd.json's sigma map is in
summary.json (aqn_layer_sigmas). Measured (2 seeds, 30 steps, WORKSPACE.md issue 14): 0.562 ± 0.022
on the faulty device and 0.789 clean (128 problems); healthy - srdd_guided -0.023, p = 0.35
(MDD 0.14 at 2 seeds).
Run time on 2 CPU cores: 257-287 s per 30-step run on one core of two, 440-540 s beside other
work (the SFT warm start ships with the package, aqn_jax/assets, so no SFT runs).
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("srdd_guided", arg)
