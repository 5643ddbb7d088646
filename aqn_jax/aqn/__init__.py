"""AQN (adaptive quantisation noise): sigma schedules, per-layer sigma maps and the injection.

`config.py` holds the `config.aqn` section, builds its injection (global, targeted, healthy or
SRDD-guided layers; QeRL's RMSNorm-weight form or the original system's activation form) and
gives each step's sigma; `aqn_jax.aqn.plan.build_plan` places the injection among the
hardware faults, so faults and AQN go through one interceptor.
"""

from .schedules import SCHEDULES, qerl_sigmas, sigma_at

__all__ = ["SCHEDULES", "qerl_sigmas", "sigma_at"]
