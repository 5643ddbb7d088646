"""The robustness evaluation: condition names and plans, agreement with the trainer's own
validation, noise level 0 adding nothing, mean@n, the held-out loss against a direct
computation, and the job's outputs and bad input."""

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

from aqn_jax.data.gsm8k import left_pad
from aqn_jax.evaluation import (
    EVAL_NOISE,
    check_evaluate,
    condition_plan,
    conditions,
    heldout_loss,
    robustness,
)
from aqn_jax.faults.config import fault_plan
from aqn_jax.faults.intercept import FaultPlan, step_key
from aqn_jax.faults.sites import LINEAR_KINDS
from aqn_jax.models.qwen2 import Qwen2ForCausalLM
from aqn_jax.rl.sampler import Sampler, SamplingParams
from aqn_jax.rl.scoring import eval_scores
from aqn_jax.rl.sft import sft_loss, sft_sequences
from aqn_jax.spec import eval_spec

from conftest import SHALLOW_FLAGS, launch_cli, load_config
from tolerance import bound, forward_path, logit_bound

BUCKET = 72  # the embedded task's one prompt bucket (config.rollout.prompt_buckets)


def _config(**ev):
    config = load_config("evaluate")
    config.rollout.max_new_tokens = 16
    for k, v in ev.items():
        config.evaluate[k] = v
    return config


def test_condition_names_and_plans():
    config = _config()
    names = [c.name for c in conditions(config.evaluate)]
    assert names == [
        "clean",
        "clean+noise5%",
        "clean+noise10%",
        "clean+mxfp4",
        "fault",
        "fault+noise5%",
        "fault+noise10%",
        "fault+mxfp4",
    ]
    hw = fault_plan(config.faults, 8)
    assert [i.name for i in hw.injections] == ["deadzone"]  # AQN never enters evaluation
    on = condition_plan(hw, True, "mxfp4")
    off = condition_plan(hw, False, "noise")
    assert [i.name for i in on.injections] == ["deadzone", "eval_mxfp4"]
    assert [i.name for i in off.injections] == ["eval_noise"]
    assert set(off.injections[0].sites.kinds) == set(LINEAR_KINDS) and len(LINEAR_KINDS) == 7
    assert off.injections[0].sites.layers == "all" and on.injections[1].sites.point == "input"


