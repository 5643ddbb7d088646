"""Arm `targeted` of the embedded study (aqn_jax/experiment.py).

THE MAIN EXPERIMENT. The deadzone at layer 4 (the 75% smallest |h| of its output flushed);
SRDD diagnoses the faulty device first and AQN is injected only on the layer(s) it locates
(aqn.layers='located').

  python -m aqn_jax.launch --config=configs/targeted.py
  python -m aqn_jax.launch --config=configs/targeted.py:smoke     # < 1 minute, a wiring check

Expected: prints 'SRDD: fault at layer(s) [4]' (the configured fault layer), the validation
accuracy at the start and the end with the fault on, the clean accuracy, the fault's cost at
the start and the share RL won back ("the fault cost 0.31 accuracy ...; RL won back N% of it"),
and the path of report.md. Measured results and run times: docs/study_embedded.md.
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("targeted", arg)
