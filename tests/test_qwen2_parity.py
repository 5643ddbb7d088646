"""Logit parity of our Flax Qwen2 with transformers' PyTorch Qwen2ForCausalLM (f32 and bf16)."""

import dataclasses

import numpy as np
import pytest
import torch

from aqn_jax.models.hf import load_hf_checkpoint
from aqn_jax.models.qwen2 import Qwen2ForCausalLM

from conftest import left_padded_batch

CONFIGS = {
    # name: overrides of conftest.make_hf_model (hidden 128 -> head_dim = 128 / heads)
    "tied_gqa_hd32_theta1e4": dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4
    ),
    "untied_mqa_hd64_theta1e6": dict(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_theta=1e6,
        tie_word_embeddings=False,
    ),
    "untied_mqa_hd32_theta1e4": dict(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_theta=1e4,
        tie_word_embeddings=False,
    ),
    "tied_mha_hd64_theta1e6": dict(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=2, rope_theta=1e6
    ),
}
LENGTHS = (520, 401, 17)  # one prompt of >= 512 tokens; the others left-padded
TOTAL = 520


def _reference(model, ids, mask, positions):
    # HF's plain forward numbers positions arange(T) even with padding; pass generate's
    # convention (count of real tokens before each one), which is also our default.
    with torch.no_grad():
        out = model(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        )
    return out.logits.numpy()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_f32_logits_match_transformers(hf_factory, name):
    path, hf_model = hf_factory(seed=len(name), **CONFIGS[name])
    config, params = load_hf_checkpoint(path)
    ids, mask, positions = left_padded_batch(
        np.random.RandomState(0), config.vocab_size, LENGTHS, TOTAL
    )
    ref = _reference(hf_model, ids, mask, positions)
    ours = np.asarray(Qwen2ForCausalLM(config).apply({"params": params}, ids, attention_mask=mask))
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    real = mask.astype(bool)
    assert np.abs(ref[real]).max() > 1.0  # logits large enough for the bound to mean something
    diff = np.abs(ours[real] - ref[real]).max()
    print(f"{name}: max |logit diff| {diff:.2e} (max |logit| {np.abs(ref[real]).max():.1f})")
    assert diff <= 1e-4


def test_wrong_rope_theta_is_detected(hf_factory):
    """Negative control: the parity check above is sharp enough to see a RoPE error."""
    path, hf_model = hf_factory(seed=1, **CONFIGS["tied_gqa_hd32_theta1e4"])
    config, params = load_hf_checkpoint(path)
    ids, mask, positions = left_padded_batch(
        np.random.RandomState(0), config.vocab_size, LENGTHS, TOTAL
    )
    ref = _reference(hf_model, ids, mask, positions)
    wrong = dataclasses.replace(config, rope_theta=1e6)
    ours = np.asarray(Qwen2ForCausalLM(wrong).apply({"params": params}, ids, attention_mask=mask))
    assert np.abs(ours - ref)[mask.astype(bool)].max() > 1e-2


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_bf16_kl_to_f32_reference(hf_factory):
    """bf16 params and compute: per-token KL(p_f32 || p_bf16) stays small (expect <= 1e-2)."""
    path, hf_model = hf_factory(seed=3, **CONFIGS["tied_gqa_hd32_theta1e4"])
    config, params = load_hf_checkpoint(path, dtype="bfloat16")
    assert config.dtype == "bfloat16" and params["norm"]["weight"].dtype.name == "bfloat16"
    ids, mask, positions = left_padded_batch(
        np.random.RandomState(1), config.vocab_size, LENGTHS, TOTAL
    )
    ref = _log_softmax(_reference(hf_model, ids, mask, positions).astype(np.float64))
    ours = np.asarray(Qwen2ForCausalLM(config).apply({"params": params}, ids, attention_mask=mask))
    assert ours.dtype == np.float32
    ours = _log_softmax(ours.astype(np.float64))
    kl = (np.exp(ref) * (ref - ours)).sum(-1)[mask.astype(bool)]
    print(f"bf16 vs f32 reference: max per-token KL {kl.max():.2e}, mean {kl.mean():.2e}")
    assert kl.max() <= 1e-2
    assert kl.mean() > 0  # bf16 really is in use


def test_apply_checks_param_shapes_without_tracing_the_initializers(monkeypatch):
    """`qwen2._param`: at apply, a param of the wrong shape still raises Flax's shape error
    naming it, but the initializers are no longer traced (`jax.eval_shape`) on every access.
    Only `nn.Embed`'s own check is left: 1 call, where Flax's `param` made one per param."""
    import flax
    import jax

    from aqn_jax.models.factory import init_params
    from aqn_jax.models.qwen2 import Qwen2Config

    cfg = Qwen2Config.preset("tiny", num_hidden_layers=2)
    model, params = Qwen2ForCausalLM(cfg), init_params(cfg, 0)
    ids = np.ones((1, 5), np.int32)
    calls = []
    real = jax.eval_shape
    monkeypatch.setattr(jax, "eval_shape", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits = model.apply({"params": params}, ids)
    assert len(jax.tree_util.tree_leaves(params)) > 20 and len(calls) == 1
    assert logits.shape == (1, 5, cfg.vocab_size)

    bad = jax.tree_util.tree_map(lambda x: x, params)
    bad["layers_1"]["mlp"]["down_proj"]["kernel"] = np.zeros((3, 3), np.float32)
    with pytest.raises(flax.errors.ScopeParamShapeError, match=r"layers_1/mlp/down_proj.*\(3, 3\)"):
        model.apply({"params": bad}, ids)
