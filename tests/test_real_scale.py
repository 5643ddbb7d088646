"""The real-scale config (configs/gsm8k_qwen2p5_1p5b.py) end to end on a local Qwen-like snapshot
(a tiny random transformers Qwen2 plus a BPE tokenizer with Qwen2.5's chat template, written with
save_pretrained) and verl-format parquet files of the arithmetic task: the 1.5B config's
structure (HF loading, HF tokenizer, parquet, epochs, fp32 master weights with bf16 compute and
generation, remat, FSDP mesh, SRDD, checkpoints), with only the sizes shrunk."""

import json
import os

import numpy as np
import pytest

from aqn_jax.data.arithmetic import ArithmeticTask

from conftest import launch_cli, load_config, make_qwen_snapshot

LAYERS, FAULT = 3, 1


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    """A Qwen-like local snapshot: tokenizer.json + chat template + config.json + safetensors."""
    root = tmp_path_factory.mktemp("real_scale")
    task = ArithmeticTask(1, 1, 0)
    texts = [e["question"] + "\n" + e["answer"] for e in task.dataset("train", 256)] + [
        'Let\'s think step by step and output the final answer after "####".'
    ]
    model_dir = root / "Qwen-tiny-Instruct"
    # Tied embeddings, as Qwen2.5-1.5B.
    make_qwen_snapshot(model_dir, texts, 300, num_hidden_layers=LAYERS, tie_word_embeddings=True)
    train = task.write_parquet(root / "train.parquet", "train", 8)
    test = task.write_parquet(root / "test.parquet", "test", 4)
    return {"model": str(model_dir), "train": str(train), "test": str(test)}


def shrunk(snapshot, arm="targeted"):
    """Command-line flags: the real config with its paths filled and only sizes shrunk."""
    return [
        f"--config=configs/gsm8k_qwen2p5_1p5b.py:{arm}",
        f"--config.model.hf_path={snapshot['model']}",
        f"--config.data.train_path={snapshot['train']}",
        f"--config.data.test_path={snapshot['test']}",
        "--config.data_batch.prompts=4",
        "--config.rollout.n=2",
        "--config.rollout.max_new_tokens=8",
        "--config.rollout.prompt_buckets=(256,)",
        "--config.actor.mini_batch_prompts=2",
        "--config.actor.micro_batch_rows=2",
        "--config.trainer.val_every=2",
        "--config.trainer.val_batch_size=4",
        "--config.trainer.val_size=4",  # the test split's 4 problems
        "--config.checkpoint.every=2",
        "--config.diagnosis.num_prompts=4",
        f"--config.faults.deadzone.layers={FAULT}",
    ]


