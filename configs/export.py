"""Export a train run's policy as an HF snapshot (job `export`, aqn_jax/jobs/export.py).

  python -m aqn_jax.launch --config=configs/export.py --config.export.run=runs/nvfp4_lora
  python -m aqn_jax.launch --config=configs/evaluate.py \
      --config.model.hf_path=runs/nvfp4_lora/export

Expected: `export: <run>/export (...)`; transformers' `AutoModelForCausalLM.from_pretrained` loads
the directory, and its logits match the run's policy (tests/test_lora.py).
"""

import ml_collections


def get_config(arg=None):
    # ':smoke' is accepted (every config takes it) and changes nothing: an export is small.
    if arg not in (None, "", "smoke"):
        raise ValueError(f"--config=configs/export.py:{arg}; allowed arguments: smoke (a no-op)")
    config = ml_collections.ConfigDict()
    config.job = "export"
    config.export = ml_collections.ConfigDict()
    config.export.run = ""  # the train run's workdir (required)
    config.export.step = -1  # its checkpoint; -1 = the latest
    config.export.out = ""  # the snapshot's directory; '' = <run>/export
    return config
