"""AQN (adaptive quantisation noise): sigma schedules and per-layer sigma maps.

The injections themselves are built by `aqn_jax.faults.config.build_plan` from `config.aqn`
(global, targeted, healthy or SRDD-guided layers; QeRL's RMSNorm-weight form or the original
system's activation form), so faults and AQN go through one interceptor.
"""

from .schedules import SCHEDULES, qerl_sigmas, sigma_at

__all__ = ["SCHEDULES", "qerl_sigmas", "sigma_at"]
