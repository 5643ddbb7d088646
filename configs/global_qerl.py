"""Arm `global_qerl` of the embedded study (aqn_jax/experiment.py): the baseline of the original
system's noise study (docs/ARCHITECTURE.md, "The original system's experiments").

The study's fault (config.study_fault: the deadzone at layer 4 by default) with AQN on every
layer at QeRL's global decay (schedule 'qerl': a sigma-0 warm-up interval, then 0.05 -> 0.0005
over the whole run), where `global_aqn` decays per epoch (the original system's 'epoch_aware').
`configs/compare.py:noise_study` compares the two under that study's relative noise.

  python -m aqn_jax.launch --config=configs/global_qerl.py
  python -m aqn_jax.launch --config=configs/global_qerl.py:smoke     # < 1 minute, a wiring check

Results under `noise_study`: docs/compare_results.md.
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("global_qerl", arg)
