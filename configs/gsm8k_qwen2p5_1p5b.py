"""The original study at real scale: Qwen2.5-1.5B-Instruct, GSM8K, GRPO on a simulated MXFP4
deadzone at layer 15, one arm per run (the arm is the config argument).

  python -m aqn_jax.launch --config=configs/gsm8k_qwen2p5_1p5b.py:targeted \
      --config.model.hf_path=/models/Qwen2.5-1.5B-Instruct \
      --config.data.train_path=/data/gsm8k/train.parquet \
      --config.data.test_path=/data/gsm8k/test.parquet --workdir=runs/gsm8k_targeted
  # several nodes: python launch/slurm.py --nodes=2 -- --config=configs/gsm8k_qwen2p5_1p5b.py:...

Arms: clean | deadzone | global_aqn | targeted | healthy | srdd_guided (aqn_jax/experiment.py).
The model snapshot (config.json, *.safetensors, tokenizer.json + chat template) and verl's GSM8K
parquet files (examples/data_preprocess/gsm8k.py) are required fields: nothing is downloaded.

Settings of the original (docs/ARCHITECTURE.md, "GSM8K and RL conventions (verl)"): 128
prompts per step, n = 5 samples, actor lr 5e-7, prompts and responses up to 1024 tokens, 2
epochs (7473 problems / 128 = 58 steps per epoch, 116 steps), deadzone at layer 15 with
threshold 0.01, AQN epoch-aware 0.05 -> 0.0005. Numerics: fp32 master weights and AdamW
moments, bf16 compute (matmuls accumulate in fp32) and bf16 generation weights, remat of each
decoder layer. FSDP over every device by default.

Before anything compiles the train job checks the paths and plans per-device memory for the
mesh (aqn_jax/planner.py); when the plan does not fit it stops and suggests a mesh that does.
Expected on 8x A100-80GB: about the original's wall time (16 h for 116 steps; not measured
here). The end-to-end path is tested on a tiny random HF checkpoint (tests/test_real_scale.py).
"""

from aqn_jax.experiment import ARMS, apply_arm, base_config


def get_config(arg: str | None = None):
    arm = arg or "targeted"
    if arm not in ARMS:
        raise ValueError(
            f"--config=configs/gsm8k_qwen2p5_1p5b.py:{arg}; allowed arms: {ARMS.names()}"
        )
    config = base_config()
    config.required = ("model.hf_path", "data.train_path", "data.test_path")

    config.model.preset = "qwen2p5_1p5b"  # the architecture; hf_path's config.json is used
    config.model.hf_path = ""  # required: the local Qwen2.5-1.5B-Instruct snapshot
    config.model.param_dtype = "float32"  # master weights and optimizer state
    config.model.dtype = "bfloat16"  # activations, matmul inputs, generation weights
    config.model.remat = True
    config.tokenizer_path = ""  # the snapshot's tokenizer and chat template

    config.data.train_path = ""  # required: verl's gsm8k train.parquet
    config.data.test_path = ""  # required: verl's gsm8k test.parquet (1319 problems)
    config.sft.enabled = False  # the Instruct model already answers with '#### N'

    config.data_batch.prompts = 128
    config.rollout.n = 5
    config.rollout.temperature = 1.0
    config.rollout.max_new_tokens = 1024
    config.rollout.max_prompt_len = 1024
    config.rollout.prompt_buckets = (256, 512, 1024)  # GSM8K prompts fit the first

    config.actor.lr = 5e-7
    config.actor.mini_batch_prompts = 32  # 4 optimizer updates per step
    config.actor.micro_batch_rows = 160  # the mini-batch at once: 40 GiB/GPU of 8
    config.critic.lr = 1e-5

    config.trainer.total_epochs = 2  # 116 steps on GSM8K's 7473 training problems
    config.trainer.val_every = 10
    config.trainer.val_size = 1319  # the whole test split
    config.trainer.val_batch_size = 128
    config.checkpoint.every = 10
    config.checkpoint.keep = 3

    config.mesh.data = 1
    config.mesh.fsdp = -1  # FSDP over every device

    config.diagnosis.max_prompt_len = 512
    config.faults.deadzone.layers = "15"
    config.faults.deadzone.threshold = 0.01
    config.aqn.schedule = "epoch_aware"
    config.aqn.sigma_start = 0.05
    config.aqn.sigma_end = 0.0005
    config.aqn.num_epochs = 2
    return apply_arm(config, arm)