@pytest.mark.slow
def test_real_scale_config_runs_end_to_end(snapshot, tmp_path):
    work = tmp_path / "run"
    out = launch_cli(*shrunk(snapshot), workdir=work)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads((work / "summary.json").read_text())
    # 2 epochs over 8 training problems at 4 prompts per step.
    assert summary["steps"] == 4
    assert summary["fault_layers"] == [FAULT]
    assert summary["srdd_located_layers"] == [FAULT] == summary["aqn_layers"]
    assert summary["sft"] == {"sft": "off"}
    assert summary["val_size"] == 4
    rows = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["data/epoch"] for r in rows[1:]] == [0, 0, 1, 1]
    # The AQN schedule (epoch-aware, 2 epochs) runs over the 4 steps the epochs gave.
    from aqn_jax.aqn.config import aqn_sigma

    aqn = load_config("gsm8k_qwen2p5_1p5b", "targeted").aqn
    expected = [aqn_sigma(aqn, s, 4) for s in range(1, 5)]
    assert [r["aqn/sigma"] for r in rows[1:]] == pytest.approx(expected, rel=1e-6)
    assert rows[1]["faults/rollout/deadzone.flushed"] > 0
    manifest = json.loads((work / "manifest.json").read_text())
    assert f"layers_{FAULT}" in json.dumps(manifest)
    config = json.loads((work / "config.json").read_text())
    assert config["model"]["dtype"] == "bfloat16" and config["model"]["remat"] is True
    assert config["mesh"]["fsdp"] == -1

    # fp32 master weights in the checkpoint (bf16 only in compute and generation).
    from aqn_jax.checkpoint import Checkpointer

    state, meta = Checkpointer(str(work), 0, 3).restore_host(4)
    kernel = state["params"]["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert kernel.dtype == np.float32
    assert meta["data"]["epoch"] == 2
    assert sorted(os.listdir(work / "checkpoints")) == ["2", "4"]


@pytest.mark.slow
def test_generation_weights_are_bf16_and_match_the_traced_cast(snapshot):
    """The rollout's bf16 copy is exactly what the fp32-master forward casts to per matmul, so
    the sampler's log-probs and the trainer's recomputed ones see the same weights."""
    import jax
    import jax.numpy as jnp

    from aqn_jax.data.config import load_split
    from aqn_jax.faults.intercept import FaultPlan
    from aqn_jax.models.factory import load_params, model_config
    from aqn_jax.models.qwen2 import Qwen2ForCausalLM
    from aqn_jax.parallel import make_mesh
    from aqn_jax.rl import step as rl_step
    from aqn_jax.rl.trainer import Trainer, TrainerParts, prompt_batcher
    from aqn_jax.spec import loop_spec, step_spec, trainer_spec
    from aqn_jax.warm_start import tokenizer_for

    config = load_config("gsm8k_qwen2p5_1p5b", "clean")
    config.model.hf_path = snapshot["model"]
    config.data.train_path, config.data.test_path = snapshot["train"], snapshot["test"]
    config.data_batch.prompts, config.rollout.n = 4, 2
    config.actor.mini_batch_prompts, config.actor.micro_batch_rows = 2, 2
    model_cfg = model_config(config.model)
    params = load_params(model_cfg, config.model.hf_path, 0)
    tok = tokenizer_for(config.tokenizer_path, config.model.hf_path, model_cfg.vocab_size)
    batcher = prompt_batcher(loop_spec(config), load_split(config.data, "train"), tok)
    total = trainer_spec(config.trainer).steps(batcher.batches_per_epoch)
    assert total == 4  # total_epochs=2 over 2 batches per epoch
    static = rl_step.static_from(step_spec(config), model_cfg, FaultPlan(), FaultPlan(), total)
    sh = rl_step.shardings(static, make_mesh(config.mesh))
    state, ref = rl_step.init_state(static, params, sh)
    test = load_split(config.data, "test")
    spec, plan = loop_spec(config), FaultPlan()
    tr = Trainer(TrainerParts(spec, static, sh, None, None, ref, batcher, tok, test, plan))
    w = tr.generation_weights(state.params)
    leaves = jax.tree_util.tree_leaves(w)
    assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree_util.tree_leaves(state.params)} == {jnp.dtype("float32")}
    ids = np.array([[5, 6, 7, 8]], np.int32)
    model = Qwen2ForCausalLM(model_cfg)
    master = model.apply({"params": state.params}, ids)
    cast = model.apply({"params": w}, ids)
    np.testing.assert_array_equal(np.asarray(master), np.asarray(cast))


@pytest.mark.slow
def test_required_paths_are_refused_before_anything_is_written(snapshot, tmp_path):
    work = tmp_path / "never"
    flags = [f for f in shrunk(snapshot) if not f.startswith("--config.model.hf_path")]
    out = launch_cli(*flags, workdir=work)
    assert out.returncode != 0
    assert "config.model.hf_path is required" in out.stderr
    assert _nothing_written(work)
    with pytest.raises(ValueError, match="allowed arms"):
        load_config("gsm8k_qwen2p5_1p5b", "tageted")


def _nothing_written(work) -> bool:
    """Nothing but the (released, empty) workdir lock that launch holds while it runs."""
    if not work.exists():
        return True
    left = [p for p in work.iterdir() if p.name != ".lock"]
    return not left and (not (work / ".lock").exists() or (work / ".lock").read_text() == "")


@pytest.mark.slow
def test_memory_planner_refuses_before_compiling(snapshot, tmp_path):
    """A device too small for the plan: the run stops in validation, naming the mesh and
    showing the per-device table, before any SFT, diagnosis or compile (nothing written)."""
    work = tmp_path / "small"
    out = launch_cli(*shrunk(snapshot), "--config.planner.device_memory_gb=0.001", workdir=work)
    assert out.returncode != 0
    assert "config.mesh=(data=1, fsdp=1, tensor=1) does not fit in device memory" in out.stderr
    assert "params" in out.stderr and "kv_cache" in out.stderr
    assert _nothing_written(work)
