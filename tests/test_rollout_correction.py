"""Rollout correction (aqn_jax/rl/rollout_correction.py) against verl's formulas computed by hand
on small arrays, its negative controls, and the mismatch scenarios end to end.

The running example (N = 2 responses, T = 3 slots; the second response has one token):

    log π_train   = [[-1.0, -2.0, pad], [-0.5, pad, pad]]
    log π_rollout = [[-1.5, -1.0, pad], [-0.5, pad, pad]]
    log ρ         = [[ 0.5, -1.0,  - ], [ 0.0,  - ,  - ]]
"""

import dataclasses
import json
import math
import threading

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from aqn_jax.rl import losses
from aqn_jax.rl.config import correction_config
from aqn_jax.rl.rollout_correction import (
    CORRECTIONS,
    LEVELS,
    PRESETS,
    RolloutCorrection,
    correct,
    correction_from,
    mismatch_metrics,
)

from conftest import load_config, lowered_during_step_1

TRAIN = np.array([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], np.float32)
ROLLOUT = np.array([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0]], np.float32)
MASK = np.array([[1, 1, 0], [1, 0, 0]], np.int32)
e = math.e


def rc(**kw):
    return RolloutCorrection(**kw)


def test_token_tis_weights_and_statistics_by_hand():
    out = correct(TRAIN, ROLLOUT, MASK, rc(rollout_is="token", rollout_is_threshold=2.0))
    # w = min(ρ, 2) on valid tokens, 0 on padding.
    expect = [[e**0.5, e**-1, 0.0], [1.0, 0.0, 0.0]]
    np.testing.assert_allclose(out.is_weights, expect, rtol=1e-6)
    assert out.loss_mask is None and out.old_logp is None
    m = out.metrics
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((e**0.5 + e**-1 + 1) / 3, rel=1e-6)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(e**0.5, rel=1e-6)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(e**-1, rel=1e-6)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0  # none above C = 2
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)  # e^-1 < 1/2
    # std and ESS on weights clamped to [1/C, C] = [0.5, 2]: (e^0.5, 0.5, 1).
    c = np.array([e**0.5, 0.5, 1.0])
    mean, sq = c.mean(), (c**2).mean()
    assert m["rollout_corr/rollout_is_std"] == pytest.approx(math.sqrt(sq - mean**2), rel=1e-5)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(mean**2 / sq, rel=1e-5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0


def test_sequence_tis_and_batch_normalisation_by_hand():
    out = correct(TRAIN, ROLLOUT, MASK, rc(rollout_is="sequence", rollout_is_threshold=2.0))
    # Row weights exp(Σ log ρ): exp(-0.5) and exp(0), broadcast over the row's tokens.
    np.testing.assert_allclose(out.is_weights, [[e**-0.5] * 2 + [0], [1, 0, 0]], rtol=1e-6)
    m = out.metrics
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(1.0)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(e**-0.5, rel=1e-6)
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == 0.0  # e^-0.5 = 0.61 >= 0.5
    # Batch normalisation at the sequence level: the mean of the per-row weights.
    norm = correct(
        TRAIN,
        ROLLOUT,
        MASK,
        rc(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True),
    )
    factor = (e**-0.5 + 1.0) / 2
    assert norm.metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(factor)
    np.testing.assert_allclose(norm.is_weights, out.is_weights / factor, rtol=1e-6)


@pytest.mark.parametrize(
    "level,lower,upper,keep,seq_fraction",
    [
        # geometric: row means of log ρ are -0.25 (e^-0.25 = 0.78: out) and 0 (kept)
        ("geometric", 0.999, 1.001, [[0, 0, 0], [1, 0, 0]], 0.5),
        # IcePop's token mask [0.5, 5]: ρ = e^0.5 kept, e^-1 = 0.37 out, 1 kept
        ("token", 0.5, 5.0, [[1, 0, 0], [1, 0, 0]], 0.5),
        # sequence [0.5, 2]: e^-0.5 = 0.61 and 1 both kept
        ("sequence", 0.5, 2.0, [[1, 1, 0], [1, 0, 0]], 0.0),
    ],
)
def test_rejection_by_hand(level, lower, upper, keep, seq_fraction):
    out = correct(
        TRAIN,
        ROLLOUT,
        MASK,
        rc(rollout_rs=level, rollout_rs_threshold=upper, rollout_rs_threshold_lower=lower),
    )
    np.testing.assert_array_equal(out.loss_mask, keep)  # the response mask with rejections
    assert out.loss_mask.dtype == MASK.dtype and out.is_weights is None
    rejected = 3 - np.sum(keep)
    assert out.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected / 3)
    assert out.metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == seq_fraction


