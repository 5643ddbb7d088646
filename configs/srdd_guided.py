"""Arm `srdd_guided` of the embedded study (aqn_jax/experiment.py).

The deadzone at layer 4; SRDD runs first and AQN is injected on every layer at the per-layer
sigma map of the original design notes (aqn.layers='srdd'; layer 4 gets sigma x1.5).

  python -m aqn_jax.launch --config=configs/srdd_guided.py
  python -m aqn_jax.launch --config=configs/srdd_guided.py:smoke     # < 1 minute, a wiring check

Expected: prints the SRDD verdict (layer 4, confidence 1.000); srdd.json's sigma map is in
summary.json (aqn_layer_sigmas). Measured (the default study: 5 seeds, 30 steps; WORKSPACE.md
issue 14): validation on the faulty device 0.508 -> 0.545 ± 0.033 (+0.037, CI [-0.004, +0.077];
256 problems), clean 0.812 ± 0.002; the compare evaluation (128 other problems) 0.536 ± 0.033
with the fault, 0.789 clean: within one SD of global_aqn (0.527 ± 0.019).
Run time on 2 CPU cores (the default study, 6 arms x 5 seeds in 48 min, WORKSPACE.md issue 14):
182-194 s per 30-step run on one core of two, before this code's 1.7x faster deadzone step
(the SFT warm start ships with the package, aqn_jax/assets, so no SFT runs).
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("srdd_guided", arg)
