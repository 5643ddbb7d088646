"""One GRPO step of aqn_jax against TRL's `GRPOTrainer` (the CPU user's peer), same machine, same
weights, same shapes.

  pip install -e '.[bench]'
  python bench/rl_step.py [--steps 12] [--settings ours1,trl1,ours2,trl2,trl2p,...]
      [--arch tiny|qwen2p5_0p5b|qwen2p5_1p5b] [--shape P,N,T] [--extra '--config.a=b ...']
      [--device cpu|gpu] [--smoke] [--record]
  python bench/rl_step.py --device=gpu --arch qwen2p5_1p5b --shape 8,8,256 --steps 6

`--device=gpu` runs both sides on the accelerator in bf16 (settings `ours_gpu`: our model
dtype bfloat16 over f32 master weights; `trl_gpu`: GRPOConfig(use_cpu=False, bf16=True)); on a
machine without one it stops with one line before any work. `--shape P,N,T` sets the prompts
per step, the samples per prompt and the new tokens (default: the arch's, SHAPES); `--extra`
appends our launch flags (e.g. `--config.actor.micro_batch_rows=16 --config.model.remat=True`).

Setup, the same on both sides:
  * weights: `tiny` = the shipped SFT warm start (aqn_jax/assets/sft-*, an HF snapshot that
    both our loader and transformers read); `qwen2p5_0p5b` = N(0, 0.02) random weights written
    with `save_hf_checkpoint` (4 prompts x 4 samples, 64 new tokens: a random model never ends
    early, so both sides generate exactly 64);
  * the embedded arithmetic task's train prompts in its chat format, the same order; the strict
    reward (`aqn_jax.rewards.compute_score`); TRL gets a `PreTrainedTokenizerFast` built from our
    `CharTokenizer` whose ids are asserted equal to ours on every prompt;
  * GRPO, group size n, at most N new tokens, temperature 1, top_p 1, KL to the reference
    (low-variance / k3 estimator) coefficient 0.001, lr 3e-5 AdamW, 1 PPO epoch, and 2 optimizer
    updates per RL step on both sides (ours: 2 mini-batches; TRL: `steps_per_generation=2`,
    one update per half of the generation batch, so one of our steps = 2 TRL optimizer steps).
    Both compute old log-probs in a separate pass (TRL does when steps_per_generation > 1) and
    reference log-probs.
Settings, each run in its own process, interleaved (ours, TRL, ours, TRL, ...):
  ours1  XLA with single-threaded Eigen, pinned to one core (`taskset -c 0`);
  ours2  XLA default (2 intra-op threads);
  trl1   `torch.set_num_threads(1)`, pinned to one core;
  trl2   2 threads, default OpenMP (spins under contention);
  trl2p  2 threads, `OMP_WAIT_POLICY=PASSIVE`;
  <setting>_bf16  the same in bf16 compute with f32 master weights and optimizer state: ours
         with `config.model.dtype=bfloat16` (bf16 matmul inputs, f32 accumulation, softmax
         and logits; generation from a bf16 copy of the weights and a bf16 KV cache), read
         from the snapshot directory (`model.hf_path`, SFT off: the shipped warm start's key
         is the f32 config's); TRL with `bf16=True` in its GRPOConfig, which on CPU runs
         the forward passes under `torch.autocast("cpu", torch.bfloat16)` (accelerate's
         mixed precision), the weights and AdamW state staying f32.
Per setting: the median RL step over steps 3..S (the first two include compile / warm-up),
the breakdown (generation, log-probs = old + reference, update), the first step, completion
length, and generated / trained tokens per second. Prints, per pairing of our best against
TRL's best and per thread count, `BENCH rl_step_vs_trl ratio=<TRL s/step / ours s/step>`
(> 1: we are faster), normalised per generated token when the mean completion lengths differ
by more than 10% (said in the line).

Per setting also the roofline of each phase, from the device's read bandwidth and matmul peak
measured first in a JAX process on the same device (best of 5 jitted sums over a 1 GiB f32 array;
best of 5 n x n products, n = 8192 on GPU, 2048 on CPU, in the setting's dtype):
  * generation: the decode floor (`floor_seconds` in bench/common.py: prefill plus each decode
    step's max(weights + KV bytes / bandwidth, FLOPs / peak), the mean completion length) and
    the % of it reached (floor / generation time);
  * log-probs (old + reference: 2 forward passes) and update (forward + backward): MFU =
    model FLOPs / (time x peak), 2 x params per token a forward and 6 x params per token an
    update (attention not counted), over the real tokens (mean prompt + completion per row).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

SHAPES = {  # arch -> (prompts per step, samples per prompt, max new tokens)
    "tiny": (16, 5, 24),
    "qwen2p5_0p5b": (4, 4, 64),
    "qwen2p5_1p5b": (8, 8, 256),
}
# --smoke (CI: both sides run, nothing timed): the same programs and settings at a smaller batch,
# 4 prompts x 2 samples, at most 8 new tokens.
SMOKE_SHAPE = (4, 2, 8)
BASE_SETTINGS = ("ours1", "trl1", "ours2", "trl2", "trl2p")
SETTINGS = BASE_SETTINGS + tuple(f"{s}_bf16" for s in ("ours1", "trl1", "ours2", "trl2p"))
GPU_SETTINGS = ("ours_gpu", "trl_gpu")  # both bf16 on the accelerator
# ours_gpu's micro-batch rows: the largest the planner fits in an H100 as JAX sizes it (59 GiB,
# headroom 0.9; `python bench/readout_plan.py`) at 8 x 8 x 256 (the whole 32-row mini-batch
# at 0.5B, 8 rows at 1.5B); other archs and the CPU settings take the whole mini-batch.
GPU_MICRO_ROWS = {"qwen2p5_0p5b": 32, "qwen2p5_1p5b": 8}
LR, KL = 3e-5, 0.001


def weights_dir(arch: str, tmp: str) -> str:
    """An HF snapshot both sides read, with our CharTokenizer saved in it (our side reads the
    snapshot's tokenizer: the same ids as TRL's)."""
    from aqn_jax.data.tokenizers import CharTokenizer

    out = os.path.join(tmp, arch)
    if arch == "tiny":
        assets = sorted((ROOT / "aqn_jax" / "assets").glob("sft-*"))
        if not assets:
            raise SystemExit("no shipped warm start under aqn_jax/assets")
        shutil.copytree(assets[-1], out)
    else:
        from common import random_params

        from aqn_jax.models.hf import save_hf_checkpoint
        from aqn_jax.models.qwen2 import Qwen2Config

        cfg = Qwen2Config.preset(arch)
        save_hf_checkpoint(out, cfg, random_params(cfg))
    CharTokenizer().save(out)
    return out


# -- ours ------------------------------------------------------------------------------------------
def micro_rows(setting: str, arch: str, rows: int) -> int:
    """The micro-batch of a setting: on the GPU `GPU_MICRO_ROWS` where it divides the
    mini-batch's `rows`, else (and on the CPU) the whole mini-batch."""
    micro = GPU_MICRO_ROWS.get(arch, rows) if setting == "ours_gpu" else rows
    return micro if rows % micro == 0 else rows


