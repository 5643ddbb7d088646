"""The shared experiment: GRPO of the warm-started tiny Qwen2 on the embedded arithmetic task.

Purpose: the base every arm config edits (clean, deadzone, global_aqn, targeted, healthy,
srdd_guided). On its own it is the clean arm without any fault or AQN.

  python -m aqn_jax.launch --config=configs/base.py
  python -m aqn_jax.launch --config=configs/base.py:smoke     # < 1 minute, a wiring check

Defaults follow the original study's design (seeds 000/001: deadzone threshold 0.01 at a
middle layer, AQN sigma 0.05 -> 0.0005 epoch-aware over 2 epochs, GRPO with n = 5, KL loss
low_var_kl 0.001, clip 0.2, token-mean), scaled to the tiny model: 8 layers (the fault layer is
4), 16 prompts per step, a larger learning rate (the tiny model learns at 1e-4, not 5e-7).
Expected: about 4 minutes on 2 CPU cores including the first-use SFT (39 s; later runs reuse
its cache); validation accuracy rises above the SFT start (0.148 -> 0.281 after 10-12 steps at
lr 1e-4, WORKSPACE.md).
"""

from aqn_jax.experiment import base_config


def get_config(arg=None):
    return base_config(arg)
