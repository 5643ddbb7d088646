"""The on-policy shortcut (`config.actor.old_logp_pass='auto'`): with one PPO epoch, one
mini-batch and no correction, the update's own log-probs, detached, are the old policy (TRL's and
verl's shortcut) and the separate old-log-prob pass is left out. Against the two-pass path
(`'always'`) on the same batch: the same loss, the same gradient, the same old log-probs, and a
PPO ratio of exactly 1. Tiny shapes (3 layers, 4 rows of 8 + 6 tokens), the faulty device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqn_jax import parallel
from aqn_jax.aqn.config import AQN_SIGMA
from aqn_jax.aqn.plan import build_plan
from aqn_jax.faults.config import fault_plan
from aqn_jax.forward import forward
from aqn_jax.models.qwen2 import Qwen2Config
from aqn_jax.rl import step as rl_step
from aqn_jax.spec import step_spec

from conftest import load_config, random_params, shallow
from tolerance import bound, forward_path

CFG = Qwen2Config.tiny(num_hidden_layers=3)
PLEN, NEW, ROWS = 8, 6, 4
VALUES = {AQN_SIGMA: np.float32(0.0)}


def _static(old_logp_pass: str, mini_batch_prompts: int = 2):
    # deadzone: the quantile deadzone at layer 1 of 3, deterministic, in every pass
    config = shallow(load_config("deadzone"))
    config.rollout.max_new_tokens = NEW
    config.rollout.n = 2
    config.data_batch.prompts = 2
    config.actor.mini_batch_prompts = mini_batch_prompts
    config.actor.micro_batch_rows = 2
    config.actor.old_logp_pass = old_logp_pass
    config.algo.use_kl_loss = False  # no reference pass (it is the same either way)
    n = CFG.num_hidden_layers
    plan, hw = build_plan(config.faults, config.aqn, n), fault_plan(config.faults, n)
    return rl_step.static_from(step_spec(config), CFG, plan, hw, 4)


def _state(static, params):
    mesh = parallel.make_mesh(shallow(load_config("deadzone")).mesh, jax.devices()[:1])
    state, _ = rl_step.init_state(static, params, rl_step.shardings(static, mesh))
    return state


def _batch():
    r = np.random.default_rng(0)
    ids = r.integers(3, 200, (ROWS, PLEN + NEW)).astype(np.int32)
    rmask = np.ones((ROWS, NEW), np.int32)
    rmask[1, 3:] = 0
    batch = dict(ids=ids, mask=np.ones_like(ids), tokens=ids[:, PLEN:], rmask=rmask)
    return jax.tree_util.tree_map(jnp.asarray, batch), jnp.asarray([1.0, 0.0, 0.0, 1.0])


def _prepare(static, state, batch, scores):
    fn = jax.jit(lambda *a: rl_step.prepare_step(static, *a))
    out, _ = fn(state, None, batch, scores, jax.random.key(3), VALUES)
    return out


@functools.cache  # one program per static: the negative control reuses the two-pass one
def _grads_fn(static):
    return jax.jit(lambda p, m: rl_step.minibatch_grads(static, p, m, jax.random.key(3), 0, VALUES))


def _grads(static, params, mb):
    fn = _grads_fn(static)
    # the update's grouping: [micro-batches, rows, ...] of the one mini-batch (a tensor-wide
    # fault statistic, the quantile deadzone's, sees the same rows as in prepare's chunks)
    g, mets, _ = fn(
        params, jax.tree_util.tree_map(lambda x: x[0], rl_step.mini_batches(static, mb))
    )
    return np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(g)]), mets


def test_which_updates_take_the_shortcut():
    assert _static("auto").fused_old_logp
    assert not _static("always").fused_old_logp
    assert not _static("auto", mini_batch_prompts=1).fused_old_logp  # two mini-batches
    with pytest.raises(ValueError, match=r"config.actor.old_logp_pass='sometimes'; allowed"):
        _static("sometimes")


@pytest.mark.slow
def test_shortcut_equals_the_two_pass_update():
    fused, two = _static("auto"), _static("always")
    params = random_params(CFG, seed=1)
    state = _state(two, params)
    batch, scores = _batch()

    # The two-pass path: prepare runs the policy forward; the fused one leaves it out.
    prep2, prep1 = _prepare(two, state, batch, scores), _prepare(fused, state, batch, scores)
    assert "old_logp" in prep2 and "old_logp" not in prep1 and "entropy" not in prep1
    np.testing.assert_array_equal(prep1["advantages"], prep2["advantages"])  # scores only

    mb = {**batch, "advantages": prep2["advantages"]}
    g2, m2 = _grads(two, state.params, {**mb, "old_logp": prep2["old_logp"]})
    g1, m1 = _grads(fused, state.params, mb)
    # Exactly on-policy: the ratio is exp(logp - stop_gradient(logp)) = 1 for every token.
    assert float(m1["ppo_kl"]) == 0.0 and float(m1["pg_clipfrac"]) == 0.0
    # The two-pass ratio is 1 up to the two programs' rounding (prepare's forward is fused
    # differently from the update's value_and_grad): a log-prob is within the f32 bound of the
    # forward's reduction path with the log-softmax, at the scale of the logits.
    logits = forward(
        two.policy,
        state.params,
        batch["ids"],
        batch["mask"],
        plan=two.plan,
        phase="train",
        key=jax.random.key(3),
        values=VALUES,
    )
    logits = rl_step.response_logits(logits, PLEN, NEW)
    path = forward_path(CFG, PLEN + NEW, log_softmax=True)
    logp_tol = bound(path, float(jnp.abs(logits).max()))
    old1 = m1[rl_step.ROWS]["old_logp"].reshape(ROWS, NEW)
    np.testing.assert_allclose(old1, prep2["old_logp"], rtol=0, atol=logp_tol)
    assert abs(float(m1["pg_loss"]) - float(m2["pg_loss"])) <= logp_tol
    # The gradient: -A * ratio * dlogp with ratio 1 against 1 + O(logp_tol); each entry within
    # the backward's path (twice the forward's) at the gradient's largest entry.
    scale = float(np.abs(g2).max())
    np.testing.assert_allclose(g1, g2, rtol=0, atol=bound(2 * path, scale) + logp_tol * scale)
    # Negative control: an old policy 0.5 nats too low on one row puts its ratio at 1.65,
    # outside the clip, so that row's gradient is dropped: a difference the bound tells apart.
    off = prep2["old_logp"].at[0].add(-0.5)
    g_off, _ = _grads(two, state.params, {**mb, "old_logp": off})
    assert np.abs(g_off - g2).max() > 10 * (bound(2 * path, scale) + logp_tol * scale)
    # What the left-out pass gave the trainer comes with the update: the train pass's fault
    # statistics (the deadzone at layer 1 flushed a share of its output, as in prepare's).
    stats = jax.tree_util.tree_leaves(m1[rl_step.FAULT_STATS])
    assert stats and any(0.0 < float(np.max(v)) < 1.0 for v in stats)
