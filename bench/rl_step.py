"""One GRPO step of aqn_jax against TRL's `GRPOTrainer` (the CPU user's peer), same machine, same
weights, same shapes.

  pip install -e '.[bench]'
  python bench/rl_step.py [--steps 12] [--settings ours1,trl1,ours2,trl2,trl2p,...]
      [--arch tiny|qwen2p5_0p5b] [--smoke] [--record]

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
"""

from __future__ import annotations

import argparse
import json
import os
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
}
# --smoke (CI: both sides run, nothing timed): the same programs and settings at a smaller batch,
# 4 prompts x 2 samples, at most 8 new tokens.
SMOKE_SHAPE = (4, 2, 8)
BASE_SETTINGS = ("ours1", "trl1", "ours2", "trl2", "trl2p")
SETTINGS = BASE_SETTINGS + tuple(f"{s}_bf16" for s in ("ours1", "trl1", "ours2", "trl2p"))
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
def run_ours(setting: str, arch: str, wdir: str, steps: int, tmp: str, shape) -> dict:
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
        f"--config.actor.micro_batch_rows={prompts // 2 * n}",
    ]  # fmt: skip
    bf16 = setting.endswith("_bf16")
    # The f32 tiny settings start from the shipped warm start through the SFT cache (the
    # default study's path; the snapshot route gives bitwise the same run). bf16 changes the
    # SFT cache key (config.model is part of it), so bf16 reads the same weights as a snapshot.
    if arch != "tiny" or bf16:
        cmd += [f"--config.model.hf_path={wdir}", "--config.sft.enabled=False"]
    if bf16:
        cmd += ["--config.model.dtype=bfloat16"]
    env = dict(os.environ)
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
    cmd += ["--threads", str(threads)]
    if setting.endswith("_bf16"):
        cmd += ["--bf16"]
    if shape != SHAPES[arch]:
        cmd += ["--smoke"]
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
    wdir: str, arch: str, steps: int, threads: int, out: str, shape, bf16: bool = False
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
        use_cpu=True,
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

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            r = fn(*a, **k)
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
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
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


# -- report ----------------------------------------------------------------------------------------
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
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--arch", default="tiny", choices=sorted(SHAPES))
    ap.add_argument(
        "--smoke", action="store_true", help="1 step per side, one setting each, SMOKE_SHAPE"
    )
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--_trl-worker", dest="trl_worker", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--bf16", action="store_true", help="(TRL worker) GRPOConfig(bf16=True)")
    args = ap.parse_args()
    if args.trl_worker:
        shape = SMOKE_SHAPE if args.smoke else SHAPES[args.arch]
        trl_worker(args.trl_worker, args.arch, args.steps, args.threads, args.out, shape, args.bf16)
        return
    from common import check_load, cpu_description, cpu_flags, record

    settings = ["ours1", "trl1"] if args.smoke else args.settings.split(",")
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        raise SystemExit(f"--settings has {bad}; allowed: {list(SETTINGS)}")
    steps = 1 if args.smoke else args.steps
    load = check_load()
    flags = cpu_flags()
    print(cpu_description(), load, "| CPU flags:", flags)
    shape = SMOKE_SHAPE if args.smoke else SHAPES[args.arch]
    prompts, n, new = shape
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_rl_step_") as tmp:
        wdir = weights_dir(args.arch, tmp)
        for s in settings:
            run = run_ours if s.startswith("ours") else run_trl
            res = run(s, args.arch, wdir, steps, tmp, shape)
            results[s] = summarise(res)
            r = results[s]
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
        suffix = "" if args.arch == "tiny" else "_" + args.arch
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
            f" load before: {load}; CPU flags: {flags}.\n\n" + "\n".join(f"`{x}`" for x in lines)
        )
        print("recorded in", record("bench/rl_step.py", intro, table))


if __name__ == "__main__":
    main()
