"""Job `pretrain`: the SFT warm start of the policy, cached and reused (aqn_jax/warm_start.py).

python -m aqn_jax.launch --config=configs/base.py --config.job=pretrain
"""

from __future__ import annotations

from aqn_jax.warm_start import tokenizer_for, warm_start, warm_start_spec


def run(config, workdir: str) -> None:
    tokenizer_for(config.tokenizer_path, config.model)
    warm_start(warm_start_spec(config), workdir)
