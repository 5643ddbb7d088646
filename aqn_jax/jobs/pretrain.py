"""Job `pretrain`: the SFT warm start of the policy, cached and reused (aqn_jax/warm_start.py).

python -m aqn_jax.launch --config=configs/base.py --config.job=pretrain
"""

from __future__ import annotations

from aqn_jax.checks import warm_start_spec
from aqn_jax.warm_start import tokenizer_for, warm_start


def run(config, workdir: str) -> None:
    tokenizer_for(config.tokenizer_path, config.model)
    warm_start(warm_start_spec(config), workdir)