def test_offpolicy_metrics_by_hand():
    m = mismatch_metrics(TRAIN, ROLLOUT, MASK)
    lr = np.array([0.5, -1.0, 0.0])
    assert m["rollout_corr/kl"] == pytest.approx(-lr.mean(), rel=1e-6)  # E[log π_r - log π_t]
    assert m["rollout_corr/k3_kl"] == pytest.approx(np.mean(np.exp(lr) - lr - 1), rel=1e-6)
    assert m["rollout_corr/chi2_token"] == pytest.approx(np.mean(np.exp(2 * lr)) - 1, rel=1e-6)
    # Σ log ρ per row: -0.5, 0
    assert m["rollout_corr/chi2_seq"] == pytest.approx((e**-1 + 1) / 2 - 1, rel=1e-6)
    # per-row mean log-probs: train -1.5, -0.5; rollout -1.25, -0.5
    assert m["rollout_corr/training_ppl"] == pytest.approx((e**1.5 + e**0.5) / 2, rel=1e-6)
    assert m["rollout_corr/rollout_ppl"] == pytest.approx((e**1.25 + e**0.5) / 2, rel=1e-6)
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(0.125, rel=1e-6)
    assert m["rollout_corr/log_ppl_abs_diff"] == pytest.approx(0.125, rel=1e-6)
    assert m["rollout_corr/ppl_ratio"] == pytest.approx((e**0.25 + 1) / 2, rel=1e-6)
    # probability space: |p_t - p_r| on the 3 valid tokens
    d = np.abs(np.exp([-1.0, -2.0, -0.5]) - np.exp([-1.5, -1.0, -0.5]))
    assert m["training/rollout_probs_diff_max"] == pytest.approx(d.max(), rel=1e-6)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(d.mean(), rel=1e-6)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(d.std(ddof=1), rel=1e-5)
    r = np.corrcoef(np.exp([-1.0, -2.0, -0.5]), np.exp([-1.5, -1.0, -0.5]))[0, 1]
    assert m["training/rollout_actor_probs_pearson_corr"] == pytest.approx(r, rel=1e-5)


def test_log_ratios_beyond_the_safety_bound_and_a_one_token_sequence():
    train = np.array([[0.0, -30.0]], np.float32)
    rollout = np.array([[-25.0, 0.0]], np.float32)  # log ρ = +25, -30: clamped to ±20
    out = correct(train, rollout, np.ones((1, 2), np.int32), rc(rollout_is="token"))
    np.testing.assert_allclose(out.is_weights, [[2.0, e**-20]], rtol=1e-5)
    assert out.metrics["rollout_corr/rollout_is_max"] == pytest.approx(e**20, rel=1e-5)
    assert out.metrics["rollout_corr/chi2_token"] == pytest.approx(
        (e**40 + e**-40) / 2 - 1, rel=1e-5
    )
    assert out.metrics["rollout_corr/k3_kl"] == pytest.approx(
        ((e**20 - 20 - 1) + (e**-20 + 20 - 1)) / 2, rel=1e-5
    )
    assert all(math.isfinite(v) for v in out.metrics.values())
    seq = correct(train, rollout, np.ones((1, 2), np.int32), rc(rollout_is="sequence"))
    np.testing.assert_allclose(seq.is_weights, [[e**-5] * 2], rtol=1e-5)  # Σ = -5, in bounds
    # One token: ESS 1, std 0 (verl: std needs two tokens).
    one = correct(train[:, :1], rollout[:, :1], np.ones((1, 1)), rc(rollout_is="token"))
    assert one.metrics["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0)
    assert one.metrics["rollout_corr/rollout_is_std"] == 0.0


def test_identical_log_probs_correct_nothing_bit_for_bit():
    """Negative control: sampler == trainer -> every weight exactly 1, nothing rejected, and the
    policy loss and its gradient equal the uncorrected ones bit for bit."""
    rng = np.random.RandomState(0)
    logp = np.log(rng.uniform(0.05, 1.0, (6, 5))).astype(np.float32)
    mask = (rng.uniform(size=(6, 5)) > 0.2).astype(np.int32)
    mask[:, 0] = 1
    for name, preset in PRESETS.items():
        if name == "bypass":
            continue
        out = correct(logp, logp, mask, RolloutCorrection(**preset))
        if out.is_weights is not None:
            np.testing.assert_array_equal(out.is_weights, mask.astype(np.float32))
        if out.loss_mask is not None:
            np.testing.assert_array_equal(out.loss_mask, mask)
        assert out.metrics["rollout_corr/kl"] == 0.0
        assert out.metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-7)
        assert out.metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    weights = correct(logp, logp, mask, rc(rollout_is="token")).is_weights
    old = logp + rng.normal(0, 0.1, logp.shape).astype(np.float32)
    adv = rng.normal(size=logp.shape).astype(np.float32)

    def loss(lp, w):
        return losses.ppo_loss(lp, old, adv, mask, weights_NT=w)[0]

    plain = jax.value_and_grad(loss)(jnp.asarray(logp), None)
    corrected = jax.value_and_grad(loss)(jnp.asarray(logp), jnp.asarray(weights))
    np.testing.assert_array_equal(plain[0], corrected[0])
    np.testing.assert_array_equal(plain[1], corrected[1])


