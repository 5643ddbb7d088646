"""Arm `global_qerl` of the embedded study (aqn_jax/experiment.py): the baseline of the original
design notes.

The study's fault (config.study_fault: the deadzone at layer 4 by default) with AQN on every
layer at QeRL's global decay (schedule 'qerl': a sigma-0 warm-up interval, then 0.05 -> 0.0005
over the whole run), where `global_aqn` decays per epoch (the original system's 'epoch_aware').
`configs/compare.py:noise_study` compares the two under the original design notes' relative
noise.

  python -m aqn_jax.launch --config=configs/global_qerl.py
  python -m aqn_jax.launch --config=configs/global_qerl.py:smoke     # < 1 minute, a wiring check

Measured under `noise_study` (10% relative noise on every linear, 5 seeds, 30 steps; WORKSPACE.md
issue 14): 0.692 ± 0.028 on the noisy device against 0.695 ± 0.031 without AQN and 0.684 ± 0.035
epoch-aware (p >= 0.62, MDD 0.061-0.068). Not run at the deadzone operating point.
Run time on 2 CPU cores: as global_aqn (the same compiled program; only the traced sigma
differs): 245-360 s per run on one core of two.
"""

from aqn_jax.experiment import arm_config


def get_config(arg=None):
    return arm_config("global_qerl", arg)
