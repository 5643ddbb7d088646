"""The deadzone severity curve of the embedded warm start, before any RL.

Purpose: choose the study's fault from a measured curve. "0.01 of the tensor max" flushes
96-100% of a real LM's residual stream (massive activations) but a few % of the tiny model's,
so severities are also stated as the flushed fraction (severity 'quantile').

  python -m aqn_jax.launch --config=configs/severity.py
  python -m aqn_jax.launch --config=configs/severity.py:smoke     # 2 layers x 2 values

Expected: the clean accuracy and loss, the prompt-dependence control, then per layer x
severity the flushed fraction, the held-out loss and the faulty-device accuracy;
runs/severity/severity.json and severity.md. Run time and the measured table: WORKSPACE.md.
"""

from aqn_jax.experiment import base_config
from aqn_jax.study.config import severity_config


def get_config(arg=None):
    if arg not in (None, "", "smoke"):
        raise ValueError(f"--config=configs/severity.py:{arg}; allowed arguments: smoke")
    config = base_config(arg)
    config.job = "severity"
    config.severity = severity_config()
    # The tiny model has no massive activations: 0.001 of the max flushes nothing, so the
    # fraction-of-max column starts at the seed's 0.01; 0.97 is the seed's own regime.
    config.severity.amax = (0.01, 0.1, 0.3)
    config.severity.quantile = (0.25, 0.5, 0.75, 0.9, 0.97)
    if arg == "smoke":
        config.severity.layers = "(2,5)"
        config.severity.amax = (0.1,)
        config.severity.quantile = (0.5,)
    return config
