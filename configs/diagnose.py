"""SRDD diagnosis of the embedded model on a simulated faulty device.

Purpose: localise a hardware fault to its decoder layer from per-layer scans (instability,
gain, kurtosis, min/max DC gain, dead fraction), and derive the original system's per-layer AQN
sigma map (docs/ARCHITECTURE.md, "SRDD diagnosis") for SRDD-guided training.

  python -m aqn_jax.launch --config=configs/diagnose.py
  python -m aqn_jax.launch --config=configs/diagnose.py --config.faults.deadzone.layers=6 \
      --config.faults.deadzone.threshold=0.1
  python -m aqn_jax.launch --config=configs/diagnose.py --config.faults.deadzone.enabled=False \
      --config.faults.noise.enabled=True --config.faults.noise.layers=2

Expected: the per-layer table and `verdict: fault at layer(s) [4]` (the configured layer) with
confidence ~1.0, `runs/diagnose/srdd.json` and `srdd.png`, the config.aqn override flags of the
guided and targeted arms; about 10 s on 2 CPU cores. With no fault: "no fault found".
"""

import ml_collections

from aqn_jax.aqn.config import aqn_config
from aqn_jax.data.config import data_config
from aqn_jax.diagnosis.config import diagnosis_config
from aqn_jax.faults.config import faults_config
from aqn_jax.models.config import model_section


def get_config(arg=None) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.job = "diagnose"
    config.seed = 0  # PRNG seed of the random init (presets only)

    config.model = model_section()  # preset tiny, or a local HF snapshot in hf_path
    config.tokenizer_path = ""  # '' = the embedded character tokenizer (or hf_path's)

    config.data = data_config()  # calibration prompts come from the train split
    config.diagnosis = diagnosis_config()

    # The simulated device: an MXFP4-style deadzone on the residual stream of a middle layer.
    config.faults = faults_config()
    config.faults.deadzone.enabled = True
    config.faults.deadzone.layers = "4"
    config.faults.deadzone.threshold = 0.01
    config.aqn = aqn_config()  # only sigma_start (the sigma map's base) is read here
    if arg == "smoke":  # fewer calibration prompts: the same scans, a wiring check
        config.diagnosis.num_prompts = 4
    elif arg not in (None, ""):
        raise ValueError(f"--config=configs/diagnose.py:{arg}; allowed arguments: smoke")
    return config