@pytest.mark.slow
def test_matrix_agrees_with_validation_and_noise_zero_is_exact(sft_tiny):
    cfg, params, tok, task = sft_tiny
    # Noise level 0 only, fault off and on: the unperturbed programs (kind 'none').
    config = _config(size=16, batch_size=8, loss=False, noise_levels=(0.0,), mxfp4=False)
    assert [(c.name, c.kind) for c in conditions(config.evaluate)] == [
        ("clean", "none"),
        ("fault", "none"),
    ]
    examples = task.examples("test", 16)
    hw = fault_plan(config.faults, cfg.num_hidden_layers)
    out = robustness(eval_spec(config), cfg, params, tok, examples, hw, log=lambda *_: None)
    conds = out["conditions"]
    assert list(conds) == ["clean", "fault"] and all(c["n"] == 16 for c in conds.values())
    assert conds["clean"]["perturbation"] == "none" and conds["fault"]["fault"]

    # The trainer's greedy validation programs, built independently: clean and faulty device
    # (as rl/trainer.py builds them: sampling limited to the tokenizer's ids; defined as
    # robustness() defines its two, so XLA's persistent cache can serve their compiles).
    greedy = SamplingParams(
        max_new_tokens=16,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
        temperature=0.0,
        vocab_size=tok.vocab_size,
    )
    model = Qwen2ForCausalLM(cfg)
    key = step_key(0, 0, "eval")
    refs = {}
    for name, plan in (("clean", FaultPlan()), ("fault", hw)):
        refs[name] = Sampler(model, greedy, plan, (BUCKET,), phase="eval")
        ended = []
        ref = eval_scores(refs[name], params, examples, tok, 8, BUCKET, fault_key=key, ended=ended)
        assert conds[name]["acc"] == pytest.approx(float(np.mean(ref)), abs=0)
        assert len(ended) == 16 and conds[name]["clipped"] == 1.0 - np.mean(ended)
        # The per-problem records: one a problem, in order, reproducing the accuracy.
        recs = conds[name]["records"]
        assert [r["index"] for r in recs] == [ex.index for ex in examples]
        assert np.mean([r["correct"] for r in recs]) == conds[name]["acc"]
        assert [r["ended"] for r in recs] == ended and {r["condition"] for r in recs} == {name}
        # Every reading of the same completions; the config's own (strict) is `acc`, and boxed
        # reads '#### N' as strict does when there is no box (tests/test_rewards.py).
        readings = conds[name]["acc_by_reading"]
        assert set(readings) == {"strict", "flexible", "boxed"}
        assert readings["strict"] == conds[name]["acc"] == readings["boxed"]
        assert readings["flexible"] == pytest.approx(readings["strict"], abs=0.07)
    # config.evaluate.clean_size: the clean device on the first 8 only, the faulty on all 16.
    half_cfg = _config(size=16, batch_size=8, loss=False, noise_levels=(0.0,), mxfp4=False)
    half_cfg.evaluate.clean_size = 8
    half = robustness(eval_spec(half_cfg), cfg, params, tok, examples, hw, log=lambda *_: None)
    assert (half["conditions"]["clean"]["n"], half["conditions"]["fault"]["n"]) == (8, 16)
    ref = eval_scores(refs["clean"], params, examples[:8], tok, 8, BUCKET, fault_key=key)
    assert half["conditions"]["clean"]["acc"] == float(np.mean(ref))
    assert half["conditions"]["fault"]["acc"] == conds["fault"]["acc"]

    # Why level 0 may skip the noise program: the traced noise at level 0 adds nothing (the same
    # greedy tokens on the faulty device; log-probs within float32 rounding, since the noise
    # program fuses differently), while a nonzero level through the same program changes them
    # by more than ten times that bound (the negative control). The injection is the one
    # condition_plan gives robustness() (its noise on every linear of every layer:
    # test_condition_names_and_plans), here on the seven linears of the last layer only (after
    # the deadzone's layer 4, which would flush much of a noise placed before it): a level of 0
    # scales each site's draw to exactly 0, so what is checked here holds site by site, and the
    # sampler compiles a few seconds instead of ~18 s (a draw per site, prefill and decode).
    # With one layer's noise the control takes level 1.0 (the largest allowed): measured on AMD
    # EPYC, 2.2e-7 at level 0, 1.45 at 1.0 (a fifth of the tokens change), 0.23 at 0.3 (too
    # close to 10 x the bound, 0.22); with every layer's noise it was 1.9e-6 and 0.92 at 0.3.
    ids, mask = _prompts(tok, examples[:8])
    *fault, noise = condition_plan(hw, True, "noise").injections
    assert noise.sites.layers == "all" and noise.name == EVAL_NOISE
    last = (cfg.num_hidden_layers - 1,)
    noise = dataclasses.replace(noise, sites=dataclasses.replace(noise.sites, layers=last))
    assert fault == list(hw.injections) and hw.injections[0].sites.layers == (4,)
    noisy = Sampler(model, greedy, FaultPlan([*fault, noise]), (BUCKET,), phase="eval")
    run = lambda sampler, level: sampler(  # noqa: E731
        params, ids, mask, jax.random.key(0), fault_key=key, values=level
    )
    plain = run(refs["fault"], {})
    at_zero = run(noisy, {EVAL_NOISE: np.float32(0.0)})
    np.testing.assert_array_equal(at_zero.tokens, plain.tokens)
    # Two programs: f32 rounding along the forward (tests/tolerance.py), the keys the prompt
    # bucket plus the generated tokens, the terms of the size of the largest logit.
    tol = bound(forward_path(cfg, BUCKET + 16, log_softmax=True), logit_bound(cfg, params))
    np.testing.assert_allclose(at_zero.logprobs, plain.logprobs, rtol=0, atol=tol)
    at_one = run(noisy, {EVAL_NOISE: np.float32(1.0)})
    assert np.abs(at_one.logprobs - plain.logprobs).max() > 10 * tol


