"""The RL job end to end: every arm config on its smoke setting, the outputs it writes, the
sharded step against the single-device step, bad input, and that GRPO learns."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from aqn_jax.experiment import arm_names

from conftest import SHALLOW_FAULT as F
from conftest import SHALLOW_LAYERS as L
from conftest import launch_cli, load_config, lowered_during_step_1, shallow
from tolerance import bound, forward_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smoke(name, sft_cache, **over):
    """`configs/<name>.py:smoke` on the shallow model (conftest.SHALLOW: 3 layers, the deadzone
    at layer 1) with the session's SFT cache, and `over`'s dotted keys set."""
    config = load_config(name, "smoke")
    config.sft.cache_dir = sft_cache
    return shallow(config, **over)


@pytest.mark.parametrize(
    "arm",
    [
        # clean: the session's one clean smoke (conftest.clean_smoke), which test_sdc.py's guard
        # compares with; its group keeps both on one worker. It is the fast tier's train run
        # (`-m "not slow"`, issue 53); the other arms are slow.
        pytest.param(a, marks=pytest.mark.xdist_group("clean_smoke"))
        if a == "clean"
        else pytest.param(a, marks=pytest.mark.slow)
        for a in arm_names("study")
    ],
)  # global_qerl: test_compare
def test_every_arm_runs_on_smoke(arm, sft_cache, tmp_path, monkeypatch, request):
    from aqn_jax.launch import run

    # srdd_guided on the preset's 8 layers: its sigma map compares each layer with the median
    # layer, and on 3 layers of the smoke warm start every layer trips one rule (measured: the
    # dead layer's gain of 3.2 is the median's outlier), so the map's shape is not checkable.
    # Its model is the random init (sft.enabled=False), which saves an 8-layer SFT's compile;
    # the assertion below held on it as on the 8-step smoke SFT (both checked, this session).
    deep = {"model.num_layers": 0, "faults.deadzone.layers": "4", "sft.enabled": False}
    deep = deep if arm == "srdd_guided" else {}
    # deadzone: a checkpoint every step, for the full fine-tuning resume check at the end
    every = {"checkpoint.every": 1} if arm == "deadzone" else {}
    if arm == "clean":
        tmp_path, made = request.getfixturevalue("clean_smoke")
    else:
        made = lowered_during_step_1(monkeypatch)
        run(smoke(arm, sft_cache, **deep, **every), str(tmp_path))
    assert made == []  # step 1 ran the programs compiled ahead (generate, prepare, update)
    layers, fault = (8, 4) if deep else (L, F)
    for name in (
        "config.json",
        "manifest.json",
        "metrics.jsonl",
        "summary.json",
        "report.md",
        "training_curves.png",
    ):
        assert (tmp_path / name).stat().st_size > 0, name
    assert any((tmp_path / "tensorboard").iterdir())
    assert (tmp_path / "checkpoints" / "2").is_dir()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in (
        "critic/score/mean",
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/grad_norm",
        "response_length/mean",
        "timing_s/gen",
        "timing_s/update",
        "aqn/sigma",
        "training/rollout_probs_diff_mean",
        "val-core/aqn_jax/arithmetic/acc/mean@1",
        "val-clean/aqn_jax/arithmetic/acc/mean@1",
    ):
        assert key in rows[1], key
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in (
        "fault_layers",
        "srdd_located_layers",
        "aqn_layers",
        "val_acc_start",
        "val_acc_end",
        "val_acc_clean_end",
        "steps",
        "wall_time_s",
    ):
        assert key in summary, key
    assert summary["steps"] == 2
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    if arm == "clean":
        assert summary["fault_layers"] == [] and summary["aqn_layers"] is None
        assert manifest["injections"] == []
    else:
        assert summary["fault_layers"] == [fault]
        assert manifest["hits"]["rollout"]["deadzone"] == [f"layers_{fault}/layer:output"]
        assert rows[1]["faults/rollout/deadzone.flushed"] > 0
        assert rows[1]["faults/train/deadzone.flushed"] > 0
    expected_aqn = {
        "clean": None,
        "deadzone": None,
        "global_aqn": list(range(layers)),
        "targeted": [fault],
        "healthy": [i for i in range(layers) if i != fault],
        "srdd_guided": list(range(layers)),
    }[arm]
    assert summary["aqn_layers"] == expected_aqn
    if arm in ("targeted", "srdd_guided"):
        assert summary["srdd_located_layers"] == [fault]
        assert (tmp_path / "srdd.json").exists()
    if arm == "srdd_guided":
        # base 0.05; the default fault (75% of layer 4 flushed) trips both rules of the original
        # design notes there: signal loss x1.5 and kurtosis x1.5.
        assert summary["aqn_layer_sigmas"]["4"] == pytest.approx(0.05 * 1.5 * 1.5)
    if arm == "deadzone":
        _resumes_exactly(tmp_path, smoke(arm, sft_cache, **every))


def _resumes_exactly(straight, config):
    """Full fine-tuning's resume (tests/test_resume.py kills and resumes QeRL mode's runs; the
    same checkpoint code): the finished run `straight` as a kill would have left it after its
    step-2 row and before its step-2 checkpoint (a copy without checkpoints/2 and the outputs of
    the run's end), restarted. It resumes from step 1, keeps exactly the rows 0..1, and ends
    with this run's rows and its whole saved state (params, AdamW moments, counters) bitwise."""
    import shutil

    import jax
    import orbax.checkpoint as ocp

    from aqn_jax.launch import run

    killed = straight.with_name(straight.name + "_killed")
    shutil.copytree(straight, killed)
    shutil.rmtree(killed / "checkpoints" / "2")
    for name in ("summary.json", "report.md", "training_curves.png"):
        (killed / name).unlink()
    assert (killed / "checkpoints" / "1").is_dir()
    run(config, str(killed))

    def rows(workdir):
        out = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith("timing_s/")} for r in out]

    assert rows(killed) == rows(straight)
    assert not (killed / "previous").exists()  # resumed, not started afresh
    a, b = (
        ocp.PyTreeCheckpointer().restore(str(w / "checkpoints" / "2" / "state"))
        for w in (straight, killed)
    )
    assert set(a["params"]) != {"lora"}  # the whole model trained, not adapters
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_ppo_with_critic_runs(sft_cache, tmp_path, monkeypatch):
    from aqn_jax.launch import run

    made = lowered_during_step_1(monkeypatch)
    run(
        smoke("clean", sft_cache, **{"algo.estimator": "gae", "critic.faults": True}), str(tmp_path)
    )
    assert made == []  # the critic's values and returns compiled ahead too
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "critic/vf_loss" in rows[1] and np.isfinite(rows[1]["critic/vf_loss"])
    assert rows[1]["critic/values/mean"] == 0.0  # zero-initialised value head at step 1


