"""The RL sections' defaults: the rollout-correction fields of `config.algo` (read by
aqn_jax/rl/rollout_correction.py)."""

from __future__ import annotations

import ml_collections


def correction_config(algo) -> None:
    """The rollout-correction fields of `config.algo` (off: verl's defaults)."""
    algo.rollout_is = "none"  # none | token | sequence: truncated IS weights on the PG loss
    algo.rollout_is_threshold = 2.0  # C of min(w, C) (verl, tunix: 2.0)
    algo.rollout_is_batch_normalize = False  # weights / their batch mean (verl)
    algo.rollout_rs = "none"  # none | token | sequence | geometric: reject ratios outside bounds
    algo.rollout_rs_threshold = 2.0  # upper bound of the kept ratio
    # lower bound of the kept ratio; None = 1 / rollout_rs_threshold
    algo.rollout_rs_threshold_lower = ml_collections.config_dict.placeholder(float)
    algo.bypass_mode = False  # PPO's old policy = the rollout's log-probs (verl bypass)
