"""RL: the rollout sampler (and, in later parts, advantages, losses and the trainer)."""