def test_a_shifted_rollout_log_prob_changes_its_weight_exactly():
    logp = np.full((2, 3), -1.0, np.float32)
    rollout = logp.copy()
    rollout[0, 1] -= 0.3  # the trainer likes this token e^0.3 times more
    out = correct(logp, rollout, np.ones((2, 3), np.int32), rc(rollout_is="token"))
    expect = np.ones((2, 3), np.float32)
    expect[0, 1] = np.exp(np.float32(-1.0) - np.float32(-1.3))
    np.testing.assert_array_equal(out.is_weights, expect)
    # The weight scales that token's loss term: the loss moves by exactly its share.
    adv = np.ones((2, 3), np.float32)
    base = losses.ppo_loss(logp, logp, adv, np.ones((2, 3)))[0]
    weighted = losses.ppo_loss(logp, logp, adv, np.ones((2, 3)), weights_NT=expect)[0]
    # per-token loss -A * ratio = -1; token mean over 6 tokens
    assert float(base) == pytest.approx(-1.0)
    assert float(weighted) == pytest.approx(-(5 + expect[0, 1]) / 6, rel=1e-6)


def test_trl_preset_is_trls_sequence_mask():
    """TRL's `sequence_mask` (cap 3): weight = exp(Σ log ρ) where it is <= 3, else the sequence is
    masked; our preset composes it from sequence TIS (cap 3) and sequence rejection (<= 3)."""
    rng = np.random.RandomState(1)
    t = rng.normal(-1, 0.5, (8, 4)).astype(np.float32)
    r = (t + rng.normal(0, 0.6, (8, 4))).astype(np.float32)
    mask = np.ones((8, 4), np.int32)
    out = correct(t, r, mask, RolloutCorrection(**PRESETS["trl_sequence_mask"]))
    ratio = np.exp(np.sum(t - r, axis=1, keepdims=True))
    trl = np.where(ratio > 3.0, 0.0, ratio) * mask  # TRL: masked_fill(ratio > cap, 0)
    effective = out.is_weights * out.loss_mask
    np.testing.assert_allclose(effective, trl, rtol=1e-5)
    assert 0 < out.metrics["rollout_corr/rollout_rs_seq_masked_fraction"] < 1  # both cases occur


def test_bypass_uses_the_rollout_log_probs_as_the_old_policy():
    out = correct(TRAIN, ROLLOUT, MASK, rc(bypass_mode=True, rollout_rs="token"))
    np.testing.assert_array_equal(out.old_logp, ROLLOUT)
    assert out.is_weights is None and out.loss_mask is not None


