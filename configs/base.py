"""The shared experiment: GRPO of the warm-started tiny Qwen2 on the embedded arithmetic task.

Purpose: the base every arm config edits (clean, deadzone, global_aqn, targeted, healthy,
srdd_guided). On its own it is the clean arm without any fault or AQN.

  python -m aqn_jax.launch --config=configs/base.py
  python -m aqn_jax.launch --config=configs/base.py:smoke     # < 1 minute, a wiring check

Defaults follow the original system's study (docs/ARCHITECTURE.md, "The original system's
experiments": a deadzone at a middle layer, AQN
sigma 0.05 -> 0.0005 epoch-aware over 2 epochs, GRPO with n = 5, KL loss low_var_kl 0.001,
clip 0.2, token-mean), scaled to the tiny model: 8 layers (the fault layer is 4), 16 prompts
per step, a larger learning rate (3e-5, not 5e-7). The fault's severity is stated as the
fraction flushed (75%), chosen from the severity curve (configs/severity.py): the seed's
"0.01 of the max" flushes 5% of this model's stream and costs nothing.
Expected: about 4 minutes on 2 CPU cores with the shipped warm start (greedy accuracy 0.832 on
the test split, no SFT at run time); the clean validation accuracy holds near it.
"""

from aqn_jax.experiment import base_config


def get_config(arg=None):
    return base_config(arg)
