"""The step-cost levers against the plain step, on the tiny model in f32: a group's prompt
computed once in the update (`config.actor.share_prompt`, `forward.SharedPrompt`) gives the
per-row gradient; micro-batches of rows without an advantage left out
(`config.actor.skip_zero_advantage`) give the full batch's update; each with a negative control.
Tiny shapes: 3 layers, 4 prompts x n=2 rows of 8 + 6 tokens, micro-batches of 2 rows."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqn_jax import parallel
from aqn_jax.aqn.config import AQN_SIGMA
from aqn_jax.aqn.plan import build_plan
from aqn_jax.faults.config import fault_plan
from aqn_jax.models.qwen2 import Qwen2Config
from aqn_jax.rl import step as rl_step
from aqn_jax.spec import step_spec

from conftest import load_config, random_params, shallow
from tolerance import bound, forward_path

CFG = Qwen2Config.tiny(num_hidden_layers=3)
PLEN, NEW, N, PROMPTS = 8, 6, 2, 4
ROWS = N * PROMPTS
VALUES = {AQN_SIGMA: np.float32(0.0)}


def _config(share: bool, skip: bool, **algo):
    # The per-token quantile deadzone at layer 1 of 3 (the real-model study's kind: scope
    # 'token'), deterministic, in every pass; on-policy (one mini-batch, one epoch).
    config = shallow(load_config("deadzone"))
    config.faults.deadzone.scope = "token"
    config.rollout.max_new_tokens = NEW
    config.rollout.n = N
    config.data_batch.prompts = PROMPTS
    config.actor.mini_batch_prompts = PROMPTS
    config.actor.micro_batch_rows = 2
    config.actor.share_prompt = share
    config.actor.skip_zero_advantage = skip
    config.algo.use_kl_loss = False
    config.algo.entropy_coeff = 0.0
    for k, v in algo.items():
        config.algo[k] = v
    return config


@functools.cache
def _static(share: bool, skip: bool):
    config = _config(share, skip)
    n = CFG.num_hidden_layers
    plan, hw = build_plan(config.faults, config.aqn, n), fault_plan(config.faults, n)
    return rl_step.static_from(step_spec(config), CFG, plan, hw, 4)


def _state(static):
    mesh = parallel.make_mesh(shallow(load_config("deadzone")).mesh, jax.devices()[:1])
    state, _ = rl_step.init_state(
        static, random_params(CFG, seed=1), rl_step.shardings(static, mesh)
    )
    return state


def _batch(scores):
    """Rows b*N .. b*N+N-1 share prompt b (left-padded: prompt 1 has 3 padding slots)."""
    r = np.random.default_rng(0)
    prompt = np.repeat(r.integers(3, 200, (PROMPTS, PLEN)), N, axis=0)
    pmask = np.ones_like(prompt)
    pmask[N : 2 * N, :3] = 0
    prompt[N : 2 * N, :3] = 0
    resp = r.integers(3, 200, (ROWS, NEW))
    rmask = np.ones((ROWS, NEW), np.int32)
    rmask[1, 3:] = 0
    resp[1, 3:] = 0
    ids = np.concatenate([prompt, resp], axis=1).astype(np.int32)
    mask = np.concatenate([pmask, rmask], axis=1).astype(np.int32)
    batch = dict(ids=ids, mask=mask, tokens=resp.astype(np.int32), rmask=rmask)
    return jax.tree_util.tree_map(jnp.asarray, batch), jnp.asarray(scores, jnp.float32)


@functools.cache
def _programs(static):
    prep = jax.jit(lambda *a: rl_step.prepare_step(static, *a))
    upd = jax.jit(lambda *a: rl_step.update_step(static, *a))
    return prep, upd


def _step(static, batch, scores, advantages=None):
    """(params after the update, its metrics) of one on-policy step on `batch`."""
    prep_fn, upd_fn = _programs(static)
    state = _state(static)
    prep, _ = prep_fn(state, None, batch, scores, jax.random.key(3), VALUES)
    upd = {**batch, "advantages": prep["advantages"] if advantages is None else advantages}
    if static.skip:
        upd["live"] = prep["live"]
    new, mets = upd_fn(state, upd, jax.random.key(3), VALUES)
    flat = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(new.params)])
    return flat, mets, prep


def _flat(static):
    return np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(_state(static).params)])


def test_levers_on_where_exact_and_off_with_a_reason():
    on = _static(True, True)
    assert on.share_group == 2 and on.skip and not on.levers_off
    # Where a lever would change the result it is off, and says why.
    cases = {
        "entropy": (dict(entropy_coeff=0.01), "skip_zero_advantage off: config.algo.entropy_coeff"),
        "kl": (dict(use_kl_loss=True), "skip_zero_advantage off: config.algo.use_kl_loss=True"),
    }
    n = CFG.num_hidden_layers
    for algo, want in cases.values():
        config = _config(True, True, **algo)
        plan, hw = build_plan(config.faults, config.aqn, n), fault_plan(config.faults, n)
        static = rl_step.static_from(step_spec(config), CFG, plan, hw, 4)
        assert not static.skip and any(want in line for line in static.levers_off)
    config = _config(True, True)
    config.faults.deadzone.scope = "call"  # a quantile over the whole call: two calls differ
    plan, hw = build_plan(config.faults, config.aqn, n), fault_plan(config.faults, n)
    static = rl_step.static_from(step_spec(config), CFG, plan, hw, 4)
    assert static.share_group == 1 and static.skip
    assert static.levers_off == (
        "config.actor.share_prompt off: deadzone: a statistic over the whole call (quantile,"
        " scope='call')",
    )


@functools.cache
def _grads_fn(static):
    return jax.jit(
        lambda p, m, live: rl_step.minibatch_grads(
            static, p, m, jax.random.key(3), 0, VALUES, live_micros=live
        )
    )


def _grads(static, batch, scores, advantages=None):
    """(the update's summed gradient, flat; its metrics) of the one mini-batch, its rows in
    the order and with the micro-batches the update runs (`_live_first` with the skip)."""
    prep_fn, _ = _programs(static)
    state = _state(static)
    prep, _ = prep_fn(state, None, batch, scores, jax.random.key(3), VALUES)
    mb = {**batch, "advantages": prep["advantages"] if advantages is None else advantages}
    live = None
    if static.skip:
        mb, _, live = rl_step._live_first(static, {**mb, "live": prep["live"]})
        live = live[0]
    mb = jax.tree_util.tree_map(lambda x: x[0], rl_step.mini_batches(static, mb))
    g, mets, _ = _grads_fn(static)(state.params, mb, live)
    return np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(g)]), mets


def _tol(g_ref):
    # Two programs computing the same gradient: the backward's path is twice the forward's
    # reductions, at the scale of the largest gradient entry (tests/tolerance.py).
    path = forward_path(CFG, PLEN + NEW, log_softmax=True)
    return bound(2 * path, float(np.abs(g_ref).max()))


@pytest.mark.slow
def test_shared_prompt_update_equals_the_per_row_update():
    plain, shared = _static(False, False), _static(True, False)
    batch, scores = _batch([1, 0, 0, 1, 1, 1, 0, 1])
    g0, m0 = _grads(plain, batch, scores)
    g1, m1 = _grads(shared, batch, scores)
    assert np.abs(g0).max() > 0
    np.testing.assert_allclose(g1, g0, rtol=0, atol=_tol(g0))
    old0 = np.asarray(m0[rl_step.ROWS]["old_logp"]).reshape(ROWS, NEW)
    old1 = np.asarray(m1[rl_step.ROWS]["old_logp"]).reshape(ROWS, NEW)
    path = forward_path(CFG, PLEN + NEW, log_softmax=True)
    logp_tol = bound(path, float(np.abs(old0).max()) + 10.0)
    np.testing.assert_allclose(old1, old0, rtol=0, atol=logp_tol)
    # Negative control: one prompt token changed (in each group's first row, the one the
    # shared pass reads) moves that group's log-probs beyond the bound, and only theirs.
    ids = batch["ids"].at[0, PLEN - 1].set((batch["ids"][0, PLEN - 1] + 1) % 200)
    _, m2 = _grads(shared, {**batch, "ids": ids}, scores)
    moved = np.abs(np.asarray(m2[rl_step.ROWS]["old_logp"]).reshape(ROWS, NEW) - old1)
    assert moved[0].max() > 100 * logp_tol and moved[1].max() > 100 * logp_tol
    assert moved[2:].max() == 0.0


@pytest.mark.slow
def test_skipping_silent_groups_equals_the_full_update():
    plain, skip = _static(False, False), _static(False, True)
    # Some groups silent (groups 1 and 3 of 0-3), none silent.
    for scores, live in (([1, 0, 1, 1, 0, 1, 0, 0], 4), ([1, 0, 0, 1, 1, 0, 0, 1], 8)):
        batch, s = _batch(scores)
        g0, _ = _grads(plain, batch, s)
        g1, m1 = _grads(skip, batch, s)
        np.testing.assert_allclose(g1, g0, rtol=0, atol=_tol(g0))
        old = np.asarray(m1[rl_step.ROWS]["old_logp"]).reshape(ROWS, NEW)
        assert np.isnan(old).any(axis=1).sum() == ROWS - live  # the rows not run
    # All silent: no pass and no optimizer step (the plain update's gradient is exactly 0, and
    # AdamW's weight decay still moves it); the metrics say so.
    batch, s = _batch([1, 1, 0, 0, 1, 1, 0, 0])
    before = _flat(skip)
    p0, m0, prep = _step(plain, batch, s)
    p1, m1, _ = _step(skip, batch, s)
    assert float(m0["actor/grad_norm"]) == 0.0 and float(m1["actor/grad_norm"]) == 0.0
    assert np.abs(p0 - before).max() > 0
    np.testing.assert_array_equal(p1, before)
    assert float(m1["actor/rows_updated"]) == 0 and float(m1["actor/update_skipped"]) == 1
    assert np.isnan(np.asarray(m1[rl_step.OLD_LOGP])).all()
    _, m1, prep = _step(skip, *_batch([1, 0, 1, 1, 0, 1, 0, 0]))
    assert float(m1["actor/rows_updated"]) == 4 and float(m1["actor/update_skipped"]) == 0
    np.testing.assert_array_equal(np.asarray(prep["live"])[:, 0], [1, 1, 0, 0, 1, 1, 0, 0])
    # Negative control: a silent row given an advantage (the skip decides from the rewards, so
    # it still leaves that row out) moves the full gradient beyond the bound.
    batch, s = _batch([1, 0, 1, 1, 0, 1, 0, 0])
    _, _, prep = _step(plain, batch, s)
    adv = prep["advantages"].at[2].set(jnp.where(batch["rmask"][2] > 0, 1.0, 0.0))
    g0, _ = _grads(plain, batch, s, adv)
    g1, _ = _grads(skip, batch, s, adv)
    assert np.abs(g1 - g0).max() > 10 * _tol(g0)


@pytest.mark.slow
def test_shared_prompt_values_equal_the_critics_per_row_values():
    # The critic's pass (`_values`) through the shared prompt: the value head at the positions
    # P - 1 .. T - 2, as the per-row forward gives them; a prompt token changed in a group's
    # first row moves that group's values only (the negative control).
    static = _static(True, False)
    critic = rl_step.init_critic(CFG, random_params(CFG, seed=2))
    # A random value head (a fresh critic's is zero: every value 0, a vacuous comparison).
    head = np.random.default_rng(3).normal(0, 0.1, (CFG.hidden_size, 1)).astype(np.float32)
    critic["value_head"] = {"kernel": head, "bias": np.zeros(1, np.float32)}
    batch, _ = _batch([1, 0, 0, 1, 1, 1, 0, 1])
    plain = dataclasses.replace(static, share_group=1)

    def run(st):
        return jax.jit(lambda b: rl_step._values(st, critic, b, jax.random.key(0), VALUES))

    run_plain, run_shared = run(plain), run(static)
    v0, v1 = np.asarray(run_plain(batch)), np.asarray(run_shared(batch))
    assert v0.shape == (ROWS, NEW) and np.abs(v0).min() > 0
    # A value is at most sqrt(D) max|final norm gain| |head| (Cauchy-Schwarz, as
    # tolerance.logit_bound): the scale of the terms along the path.
    gain = float(np.abs(np.asarray(critic["norm"]["weight"])).max())
    scale = np.sqrt(CFG.hidden_size) * gain * float(np.linalg.norm(head))
    tol = bound(forward_path(CFG, PLEN + NEW), scale)
    np.testing.assert_allclose(v1, v0, rtol=0, atol=tol)
    ids = batch["ids"].at[0, PLEN - 1].set((batch["ids"][0, PLEN - 1] + 1) % 200)
    moved = np.abs(np.asarray(run_shared({**batch, "ids": ids})) - v1).max(axis=1)
    assert moved[:N].min() > 10 * tol and moved[N:].max() == 0.0
