"""`config.model`: the defaults of the model's section (read by aqn_jax/models/factory.py)."""

from __future__ import annotations

import ml_collections

# Positions per chunk of the log-prob readout when config.model does not say.
LOGPROB_CHUNK = 32


def model_section(preset: str = "tiny") -> ml_collections.ConfigDict:
    """`config.model`: a preset (random init) or a local HF snapshot, and the numerics."""
    c = ml_collections.ConfigDict()
    c.preset = preset  # a registered family's preset (models/registry.py `presets()`)
    c.hf_path = ""  # local Hugging Face snapshot (config.json + safetensors); '' = the preset
    # > 0: the preset with this many decoder layers (a shallower model of the same widths, e.g.
    # a wiring check with one faulty layer between healthy ones); 0 = the preset's own depth.
    c.num_layers = 0  # presets only
    c.param_dtype = "float32"  # float32 | bfloat16 | float16
    c.dtype = "float32"  # activation / matmul dtype
    c.remat = False  # rematerialise each decoder layer in the backward pass
    c.logprob_chunk = LOGPROB_CHUNK  # positions per log-prob readout chunk (f32 logits: rows x it)
    # The frozen base's decoder linears in a 4-bit format (QeRL's NVFP4A16 / MXFP4A16), packed
    # and dequantised in every forward (aqn_jax/quant_base.py): none | nvfp4 | mxfp4. Training
    # needs config.lora.rank > 0 (a quantised base is frozen); evaluate takes it as a device.
    c.weight_format = "none"
    return c
