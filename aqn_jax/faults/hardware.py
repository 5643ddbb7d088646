"""The simulated device: the hardware faults of a config, without the treatment (AQN).

SRDD diagnoses this device, validation and the robustness matrix measure accuracy on it, and
the critic runs it with `config.critic.faults=True`.
"""

from __future__ import annotations

import copy
from typing import Any

import ml_collections

from aqn_jax.faults.config import build_plan
from aqn_jax.faults.intercept import FaultPlan


def hardware_plan(config: Any, num_layers: int) -> FaultPlan:
    """The device's fault plan: `config.faults` with AQN switched off."""
    hw = ml_collections.ConfigDict(copy.deepcopy(config.to_dict()))
    hw.aqn.enabled = False
    return build_plan(hw, num_layers)
