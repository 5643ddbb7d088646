"""The log-prob readout (aqn_jax/logprobs.py, issue 51) against the unfused path: the head on
every position, `logprobs_from_logits` over the whole `[N, R, V]` logits.

Tolerances are a priori (tests/tolerance.py). At the head: the logits are a dot product over D
accumulated in float32 in both compute dtypes (`preferred_element_type`), the log-prob and the
entropy add the log-sum-exp over V, so each is within float32 eps x (D + V) x the logits' bound
(|z| <= max|x_t| max|W_v| / temperature, Cauchy-Schwarz); both paths round the same bf16 inputs.
The gradient goes back through the same reductions (twice the path) and, in bf16, the head's
gradient is a bf16 product once per chunk (the readout adds one partial per chunk; the unfused
path rounds once): + (chunks + 1) bf16 roundings at the gradient's scale. Through the whole
model, in float32: the forward's reduction path (`forward_path`). Every comparison has its
negative control: a wrong token or temperature moves the value by more than the bound.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqn_jax.faults.intercept import FaultPlan, Injection
from aqn_jax.faults.sites import SiteSelector
from aqn_jax.faults.transforms import Deadzone, Noise, Scale
from aqn_jax.forward import Readout, forward
from aqn_jax.logprobs import chunked_logprobs, logprobs_from_logits
from aqn_jax.models.qwen2 import Qwen2Config, Qwen2ForCausalLM, Qwen2Head
from aqn_jax.rl.step import response_logits

from conftest import random_params
from tolerance import bound, eps, forward_path, logit_bound

V, D, CHUNK = 37, 32, 3  # a vocabulary and a response length (7) the chunk does not divide
N, R = 3, 7


def _config(dtype: str, tied: bool) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
        dtype=dtype,
        logprob_chunk=CHUNK,
        rope_theta=1e4,
    )


def _head_case(dtype: str, tied: bool):
    cfg = _config(dtype, tied)
    head = Qwen2Head(cfg)
    x = jax.random.normal(jax.random.key(0), (N, R, D)).astype(dtype)
    params = jax.tree.map(lambda a: 4.0 * a, nn.unbox(head.init(jax.random.key(1), x)["params"]))
    tokens = jax.random.randint(jax.random.key(2), (N, R), 0, V)
    w = jnp.ones((N, R)).at[0, :3].set(0.0)  # a padded row's first positions carry no loss
    return head, params, x, tokens, w


def _loss(head, params, x, tokens, w, temperature, fused):
    """A token-mean of log-prob and entropy (the policy loss's shape) and the per-token values."""
    if fused:
        fn = lambda x_c, part: (head.apply({"params": params}, x_c), {})  # noqa: E731
        logp, ent, _ = chunked_logprobs(fn, x, tokens, temperature, CHUNK)
    else:
        logp, ent = logprobs_from_logits(head.apply({"params": params}, x), tokens, temperature)
    return jnp.sum((logp + 0.1 * ent) * w) / jnp.sum(w), (logp, ent)


def _grads(head, params, x, tokens, w, temperature, fused):
    fn = jax.value_and_grad(_loss, argnums=(1, 2), has_aux=True)
    (loss, (logp, ent)), g = fn(head, params, x, tokens, w, temperature, fused)
    return (
        loss,
        logp,
        ent,
        jnp.concatenate([a.astype(jnp.float32).ravel() for a in jax.tree.leaves(g)]),
    )


# Two of the eight cases (both dtypes, both heads, both temperatures between them) in the fast
# tier; all eight in the full suite (issue 53: the fast tier within 180 s cold).
_READOUT_CASES = [
    pytest.param(
        dtype,
        tied,
        temperature,
        marks=()
        if (dtype, tied, temperature) in (("float32", True, 1.0), ("bfloat16", False, 0.7))
        else pytest.mark.slow,
    )
    for dtype in ("float32", "bfloat16")
    for tied in (True, False)
    for temperature in (1.0, 0.7)
]


@pytest.mark.parametrize("dtype,tied,temperature", _READOUT_CASES)
def test_readout_matches_the_full_logits(dtype, tied, temperature):
    head, params, x, tokens, w = _head_case(dtype, tied)
    # One jitted program per path, the tokens and the temperature its arguments (eagerly, every
    # op of the chunked scan and its gradient compiled on its own).
    jitted = jax.jit(functools.partial(_grads, head), static_argnames="fused")
    grads = lambda tokens, temperature, fused: jitted(  # noqa: E731
        params, x, tokens, w, jnp.float32(temperature), fused=fused
    )
    loss, logp, ent, g = grads(tokens, temperature, fused=True)
    loss0, logp0, ent0, g0 = grads(tokens, temperature, fused=False)
    table = params["embed_tokens"]["embedding"] if tied else params["lm_head"]["kernel"].T
    x_max = float(jnp.max(jnp.linalg.norm(x.astype(jnp.float32), axis=-1)))
    w_max = float(jnp.max(jnp.linalg.norm(table.astype(jnp.float32), axis=-1)))
    z_bound = x_max * w_max / temperature
    tol = bound(D + V, z_bound)
    np.testing.assert_allclose(logp, logp0, rtol=0, atol=tol)
    np.testing.assert_allclose(ent, ent0, rtol=0, atol=tol)
    assert abs(float(loss) - float(loss0)) <= 1.1 * tol  # a weighted mean of both
    g_scale = float(jnp.max(jnp.abs(g0)))
    g_tol = bound(2 * (D + V) + N * R, g_scale)
    if dtype == "bfloat16":
        g_tol += bound(-(-R // CHUNK) + 1, g_scale, jnp.bfloat16)
    np.testing.assert_allclose(g, g0, rtol=0, atol=g_tol)
    # Negative controls: the next token's log-prob, another temperature's entropy, the gradient
    # of the loss with one token changed: each differs by more than its bound.
    _, wrong, _, g_wrong = grads((tokens + 1) % V, temperature, fused=True)
    assert float(jnp.max(jnp.abs(wrong - logp0))) > 10 * tol
    _, _, ent_hot, _ = grads(tokens, 1.5 * temperature, fused=True)
    assert float(jnp.max(jnp.abs(ent_hot - ent0))) > 10 * tol
    assert float(jnp.max(jnp.abs(g_wrong - g0))) > 10 * g_tol


def _model_case(tied: bool):
    cfg = _config("float32", tied)
    params = random_params(cfg, seed=3)
    rng = np.random.default_rng(0)
    plen = 5
    ids = rng.integers(0, V, (N, plen + R)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    return cfg, params, jnp.asarray(ids), jnp.asarray(mask), plen


@pytest.mark.parametrize("tied", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_forward_readout_and_its_gradient_match_the_unfused_path(tied):
    """Through the whole model (float32): the response's log-probs, entropy, a token-mean loss
    and its gradient in every param, the readout against the full logits sliced."""
    cfg, params, ids, mask, plen = _model_case(tied)
    model = Qwen2ForCausalLM(cfg)
    tokens, temperature = ids[:, plen:], 0.7
    rmask = jnp.ones((N, R)).at[2, 4:].set(0.0)

    def run(p, toks, fused):
        if fused:
            logp, ent = forward(model, p, ids, mask, readout=Readout(toks, plen - 1, temperature))
        else:
            logits = response_logits(forward(model, p, ids, mask), plen, R)
            logp, ent = logprobs_from_logits(logits, toks, temperature)
        return jnp.sum((logp - 0.01 * ent) * rmask) / jnp.sum(rmask), (logp, ent)

    jitted = jax.jit(jax.value_and_grad(run, has_aux=True), static_argnums=2)  # built once

    def both(toks, fused):
        return jitted(params, toks, fused)

    (loss, (logp, ent)), g = both(tokens, True)
    (loss0, (logp0, ent0)), g0 = both(tokens, False)
    path = forward_path(cfg, plen + R, log_softmax=True)
    tol = bound(path, logit_bound(cfg, params) / temperature)
    np.testing.assert_allclose(logp, logp0, rtol=0, atol=tol)
    np.testing.assert_allclose(ent, ent0, rtol=0, atol=tol)
    assert abs(float(loss) - float(loss0)) <= tol
    flat = lambda t: jnp.concatenate([a.ravel() for a in jax.tree.leaves(t)])  # noqa: E731
    g_tol = bound(2 * path, float(jnp.max(jnp.abs(flat(g0)))))
    np.testing.assert_allclose(flat(g), flat(g0), rtol=0, atol=g_tol)
    # Negative controls: another token, a gradient of another token's loss.
    (_, (wrong, _)), g_wrong = both((tokens + 1) % V, True)
    assert float(jnp.max(jnp.abs(wrong - logp0))) > 10 * tol
    assert float(jnp.max(jnp.abs(flat(g_wrong) - flat(g0)))) > 10 * g_tol


def _lm_head_plan(transform) -> FaultPlan:
    return FaultPlan([Injection("h", SiteSelector(("lm_head",)), transform, ("eval",))])


def test_lm_head_faults_act_per_chunk():
    """A per-token fault at lm_head gives the readout what it gives the full logits (a deadzone
    of each token's own amax: chunk-invariant); random noise draws anew per chunk (the chunks of
    one call never repeat a draw); a statistic over the whole call is refused in one line."""
    cfg, params, ids, mask, plen = _model_case(True)
    model = Qwen2ForCausalLM(cfg)
    tokens, key = ids[:, plen:], jax.random.key(5)
    dz = _lm_head_plan(Deadzone(0.3, scope="token"))
    kw = dict(plan=dz, phase="eval", key=key)
    (logp, _), stats = forward(
        model, params, ids, mask, readout=Readout(tokens, plen - 1), mutable=["fault_stats"], **kw
    )
    full, full_stats = forward(model, params, ids, mask, mutable=["fault_stats"], **kw)
    logp0, _ = logprobs_from_logits(response_logits(full, plen, R), tokens, 1.0)
    tol = bound(forward_path(cfg, plen + R, log_softmax=True), logit_bound(cfg, params))
    np.testing.assert_allclose(logp, logp0, rtol=0, atol=tol)
    flushed = float(stats["fault_stats"]["lm_head"]["h.flushed"][0])
    assert 0.0 < flushed < 1.0  # the telemetry, combined over the chunks
    # Negative control: without the fault the log-probs move by more than the bound.
    clean, _ = forward(model, params, ids, mask, readout=Readout(tokens, plen - 1))
    assert float(jnp.max(jnp.abs(clean - logp0))) > 10 * tol

    # Noise of fixed absolute scale: the error it adds to each chunk's log-probs differs
    # between chunks fed the same hidden states (each chunk folds its index into the key).
    same = jnp.broadcast_to(ids[:, plen - 1 : plen], ids[:, plen - 1 :].shape)
    flat_ids = jnp.concatenate([ids[:, :plen], same[:, 1:]], axis=1)
    noise = _lm_head_plan(Noise("absolute_gaussian", Scale(1.0)))
    noisy, _ = forward(
        model, params, flat_ids, plan=noise, phase="eval", key=key, readout=Readout(tokens, plen)
    )
    clean, _ = forward(model, params, flat_ids, readout=Readout(tokens, plen))
    err = noisy - clean  # positions plen .. plen + R - 2 hold the same token: the same logits
    first, second = err[:, :CHUNK], err[:, CHUNK : 2 * CHUNK]
    assert float(jnp.max(jnp.abs(first - second))) > 0.1

    with pytest.raises(ValueError, match=r"at lm_head .*scope='call'.*use scope='token'"):
        forward(
            model,
            params,
            ids,
            plan=_lm_head_plan(Deadzone(0.3)),
            phase="eval",
            key=key,
            readout=Readout(tokens, plen - 1),
        )


def test_prefill_computes_only_the_last_positions_logits():
    """The sampler's prefill (`last_only`): no `[B, T, V]` array in its program; the full
    forward of the same call has one (the negative control)."""
    cfg = _config("float32", True)
    model = Qwen2ForCausalLM(cfg)
    params = random_params(cfg)
    ids = jnp.zeros((2, 11), jnp.int32)

    def shapes(last_only):
        jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, ids, last_only=last_only))
        return {tuple(v.aval.shape) for e in jaxpr(params).eqns for v in e.outvars}

    assert (2, 11, V) not in shapes(True) and (2, 1, V) in shapes(True)
    assert (2, 11, V) in shapes(False)


def test_eps_of_both_dtypes():
    assert eps(np.float32) == 2.0**-23 and eps(jnp.bfloat16) == 2.0**-7
