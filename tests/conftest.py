"""Shared fixtures: tiny random HF Qwen2 checkpoints made locally (no hub access)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import pytest
import transformers

transformers.utils.logging.disable_progress_bar()


def randomize_hf_weights(model, seed: int) -> None:
    """Replace HF's init (zero biases, unit norms, std 0.02) by weights that make logits O(10).

    With HF's own init the logits are ~1e-2 and a parity bound of 1e-4 would be loose; here
    every tensor is random, so a wrong bias, norm, RoPE or head mapping shows up.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(0.25 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))


def make_hf_model(path, seed: int = 0, **overrides):
    """A random transformers Qwen2ForCausalLM saved with save_pretrained into `path`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kw = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1e4,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        attn_implementation="eager",
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**kw)).eval()
    randomize_hf_weights(model, seed)
    model.save_pretrained(str(path))
    return model


@pytest.fixture
def hf_factory(tmp_path):
    counter = iter(range(1000))

    def factory(seed=0, **overrides):
        path = tmp_path / f"hf_{next(counter)}"
        model = make_hf_model(path, seed=seed, **overrides)
        return str(path), model

    return factory


def left_padded_batch(rng: np.random.RandomState, vocab: int, lengths, total: int):
    """ids/mask/positions [B, total] with sequence b occupying the last lengths[b] slots."""
    ids = rng.randint(0, vocab, size=(len(lengths), total))
    mask = np.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, total - n :] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return ids, mask, positions


def random_params(config, seed: int = 0):
    """Our own params for `config`, random at a scale that makes logits O(10)."""
    import jax

    from aqn_jax.models.hf import abstract_params

    shapes = abstract_params(config)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    rng = np.random.RandomState(seed)
    out = []
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            value = 1.0 + 0.2 * rng.randn(*leaf.shape)
        elif "bias" in name:
            value = 0.3 * rng.randn(*leaf.shape)
        elif "embedding" in name:
            value = 0.25 * rng.randn(*leaf.shape)
        else:
            value = rng.randn(*leaf.shape) / np.sqrt(leaf.shape[0])
        out.append(value.astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)
