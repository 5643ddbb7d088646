"""Build the embedded tiny Qwen2 (or load a local HF snapshot) and print its summary.

Purpose: the smallest end-to-end check of an install: model construction or HF loading, the
tokenizer's chat template and one jitted forward.

  python -m aqn_jax.launch --config=configs/model_summary.py
  python -m aqn_jax.launch --config=configs/model_summary.py \
      --config.model.hf_path=/models/Qwen2.5-0.5B-Instruct
  python -m aqn_jax.launch --config=configs/model_summary.py \
      --config.faults.deadzone.enabled=True --config.faults.deadzone.layers=3 \
      --config.aqn.enabled=True --config.aqn.layers='(3,)' --config.phase=rollout

Expected: a parameter table (1,609,856 params for `tiny`), the prompt length and the top-5
next tokens, the fault plan with the modules each injection hits per phase, the telemetry and
the logit change the faults cause; `runs/model_summary/{model_summary,manifest}.json`; about
10 s on a laptop CPU.
"""

import ml_collections

from aqn_jax.aqn.config import aqn_config
from aqn_jax.faults.config import faults_config


def get_config(arg=None) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.job = "model_summary"  # which aqn_jax/jobs/<job>.py runs
    config.seed = 0  # PRNG seed of the random init (presets only)

    # --- model --------------------------------------------------------------------------------
    config.model = ml_collections.ConfigDict()
    # Architecture preset when no HF snapshot is given: tiny | qwen2p5_0p5b | qwen2p5_1p5b |
    # qwen2p5_3b | qwen2p5_7b (the full-size ones are random weights: summary only).
    config.model.preset = "tiny"
    # Local Hugging Face snapshot directory (config.json + safetensors); '' = use the preset.
    config.model.hf_path = ""
    config.model.param_dtype = "float32"  # storage dtype of params: float32 | bfloat16 | float16
    config.model.dtype = "float32"  # activation / matmul dtype: float32 | bfloat16 | float16
    config.model.remat = False  # rematerialise each decoder layer in the backward pass

    # --- tokenizer ----------------------------------------------------------------------------
    # '' = the embedded character tokenizer, or model.hf_path's tokenizer when that is set.
    config.tokenizer_path = ""
    # The user message of the sample forward pass (rendered through the chat template).
    config.prompt = "Tom has 12 apples and buys 7 more. How many apples does he have?"

    # --- faults and AQN (faults/config.py and aqn/config.py document every field) -------------
    config.faults = faults_config()
    config.faults.deadzone.layers = "3"  # the tiny model has 8 layers (the 1.5B default is 15)
    config.aqn = aqn_config()
    config.aqn.layers = "all"
    config.phase = "eval"  # which phase's injections the sample forward runs: rollout|train|eval
    config.step = 20  # RL step whose AQN sigma the forward uses ...
    config.total_steps = 100  # ... out of this many steps (sigma schedule)
    if arg not in (None, "", "smoke"):  # the summary is one forward pass: smoke is the same
        raise ValueError(f"--config=configs/model_summary.py:{arg}; allowed arguments: smoke")
    return config
