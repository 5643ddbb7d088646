"""`config.diagnosis`: the defaults of SRDD's section (read by aqn_jax/diagnosis/srdd.py)."""

from __future__ import annotations

import ml_collections


def diagnosis_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.num_prompts = 8  # calibration prompts (train split of config.data)
    c.max_prompt_len = 256  # calibration prompts longer than this are skipped
    c.trials = 3  # instability: runs of the same input (the original's: 3)
    c.gain_scale = 0.1  # gain probe: noise std = gain_scale * std(layer input) (the original's)
    c.dc_scale = 0.01  # min/max gain and dead probes: DC bias = dc_scale * std(layer input)
    c.z_threshold = 3.0  # robust |z| above which a layer is suspect (the original's)
    c.declare = ("instability", "dead")  # metrics that may declare a fault (analysis.py)
    c.dead_floor = 1e-3  # dead fraction a declaration needs
    c.instability_floor = 1e-4  # instability / std(output) a declaration needs
    c.signal_loss = "gain_or_dead"  # sigma-map signal-loss rule: gain_or_dead | gain (seed)
    c.base_sigma = 0.0  # sigma map base; 0 = config.aqn.sigma_start
    c.seed = 0  # probe noise and fault keys of the diagnosis
    c.always = False  # train job: diagnose even when the AQN arm does not need it
    return c