def _prompts(tok, examples):
    """Left-padded chat prompts of `examples`, as eval_scores builds them."""
    ids = [tok.encode_chat(ex.prompt_messages) for ex in examples]
    return left_pad(ids, tok.pad_id, max(map(len, ids)))


@pytest.mark.slow
def test_mean_at_n(sft_tiny):
    cfg, params, tok, task = sft_tiny
    config = _config(size=4, batch_size=4, samples=3, noise_levels=(0.0,), mxfp4=False)
    config.rollout.max_new_tokens = 8
    config.evaluate.fault = (False,)
    config.evaluate.loss = False
    examples = task.examples("test", 4)
    hw = fault_plan(config.faults, cfg.num_hidden_layers)
    out = robustness(eval_spec(config), cfg, params, tok, examples, hw, log=lambda *_: None)
    acc = out["conditions"]["clean"]["acc"]
    assert out["conditions"]["clean"]["samples"] == 3
    assert acc * 4 * 3 == pytest.approx(round(acc * 4 * 3), abs=1e-4)  # k of 12 samples


@pytest.mark.slow
def test_heldout_loss_equals_direct_cross_entropy(sft_tiny):
    cfg, params, tok, task = sft_tiny
    examples = task.examples("test", 12)
    model = Qwen2ForCausalLM(cfg)
    key = jax.random.key(0)
    loss = heldout_loss(model, params, FaultPlan(), examples, tok, 5, key)  # padded last batch
    data = sft_sequences(examples, tok)
    direct = float(  # jitted: eagerly, every op of the forward and its readout compiles alone
        jax.jit(functools.partial(sft_loss, model))(params, data.ids, data.mask, data.loss_mask)
    )
    # Two programs (padded batches of 5 against one batch of 12): a mean of per-token
    # cross-entropies, each within the forward's f32 rounding at the largest logit's scale,
    # and the sum over the tokens (tests/tolerance.py).
    n = forward_path(cfg, data.ids.shape[1], log_softmax=True) + int(np.sum(data.loss_mask))
    assert loss == pytest.approx(direct, rel=0, abs=bound(n, logit_bound(cfg, params)))
    config = _config()
    config.faults.deadzone.severity = "amax"
    config.faults.deadzone.threshold = 0.5
    faulty = heldout_loss(model, params, fault_plan(config.faults, 8), examples, tok, 5, key)
    assert faulty > loss + 0.1


def test_bad_evaluate_config_is_refused():
    for field, value, message in (
        ("noise_levels", (0.0, 1.5), "each must be in [0, 1]"),
        ("samples", 0, "must be >= 1"),
        ("fault", (), "allowed"),
        ("step", -3, "must be a step"),
    ):
        config = _config(**{field: value})
        with pytest.raises(ValueError, match=f"config.evaluate.{field}="):
            check_evaluate(config.evaluate)
        with pytest.raises(ValueError, match=message.replace("[", r"\[")):
            check_evaluate(config.evaluate)


@pytest.mark.slow
def test_evaluate_job(tmp_path, sft_cache):
    work = tmp_path / "eval"
    # The faulty device only (fault off/on is covered above): 2 programs, noise and MXFP4. The
    # smoke warm start is the session's (the shallow smoke arms' SFT: the same cache key).
    out = launch_cli(
        "--config=configs/evaluate.py:smoke",
        *SHALLOW_FLAGS,
        "--config.evaluate.noise_levels=(0.0,0.1)",
        "--config.evaluate.fault=(True,)",
        f"--config.sft.cache_dir={sft_cache}",
        workdir=work,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((work / "evaluation.json").read_text())
    assert list(result["conditions"]) == ["fault", "fault+noise10%", "fault+mxfp4"]
    assert result["test_size"] == 8 and set(result["loss"]) == {"fault"}
    text = (work / "evaluation.md").read_text()
    assert "| device | none | noise10% | mxfp4 |" in text
    assert f"| fault | {result['conditions']['fault']['acc']:.3f} |" in text
    assert (work / "evaluation.png").stat().st_size > 1000

    bad = launch_cli(
        "--config=configs/evaluate.py:smoke",
        f"--config.evaluate.run={tmp_path / 'nowhere'}",
        workdir=tmp_path / "bad",
    )
    assert bad.returncode != 0 and "config.evaluate.run=" in bad.stderr


def test_an_unfinished_run_is_evaluated_as_such(tmp_path):
    """The step evaluated, and whether it is the run's end, from the run's own files."""
    import json

    from aqn_jax.jobs.evaluate import run_status

    (tmp_path / "config.json").write_text(json.dumps({"trainer": {"total_steps": 30}}))
    assert run_status(str(tmp_path), 10) == {"step": 10, "finished": False, "total_steps": 30}
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 30}))
    assert run_status(str(tmp_path), 10)["finished"] is False  # an older checkpoint
    assert run_status(str(tmp_path), 30) == {"step": 30, "finished": True, "total_steps": 30}


