"""The jitted KV-cache sampler against uncached forwards: greedy, logprobs, EOS, keys, buckets,
faults during rollout."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from aqn_jax.faults.intercept import FaultPlan, Injection
from aqn_jax.faults.sites import SiteSelector
from aqn_jax.faults.transforms import Deadzone, Noise, Scale
from aqn_jax.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from aqn_jax.rl import sampler as sampler_mod
from aqn_jax.rl.sampler import Sampler, SamplingParams

from conftest import left_padded_batch, random_params
from tolerance import bound, forward_path, logit_bound

CONFIG = Qwen2Config.tiny(num_hidden_layers=3)
MODEL = Qwen2ForCausalLM(CONFIG)
WEIGHTS = random_params(CONFIG, seed=0)
VOCAB = 200  # the tokenizer's ids; the model's vocab (256) is padded beyond them
LENGTHS = (7, 3, 10)
BUCKETS = (16, 32)
NEW = 6


def prompts(lengths=LENGTHS, total=None, seed=0):
    ids, mask, _ = left_padded_batch(
        np.random.RandomState(seed), VOCAB, lengths, total or max(lengths)
    )
    return ids.astype(np.int32), mask.astype(np.int32)


def sampler(**kw):
    params = dict(max_new_tokens=NEW, eos_id=1, pad_id=0, temperature=0.0, vocab_size=VOCAB)
    plan = kw.pop("plan", None)
    params.update(kw)
    return Sampler(MODEL, SamplingParams(**params), plan=plan, buckets=BUCKETS)


# Jitted: one compile per sequence length (op-by-op dispatch compiled every op of every
# length, ~30 s of the greedy test); still the plain uncached forward, no cache or sampler.
_forward = jax.jit(
    lambda params, ids, mask: MODEL.apply({"params": params}, ids, attention_mask=mask)
)


def full_logits(ids, mask):
    return np.asarray(_forward(WEIGHTS, ids, mask))


@pytest.mark.slow
def test_greedy_equals_stepwise_argmax_of_uncached_forward():
    ids, mask = prompts()
    out = sampler(eos_id=-1)(WEIGHTS, ids, mask, jax.random.key(0))
    seq, seq_mask = out.prompt_ids, out.prompt_mask
    L = seq.shape[1]
    for t in range(NEW):
        # The prefix right-padded to the final length (masked slots after it: the causal
        # forward's logits at its last token do not read them), so one program serves every step.
        pad = ((0, 0), (0, NEW - t))
        logits = full_logits(np.pad(seq, pad), np.pad(seq_mask, pad))[:, L + t - 1, :VOCAB]
        np.testing.assert_array_equal(out.tokens[:, t], logits.argmax(-1))
        seq = np.concatenate([seq, out.tokens[:, t : t + 1]], axis=1)
        seq_mask = np.concatenate([seq_mask, np.ones((len(seq), 1), np.int32)], axis=1)
    assert out.response_mask.all()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9), (0.0, 0, 1.0)])
def test_logprobs_equal_teacher_forced_forward(temperature, top_k, top_p):
    ids, mask = prompts()
    sp = dict(temperature=temperature, top_k=top_k, top_p=top_p, n=2, eos_id=-1)
    out = sampler(**sp)(WEIGHTS, ids, mask, jax.random.key(1))
    seq = np.concatenate([out.prompt_ids, out.tokens], axis=1)
    seq_mask = np.concatenate([out.prompt_mask, out.response_mask], axis=1)
    L = out.prompt_ids.shape[1]
    logits = full_logits(seq, seq_mask)[:, L - 1 : -1] / (temperature or 1.0)
    logp = jax.nn.log_softmax(logits, axis=-1)
    teacher = np.take_along_axis(np.asarray(logp), out.tokens[..., None], axis=-1)[..., 0]
    real = out.response_mask.astype(bool)
    assert real.all()
    # Cached decode against one uncached forward: two programs, f32 rounding along the forward
    # (tests/tolerance.py) at the scale of the largest (tempered) logit.
    tol = bound(forward_path(CONFIG, seq.shape[1], log_softmax=True), np.abs(logits).max())
    np.testing.assert_allclose(out.logprobs[real], teacher[real], atol=tol, rtol=0)
    assert out.tokens.max() < VOCAB  # padded-vocab ids are never sampled
    # n samples per prompt: rows b*n .. b*n+n-1 share prompt b.
    np.testing.assert_array_equal(out.prompt_ids[0], out.prompt_ids[1])
    assert out.tokens.shape == (len(LENGTHS) * 2, NEW)


def test_eos_stops_each_sequence_independently():
    ids, mask = prompts()
    free = sampler(eos_id=-1)(WEIGHTS, ids, mask, jax.random.key(0))
    # Make the token sequence 0 emits at step 2 the EOS: it stops there (or where it first
    # produced that token); the others stop at their first occurrence, if any.
    eos = int(free.tokens[0, 2])
    out = sampler(eos_id=eos)(WEIGHTS, ids, mask, jax.random.key(0))
    for row in range(len(LENGTHS)):
        hits = np.flatnonzero(free.tokens[row] == eos)
        stop = hits[0] + 1 if len(hits) else NEW  # EOS itself is part of the response
        np.testing.assert_array_equal(out.response_mask[row], np.arange(NEW) < stop)
        np.testing.assert_array_equal(out.tokens[row, :stop], free.tokens[row, :stop])
        assert (out.tokens[row, stop:] == 0).all() and (out.logprobs[row, stop:] == 0).all()
    assert out.response_mask.sum(1).min() < out.response_mask.sum(1).max()  # really independent


def test_stop_ids_end_rows_and_ended_says_which():
    # A model's generation config may list several end-of-turn ids (Qwen2.5-Instruct: 151645
    # and 151643): a row ends on any of them, and `ended` is the rows that stopped (what the
    # clip metrics read). Negative control: with eos alone the rows run on.
    ids, mask = prompts()
    free = sampler(eos_id=-1)(WEIGHTS, ids, mask, jax.random.key(0))
    assert not free.ended.any()  # nothing stops: every row ran to the cap
    stop = int(free.tokens[1, 1])
    out = sampler(eos_id=-1, stop_ids=(stop,))(WEIGHTS, ids, mask, jax.random.key(0))
    for row in range(len(LENGTHS)):
        hits = np.flatnonzero(free.tokens[row] == stop)
        end = hits[0] + 1 if len(hits) else NEW
        np.testing.assert_array_equal(out.response_mask[row], np.arange(NEW) < end)
        assert out.ended[row] == bool(len(hits))
    assert out.ended[1] and out.response_mask[1].sum() <= 2


def test_same_key_same_samples_and_different_key_differs():
    ids, mask = prompts()
    s = sampler(temperature=1.0, n=3)
    a = s(WEIGHTS, ids, mask, jax.random.key(5))
    b = s(WEIGHTS, ids, mask, jax.random.key(5))
    c = s(WEIGHTS, ids, mask, jax.random.key(6))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert (a.tokens != c.tokens).any()
    assert (a.tokens[0] != a.tokens[1]).any()  # the n samples of one prompt differ


@pytest.mark.slow
def test_top_k_one_and_tiny_top_p_are_greedy():
    ids, mask = prompts()
    greedy = sampler()(WEIGHTS, ids, mask, jax.random.key(0)).tokens
    np.testing.assert_array_equal(
        sampler(temperature=1.0, top_k=1)(WEIGHTS, ids, mask, jax.random.key(3)).tokens, greedy
    )
    np.testing.assert_array_equal(
        sampler(temperature=1.0, top_p=1e-6)(WEIGHTS, ids, mask, jax.random.key(3)).tokens, greedy
    )


@pytest.mark.slow
def test_no_retrace_within_a_bucket():
    s = sampler()
    for lengths in [(7, 3, 10), (12, 5, 13), (16, 1, 2)]:  # all fit bucket 16
        ids, mask = prompts(lengths)
        out = s(WEIGHTS, ids, mask, jax.random.key(0))
        assert out.prompt_ids.shape == (3, 16)
    assert s.traces == 1
    ids, mask = prompts((20, 4, 9))  # bucket 32
    s(WEIGHTS, ids, mask, jax.random.key(0))
    assert s.traces == 2
    with pytest.raises(ValueError, match="prompt length 40 exceeds the largest bucket 32"):
        s(WEIGHTS, *prompts((40, 2, 2)), jax.random.key(0))


def test_deadzone_plan_acts_during_rollout():
    plan = FaultPlan(
        [Injection("dz", SiteSelector(("layer",), (1,)), Deadzone(0.5), phases=("rollout",))]
    )
    ids, mask = prompts()
    clean = sampler()(WEIGHTS, ids, mask, jax.random.key(0))
    faulty = sampler(plan=plan)(WEIGHTS, ids, mask, jax.random.key(0))
    assert (faulty.tokens != clean.tokens).any()
    # Telemetry is sown per hit site: the deadzone acted at layer 1's output and nowhere else.
    assert set(faulty.fault_stats) == {"layers_1"} and set(faulty.fault_stats["layers_1"]) == {
        "dz.flushed"
    }
    flushed = faulty.fault_stats["layers_1"]["dz.flushed"][0]
    assert 0.0 < float(flushed) < 1.0
    # A plan for other phases leaves the rollout clean.
    train_only = FaultPlan(
        [Injection("dz", SiteSelector(("layer",), (1,)), Deadzone(0.5), phases=("train",))]
    )
    same = sampler(plan=train_only)(WEIGHTS, ids, mask, jax.random.key(0))
    np.testing.assert_array_equal(same.tokens, clean.tokens)


@pytest.mark.slow
def test_shared_prompt_prefill_equals_one_prefill_per_row():
    # One prefill per distinct prompt, broadcast to its n rows, against a prefill of every row:
    # the same greedy tokens and log-probs under a deterministic fault whose call-wide amax
    # (scope 'call') sees the duplicated rows or not.
    dz = Deadzone(0.3, scope="call")
    plan = FaultPlan([Injection("dz", SiteSelector(("layer",), (1,)), dz, phases=("rollout",))])
    ids, mask = prompts()
    shared = sampler(n=3, plan=plan)
    assert shared._spec.share and not shared.unshared
    rowwise = sampler(n=3, plan=plan, share_prompt=False)
    assert not rowwise._spec.share
    a = shared(WEIGHTS, ids, mask, jax.random.key(0))
    b = rowwise(WEIGHTS, ids, mask, jax.random.key(0))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    # The same cached decode over [B*n] rows; only the prefill's batch differs (its products
    # may be blocked differently): f32 rounding along the path at the logits' scale.
    tol = bound(
        forward_path(CONFIG, BUCKETS[0] + NEW, log_softmax=True), logit_bound(CONFIG, WEIGHTS)
    )
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=tol, rtol=0)
    np.testing.assert_allclose(
        a.fault_stats["layers_1"]["dz.flushed"][0],
        b.fault_stats["layers_1"]["dz.flushed"][0],
        atol=1.0 / (len(LENGTHS) * BUCKETS[0] * CONFIG.hidden_size),
    )
    # Negative control: one prompt token changed, and that group's samples differ.
    ids2 = ids.copy()
    ids2[0, -1] = (ids2[0, -1] + 1) % VOCAB
    c = shared(WEIGHTS, ids2, mask, jax.random.key(0))
    assert np.abs(c.logprobs[:3] - a.logprobs[:3]).max() > tol
    np.testing.assert_array_equal(c.tokens[3:], a.tokens[3:])


def prefixed(own=(7, 3, 10), common=20, seed=1):
    """Left-padded prompts that all start with the same `common` tokens, then their own."""
    rng = np.random.RandomState(seed)
    head = rng.randint(2, VOCAB, common)
    rows = [np.concatenate([head, rng.randint(2, VOCAB, n)]) for n in own]
    L = max(len(r) for r in rows)
    ids = np.zeros((len(rows), L), np.int32)
    mask = np.zeros((len(rows), L), np.int32)
    for i, r in enumerate(rows):
        ids[i, L - len(r) :], mask[i, L - len(r) :] = r, 1
    return ids, mask


def test_shared_prefix_len_and_layout():
    ids, mask = prefixed(common=20)
    assert sampler_mod.shared_prefix_len(ids, mask) == 16  # 20 common, rounded down to 16
    assert sampler_mod.shared_prefix_len(*prefixed(common=15)) == 0
    assert sampler_mod.shared_prefix_len(ids[:1], mask[:1]) == 0  # one prompt: nothing to share
    # Every row keeps one token of its own: a prompt that is all prefix shares one token less.
    same = np.tile(ids[2:3], (2, 1))
    assert sampler_mod.shared_prefix_len(same, mask[2:3].repeat(2, 0)) == 16  # 30 tokens: 29 -> 16
    prefix, own, own_mask = sampler_mod.split_prefix(ids, mask, 16, 32)
    assert prefix.shape == (1, 16) and own.shape == own_mask.shape == (3, 16)
    for i in range(3):
        real = ids[i][mask[i] > 0]
        np.testing.assert_array_equal(np.concatenate([prefix[0], own[i][own_mask[i] > 0]]), real)
        assert own_mask[i, -1] == 1 and own_mask[i].sum() == len(real) - 16  # left-padded


@pytest.mark.parametrize("fault", [None, "token"])
@pytest.mark.parametrize("n", [1, 3])
def test_shared_prefix_gives_the_greedy_tokens_of_a_whole_prefill(fault, n):
    # The prefix every prompt starts with, prefilled once and broadcast, then each row's own
    # tokens: the same greedy tokens as prefilling every prompt whole, with no fault and with a
    # deterministic per-token deadzone (scope 'token': each token's flush is its own).
    plan = None
    if fault:
        dz = Deadzone(0.3, scope=fault)
        plan = FaultPlan([Injection("dz", SiteSelector(("layer",), (1,)), dz, phases=("rollout",))])
    ids, mask = prefixed()
    on = sampler(n=n, plan=plan, temperature=0.0)
    off = sampler(n=n, plan=plan, temperature=0.0, share_prefix=False)
    assert not on.prefix_refused and off.prefix_refused == ["config.rollout.share_prefix=False"]
    a = on(WEIGHTS, ids, mask, jax.random.key(0))
    b = off(WEIGHTS, ids, mask, jax.random.key(0))
    assert on.prefix_calls == 1 and off.prefix_calls == 0
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)  # the train rows: today's layout
    # The same products over other slots (the padding moved after the prefix) and batches:
    # f32 rounding along the path at the logits' scale.
    tol = bound(
        forward_path(CONFIG, BUCKETS[1] + NEW, log_softmax=True), logit_bound(CONFIG, WEIGHTS)
    )
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=tol, rtol=0)
    # (The telemetry is a mean over every slot, padding included, and a padding query now
    # sees the prefix: the flushed share differs by what the padding slots flush.)
    # Negative control: one prefix token changed in row 0 only: nothing is shared beyond it,
    # and row 0's result differs from what the shared prefix gave.
    ids2 = ids.copy()
    ids2[0, np.flatnonzero(mask[0])[3]] += 1
    c = on(WEIGHTS, ids2, mask, jax.random.key(0))
    assert on.prefix_calls == 1  # no shared prefix: the whole prefill
    assert np.abs(c.logprobs[:n] - a.logprobs[:n]).max() > tol


def test_shared_prefix_is_off_where_it_would_change_the_values():
    # A call-wide statistic, or a draw per call: one line naming the injection.
    for t, why in (
        (Deadzone(0.3, scope="call"), "a statistic over the whole call"),
        (Noise("relative_gaussian", Scale(0.1)), "draws its values per call"),
    ):
        plan = FaultPlan([Injection("f", SiteSelector(("layer",), (1,)), t, phases=("rollout",))])
        s = sampler(plan=plan)
        assert len(s.prefix_refused) == 1 and why in s.prefix_refused[0]
        ids, mask = prefixed()
        s(WEIGHTS, ids, mask, jax.random.key(0))
        assert s.prefix_calls == 0


def test_retire_sizes_halve_down_to_the_floor():
    assert sampler_mod.RETIRE_MIN_ROWS == 8
    assert sampler_mod.retire_sizes(32) == (32, 16, 8)
    assert sampler_mod.retire_sizes(40) == (40, 20, 10)  # 5 is below the floor
    assert sampler_mod.retire_sizes(12) == (12,)  # 6 is below the floor
    assert sampler_mod.retire_sizes(9) == (9,)  # odd: no half
    assert sampler_mod.retire_sizes(64, divisor=2) == (64, 32, 16, 8)
    assert sampler_mod.retire_sizes(48, divisor=16) == (48,)  # 24 does not split over 16


def early_stops(rows=32, new=12):
    """Prompts of `rows` lengths and stop ids that end most rows in the first steps: the ids
    the first 20 rows emit at step 1 without any stop id (random weights rarely stop)."""
    lengths = tuple(np.random.RandomState(3).randint(3, 15, rows))
    ids, mask = prompts(lengths)
    free = sampler(eos_id=-1, max_new_tokens=new)(WEIGHTS, ids, mask, jax.random.key(0))
    return ids, mask, tuple(sorted({int(x) for x in free.tokens[:20, 1]}))


@pytest.mark.parametrize("fault", [None, "token"])
def test_retired_rows_give_the_greedy_tokens_of_the_full_batch(fault):
    # 32 rows, most of which stop within a few steps: the decode goes on at 16 rows, then 8,
    # and every row's tokens, end and mask are those of decoding all 32 to the end, with no
    # fault and with a deterministic per-token deadzone.
    plan = None
    if fault:
        dz = Deadzone(0.3, scope=fault)
        plan = FaultPlan([Injection("dz", SiteSelector(("layer",), (1,)), dz, phases=("rollout",))])
    new = 12
    ids, mask, stops = early_stops(new=new)
    kw = dict(eos_id=-1, stop_ids=stops, max_new_tokens=new, plan=plan)
    on, off = sampler(**kw, retire_rows=True), sampler(**kw)
    assert on._spec.retire and not on.retire_refused
    assert off.retire_refused == ["config.rollout.retire_rows=False"]
    a = on(WEIGHTS, ids, mask, jax.random.key(0))
    b = off(WEIGHTS, ids, mask, jax.random.key(0))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.response_mask, b.response_mask)
    np.testing.assert_array_equal(a.ended, b.ended)
    assert 8 <= b.ended.sum() < 32  # rows stop early, and some run to the cap
    # The same products for a row over batches of other sizes: f32 rounding along the path.
    path = forward_path(CONFIG, BUCKETS[0] + new, log_softmax=True)
    tol = bound(path, logit_bound(CONFIG, WEIGHTS))
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=tol, rtol=0)
    # Not vacuous: the full batch computed 32 rows at every step it ran, the retiring one 16
    # from the first step that 16 or fewer rows ran, 8 from the first that 8 or fewer did.
    live = b.response_mask.sum(0)  # rows live at each step
    steps = int((live > 0).sum())
    assert b.row_steps == 32 * steps
    kept = np.where(live[:steps] > 16, 32, np.where(live[:steps] > 8, 16, 8))
    assert a.row_steps == kept.sum() < b.row_steps


def test_retiring_is_off_where_it_would_change_the_values():
    # Sampled tokens are drawn over the whole batch; a call-wide statistic or a draw per call
    # changes with the rows of a call: one line each, and every row decoded to the end.
    sampled = sampler(retire_rows=True, temperature=1.0)
    assert not sampled._spec.retire and "draws over the batch" in sampled.retire_refused[0]
    for t, why in (
        (Deadzone(0.3, scope="call"), "a statistic over the whole call"),
        (Noise("relative_gaussian", Scale(0.1)), "draws its values per call"),
    ):
        plan = FaultPlan([Injection("f", SiteSelector(("layer",), (1,)), t, phases=("rollout",))])
        s = sampler(plan=plan, retire_rows=True)
        assert not s._spec.retire and len(s.retire_refused) == 1 and why in s.retire_refused[0]
        ids, mask, stops = early_stops()
        s = sampler(plan=plan, retire_rows=True, eos_id=-1, stop_ids=stops, max_new_tokens=12)
        out = s(WEIGHTS, ids, mask, jax.random.key(0))
        assert out.row_steps == 32 * int(out.response_mask.sum(0).astype(bool).sum())


def test_norm_weight_noise_is_drawn_once_per_rollout():
    # AQN's norm-weight noise (QeRL's form) models the weights the rollout device holds: one
    # draw for the prefill and every decode step. The sampler's log-probs then equal one
    # teacher-forced forward under that draw (the values' DRAW_KEY, the rollout's fault key);
    # the negative control: the forward drawing its own weights differs beyond the bound.
    from aqn_jax.faults.transforms import DRAW_KEY, NormWeightNoise, Scale
    from aqn_jax.forward import forward

    aqn = NormWeightNoise(Scale(0.1))
    plan = FaultPlan([Injection("aqn", SiteSelector(("rmsnorm",)), aqn, phases=("rollout",))])
    ids, mask = prompts()
    fault_key = jax.random.key(11)
    out = sampler(plan=plan)(WEIGHTS, ids, mask, jax.random.key(0), fault_key=fault_key)
    seq = np.concatenate([out.prompt_ids, out.tokens], axis=1)
    seq_mask = np.concatenate([out.prompt_mask, out.response_mask], axis=1)
    L = out.prompt_ids.shape[1]

    def teacher(values):
        logits = forward(
            MODEL,
            WEIGHTS,
            seq,
            seq_mask,
            plan=plan,
            phase="rollout",
            key=jax.random.key(5),
            values=values,
        )
        logp = jax.nn.log_softmax(np.asarray(logits)[:, L - 1 : -1], axis=-1)
        return np.take_along_axis(np.asarray(logp), out.tokens[..., None], axis=-1)[..., 0]

    real = out.response_mask.astype(bool)
    # The final norm's gain under noise: |g + 0.1 z| <= 2 max|g| for |z| <= 10 (g = 1 here).
    tol = bound(
        forward_path(CONFIG, seq.shape[1], log_softmax=True), 2 * logit_bound(CONFIG, WEIGHTS)
    )
    same = teacher({DRAW_KEY: jax.random.key_data(fault_key)})
    np.testing.assert_allclose(out.logprobs[real], same[real], atol=tol, rtol=0)
    own = teacher({})
    assert np.abs(out.logprobs[real] - own[real]).max() > 10 * tol


def test_call_wide_quantile_keeps_one_prefill_per_row():
    # A quantile over the call's values counts each duplicated row: sharing would change it.
    dz = Deadzone(0.3, severity="quantile", scope="call")
    plan = FaultPlan([Injection("dz", SiteSelector(("layer",), (1,)), dz, phases=("rollout",))])
    s = sampler(n=2, plan=plan)
    assert not s._spec.share and s.unshared == [
        "dz: a statistic over the whole call (quantile, scope='call')"
    ]


MESH = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, {tests!r})
    import ml_collections
    from test_sampler import MODEL, WEIGHTS, prefixed, prompts, sampler
    from aqn_jax import parallel
    from aqn_jax.faults.intercept import FaultPlan, Injection
    from aqn_jax.faults.sites import SiteSelector
    from aqn_jax.faults.transforms import Deadzone
    from aqn_jax.rl import advantages as A
    from aqn_jax.rl.sampler import Sampler, SamplingParams

    assert len(jax.devices()) == 2
    cfg = ml_collections.ConfigDict(dict(data=2, fsdp=1, tensor=1))
    mesh = parallel.make_mesh(cfg)
    dz = Deadzone(0.3, scope="call")
    plan = FaultPlan([Injection("dz", SiteSelector(("layer",), (1,)), dz, phases=("rollout",))])
    sp = dict(max_new_tokens=6, eos_id=-1, pad_id=0, temperature=0.0, vocab_size=200)
    out = {{}}
    # 3 prompts x 2 (the prompts replicated: 3 do not split over 2 devices), 2 x 3 (a prompt a
    # device, each group's rows on one device)
    for lengths, n in (((7, 3, 10), 2), ((7, 3), 3)):
        ids, mask = prompts(lengths)
        got = []
        for share in (True, False):
            params = SamplingParams(**sp, n=n, share_prompt=share)
            s = Sampler(MODEL, params, plan, (16,), mesh=mesh)
            assert s._spec.share == share
            got.append(s(WEIGHTS, ids, mask, jax.random.key(0)))
        np.testing.assert_array_equal(got[0].tokens, got[1].tokens)
        out[len(lengths)] = float(np.abs(got[0].logprobs - got[1].logprobs).max())
    # The shared prefix on the mesh (a deterministic per-token deadzone): 4 prompts x 2 over
    # the two devices, the prefix replicated, the same greedy tokens as whole prefills.
    tok = FaultPlan([Injection("dz", SiteSelector(("layer",), (1,)), Deadzone(0.3, scope="token"),
                               phases=("rollout",))])
    ids, mask = prefixed(own=(7, 3, 10, 5))
    got = []
    for share in (True, False):
        s = Sampler(MODEL, SamplingParams(**sp, n=2, share_prefix=share), tok, (32,), mesh=mesh)
        got.append(s(WEIGHTS, ids, mask, jax.random.key(0)))
        assert s.prefix_calls == int(share)
    np.testing.assert_array_equal(got[0].tokens, got[1].tokens)
    out["prefix"] = float(np.abs(got[0].logprobs - got[1].logprobs).max())
    # Finished rows retired on the mesh: 32 rows over the two devices (levels 32, 16, 8, each
    # split over both), the same greedy tokens and ends as decoding every row to the end.
    from test_sampler import early_stops
    ids, mask, stops = early_stops()
    got = []
    for retire in (True, False):
        params = SamplingParams(**dict(sp, max_new_tokens=12), stop_ids=stops, retire_rows=retire)
        s = Sampler(MODEL, params, tok, (16,), mesh=mesh)
        got.append(s(WEIGHTS, ids, mask, jax.random.key(0)))
    np.testing.assert_array_equal(got[0].tokens, got[1].tokens)
    np.testing.assert_array_equal(got[0].ended, got[1].ended)
    assert got[0].row_steps < got[1].row_steps, (got[0].row_steps, got[1].row_steps)
    # Silent groups' advantages exactly 0 on the mesh (rows split over both devices).
    for n in (3, 5, 7):
        scores = np.ones(4 * n, np.float32)
        scores[0] = 0.0  # group 0 live: the negative control
        x = jax.device_put(scores, parallel.batch_sharding(mesh, 1))
        m = jax.device_put(np.ones((4 * n, 2), np.float32), parallel.batch_sharding(mesh, 2))
        adv = np.asarray(jax.jit(A.grpo_outcome_advantage, static_argnums=2)(x, m, n))
        assert np.all(adv[n:] == 0.0) and np.all(adv[:n] != 0.0), n
    print("MAXDIFF", out[3], out[2], out["prefix"])
    """
)


