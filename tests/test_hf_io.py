"""HF checkpoint loading and saving: round trips through transformers, strictness on bad input."""

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM

from aqn_jax.models.hf import (
    abstract_params,
    config_from_hf,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from aqn_jax.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

from tolerance import bound, forward_path

# config.json of Qwen2.5-1.5B-Instruct as published (transformers 4.x layout).
QWEN25_1P5B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 1536,
    "initializer_range": 0.02,
    "intermediate_size": 8960,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def parity_tol(config, ids, ref):
    """Ours (XLA) against transformers (torch), both f32: two programs, each rounding along the
    forward over `ids`' length of keys (tests/tolerance.py), at the scale of the largest logit."""
    return bound(forward_path(config, ids.shape[1]), np.abs(ref).max())


def _ids(config, seed=0, shape=(2, 33)):
    return np.random.RandomState(seed).randint(0, config.vocab_size, size=shape)


def test_published_config_maps_to_preset():
    config, ignored = config_from_hf(QWEN25_1P5B_CONFIG)
    assert config == Qwen2Config.qwen2p5_1p5b(param_dtype="bfloat16", dtype="bfloat16")
    assert "sliding_window" in ignored and "max_window_layers" in ignored


@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_hf_ours_hf(hf_factory, tmp_path, tied):
    path, hf_model = hf_factory(seed=4, tie_word_embeddings=tied)
    config, params = load_hf_checkpoint(path)
    out = str(tmp_path / "exported")
    save_hf_checkpoint(out, config, params)
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = _ids(config)
    np.testing.assert_array_equal(_hf_logits(reloaded, ids), _hf_logits(hf_model, ids))
    # Every tensor identical, not only the logits.
    ref, new = hf_model.state_dict(), reloaded.state_dict()
    assert set(ref) == set(new)
    for key in ref:
        torch.testing.assert_close(new[key], ref[key], rtol=0, atol=0)
    config2, params2 = load_hf_checkpoint(out)
    assert config2 == config
    ours = Qwen2ForCausalLM(config2).apply({"params": params2}, ids)
    ref = _hf_logits(hf_model, ids)
    np.testing.assert_allclose(np.asarray(ours), ref, atol=parity_tol(config2, ids, ref))


def test_sharded_checkpoints_both_ways(hf_factory, tmp_path):
    path, hf_model = hf_factory(seed=5, tie_word_embeddings=False)
    sharded_in = str(tmp_path / "sharded_in")
    hf_model.save_pretrained(sharded_in, max_shard_size="40KB")
    assert os.path.exists(os.path.join(sharded_in, "model.safetensors.index.json"))
    config, params = load_hf_checkpoint(sharded_in)
    _, single = load_hf_checkpoint(path)
    flat = lambda tree: {  # noqa: E731
        "/".join(k): v for k, v in __import__("flax").traverse_util.flatten_dict(tree).items()
    }
    for key, value in flat(single).items():
        np.testing.assert_array_equal(flat(params)[key], value)

    sharded_out = str(tmp_path / "sharded_out")
    save_hf_checkpoint(sharded_out, config, params, max_shard_bytes=50_000)
    files = sorted(f for f in os.listdir(sharded_out) if f.endswith(".safetensors"))
    assert len(files) > 1 and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    reloaded = AutoModelForCausalLM.from_pretrained(sharded_out, attn_implementation="eager")
    ids = _ids(config)
    np.testing.assert_array_equal(_hf_logits(reloaded.eval(), ids), _hf_logits(hf_model, ids))


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16])
def test_half_precision_storage(hf_factory, tmp_path, storage):
    _, hf_model = hf_factory(seed=6)
    half = str(tmp_path / "half")
    hf_model.to(storage).save_pretrained(half)
    config, params = load_hf_checkpoint(half)
    name = str(storage).removeprefix("torch.")
    assert config.param_dtype == name and config.dtype == name
    q = hf_model.state_dict()["model.layers.1.self_attn.q_proj.weight"].float().numpy()
    np.testing.assert_array_equal(
        params["layers_1"]["self_attn"]["q_proj"]["kernel"].astype(np.float32), q.T
    )
    config32, params32 = load_hf_checkpoint(half, dtype="float32")
    assert config32.param_dtype == "float32"
    assert params32["layers_1"]["self_attn"]["q_proj"]["kernel"].dtype == np.float32
    np.testing.assert_array_equal(params32["layers_1"]["self_attn"]["q_proj"]["kernel"], q.T)