def run_ours(setting: str, arch: str, wdir: str, steps: int, tmp: str, shape, extra=()) -> dict:
    prompts, n, new = shape
    workdir = tempfile.mkdtemp(prefix=f"ours_{setting}_", dir=tmp)
    cmd = [
        sys.executable, "-m", "aqn_jax.launch", "--config=configs/clean.py",
        f"--workdir={workdir}", f"--config.trainer.total_steps={steps}",
        # Validation (steps 0 and last, outside the timed steps) on 16 problems, not 256.
        "--config.trainer.val_every=0", "--config.trainer.val_size=16",
        "--config.checkpoint.every=0",
        f"--config.data_batch.prompts={prompts}", f"--config.rollout.n={n}",
        f"--config.rollout.max_new_tokens={new}", f"--config.actor.lr={LR}",
        f"--config.actor.mini_batch_prompts={prompts // 2}",
        f"--config.actor.micro_batch_rows={micro_rows(setting, arch, prompts // 2 * n)}",
    ]  # fmt: skip
    bf16 = setting.endswith("_bf16") or setting == "ours_gpu"
    # The f32 tiny settings start from the shipped warm start through the SFT cache (the
    # default study's path; the snapshot route gives bitwise the same run). bf16 changes the
    # SFT cache key (config.model is part of it), so bf16 reads the same weights as a snapshot.
    if arch != "tiny" or bf16:
        cmd += [f"--config.model.hf_path={wdir}", "--config.sft.enabled=False"]
    if bf16:
        cmd += ["--config.model.dtype=bfloat16"]
    cmd += list(extra)
    env = dict(os.environ)
    if setting != "ours_gpu":
        env["JAX_PLATFORMS"] = "cpu"
    if setting.startswith("ours1"):
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
        ).strip()
        cmd = ["taskset", "-c", "0", *cmd]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{setting} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in Path(workdir, "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing_s/step" in r]
    return {
        "setting": setting,
        "wall_s": time.perf_counter() - t0,
        "steps": [
            {
                "step": r["timing_s/step"],
                "gen": r["timing_s/gen"],
                "logprobs": r["timing_s/old_log_prob"],
                "update": r["timing_s/update"],
                "completion_len": r["response_length/mean"],
            }
            for r in rows
        ],
        "rows": prompts * n,
    }


