"""The defaults of the top-level modules' config sections, apart from the modules that read them
(those take a section, or the spec built from it, and import no `ml_collections`):

  sft_config          `config.sft`: the SFT warm start (aqn_jax/warm_start.py)
  lora_section        `config.lora`: LoRA adapters on a frozen base (aqn_jax/lora.py)
  mesh_config         `config.mesh`: the device mesh's axes (aqn_jax/parallel.py)
  distributed_config  `config.distributed`: several hosts (aqn_jax/parallel.py)
  planner_config      `config.planner`: the memory plan's check (aqn_jax/planner.py)
  evaluate_config     `config.evaluate`: job `evaluate`'s robustness matrix (aqn_jax/evaluation.py)
  trainer_config      `config.trainer`: the RL loop's length and bounds (aqn_jax/training.py)
  checkpoint_config   `config.checkpoint`: Orbax checkpoints and the export (aqn_jax/checkpoint.py)

A package's own sections are in its config.py (aqn/, data/, diagnosis/, faults/, models/, rl/,
sdc/, study/).
"""

from __future__ import annotations

import ml_collections


def frozen(section: ml_collections.ConfigDict) -> ml_collections.FrozenConfigDict:
    """A section not typed yet (config.model), as a frozen copy: a later change of the config
    changes nothing in it."""
    return ml_collections.FrozenConfigDict(section)


def sft_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.enabled = True  # SFT warm start before RL (the embedded default); False = use the model
    c.steps = 300  # optimizer steps
    c.batch_size = 32  # sequences per step
    c.lr = 3e-3  # AdamW peak learning rate
    c.warmup_steps = 10  # steps of linear warmup
    c.schedule = "cosine"  # constant | warmup_constant | cosine
    c.examples = 2048  # train examples used for SFT (the first N of the train split)
    c.cache_dir = ""  # '' = <workdir>/../cache
    c.seed = -1  # init + SFT seed; -1 = config.seed (the compare job fixes it: one warm start)
    return c


def lora_section() -> ml_collections.ConfigDict:
    """`config.lora`: LoRA adapters on a frozen base (QeRL mode; verl's lora_rank / alpha /
    target_modules)."""
    c = ml_collections.ConfigDict()
    c.rank = 0  # adapter rank r; 0 = off (full fine-tuning). QeRL: 16-32, verl advice >= 32
    c.alpha = 16.0  # scale = alpha / rank (QeRL and PEFT: alpha 16)
    # 'all-linear' = q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj, or a comma-separated
    # subset of those names (e.g. 'q_proj,v_proj')
    c.target_modules = "all-linear"
    c.train_norms = False  # QeRL's --ln: train the RMSNorm weights too
    return c


def mesh_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.data = -1  # -1: all devices not used by the other axes
    c.fsdp = 1  # devices that shard params and rows (ZeRO-3 style)
    c.tensor = 1  # devices that shard heads / mlp / vocab (Megatron style)
    return c


def distributed_config() -> ml_collections.ConfigDict:
    """`config.distributed`: several processes (hosts) in one run.

    coordinator '' and auto False: one process. coordinator 'host:port' with num_processes and
    process_id: explicit (launch/local.sh, launch/slurm.sh pass these). auto True:
    `jax.distributed.initialize()` detects the cluster itself (TPU pod slices, Slurm).
    """
    c = ml_collections.ConfigDict()
    c.coordinator = ""  # 'host:port' of process 0
    c.num_processes = 0  # hosts (0 = from the coordinator or auto)
    c.process_id = -1  # this host's index (-1 = auto)
    c.auto = False  # let JAX detect the cluster (TPU pod, Slurm, Open MPI)
    c.local_device_ids = ""  # e.g. '0,1' (GPUs this process uses); '' = all visible
    return c


def planner_config() -> ml_collections.ConfigDict:
    """`config.planner`: the per-device memory check that runs before the train job compiles."""
    c = ml_collections.ConfigDict()
    c.enabled = True  # False: report the plan, never refuse
    c.device_memory_gb = 0.0  # GiB per device; 0 = the backend's bytes_limit (none on CPU)
    c.headroom = 0.9  # fraction of the device memory the estimate may use (XLA needs scratch)
    return c


def evaluate_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.run = ""  # a train run's workdir: its checkpoint is evaluated; '' = the warm start
    c.step = -1  # checkpoint step of `run`; -1 = the latest
    c.size = 0  # test examples; 0 = config.trainer.val_size
    c.clean_size = 0  # the first this many of them with the fault off; 0 = all of them
    c.batch_size = 0  # 0 = config.trainer.val_batch_size
    c.fault = (False, True)  # the hardware fault of config.faults off and/or on
    c.noise_levels = (0.0, 0.05, 0.10)  # relative noise on every linear output (0 = none)
    c.mxfp4 = True  # also MXFP4 on every linear input
    # Weight-quantised inference: the policy's decoder linears stored in these 4-bit formats
    # (aqn_jax/quant_base.py, QeRL's NVFP4A16 / MXFP4A16): a device condition of its own, e.g.
    # ('nvfp4', 'mxfp4'); () = none.
    c.weight_formats = ()
    c.samples = 1  # 1 = greedy; n > 1: n samples per prompt at rollout.temperature (mean@n)
    c.loss = True  # held-out loss (answer-token cross-entropy) with the fault off / on
    return c


def trainer_config() -> ml_collections.ConfigDict:
    """`config.trainer`: the loop."""
    c = ml_collections.ConfigDict()
    c.total_steps = 30  # RL steps (used when total_epochs = 0)
    c.total_epochs = 0  # > 0: this many passes over the train split instead
    c.val_every = 10  # 0 = only at the start and the end
    c.val_size = 256  # test examples per validation
    c.val_batch_size = 64  # prompts per validation batch
    # Checked before every save (no checkpoint of a diverged run): params and optimizer state
    # finite, the pre-clip gradient norm <= max_grad_norm (the embedded runs stay under 10),
    # every |param| <= max_param_abs. 0 turns a bound off.
    c.max_grad_norm = 1e4  # pre-clip actor gradient norm bound
    c.max_param_abs = 1e4  # |param| bound
    return c


def checkpoint_config() -> ml_collections.ConfigDict:
    """`config.checkpoint`: Orbax checkpoints under <workdir>/checkpoints."""
    c = ml_collections.ConfigDict()
    c.every = 0  # 0 = only at the end
    c.keep = 2  # the latest N kept
    # What the last step saves: state (resumable) | params (params only, a third of the state's
    # bytes under AdamW: an evaluation-sized run) | none (no checkpoint at the end).
    c.final = "state"
    # hf: at the end, <workdir>/export/ is an HF snapshot of the trained policy (LoRA merged:
    # W + alpha/rank A B over the dequantised base) with config.json and the tokenizer, which
    # transformers and `configs/evaluate.py --config.model.hf_path=` load | none.
    c.export = "none"
    return c
