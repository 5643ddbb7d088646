"""Job `pretrain`: the SFT warm start of the policy, cached and reused (aqn_jax/warm_start.py).

python -m aqn_jax.launch --config=configs/base.py --config.job=pretrain
"""

from __future__ import annotations

from aqn_jax.models.factory import model_config
from aqn_jax.spec import warm_start_spec
from aqn_jax.warm_start import tokenizer_for, warm_start


def run(config, workdir: str) -> None:
    model_cfg = model_config(config.model)
    tokenizer_for(config.tokenizer_path, config.model.hf_path, model_cfg.vocab_size)
    warm_start(warm_start_spec(config, model_cfg), workdir)