# -- TRL -------------------------------------------------------------------------------------------
def hf_char_tokenizer(tok):
    """A transformers tokenizer with our CharTokenizer's ids: specials and task words as added
    tokens (longest match first, as ours), every other character its own token."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tok.vocab)}
    rust = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    rust.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=rust, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    from tokenizers import AddedToken

    multi = [t for t in tok.vocab if len(t) > 1]
    special = {"<pad>", "<eos>", "<bos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"}
    fast.add_tokens(
        [AddedToken(t, normalized=False, special=t in special) for t in multi],
        special_tokens=False,
    )
    fast.padding_side = "left"
    return fast


def run_trl(setting: str, arch: str, wdir: str, steps: int, tmp: str, shape) -> dict:
    env = dict(os.environ)
    base = setting.removesuffix("_bf16")
    threads = 1 if base == "trl1" else 2
    if base == "trl2p":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    cmd = [sys.executable, __file__, "--_trl-worker", wdir, "--arch", arch, "--steps", str(steps)]
    cmd += ["--threads", str(threads), "--shape", ",".join(map(str, shape))]
    if setting.endswith("_bf16") or setting == "trl_gpu":
        cmd += ["--bf16"]
    if setting == "trl_gpu":
        cmd += ["--device", "gpu"]
    if base == "trl1":
        cmd = ["taskset", "-c", "0", *cmd]
    out = os.path.join(tmp, f"{setting}.json")
    cmd += ["--out", out]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{setting} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads(Path(out).read_text())
    res.update(setting=setting, wall_s=time.perf_counter() - t0)
    return res


def trl_worker(
    wdir: str,
    arch: str,
    steps: int,
    threads: int,
    out: str,
    shape,
    bf16: bool = False,
    device: str = "cpu",
) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch

    torch.set_num_threads(threads)
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from aqn_jax.data.arithmetic import ArithmeticTask
    from aqn_jax.data.tokenizers import CharTokenizer
    from aqn_jax.rewards import compute_score

    prompts, n, new = shape
    tok = CharTokenizer()
    fast = hf_char_tokenizer(tok)
    examples = ArithmeticTask().examples("train", prompts * steps)
    texts = [tok.apply_chat_template(ex.prompt_messages) for ex in examples]
    for ex, text in zip(examples, texts, strict=True):  # identical token ids on both sides
        ours = tok.encode_chat(ex.prompt_messages)
        theirs = fast(text, add_special_tokens=False)["input_ids"]
        assert ours == theirs, (text, ours, theirs)
    data = datasets.Dataset.from_list(
        [
            {"prompt": t, "ground_truth": ex.ground_truth}
            for t, ex in zip(texts, examples, strict=True)
        ]
    )

    def reward(prompts, completions, ground_truth, **kw):
        return [compute_score(c, g) for c, g in zip(completions, ground_truth, strict=True)]

    model = transformers.AutoModelForCausalLM.from_pretrained(wdir, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(out), "trl_out"),
        use_cpu=device == "cpu",
        per_device_train_batch_size=prompts * n // 2,
        gradient_accumulation_steps=1,
        steps_per_generation=2,
        num_generations=n,
        max_completion_length=new,
        temperature=1.0,
        top_p=1.0,
        beta=KL,
        learning_rate=LR,
        weight_decay=0.01,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        num_iterations=1,
        max_steps=2 * steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        shuffle_dataset=False,
        seed=0,
        bf16=bf16,
        disable_dropout=True,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=fast
    )
    if arch != "tiny":  # a random model must never end early: generate exactly `new`
        trainer.generation_config.eos_token_id = None
    clock: dict[str, list[float]] = {"gen": [], "gen_score": [], "step": [], "len": []}
    # On a GPU the clock reads after the device finished (CUDA runs asynchronously).
    sync = torch.cuda.synchronize if device == "gpu" else (lambda: None)

    def timed(name, fn):
        def wrapper(*a, **k):
            sync()
            t0 = time.perf_counter()
            r = fn(*a, **k)
            sync()
            clock[name].append(time.perf_counter() - t0)
            return r

        return wrapper

    trainer._generate = timed("gen", trainer._generate)
    gen_and_score = timed("gen_score", trainer._generate_and_score_completions)

    def gen_score_and_length(*a, **k):
        out = gen_and_score(*a, **k)
        # The completion length of this generation (TRL logs it once per generation).
        clock["len"].append(float(trainer._metrics["train"]["completions/mean_length"][-1]))
        return out

    trainer._generate_and_score_completions = gen_score_and_length

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()
            clock["step"].append(time.perf_counter() - self.t0)

    trainer.add_callback(StepTimer())
    # What precision the forwards really ran in: a projection's output dtype, per grad mode (TRL
    # computes its log-probs from lm_head.weight in tiles, so the lm_head module is only called
    # by generation).
    seen: dict[str, set] = {}

    def probe(module, inputs, output):  # returns None: the output is left as it is
        mode = "grad" if torch.is_grad_enabled() else "no_grad"
        seen.setdefault(mode, set()).add(str(output.dtype).removeprefix("torch."))

    trainer.model.model.layers[0].mlp.down_proj.register_forward_hook(probe)
    trainer.train()
    weights = sorted({str(p.dtype) for p in trainer.model.parameters()})
    # One of our RL steps = 2 TRL optimizer steps (a generation, then 2 updates).
    rl = []
    for i in range(steps):
        s = clock["step"][2 * i] + clock["step"][2 * i + 1]
        gen, gs = clock["gen"][i], clock["gen_score"][i]
        rl.append(
            {"step": s, "gen": gen, "logprobs": gs - gen, "update": s - gs,
             "completion_len": clock["len"][i]}
        )  # fmt: skip
    Path(out).write_text(
        json.dumps(
            {
                "steps": rl,
                "rows": prompts * n,
                "proj_out": {k: sorted(v) for k, v in seen.items()},
                "weights": weights,
            }
        )
    )


# -- the device ------------------------------------------------------------------------------------
def roofline_worker(device: str, out: str, small: bool) -> None:
    """The device's bandwidth and matmul peaks (`xla_roofline`), measured in a process of its
    own, so that the GPU is free again when the runs start. Exits 2 with one line on stderr when
    `device` is gpu and neither JAX nor torch sees one."""
    import jax

    if device == "gpu":
        try:
            gpus = jax.devices("gpu")
        except RuntimeError:
            gpus = []
        torch_sees = False
        if gpus:  # torch (TRL's side) only imported where JAX found one
            import torch

            torch_sees = torch.cuda.is_available()
        if not gpus or not torch_sees:
            why = (
                f"JAX sees no GPU (backend {jax.default_backend()})"
                if not gpus
                else f"JAX sees {len(gpus)} but torch.cuda.is_available() is False"
            )
            print(
                f"--device=gpu: no GPU for both sides on this machine: {why}; run it where an"
                " accelerator is, or use --device=cpu",
                file=sys.stderr,
            )
            sys.exit(2)
    from common import xla_roofline

    nbytes, n = (2**26, 256) if small else (2**30, 8192 if device == "gpu" else 2048)
    result = xla_roofline(nbytes, n)
    result["device"] = jax.devices()[0].device_kind
    Path(out).write_text(json.dumps(result))


def measure_roofline(device: str, tmp: str, small: bool) -> dict:
    out = os.path.join(tmp, "roofline.json")
    cmd = [sys.executable, __file__, "--_roofline", device, "--out", out]
    cmd += ["--smoke"] if small else []
    env = dict(os.environ, **({"JAX_PLATFORMS": "cpu"} if device == "cpu" else {}))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        lines = proc.stderr.strip().splitlines() or [f"rc {proc.returncode}"]
        fail(lines[-1])
    return json.loads(Path(out).read_text())


def fail(message: str) -> None:
    """A usage error: one line on stderr, exit 2, before any work."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_shape(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    ok = len(parts) == 3 and all(p.strip().isdigit() for p in parts)
    shape = tuple(int(p) for p in parts) if ok else (0, 0, 0)
    if shape[0] < 2 or shape[0] % 2 or shape[1] < 1 or shape[2] < 1:
        fail(
            f"--shape={text}: want P,N,T: prompts per step (even: 2 updates a step),"
            " samples per prompt >= 1, new tokens >= 1"
        )
    return shape


