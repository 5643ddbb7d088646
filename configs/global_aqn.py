"""Arm `global_aqn` of the embedded study (aqn_jax/experiment.py).

The deadzone at layer 4, with AQN (relative Gaussian noise y + sigma*randn*|y| at every decoder
layer's output, rollout only, sigma 0.05 -> 0.0005 epoch-aware) on all layers.

  python -m aqn_jax.launch --config=configs/global_aqn.py
  python -m aqn_jax.launch --config=configs/global_aqn.py:smoke     # < 1 minute, a wiring check

Measured results and run times: docs/study_embedded.md.
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("global_aqn", arg)