def test_registries_have_one_function_per_name():
    """Each correction is named by its RolloutCorrection field; that field's values are 'none'
    and registered levels, each mapped to the level's one function."""
    fields = {f.name for f in dataclasses.fields(RolloutCorrection)}
    assert len(CORRECTIONS) and set(CORRECTIONS) <= fields
    for name, entry in CORRECTIONS.items():
        assert entry.levels.field == f"config.algo.{name}"
        assert entry.levels.names()[0] == "none"
        assert set(entry.levels.names()[1:]) <= set(LEVELS)
    # Every level is taken by some correction (rejection takes them all).
    assert set(LEVELS) == {lv for e in CORRECTIONS.items() for lv in e[1].levels} - {"none"}


def _algo(**kw):
    algo = ml_collections.ConfigDict()
    correction_config(algo)
    for k, v in kw.items():
        algo[k] = v
    return algo


def _rollout(**kw):
    ro = ml_collections.ConfigDict({"temperature": 1.0, "top_k": 0, "top_p": 1.0})
    ro.update(kw)
    return ro


@pytest.mark.parametrize(
    "algo,rollout,message",
    [
        ({"rollout_is": "tok"}, {}, "config.algo.rollout_is='tok'; allowed: ('none', 'token'"),
        ({"rollout_rs": "seq"}, {}, "config.algo.rollout_rs='seq'; allowed:"),
        ({"rollout_is_threshold": 0.0}, {}, "config.algo.rollout_is_threshold=0.0; must be"),
        ({"rollout_rs_threshold": -1.0}, {}, "config.algo.rollout_rs_threshold=-1.0; must be"),
        ({"rollout_rs_threshold_lower": 0.0}, {}, "config.algo.rollout_rs_threshold_lower=0.0;"),
        (
            {"rollout_rs_threshold": 2.0, "rollout_rs_threshold_lower": 3.0},
            {},
            "config.algo.rollout_rs_threshold_lower=3.0 > config.algo.rollout_rs_threshold=2.0",
        ),
        (  # the default lower bound 1 / 0.5: named as a default, never as a value the user set
            {"rollout_rs": "geometric", "rollout_rs_threshold": 0.5},
            {},
            "config.algo.rollout_rs_threshold=0.5; must be >= 1 while"
            " config.algo.rollout_rs_threshold_lower is unset (it defaults to 1 / threshold = 2",
        ),
        ({"rollout_is": "token"}, {"temperature": 0.0}, "config.rollout.temperature=0 samples"),
        ({"bypass_mode": True}, {"top_k": 5}, "config.rollout.top_k=5 filters it"),
        ({"rollout_rs": "token"}, {"top_p": 0.9}, "config.rollout.top_p=0.9 filters it"),
        ({"rollout_is_batch_normalize": True}, {}, "config.algo.rollout_is='none'"),
        ({"rollout_is": "token", "bypass_mode": True}, {}, "already is the IS weight"),
    ],
)
def test_bad_correction_config_is_one_line_naming_the_field(algo, rollout, message):
    with pytest.raises(ValueError) as err:
        correction_from(_algo(**algo), _rollout(**rollout))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_defaults_and_lower_bound():
    assert correction_from(_algo(), _rollout()) == RolloutCorrection()  # off, verl's defaults
    got = correction_from(_algo(rollout_rs="token", rollout_rs_threshold=4.0), _rollout())
    assert got.rollout_rs_threshold_lower == 0.25  # 1 / upper
    # With no correction, a greedy rollout is fine (nothing reads its log-probs).
    assert correction_from(_algo(), _rollout(temperature=0.0)).active == ()


