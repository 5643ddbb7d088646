"""Arm `targeted` of the embedded study (aqn_jax/experiment.py).

THE MAIN EXPERIMENT. The deadzone at layer 4; SRDD diagnoses the faulty device first and AQN is
injected only on the layer(s) it locates (aqn.layers='located').

  python -m aqn_jax.launch --config=configs/targeted.py
  python -m aqn_jax.launch --config=configs/targeted.py:smoke     # < 1 minute, a wiring check

Expected: prints 'SRDD: fault at layer(s) [4]' (the configured fault layer), the validation
accuracy at the start and the end with the fault on, the clean accuracy, and the path of
report.md.
Run time on 2 CPU cores: about 4-5 minutes (configs/targeted.py measured 4 min 20 s, including
the first-use SFT of 39 s and the SRDD diagnosis; WORKSPACE.md); every arm shares the SFT
through its cache (runs/cache/). `:smoke`: about 30 s.
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("targeted", arg)