def test_eval_scores_reads_answers_with_the_configured_method(capsys):
    """`config.data.reward_method` reaches the score: a prose answer ("... is 12") scores 0
    strict (no '#### ') and 1 flexible (the last number), a '#### 12' answer 1 under both, a
    wrong number 0 under both, and "... is 12." 0 under both (verl's flexible pattern takes the
    trailing period into the number: "12." != "12"). A stub sampler returns fixed completions,
    so this is the scoring path alone."""
    import types

    from aqn_jax.data.gsm8k import Example
    from aqn_jax.data.tokenizers import CharTokenizer

    tok = CharTokenizer()
    answers = ["So 7 plus 5 is 12", "7 + 5 = 12\n#### 12", "It is 13", "It is 12."]
    examples = [
        Example(
            question=f"q{i}",
            prompt_messages=[{"role": "user", "content": f"What is 7 plus 5? ({i})"}],
            ground_truth="12",
            index=i,
        )
        for i in range(len(answers))
    ]
    width = max(len(tok.encode(a)) for a in answers)

    def sampler(params, ids, mask, key, fault_key=None, values=None):
        rows = [tok.encode(answers[i % len(answers)]) for i in range(ids.shape[0])]
        tokens = np.zeros((ids.shape[0], width), np.int32)
        resp = np.zeros_like(tokens)
        for i, r in enumerate(rows):
            tokens[i, : len(r)], resp[i, : len(r)] = r, 1
        ended = np.zeros(ids.shape[0], bool)
        return types.SimpleNamespace(tokens=tokens, response_mask=resp, ended=ended)

    eos = (tok.eos_id,)
    sampler.sampling = types.SimpleNamespace(n=1, max_new_tokens=width, eos_id=eos[0], stop_ids=eos)
    sampler.phase = "eval"
    strict = eval_scores(sampler, None, examples, tok, 4, 72, method="strict")
    flexible = eval_scores(sampler, None, examples, tok, 4, 72, method="flexible")
    np.testing.assert_array_equal(strict, [0.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(flexible, [1.0, 1.0, 0.0, 0.0])
    # `ended`: whether each completion emitted EOS; none of these did (cut at the budget) ...
    ended = []
    capsys.readouterr()
    eval_scores(sampler, None, examples, tok, 4, 72, ended=ended)
    assert ended == [False] * 4
    # A call in which no response ended says so, in one line.
    assert capsys.readouterr().out == (
        f"eval: every one of 4 responses ran to the {width}-token cap without a stop id"
        f" [{tok.eos_id}]: the answers may be cut, or the tokenizer's eos is not the model's end"
        " of turn\n"
    )
    # ... and with EOS ending rows 1 and 3, on 3 examples (a batch of 4: row 3 is padding), row 1
    # ended and the padding row is dropped.
    eos_rows = {1, 3}

    def ending(params, ids, mask, key, fault_key=None, values=None):
        out = sampler(params, ids, mask, key)
        for i in range(ids.shape[0]):
            if i % len(answers) in eos_rows:
                j = int(out.response_mask[i].sum())
                out.tokens[i, j - 1], out.response_mask[i, j - 1] = tok.eos_id, 1
                out.ended[i] = True
        return out

    ending.sampling = sampler.sampling
    ended = []
    eval_scores(ending, None, examples[:3], tok, 4, 72, ended=ended)
    assert ended == [False, True, False]
    assert capsys.readouterr().out == ""  # one response ended: no line
