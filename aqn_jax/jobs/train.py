"""Job `train`: RL (GRPO / PPO) of the warm-started policy on the simulated faulty device.

The run itself is `aqn_jax.training.run`, which the compare study calls for each of its runs.
"""

from aqn_jax.training import run

__all__ = ["run"]
