"""Produce the embedded default's SFT warm start and ship it with the package.

The embedded study needs a warm start that reads its prompt (greedy accuracy >= 0.6 on the
test split, about the same on the same problems with redrawn numbers). That takes longer than
a first run should wait, so the result is committed under aqn_jax/assets/sft-<key>/ (an HF
snapshot: config.json, model.safetensors, sft.json) and `jobs/pretrain.warm_start` loads it
for any config whose SFT cache key matches, instead of training.

  python -m aqn_jax.launch --config=configs/warm_start.py

Expected: the SFT progress bar, then "cached aqn_jax/assets/sft-<key>". Run time and the
warm start's accuracy: WORKSPACE.md. A changed SFT setting (steps, lr, data, model)
changes the key: the run then trains and caches under runs/cache/ as before.
"""

from aqn_jax.experiment import base_config
from aqn_jax.warm_start import SHIPPED_DIR


def get_config(arg=None):
    config = base_config(arg)
    config.job = "pretrain"
    config.sft.cache_dir = SHIPPED_DIR
    return config
