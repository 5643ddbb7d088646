"""Arm `targeted` of the embedded study (aqn_jax/experiment.py).

THE MAIN EXPERIMENT. The deadzone at layer 4 (the 75% smallest |h| of its output flushed);
SRDD diagnoses the faulty device first and AQN is injected only on the layer(s) it locates
(aqn.layers='located').

  python -m aqn_jax.launch --config=configs/targeted.py
  python -m aqn_jax.launch --config=configs/targeted.py:smoke     # < 1 minute, a wiring check

Expected: prints 'SRDD: fault at layer(s) [4]' (the configured fault layer), the validation
accuracy at the start and the end with the fault on, the clean accuracy, the fault's cost at
the start and the share RL won back ("the fault cost 0.31 accuracy ...; RL won back N% of it"),
and the path of report.md. Measured (3 seeds, 30 steps, `configs/compare.py:aqn_between`, the
default AQN form; WORKSPACE.md issue 14): SRDD locates layer 4 at confidence 1.000; 0.516 ± 0.014
on the faulty device and 0.797 ± 0.008 clean (128 problems); targeted - global_aqn -0.010,
p = 0.56 (MDD 0.066): no effect of AQN's placement detected at this operating point.
Run time on 2 CPU cores: 257-287 s per 30-step run on one core of two, 460-634 s beside other
work (the SFT warm start ships with the package, aqn_jax/assets, so no SFT runs).
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("targeted", arg)
