"""`config.sdc`: the defaults of the SDC section (read by aqn_jax/sdc/guard.py)."""

from __future__ import annotations

import ml_collections


def sdc_config():
    """`config.sdc`: detection and recovery, everything off."""
    c = ml_collections.ConfigDict()
    c.abft = False  # row checksums on every linear (rollout and train passes; detections logged)
    c.abft_backward = False  # also on every linear's dX and dW in the update's backward passes
    c.guard = "none"  # none | skip | recompute
    c.max_recomputes = 2  # failed recomputes of one step before the run rolls back
    c.window = 20  # accepted steps the anomaly's robust z looks back over
    c.z = 6.0  # |robust z| above which a grad-norm / update-RMS is an anomaly
    return c