@pytest.mark.slow
def test_shared_prefill_on_a_two_device_mesh(tmp_path):
    # The rows over two devices (3 prompts x 2: the prompts replicated, then 2 x 3: one
    # prompt a device): the same greedy tokens as a prefill per row, and the jitted
    # advantages of silent groups exactly 0 on the mesh.
    tests = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "mesh.py"
    script.write_text(MESH.format(tests=tests))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = [float(x) for x in proc.stdout.split("MAXDIFF")[1].split()]
    tol = bound(
        forward_path(CONFIG, BUCKETS[1] + NEW, log_softmax=True), logit_bound(CONFIG, WEIGHTS)
    )
    assert max(diffs) <= tol


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="top_p=1.5; must be in"):
        SamplingParams(max_new_tokens=4, eos_id=1, pad_id=0, top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        SamplingParams(max_new_tokens=0, eos_id=1, pad_id=0)


def test_task_batches_through_the_sampler_to_rewards(tmp_path):
    """The embedded task end to end: verl parquet -> PromptBatcher -> Sampler -> verl reward."""
    from aqn_jax.data.arithmetic import ArithmeticTask
    from aqn_jax.data.gsm8k import PromptBatcher, load_verl_parquet
    from aqn_jax.data.tokenizers import CharTokenizer
    from aqn_jax.rewards import score_batch

    tok = CharTokenizer()
    path = ArithmeticTask().write_parquet(tmp_path / "train.parquet", "train", 12)
    batcher = PromptBatcher(
        load_verl_parquet(path), tok, batch_size=4, seed=0, max_prompt_len=128, buckets=(128,)
    )
    batch = batcher.next_batch()
    s = Sampler(
        MODEL,
        SamplingParams(
            max_new_tokens=8, eos_id=tok.eos_id, pad_id=tok.pad_id, n=2, vocab_size=tok.vocab_size
        ),
        buckets=(128,),
    )
    out = s(WEIGHTS, batch["input_ids"], batch["attention_mask"], jax.random.key(0))
    rows = zip(out.tokens, out.response_mask, strict=True)
    texts = [tok.decode(row[m.astype(bool)]) for row, m in rows]
    truths = [gt for gt in batch["ground_truth"] for _ in range(2)]
    rewards = score_batch(texts, truths)
    assert rewards.shape == (8,) and set(np.unique(rewards)) <= {0.0, 1.0}
    # A response that is the right answer scores 1 through the same path.
    assert score_batch([f"#### {truths[0]}"], [truths[0]])[0] == 1.0