# --- bad inputs ---------------------------------------------------------------------------------
@pytest.fixture
def checkpoint(hf_factory, tmp_path):
    path, _ = hf_factory(seed=7)
    return path


def _edit_config(path, **changes):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def _edit_tensors(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_checkpoint(str(tmp_path / "nope"))


def test_missing_config_json(checkpoint):
    os.remove(os.path.join(checkpoint, "config.json"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_hf_checkpoint(checkpoint)


def test_missing_weights(checkpoint):
    os.remove(os.path.join(checkpoint, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load_hf_checkpoint(checkpoint)


def test_wrong_shape(checkpoint):
    key = "model.layers.0.mlp.up_proj.weight"
    _edit_tensors(checkpoint, lambda t: t.update({key: t[key][:-1]}))
    with pytest.raises(
        ValueError, match=rf"{key} has shape \(95, 64\); the config implies \(96, 64\)"
    ):
        load_hf_checkpoint(checkpoint)


def test_extra_key(checkpoint):
    _edit_tensors(checkpoint, lambda t: t.update({"model.layers.0.mlp.extra": np.zeros(3)}))
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.mlp.extra'\] \(1\)"):
        load_hf_checkpoint(checkpoint)


def test_missing_key(checkpoint):
    _edit_tensors(checkpoint, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.k_proj.bias'\]"):
        load_hf_checkpoint(checkpoint)


def test_extra_layer_in_weights_is_unexpected(checkpoint):
    _edit_config(checkpoint, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.1.input_layernorm.weight'"):
        load_hf_checkpoint(checkpoint)


def test_tied_checkpoint_with_differing_head(checkpoint):
    def add_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1.0

    _edit_tensors(checkpoint, add_head)
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        load_hf_checkpoint(checkpoint)


def test_tied_checkpoint_with_identical_head_and_derived_buffers_loads(checkpoint):
    def add(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)

    _edit_tensors(checkpoint, add)
    config, params = load_hf_checkpoint(checkpoint)
    assert "lm_head" not in params and config.tie_word_embeddings


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling=.*only the default RoPE"),
        ({"use_sliding_window": True}, "use_sliding_window=True"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters="),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types="),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "gemma"}, "model_type='gemma'; allowed: \\['llama', 'mistral', 'qwen2'\\]"),
        ({"model_type": "llama"}, "architectures=.*expected 'LlamaForCausalLM'"),
        ({"attention_bias": False}, "attention_bias=False .* qwen2; allowed: true"),
        ({"quantization_config": {"bits": 4}}, "unknown field quantization_config="),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ],
)
def test_unsupported_config_fields(checkpoint, changes, message):
    _edit_config(checkpoint, **changes)
    with pytest.raises(ValueError, match=message):
        load_hf_checkpoint(checkpoint)


def test_quantised_storage_rejected(checkpoint):
    key = "model.norm.weight"
    _edit_tensors(checkpoint, lambda t: t.update({key: t[key].astype(np.int8)}))
    with pytest.raises(ValueError, match=f"{key} has dtype I8"):
        load_hf_checkpoint(checkpoint)


def test_sharded_index_naming_missing_file(hf_factory, tmp_path):
    _, hf_model = hf_factory(seed=8)
    path = str(tmp_path / "sharded")
    hf_model.save_pretrained(path, max_shard_size="40KB")
    victim = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[0]
    os.remove(os.path.join(path, victim))
    with pytest.raises(FileNotFoundError, match=f"names {victim}, which is missing"):
        load_hf_checkpoint(path)
    shutil.rmtree(path)


# config.json of SmolLM2-135M-Instruct (llama family) as published.
SMOLLM2_135M_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pad_token_id": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 49152,
}


def test_published_llama_config():
    config, _ = config_from_hf(SMOLLM2_135M_CONFIG)
    assert (config.model_type, config.attention_bias) == ("llama", False)
    assert (config.num_hidden_layers, config.hidden_size, config.resolved_head_dim) == (30, 576, 64)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.rope_theta == 1e5 and config.rms_norm_eps == 1e-5 and config.tie_word_embeddings
    # 135M parameters: the count the model card gives.
    n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(abstract_params(config)))
    assert n == 134_515_008


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("tied", [True, False])
def test_llama_family_round_trip_and_parity(hf_factory, tmp_path, family, tied):
    path, hf_model = hf_factory(seed=6, family=family, tie_word_embeddings=tied)
    config, params = load_hf_checkpoint(path)
    assert (config.model_type, config.attention_bias) == (family, False)
    # No q/k/v bias: a Qwen2 decoder without them, not a bias of zeros.
    assert "bias" not in params["layers_0"]["self_attn"]["q_proj"]
    ids = _ids(config)
    ours = Qwen2ForCausalLM(config).apply({"params": params}, ids)
    ref = _hf_logits(hf_model, ids)
    assert np.abs(ref).max() > 1.0  # logits O(1) or more: the bound below is not vacuous
    np.testing.assert_allclose(np.asarray(ours), ref, atol=parity_tol(config, ids, ref))
    out = str(tmp_path / "exported")
    save_hf_checkpoint(out, config, params)
    written = json.loads(Path(out, "config.json").read_text())
    assert written["model_type"] == family and written["attention_bias"] is False
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(reloaded) is type(hf_model)
    ref_sd, new_sd = hf_model.state_dict(), reloaded.state_dict()
    assert set(ref_sd) == set(new_sd)
    for key in ref_sd:
        torch.testing.assert_close(new_sd[key], ref_sd[key], rtol=0, atol=0)


def test_qwen2_weights_read_as_llama_are_refused(hf_factory):
    """A llama config over a checkpoint with q/k/v biases: the biases are unexpected keys."""
    path, _ = hf_factory(seed=7)
    cfg = json.loads(Path(path, "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=False)
    cfg.pop("use_sliding_window", None)
    Path(path, "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.self_attn.k_proj.bias'"):
        load_hf_checkpoint(path)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"attention_bias": True}, "attention_bias=True is not supported .* llama; allowed: false"),
        ({"mlp_bias": True}, "mlp_bias=True .*allowed: false"),
        ({"pretraining_tp": 2}, "pretraining_tp=2 .*allowed: 1"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling=.*default RoPE"),
        ({"architectures": ["Qwen2ForCausalLM"]}, "expected 'LlamaForCausalLM' for llama"),
    ],
)
def test_unsupported_llama_fields(changes, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**SMOLLM2_135M_CONFIG, **changes})


def test_mistral_sliding_window_refused():
    cfg = {**SMOLLM2_135M_CONFIG, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    for k in ("mlp_bias", "pretraining_tp"):
        cfg.pop(k)
    config, _ = config_from_hf({**cfg, "sliding_window": None})
    assert config.model_type == "mistral"
    with pytest.raises(ValueError, match="sliding_window=4096 .* mistral; allowed: null"):
        config_from_hf({**cfg, "sliding_window": 4096})


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_safetensors_name_the_file(checkpoint, damage):
    path = Path(checkpoint, "model.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x07" * 4096)
    with pytest.raises(
        ValueError, match=r"model\.safetensors: (not a readable safetensors|tensor)"
    ):
        load_hf_checkpoint(checkpoint)
