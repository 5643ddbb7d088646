"""The embedded default's warm start ships with the package (configs/warm_start.py made it) and
reads its prompt: accuracy >= 0.6 on the test split, about the same with every number redrawn,
and its answers follow the numbers. Runs on the shipped snapshot, no SFT."""

import os

import pytest

from conftest import load_config


def test_shipped_warm_start_reads_its_prompt(tmp_path):
    from aqn_jax.evaluation import prompt_dependence
    from aqn_jax.jobs.pretrain import SHIPPED_DIR, cache_dir, tokenizer_for, warm_start

    config = load_config("targeted")
    config.sft.cache_dir = str(tmp_path / "cache")
    qcfg, params, info = warm_start(config, str(tmp_path / "run"))
    assert info["cache"] == "shipped" and info["steps"] == config.sft.steps
    assert cache_dir(config, "x").endswith(info["key"])
    assert not (tmp_path / "cache").exists()  # loaded, not trained
    assert str(SHIPPED_DIR).endswith("aqn_jax/assets")

    r = prompt_dependence(config, qcfg, params, tokenizer_for(config), size=256)
    assert r["n"] == 256
    assert r["acc"] >= 0.6
    # The same problems with new numbers: about the same accuracy, and the answers moved with
    # the numbers (a policy answering from the words alone would keep the old answers).
    assert r["acc_redrawn"] == pytest.approx(r["acc"], abs=0.1)
    assert r["answered_original"] < 0.1
    assert r["shared_completion"] < 0.2


def test_a_changed_sft_setting_does_not_load_the_shipped_warm_start():
    from aqn_jax.jobs.pretrain import SHIPPED_DIR, cache_dir

    config = load_config("targeted")
    shipped = cache_dir(config, "x").rsplit("/", 1)[1]
    config.sft.steps += 1
    assert cache_dir(config, "x").rsplit("/", 1)[1] != shipped
    assert os.path.isdir(os.path.join(SHIPPED_DIR, shipped))
