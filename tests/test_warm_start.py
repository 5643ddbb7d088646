"""The embedded default's warm start ships with the package (configs/warm_start.py made it) and
reads its prompt: accuracy >= 0.6 on the test split, about the same with every number redrawn,
and its answers follow the numbers. Runs on the shipped snapshot, no SFT."""

import os

import pytest

from conftest import load_config, shallow


@pytest.mark.slow
def test_shipped_warm_start_reads_its_prompt(tmp_path):
    from aqn_jax.data.config import task_of
    from aqn_jax.evaluation import prompt_dependence
    from aqn_jax.spec import decode_spec, warm_start_spec
    from aqn_jax.warm_start import SHIPPED_DIR, cache_dir, tokenizer_for, warm_start

    config = load_config("targeted")
    config.sft.cache_dir = str(tmp_path / "cache")
    ws = warm_start_spec(config)
    qcfg, params, info = warm_start(ws, str(tmp_path / "run"))
    assert info["cache"] == "shipped" and info["steps"] == config.sft.steps
    assert cache_dir(ws, "x").endswith(info["key"])
    assert not (tmp_path / "cache").exists()  # loaded, not trained
    assert str(SHIPPED_DIR).endswith("aqn_jax/assets")

    spec, task = decode_spec(config), task_of(config.data)
    tok = tokenizer_for(config.tokenizer_path, config.model.hf_path, qcfg.vocab_size)
    r = prompt_dependence(spec, task, qcfg, params, tok, size=256)
    assert r["n"] == 256
    assert r["acc"] >= 0.6
    # The same problems with new numbers: about the same accuracy, and the answers moved with
    # the numbers (a policy answering from the words alone would keep the old answers).
    assert r["acc_redrawn"] == pytest.approx(r["acc"], abs=0.1)
    assert r["answered_original"] < 0.1
    assert r["shared_completion"] < 0.2


def test_a_changed_sft_setting_does_not_load_the_shipped_warm_start():
    from aqn_jax.spec import warm_start_spec
    from aqn_jax.warm_start import SHIPPED_DIR, cache_dir

    config = load_config("targeted")
    shipped = cache_dir(warm_start_spec(config), "x").rsplit("/", 1)[1]
    config.sft.steps += 1
    assert cache_dir(warm_start_spec(config), "x").rsplit("/", 1)[1] != shipped
    assert os.path.isdir(os.path.join(SHIPPED_DIR, shipped))


@pytest.mark.slow
def test_a_damaged_sft_cache_entry_is_set_aside_and_recomputed(tmp_path, monkeypatch, capsys):
    """A truncated cache entry used to block every later run with a bare SafetensorError."""
    from aqn_jax import warm_start as pretrain
    from aqn_jax.spec import warm_start_spec

    calls = []

    def fake_sft(model, params, data, **kw):  # the SFT itself is tested elsewhere
        calls.append(kw["steps"])
        return params, {"loss": [1.0]}

    monkeypatch.setattr(pretrain, "sft_train", fake_sft)
    # The shallow smoke model: its random init is the one program this test compiles (an
    # 8-layer init: ~4 s of XLA compile).
    config = shallow(load_config("deadzone", "smoke"))
    config.sft.cache_dir = str(tmp_path / "cache")
    ws = warm_start_spec(config)
    pretrain.warm_start(ws, str(tmp_path))
    entry = pretrain.cache_dir(ws, str(tmp_path))
    weights = os.path.join(entry, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    _, _, info = pretrain.warm_start(ws, str(tmp_path))
    assert info["cache"] == "miss" and len(calls) == 2  # recomputed, not a crash
    out = capsys.readouterr().out
    assert f"SFT cache {entry} is damaged" in out and "model.safetensors" in out
    (aside,) = [p for p in os.listdir(tmp_path / "cache") if ".damaged-" in p]
    assert os.path.getsize(tmp_path / "cache" / aside / "model.safetensors") < os.path.getsize(
        weights
    )  # the damaged entry kept for inspection, a whole one in its place
    _, _, info = pretrain.warm_start(ws, str(tmp_path))
    assert info["cache"] == "hit" and len(calls) == 2


@pytest.mark.slow
def test_sft_train_learns_the_task():
    """sft_train lowers the loss: 30 steps (batch 8, lr 3e-3, 5 warmup) of a random 1-layer tiny
    model on 256 train problems of the default arithmetic task end below 0.6 of the first
    step's loss (the check the session's SFT fixture made when it trained one; the tests that
    need a trained model now read the shipped warm start). One layer and batch 8 keep the step's
    compile and the 30 steps small (3 layers, batch 16 before); measured: 0.38 of the first
    loss."""
    from aqn_jax.data.arithmetic import ArithmeticTask
    from aqn_jax.data.tokenizers import CharTokenizer
    from aqn_jax.models.factory import init_params
    from aqn_jax.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from aqn_jax.rl.sft import sft_sequences, sft_train

    cfg = Qwen2Config.tiny(num_hidden_layers=1)
    data = sft_sequences(ArithmeticTask().examples("train", 256), CharTokenizer())
    _, hist = sft_train(
        Qwen2ForCausalLM(cfg),
        init_params(cfg, 0),
        data,
        steps=30,
        batch_size=8,
        lr=3e-3,
        warmup_steps=5,
    )
    assert hist["loss"][-1] < 0.6 * hist["loss"][0], hist["loss"]


def test_pretrain_job_loads_the_shipped_warm_start_and_trains_nothing(
    tmp_path, monkeypatch, capsys
):
    """Job `pretrain` (configs/warm_start.py, the config that made aqn_jax/assets): its SFT key
    is the shipped snapshot's, so the job reads it and trains nothing, leaving the package's
    assets byte-identical; a changed SFT setting is a miss and would train (the negative
    control: the same tripwire fires)."""
    from aqn_jax import warm_start as pretrain
    from aqn_jax.launch import run
    from aqn_jax.spec import warm_start_spec

    from conftest import tree_state

    class Trained(Exception):
        pass

    def tripwire(*args, **kwargs):
        raise Trained

    monkeypatch.setattr(pretrain, "sft_train", tripwire)
    config = load_config("warm_start")
    assert config.job == "pretrain" and config.sft.cache_dir == pretrain.SHIPPED_DIR
    entry = pretrain.cache_dir(warm_start_spec(config), str(tmp_path))
    before = tree_state(pretrain.SHIPPED_DIR)
    run(config, str(tmp_path / "run"))
    assert f"SFT warm start: cached {entry}" in capsys.readouterr().out
    assert os.path.isdir(entry) and tree_state(pretrain.SHIPPED_DIR) == before
    changed = load_config("warm_start")
    changed.sft.steps += 1
    changed.sft.cache_dir = str(tmp_path / "cache")
    with pytest.raises(Trained):
        run(changed, str(tmp_path / "changed"))
    assert tree_state(pretrain.SHIPPED_DIR) == before
