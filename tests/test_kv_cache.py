"""KV cache: prefill + single-token steps reproduce one full forward (f32, left padding)."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from aqn_jax.models.qwen2 import Qwen2Config, Qwen2ForCausalLM, init_cache

from conftest import left_padded_batch, random_params
from tolerance import bound, forward_path

CONFIG = Qwen2Config.tiny(num_hidden_layers=3)
PROMPT_LENGTHS = (9, 5, 12)  # left-padded to 12
PROMPT_T = 12
NEW_TOKENS = 7
MAX_LEN = 24  # more slots than used: unwritten slots must stay masked
# Cached against one full forward: two programs, f32 rounding along the forward over at most
# MAX_LEN keys (tests/tolerance.py), terms of the size of the largest logit (set in setUp).
PATH = forward_path(CONFIG, MAX_LEN)


@pytest.mark.slow  # prefill + stepwise decode vs the full forward, eager and jitted (issue 53)
class KVCacheTest(chex.TestCase):
    def setUp(self):
        super().setUp()
        self.model = Qwen2ForCausalLM(CONFIG)
        self.params = random_params(CONFIG, seed=0)
        rng = np.random.RandomState(0)
        ids, mask, _ = left_padded_batch(rng, CONFIG.vocab_size, PROMPT_LENGTHS, PROMPT_T)
        new = rng.randint(0, CONFIG.vocab_size, size=(len(PROMPT_LENGTHS), NEW_TOKENS))
        self.prompt, self.prompt_mask, self.new = ids, mask, new
        full_ids = np.concatenate([ids, new], axis=1)
        full_mask = np.concatenate([mask, np.ones_like(new)], axis=1)
        self.full = np.asarray(
            self.model.apply({"params": self.params}, full_ids, attention_mask=full_mask)
        )
        self.real = full_mask.astype(bool)
        self.tol = bound(PATH, np.abs(self.full).max())

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((1,), (3,))
    def test_prefill_then_steps_match_full_forward(self, chunk):
        """Prefill the prompt, then feed the continuation `chunk` tokens at a time."""

        @self.variant
        def step(params, ids, mask, cache):
            return self.model.apply({"params": params}, ids, attention_mask=mask, cache=cache)

        cache = init_cache(CONFIG, len(PROMPT_LENGTHS), MAX_LEN)
        logits, cache = step(self.params, self.prompt, self.prompt_mask, cache)
        pieces = [np.asarray(logits)]
        for start in range(0, NEW_TOKENS, chunk):
            ids = self.new[:, start : start + chunk]
            logits, cache = step(self.params, ids, np.ones_like(ids), cache)
            pieces.append(np.asarray(logits))
        cached = np.concatenate(pieces, axis=1)
        assert int(cache.end) == PROMPT_T + NEW_TOKENS
        np.testing.assert_array_equal(
            np.asarray(cache.mask)[:, : PROMPT_T + NEW_TOKENS], self.real.astype(np.int32)
        )
        assert np.asarray(cache.mask)[:, PROMPT_T + NEW_TOKENS :].sum() == 0
        diff = np.abs(cached - self.full)[self.real].max()
        assert diff <= self.tol, (diff, self.tol)

    def test_padding_does_not_change_real_tokens(self):
        """A left-padded prompt gives the logits of the same prompt alone (positions from mask)."""
        b = 1  # 5 real tokens after 7 pads
        alone = self.prompt[b : b + 1, -PROMPT_LENGTHS[b] :]
        logits = self.model.apply({"params": self.params}, alone)
        np.testing.assert_allclose(
            np.asarray(logits)[0],
            self.full[b, PROMPT_T - PROMPT_LENGTHS[b] : PROMPT_T],
            atol=self.tol,
        )


@pytest.mark.slow
def test_remat_gives_same_logits_and_grads():
    params = random_params(CONFIG, seed=1)
    ids = np.random.RandomState(2).randint(0, CONFIG.vocab_size, size=(2, 10))

    def loss(params, config):
        logp = jax.nn.log_softmax(Qwen2ForCausalLM(config).apply({"params": params}, ids))
        return jnp.mean(logp[..., 0]), logp

    # Each a jitted program (eager, every op of the forward and backward compiled on its own).
    grads = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (plain_loss, logp), plain_grads = grads(params, CONFIG)
    (remat_loss, _), remat_grads = grads(params, dataclasses.replace(CONFIG, remat=True))
    # Two programs (the remat one recomputes the forward inside the backward and fuses it
    # apart): the loss within the forward's f32 rounding (tests/tolerance.py) at the scale of
    # the log-probs, the gradients within the forward and backward paths' (twice the forward's,
    # plus the sum of a weight gradient over the batch's tokens) at the largest gradient's scale.
    n = forward_path(CONFIG, ids.shape[1], log_softmax=True)
    tol = bound(n, np.abs(logp).max())
    np.testing.assert_allclose(plain_loss, remat_loss, rtol=0, atol=tol)
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(plain_grads))
    chex.assert_trees_all_close(
        plain_grads, remat_grads, rtol=0, atol=bound(2 * n + ids.size, scale)
    )
    # The remat program really differs: its jaxpr contains a checkpoint (remat) primitive.
    jaxpr = jax.make_jaxpr(jax.grad(loss, has_aux=True), static_argnums=1)(
        params, dataclasses.replace(CONFIG, remat=True)
    )
    assert "checkpoint" in str(jaxpr) or "remat" in str(jaxpr)


def test_last_only_equals_last_position_of_full_logits():
    params = random_params(CONFIG, seed=3)
    ids, mask, _ = left_padded_batch(np.random.RandomState(4), CONFIG.vocab_size, (6, 9), 9)
    model = Qwen2ForCausalLM(CONFIG)
    full = np.asarray(model.apply({"params": params}, ids, attention_mask=mask))
    last = np.asarray(model.apply({"params": params}, ids, attention_mask=mask, last_only=True))
    assert last.shape == (2, 1, CONFIG.vocab_size)
    # last_only skips the other positions' head: another program (tests/tolerance.py).
    tol = bound(forward_path(CONFIG, ids.shape[1]), np.abs(full).max())
    np.testing.assert_allclose(last[:, 0], full[:, -1], atol=tol)