# -- end to end: the negative-control scenario ----------------------------------------------------
@pytest.mark.slow
def test_causal_scenario_corrects_nothing_and_the_update_reads_the_correction(
    tmp_path, monkeypatch
):
    """Scenario (c), both phases faulty under a causal statistic, on the shipped warm start
    (its SFT settings kept: the model reads its prompt), token TIS and geometric rejection on:
    the sampler and the trainer agree to float noise, so every weight is ~1 and nothing is
    rejected. The update really reads what the correction returns: step 2's IS weights and step
    3's loss mask are replaced by zeros (the metrics stay the real ones), which zeroes the
    policy-gradient loss, and with the mask also the KL and entropy terms (step 1, unchanged,
    moves the policy off the reference, so its KL term is not 0 by itself).
    (Scenario (b)'s drift, rollout_corr/kl > 1e-3: test_train.py's learning test.)"""
    from aqn_jax.launch import run
    from aqn_jax.rl import trainer

    calls = []

    def zeroing(*args):
        out = correct(*args)
        if threading.current_thread() is not threading.main_thread():
            return out  # the compile-ahead's call (zeros of the step's shapes), not a step's
        calls.append(out)
        if len(calls) == 2:
            return out._replace(is_weights=np.zeros_like(out.is_weights))
        if len(calls) == 3:
            return out._replace(loss_mask=np.zeros_like(out.loss_mask))
        return out

    monkeypatch.setattr(trainer, "correct", zeroing)
    made = lowered_during_step_1(monkeypatch)  # IS weights and the loss mask compiled ahead too
    config = load_config("mismatch", "both_causal,geo_rs")
    config.algo.rollout_is = "token"
    config.data_batch.prompts = 4
    config.actor.mini_batch_prompts = 2
    config.actor.micro_batch_rows = 10
    config.trainer.total_steps = 3
    config.trainer.val_every = 0
    config.trainer.val_size = 8
    config.trainer.val_batch_size = 8
    run(config, str(tmp_path))
    assert made == []
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(calls) == 3
    for r in rows[1:]:
        assert abs(r["rollout_corr/kl"]) < 1e-5
        assert abs(r["rollout_corr/rollout_is_mean"] - 1.0) < 1e-4
        assert r["rollout_corr/rollout_rs_masked_fraction"] == 0.0
        assert r["faults/train/deadzone.flushed"] > 0.01  # the fault is there, in training too
    for out in calls:  # the real weights: ~1 on every response token
        assert np.all(np.abs(out.is_weights[out.loss_mask > 0] - 1.0) < 1e-3)
    step1, step2, step3 = rows[1:4]
    assert step1["actor/pg_loss"] != 0.0  # negative control: the real correction
    assert step2["actor/pg_loss"] == 0.0 and step2["actor/kl_loss"] != 0.0  # weights read
    assert step3["actor/pg_loss"] == 0.0 and step3["actor/kl_loss"] == 0.0  # mask read
    assert step3["actor/entropy"] == 0.0


@pytest.mark.parametrize(
    "variant,phases,arms",
    [
        # (a): the deadzone, or MXFP4, on the rollout (and evaluation) device; a clean trainer
        ("mismatch_study", {"deadzone": ("rollout", "eval")}, 7),
        ("mismatch_study_mxfp4", {"quant": ("rollout", "eval")}, 7),
        ("mismatch_study_call", {"deadzone": ("rollout", "train", "eval")}, 6),
        ("mismatch_study_causal", {"deadzone": ("rollout", "train", "eval")}, 4),
    ],
)
def test_mismatch_study_variants_place_each_fault_on_its_devices(variant, phases, arms, tmp_path):
    """Each scenario's device plan, per arm: the fault on exactly the scenario's phases, AQN
    (QeRL's RMSNorm-weight form) only on the rollout, the correction preset on config.algo; and
    every arm's train config passes the compare job's checks (no compile)."""
    from aqn_jax.aqn.plan import build_plan
    from aqn_jax.jobs.compare import check_config, run_config

    config = load_config("compare", variant)
    assert len(config.compare.arms) == arms and config.compare.reference_arm == "uncorrected"
    check_config(config, str(tmp_path))
    for arm in config.compare.arms:
        rc_ = run_config(config, arm, 0, str(tmp_path), None)
        plan = build_plan(rc_.faults, rc_.aqn, 8)
        got = {inj.name: inj.phases for inj in plan.injections}
        if arm == "clean":
            assert got == {}
            continue
        aqn = got.pop("aqn", None)
        assert got == phases, (arm, got)
        assert (aqn == ("rollout",)) == arm.startswith("aqn_qerl"), (arm, aqn)
        if arm.startswith("aqn_qerl"):
            assert rc_.aqn.form == "norm_weight" and rc_.aqn.schedule == "qerl"
        corr = correction_from(rc_.algo, rc_.rollout)
        expected = {"tis": ("rollout_is",), "aqn_qerl_tis": ("rollout_is",)}.get(arm, ())
        expected = {"trl_mask": ("rollout_is", "rollout_rs"), "geo_rs": ("rollout_rs",)}.get(
            arm, expected
        )
        assert corr.active == expected, (arm, corr)
