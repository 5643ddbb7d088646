"""Arm `targeted` of the embedded study (aqn_jax/experiment.py).

THE MAIN EXPERIMENT. The deadzone at layer 4 (the 75% smallest |h| of its output flushed);
SRDD diagnoses the faulty device first and AQN is injected only on the layer(s) it locates
(aqn.layers='located').

  python -m aqn_jax.launch --config=configs/targeted.py
  python -m aqn_jax.launch --config=configs/targeted.py:smoke     # < 1 minute, a wiring check

Expected: prints 'SRDD: fault at layer(s) [4]' (the configured fault layer), the validation
accuracy at the start and the end with the fault on, the clean accuracy, the fault's cost at
the start and the share RL won back ("the fault cost 0.31 accuracy ...; RL won back N% of it"),
and the path of report.md. Measured (the default study: 5 seeds, 30 steps; WORKSPACE.md issue
14): SRDD locates layer 4 at confidence 1.000; validation on the faulty device 0.508 -> 0.526 ±
0.021 (+0.018, CI [-0.009, +0.044], 5.5% of the gap; 256 problems), clean 0.816 ± 0.010; the
compare evaluation (128 other problems) 0.502 ± 0.029 with the fault, 0.791 clean; targeted -
global_aqn -0.025, p = 0.15 (MDD 0.051; 6 seeds per arm would detect 0.05): no benefit of
targeting AQN at the located layer at this operating point.
Run time on 2 CPU cores (the default study, 6 arms x 5 seeds in 48 min, WORKSPACE.md issue 14):
175-191 s per 30-step run on one core of two, before this code's 1.7x faster deadzone step
(the SFT warm start ships with the package, aqn_jax/assets, so no SFT runs).
`:smoke`: about 30 s (it trains its own 8-step SFT).
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("targeted", arg)
