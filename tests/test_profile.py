"""The residual stream's per-layer profile (model_summary), against transformers' hidden states."""

import numpy as np
import torch

from aqn_jax.diagnosis.profile import format_profile, residual_profile
from aqn_jax.models.hf import load_hf_checkpoint
from aqn_jax.models.qwen2 import Qwen2ForCausalLM


def test_profile_matches_transformers_hidden_states(hf_factory):
    path, hf_model = hf_factory(seed=11, family="llama")
    config, params = load_hf_checkpoint(path)
    rng = np.random.RandomState(0)
    ids = rng.randint(0, config.vocab_size, size=(2, 12))
    mask = np.ones_like(ids)
    mask[1, :5] = 0  # row 1 is left-padded: its first 5 slots are not tokens
    rows = residual_profile(Qwen2ForCausalLM(config), params, ids, mask)
    assert [r["layer"] for r in rows] == list(range(config.num_hidden_layers))

    with torch.no_grad():
        out = hf_model(
            torch.tensor(ids[:1]), output_hidden_states=True
        ).hidden_states  # row 0 alone: no padding
        out1 = hf_model(torch.tensor(ids[1:, 5:]), output_hidden_states=True).hidden_states
    # HF's hidden_states[i + 1] is layer i's output, except the last (after the final norm).
    for i in range(config.num_hidden_layers - 1):
        h = np.concatenate(
            [np.abs(out[i + 1][0].numpy()).ravel(), np.abs(out1[i + 1][0].numpy()).ravel()]
        )
        r = rows[i]
        np.testing.assert_allclose(r["max"], h.max(), rtol=1e-5)
        np.testing.assert_allclose(r["median"], np.median(h), rtol=1e-4)
        np.testing.assert_allclose(r["p99"], np.percentile(h, 99), rtol=1e-4)
        np.testing.assert_allclose(r["max_over_median"], h.max() / np.median(h), rtol=1e-4)
        # Where the max sits: (row, position among the row's real tokens, channel).
        a0, a1 = np.abs(out[i + 1][0].numpy()), np.abs(out1[i + 1][0].numpy())
        row = 0 if a0.max() >= a1.max() else 1
        t, c = np.unravel_index(
            (a0 if row == 0 else a1).argmax(), a0.shape if row == 0 else a1.shape
        )
        assert (r["max_row"], r["max_token"], r["max_channel"]) == (row, t, c)


def test_padding_never_sets_the_max(hf_factory):
    """Negative control: a padded slot whose value would be the max is excluded."""
    path, _ = hf_factory(seed=12, family="llama")
    config, params = load_hf_checkpoint(path)
    model = Qwen2ForCausalLM(config)
    ids = np.random.RandomState(1).randint(0, config.vocab_size, size=(1, 10))
    full = residual_profile(model, params, ids)
    t_max = full[0]["max_token"]
    mask = np.ones_like(ids)
    mask[0, : t_max + 1] = 0  # pad out the slot of the max (and everything before it)
    cut = residual_profile(model, params, ids, mask)
    assert cut[0]["max"] < full[0]["max"]
    assert "max/median" in format_profile(full)