def roofline(r: dict, cfg, n_params: int, rows: int, prompt_len: float, roof: dict, bf16: bool):
    """The decode floor and % reached, and the MFU of log-probs and update (module docstring)."""
    from common import floor_seconds

    dtype = "bfloat16" if bf16 else "float32"
    peak = roof[dtype]
    new = max(1, round(r["len"]))
    floor = floor_seconds(
        cfg, n_params, rows, round(prompt_len), new, roof["bw"], peak, 2 if bf16 else 4
    )
    tokens = rows * (prompt_len + r["len"])
    return {
        "decode_floor_s": floor,
        "gen_s": r["gen"],
        "decode_pct_floor": 100 * floor / r["gen"],
        "logprobs_mfu_pct": 100 * 2 * 2 * n_params * tokens / (r["logprobs"] * peak),
        "update_mfu_pct": 100 * 6 * n_params * tokens / (r["update"] * peak),
        "peak_tflops": peak / 1e12,
        "bw_gbs": roof["bw"] / 1e9,
    }


# -- report ----------------------------------------------------------------------------------------
def jax_leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def summarise(res: dict) -> dict:
    steps = res["steps"]
    tail = steps[2:] or steps
    med = {k: statistics.median(s[k] for s in tail) for k in ("step", "gen", "logprobs", "update")}
    length = statistics.mean(s["completion_len"] for s in tail)
    rows = res["rows"]
    return {
        **med,
        "first": steps[0]["step"],
        "len": length,
        "gen_tok_s": rows * length / med["step"],
        "n_steps": len(tail),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--settings", default=None, help=f"default: all of {SETTINGS} on cpu")
    ap.add_argument("--arch", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--shape", default=None, help="P,N,T (default: the arch's, SHAPES)")
    ap.add_argument("--extra", default="", help="our launch flags, appended (one string)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument(
        "--smoke", action="store_true", help="1 step per side, one setting each, SMOKE_SHAPE"
    )
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--_trl-worker", dest="trl_worker", default=None)
    ap.add_argument("--_roofline", dest="roofline", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--bf16", action="store_true", help="(TRL worker) GRPOConfig(bf16=True)")
    args = ap.parse_args()
    default_shape = SMOKE_SHAPE if args.smoke else SHAPES[args.arch]
    shape = parse_shape(args.shape) if args.shape else default_shape
    if args.trl_worker:
        trl_worker(
            args.trl_worker,
            args.arch,
            args.steps,
            args.threads,
            args.out,
            shape,
            args.bf16,
            args.device,
        )
        return
    if args.roofline:
        roofline_worker(args.roofline, args.out, args.smoke)
        return
    gpu = args.device == "gpu"
    allowed = GPU_SETTINGS if gpu else SETTINGS
    if args.settings:
        settings = args.settings.split(",")
    else:
        settings = list(GPU_SETTINGS if gpu else ("ours1", "trl1") if args.smoke else SETTINGS)
    bad = [s for s in settings if s not in allowed]
    if bad:
        fail(f"--settings has {bad}; allowed on {args.device}: {list(allowed)}")
    extra = shlex.split(args.extra)
    steps = 1 if args.smoke else args.steps
    with tempfile.TemporaryDirectory(prefix="bench_rl_step_") as tmp:
        roof = measure_roofline(args.device, tmp, args.smoke)  # gpu: fails here without one
        from common import check_load, cpu_description, cpu_flags, record

        from aqn_jax.data.arithmetic import ArithmeticTask
        from aqn_jax.data.tokenizers import CharTokenizer
        from aqn_jax.models.hf import abstract_params, config_from_hf

        load = check_load()
        flags = cpu_flags()
        print(cpu_description(), load, "| CPU flags:", flags, "| device:", roof["device"])
        print(
            f"roofline ({roof['device']}): read bandwidth {roof['bw'] / 1e9:.1f} GB/s, matmul peak"
            f" f32 {roof['float32'] / 1e12:.3f}, bf16 {roof['bfloat16'] / 1e12:.3f} TFLOP/s"
        )
        prompts, n, new = shape
        tok = CharTokenizer()
        examples = ArithmeticTask().examples("train", prompts * steps)
        prompt_len = statistics.mean(len(tok.encode_chat(e.prompt_messages)) for e in examples)
        results, roofs = {}, {}
        wdir = weights_dir(args.arch, tmp)
        cfg, _ = config_from_hf(json.loads(Path(wdir, "config.json").read_text()))
        n_params = sum(x.size for x in jax_leaves(abstract_params(cfg)))
        for s in settings:
            if s.startswith("ours"):
                res = run_ours(s, args.arch, wdir, steps, tmp, shape, extra)
            else:
                res = run_trl(s, args.arch, wdir, steps, tmp, shape)
            results[s] = summarise(res)
            r = results[s]
            bf16 = s.endswith(("_bf16", "_gpu"))
            roofs[s] = roofline(r, cfg, n_params, prompts * n, prompt_len, roof, bf16)
            print(
                f"{s}: step {r['step']:.2f}s (gen {r['gen']:.2f}, log-probs {r['logprobs']:.2f},"
                f" update {r['update']:.2f}); first step {r['first']:.1f}s; completion"
                f" {r['len']:.1f} tokens; {r['gen_tok_s']:.0f} generated tok/s;"
                f" process wall {res['wall_s']:.0f}s"
                + (
                    f"; down_proj output {res['proj_out']}, weights {res['weights']}"
                    if "proj_out" in res
                    else ""
                ),
                flush=True,
            )
            print(f"ROOFLINE setting={s} " + " ".join(f"{k}={v:.6g}" for k, v in roofs[s].items()))
    lines = []
    ours = {s: r for s, r in results.items() if s.startswith("ours")}
    trl = {s: r for s, r in results.items() if s.startswith("trl")}
    pairs = []
    if ours and trl:
        best_o = min(ours, key=lambda s: ours[s]["step"])
        best_t = min(trl, key=lambda s: trl[s]["step"])
        pairs.append(("best", best_o, best_t))
        for o, t in (("ours1", "trl1"), ("ours2", "trl2p")):
            for suffix in ("", "_bf16"):
                if o + suffix in ours and t + suffix in trl:
                    pairs.append((f"{o}_{t}{suffix}", o + suffix, t + suffix))
    for name, o, t in pairs:
        a, b = ours[o], trl[t]
        differ = abs(a["len"] - b["len"]) > 0.1 * max(a["len"], b["len"])
        if differ:  # per generated token
            ratio = (b["step"] / b["len"]) / (a["step"] / a["len"])
            note = "per_generated_token"
        else:
            ratio, note = b["step"] / a["step"], "per_step"
        suffix = ("" if args.arch == "tiny" else "_" + args.arch) + ("_gpu" if gpu else "")
        lines.append(
            f"BENCH rl_step_vs_trl{suffix} ratio={ratio:.3f} pairing={name} ours={o} trl={t}"
            f" ours_step_s={a['step']:.2f} trl_step_s={b['step']:.2f}"
            f" ours_first_s={a['first']:.1f} trl_first_s={b['first']:.1f}"
            f" ours_len={a['len']:.1f} trl_len={b['len']:.1f} normalised={note}"
        )
    for line in lines:
        print(line)
    if args.record and not args.smoke:
        table = [
            "| setting | step s | generation | log-probs | update | first step s | completion"
            " tokens | generated tok/s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for s, r in results.items():
            table.append(
                f"| {s} | {r['step']:.2f} | {r['gen']:.2f} | {r['logprobs']:.2f} |"
                f" {r['update']:.2f} | {r['first']:.1f} | {r['len']:.1f} | {r['gen_tok_s']:.0f} |"
            )
        intro = (
            f"`{args.arch}`: {prompts} prompts x {n} samples, <= {new} new tokens, KL {KL},"
            f" lr {LR}, 2 updates per step on both sides; medians over steps 3..{steps};"
            f" load before: {load}; CPU flags: {flags}; device {roof['device']}."
            + (f" Our extra flags: `{args.extra}`." if extra else "")
            + "\n\n"
            + "\n".join(f"`{x}`" for x in lines)
        )
        table[0] += " decode % of floor | log-probs MFU % | update MFU % |"
        table[1] += "---|---|---|"
        for i, s in enumerate(results, start=2):
            f = roofs[s]
            table[i] += (
                f" {f['decode_pct_floor']:.1f} | {f['logprobs_mfu_pct']:.1f} |"
                f" {f['update_mfu_pct']:.1f} |"
            )
        print("recorded in", record("bench/rl_step.py", intro, table))


if __name__ == "__main__":
    main()