def test_gspo_trains(sft_cache, tmp_path, monkeypatch):
    """config.algo.policy_loss='gspo' end to end (the smoke: 2 mini-batches, so the second one's
    sequence ratios move off 1): the step programs compile ahead as PPO's do, and the policy
    learns from the loss (a gradient, a second mini-batch that sees a changed policy). The run
    reads each split once (`check_train` loads them; the run takes them from its spec) and
    parses config.model once (a preset's parse reads the preset table: `registry.presets`)."""
    from aqn_jax.data import config as data_config
    from aqn_jax.launch import run
    from aqn_jax.models import registry

    made = lowered_during_step_1(monkeypatch)
    reads, raw_split, presets = [], data_config._raw_split, registry.presets

    def counted(data, split):
        reads.append(split)
        return raw_split(data, split)

    def parsed():
        reads.append("config.model")
        return presets()

    monkeypatch.setattr(data_config, "_raw_split", counted)
    monkeypatch.setattr(registry, "presets", parsed)
    run(smoke("clean", sft_cache, **{"algo.policy_loss": "gspo"}), str(tmp_path))
    assert made == []
    # Before (the SFT trained): config.model parsed 4 times (the check, its tokenizer's vocab,
    # the SFT's tokenizer and init), each split read again by the run and the train split once
    # more by the SFT.
    assert reads == ["config.model", "train", "test"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["algo"]["policy_loss"] == "gspo"
    assert config["algo"]["gspo"] == {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:
        assert np.isfinite(row["actor/pg_loss"]) and row["actor/grad_norm"] > 0, row
        assert row["actor/pg_clipfrac_lower"] == 0.0  # GSPO has no dual-clip
        assert row["actor/ppo_kl"] != 0.0  # the second mini-batch's policy is another one


def _launch(args, workdir):
    return launch_cli(*args, workdir=workdir)


def test_bad_input_is_refused_before_anything_is_written(tmp_path, sft_cache):
    from aqn_jax.launch import run

    # An existing run's checkpoint must survive every refused start.
    ckpt = tmp_path / "checkpoints" / "7"
    ckpt.mkdir(parents=True)
    (ckpt / "state").write_text("precious")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    cases = [
        (
            {"faults.deadzone.layers": "8"},
            f"config.faults.deadzone.layers='8' but the model has {L} layers",
        ),
        ({"mesh.data": 3}, r"config.mesh=\(data=3, fsdp=1, tensor=1\) uses 3 devices but 1"),
        (
            {"data.train_path": "/nonexistent/train.parquet"},
            "config.data.train_path='/nonexistent/train.parquet': no such file",
        ),
        ({"aqn.enabled": True, "aqn.layers": "(1,9)"}, "config.aqn.layers"),
        ({"actor.mini_batch_prompts": 3}, "config.actor.mini_batch_prompts=3 must divide"),
        ({"algo.estimator": "reinforce"}, "config.algo.estimator='reinforce'"),
    ]
    for over, match in cases:
        with pytest.raises(ValueError, match=match):
            run(smoke("deadzone", sft_cache, **over), str(tmp_path))
    # The workdir as it was found: a refused command removes the lock it took (issue 42).
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert not (tmp_path / ".lock").exists()
    assert (ckpt / "state").read_text() == "precious"
    # From the command line: a clear message and a non-zero exit code.
    proc = _launch(["--config=configs/deadzone.py:smoke", "--config.job=nope"], tmp_path)
    assert proc.returncode != 0
    assert "config.job='nope'; allowed:" in proc.stderr
    proc = _launch(
        ["--config=configs/deadzone.py:smoke", "--config.faults.deadzone.layers=12"], tmp_path
    )
    assert proc.returncode != 0 and "config.faults.deadzone.layers" in proc.stderr
    assert (ckpt / "state").read_text() == "precious"


SHARDED = textwrap.dedent(
    """
    import os, sys, json
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, numpy as np
    sys.path.insert(0, {tests!r})
    from conftest import load_config
    from aqn_jax import parallel
    from aqn_jax.data.config import load_split
    from aqn_jax.aqn.plan import build_plan
    from aqn_jax.faults.config import fault_plan
    from aqn_jax.rewards import score_batch
    from aqn_jax.rl import step as rl_step
    from aqn_jax.rl.trainer import Trainer, TrainerParts, prompt_batcher, train_batch
    from aqn_jax.spec import loop_spec, step_spec, warm_start_spec
    from aqn_jax.warm_start import tokenizer_for, warm_start

    # The shipped warm start (not a random init, whose rewards are all 0: its gradient is ~1e-10
    # and any two meshes agree on it), so the step's gradient is a real one.
    config = load_config("deadzone")
    config.data_batch.prompts = 4
    config.actor.mini_batch_prompts = 4
    config.actor.micro_batch_rows = 20
    # The two-pass path (one mini-batch would take the on-policy shortcut, whose update reads
    # its own old log-probs): the gradient compared is the one fed the prepare pass's.
    config.actor.old_logp_pass = "always"
    model_cfg, params, info = warm_start(warm_start_spec(config), {out!r})
    assert info["cache"] == "shipped", info
    params = jax.device_get(params)
    tok = tokenizer_for(config.tokenizer_path, config.model.hf_path, model_cfg.vocab_size)
    plan, hw = build_plan(config.faults, config.aqn, 8), fault_plan(config.faults, 8)
    static = rl_step.static_from(step_spec(config), model_cfg, plan, hw, 4)
    sigma, key = np.float32(0.05), jax.random.key(7)
    values = {{"aqn_sigma": sigma}}

    def misplaced(tree, shardings):
        # A wrong placement rule: every device holds the mirror block of its own along each
        # sharded axis (a shard-to-device map off by a permutation).
        def one(x, s):
            x = np.asarray(x)
            def block(idx):
                return x[tuple(
                    sl if sl.start is None else slice(n - sl.stop, n - sl.start)
                    for sl, n in zip(idx, x.shape)
                )]
            return jax.make_array_from_callback(x.shape, s, block)
        return jax.tree_util.tree_map(one, tree, shardings)

    def grads(devices, shape, place=parallel.put_global):
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor = shape
        mesh = parallel.make_mesh(config.mesh, devices)
        sh = rl_step.shardings(static, mesh)
        parallel.put_global, saved = place, parallel.put_global
        try:
            state, ref = rl_step.init_state(static, params, sh)
        finally:
            parallel.put_global = saved
        dev = parallel.put_batch({{k: v for k, v in tb.items() if k != "scores"}}, mesh)
        prep, _ = jax.jit(lambda *a: rl_step.prepare_step(static, *a))(
            state, ref, dev, parallel.put_batch(tb["scores"], mesh), key, values
        )
        upd = {{k: dev[k] for k in ("ids", "mask", "tokens", "rmask")}}
        upd.update({{k: prep[k] for k in ("old_logp", "advantages", "ref_logp")}})
        first = jax.tree_util.tree_map(lambda x: x[0], rl_step.mini_batches(static, upd))
        g, mets, _ = jax.jit(
            lambda p, mb: rl_step.minibatch_grads(static, p, mb, key, 0, values),
            out_shardings=(sh.params, sh.replicated, sh.replicated),
        )(state.params, first)
        shard = g["layers_0"]["mlp"]["up_proj"]["kernel"].sharding
        np.savez({out!r} + name + ".npz", *jax.tree_util.tree_leaves(jax.device_get(g)))
        return dict(loss=float(mets["pg_loss"]), spec=str(shard.spec),
                    devices=len(shard.device_set))

    # One rollout (one device) feeds every layout: the comparison is of the train computation.
    mesh1 = parallel.make_mesh(config.mesh, jax.devices()[:1])
    sh1 = rl_step.shardings(static, mesh1)
    state1, _ = rl_step.init_state(static, params, sh1)
    batcher = prompt_batcher(loop_spec(config), load_split(config.data, "train"), tok)
    parts = TrainerParts(loop_spec(config), static, sh1, None, None, None, batcher, tok, [], hw)
    loop = Trainer(parts)
    batch = batcher.next_batch()
    out = loop.rollout(state1.params, batch, 1)  # AQN's sigma at step 1 (the values dict's)
    texts = [tok.decode(t[m > 0]) for t, m in zip(out.tokens, out.response_mask)]
    scores = score_batch(texts, [g for g in batch["ground_truth"] for _ in range(5)])
    tb = train_batch(out, scores)
    res = {{"score": float(scores.mean())}}
    for name, devices, shape, place in (
        ("one", jax.devices()[:1], (1, 1, 1), parallel.put_global),
        ("eight", jax.devices(), (2, 2, 2), parallel.put_global),
        ("wrong", jax.devices(), (2, 2, 2), misplaced),
    ):
        res[name] = grads(devices, shape, place)
    print(json.dumps(res))
    """
)


def _gradient_path() -> int:
    """The reductions one actor gradient of SHARDED's step passes through: the forward and the
    backward over bucket + max_new_tokens keys (twice the forward's path, with the
    log-softmax), then a weight gradient's sum over the micro-batch's tokens."""
    from aqn_jax.models.factory import model_config

    config = load_config("deadzone")
    keys = max(config.rollout.prompt_buckets) + config.rollout.max_new_tokens
    forward = forward_path(model_config(config.model), keys, log_softmax=True)
    return 2 * forward + 20 * keys  # micro_batch_rows = 20 in SHARDED


def assert_same_gradient(a, b):
    """Leaf by leaf: the two layouts sum in different orders, so each entry is within the f32
    bound of the gradient's path (tests/tolerance.py) at the leaf's largest |entry| (seen on
    AMD EPYC: 2.4e-5 of that scale; the bound is ~2.6e-3 of it)."""
    n = _gradient_path()
    for k in b.files:
        tol = bound(n, np.abs(b[k]).max())
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=tol, err_msg=k)


@pytest.mark.slow
def test_sharded_step_equals_single_device(tmp_path):
    """The actor gradient of one mini-batch (the warm start's, on one rollout) on 1 device and
    on a 2x2x2 (data, fsdp, tensor) mesh agree (`assert_same_gradient`); the negative control,
    the same mesh with a wrong placement rule (each device holding the mirror block of its
    own), must not."""
    script = SHARDED.format(tests=os.path.join(REPO, "tests"), out=str(tmp_path) + "/")
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["eight"]["devices"] == 8 and "fsdp" in out["eight"]["spec"]
    assert "tensor" in out["eight"]["spec"]
    assert out["score"] > 0  # rewards vary: a real policy gradient
    one, eight, wrong = (np.load(tmp_path / f"{n}.npz") for n in ("one", "eight", "wrong"))
    assert len(one.files) == len(eight.files) > 50
    assert max(float(np.abs(one[k]).max()) for k in one.files) > 1e-3
    # The policy loss is ~0 at ratio 1 (advantages sum to 0 per group): its gradient is not.
    # The policy loss: a mean over the tokens of ratio (1) x advantage terms; GRPO advantages
    # are z-scores within a group of 5 samples, so |A| <= 4 / sqrt(5) < 2.
    tol = bound(_gradient_path(), 2.0)
    assert out["one"]["loss"] == pytest.approx(out["eight"]["loss"], abs=tol)
    assert_same_gradient(eight, one)
    # The negative control: a wrong sharding rule fails the same comparison.
    with pytest.raises(AssertionError):
        assert_same_gradient(wrong, one)


@pytest.mark.slow
def test_grpo_wins_back_part_of_the_fault_on_the_faulty_device(tmp_path, sft_cache):
    """GRPO of the deadzone arm from the shipped warm start (fixed seed): the default fault costs
    accuracy at the start, RL on the faulty device wins part of it back, and the policy's
    accuracy on a clean device holds (measured numbers in WORKSPACE.md, issue 14)."""
    from aqn_jax.launch import run

    config = load_config("deadzone")
    config.sft.cache_dir = sft_cache
    config.trainer.total_steps = LEARN_STEPS
    config.trainer.val_every = 0
    config.trainer.val_size = 128
    run(config, str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sft"]["cache"] == "shipped"
    assert summary["fault_gap_start"] >= 0.25  # the fault really costs accuracy
    assert summary["val_acc_start"] >= 0.1  # and leaves a reward signal
    assert summary["val_acc_end"] >= summary["val_acc_start"] + LEARN_MARGIN, summary
    assert summary["recovered"] > 0
    # the gap at the end, beside the share won back (which the clean device's own gain inflates)
    gap_end = summary["val_acc_clean_end"] - summary["val_acc_end"]
    assert summary["fault_gap_end"] == gap_end, summary
    assert summary["val_acc_clean_end"] >= summary["val_acc_clean_start"] - 0.03, summary
    # Issue 29's scenario (b): the deadzone's per-call statistic makes the sampler and the
    # trainer disagree (~0.5 nats per token measured); no correction is on, nothing rejected.
    mismatch = summary["mismatch"]
    assert mismatch["rollout_corr/kl"] > 1e-3, mismatch
    assert mismatch["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert summary["rollout_correction"]["rollout_is"] == "none"


LEARN_STEPS = 12
LEARN_MARGIN = 0.02


@pytest.mark.slow
def test_a_diverging_run_stops_before_saving_its_weights(tmp_path, sft_cache):
    """lr 1e6: the first update blows the weights up; the check before the save stops the run
    naming the step, and no checkpoint holds the diverged weights (issue 18)."""
    from aqn_jax.launch import run

    config = smoke("deadzone", sft_cache, **{"actor.lr": 1e6, "checkpoint.every": 1})
    with pytest.raises(FloatingPointError, match=r"RL step 1: not saved: .*max \|param\|"):
        run(config, str(tmp_path))
    ckpts = tmp_path / "checkpoints"
    assert not ckpts.exists() or not [p for p in ckpts.iterdir() if p.name.isdigit()]
