"""Arm `targeted` of the embedded study (aqn_jax/experiment.py).

THE MAIN EXPERIMENT. The deadzone at layer 4; SRDD diagnoses the faulty device first and AQN is
injected only on the layer(s) it locates (aqn.layers='located').

  python -m aqn_jax.launch --config=configs/targeted.py
  python -m aqn_jax.launch --config=configs/targeted.py:smoke     # < 1 minute, a wiring check

Expected: prints 'SRDD: fault at layer(s) [4]' (the configured fault layer), the validation
accuracy at the start and the end with the fault on, the clean accuracy, and the path of
report.md.
Run time on 2 CPU cores: see RUNTIME below (measured, WORKSPACE.md); SFT is shared through its
cache (runs/cache/) by every arm.
"""

from aqn_jax.experiment import arm_config

RUNTIME = "measured in WORKSPACE.md"


def get_config(arg=None):
    return arm_config("targeted", arg)
