"""Device section A (issue 43 item 4): GRPO step time on one GPU at the real 0.5B shape, random
weights, through bench/rl_step.py's own programs (run_ours / run_trl / summarise / roofline),
with the roofline and the random snapshot made once for all settings, and a cold persistent
compile cache per setting (each first step compiles its own programs):

  ours_full   ours_gpu as rl_step.py runs it (bf16 compute over f32 master weights)
  ours_lora   + --config.lora.rank=32
  ours_nvfp4  + --config.lora.rank=32 --config.model.weight_format=nvfp4
  trl_gpu     TRL's GRPOTrainer (bf16), the reference

  python bench/device/section_a.py --arch qwen2p5_0p5b --shape 8,8,256 --steps 4 \
      --order ours_full,ours_lora,trl_gpu,ours_nvfp4 --budget 400 --out $OUT/A.json

Each setting runs in its own process with a timeout (what is left of --budget, at most
--per-setting); a setting that fails or times out is reported and the next one runs. Prints the
per-setting lines and ROOFLINE lines as rl_step.py does, and one BENCH line per ours setting
against trl_gpu: ratio = TRL s/step / ours s/step (> 1: we are faster).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import rl_step  # noqa: E402

EXTRA = {
    "ours_full": [],
    "ours_lora": ["--config.lora.rank=32"],
    "ours_nvfp4": ["--config.lora.rank=32", "--config.model.weight_format=nvfp4"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen2p5_0p5b")
    ap.add_argument("--shape", default="8,8,256")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--order", default="ours_full,ours_lora,trl_gpu,ours_nvfp4")
    ap.add_argument("--device", default="gpu", choices=("cpu", "gpu"))
    ap.add_argument("--budget", type=float, default=400.0, help="seconds for all settings")
    ap.add_argument("--per-setting", type=float, default=170.0)
    ap.add_argument("--extra", default="", help="our launch flags for every ours setting")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t_start = time.perf_counter()
    shape = rl_step.parse_shape(args.shape)
    prompts, n, new = shape
    order = [s for s in args.order.split(",") if s]
    gpu = args.device == "gpu"
    report: dict = {"arch": args.arch, "shape": shape, "steps": args.steps, "settings": {}}

    def save():
        report["wall_s"] = time.perf_counter() - t_start
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))

    with tempfile.TemporaryDirectory(prefix="devA_") as tmp:
        t0 = time.perf_counter()
        try:
            roof = rl_step.measure_roofline(args.device, tmp, not gpu)
        except SystemExit as e:  # no GPU: rl_step's one line is on stderr already
            report["error"] = f"roofline: {e}"
            save()
            raise
        report["roofline"] = roof
        from common import cpu_flags

        from aqn_jax.data.arithmetic import ArithmeticTask
        from aqn_jax.data.tokenizers import CharTokenizer
        from aqn_jax.models.hf import abstract_params, config_from_hf

        report["cpu_flags"] = cpu_flags()
        print(
            f"A roofline ({roof['device']}, {time.perf_counter() - t0:.0f} s): read bandwidth"
            f" {roof['bw'] / 1e9:.1f} GB/s, matmul peak f32 {roof['float32'] / 1e12:.1f},"
            f" bf16 {roof['bfloat16'] / 1e12:.1f} TFLOP/s",
            flush=True,
        )
        t0 = time.perf_counter()
        wdir = rl_step.weights_dir(args.arch, tmp)
        print(f"A random snapshot {args.arch}: {time.perf_counter() - t0:.0f} s", flush=True)
        cfg, _ = config_from_hf(json.loads(Path(wdir, "config.json").read_text()))
        n_params = sum(x.size for x in rl_step.jax_leaves(abstract_params(cfg)))
        tok = CharTokenizer()
        examples = ArithmeticTask().examples("train", prompts * args.steps)
        prompt_len = sum(len(tok.encode_chat(e.prompt_messages)) for e in examples) / len(examples)
        extra = args.extra.split()
        results = {}
        for name in order:
            left = args.budget - (time.perf_counter() - t_start)
            limit = min(args.per_setting, left)
            if limit < 30:
                print(f"A {name}: skipped ({left:.0f} s of the budget left)", flush=True)
                report["settings"][name] = {"error": f"skipped: {left:.0f} s left"}
                save()
                continue
            # rl_step runs each side with subprocess.run: give it this setting's timeout.
            rl_step.subprocess = types.SimpleNamespace(
                run=functools.partial(subprocess.run, timeout=limit)
            )
            # A cold persistent compile cache per setting: each first step is its own compile.
            os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tmp, f"xla_{name}")
            t0 = time.perf_counter()
            try:
                if name.startswith("ours"):
                    setting = "ours_gpu" if gpu else "ours2_bf16"
                    res = rl_step.run_ours(
                        setting, args.arch, wdir, args.steps, tmp, shape, extra + EXTRA[name]
                    )
                else:
                    setting = "trl_gpu" if gpu else "trl2p_bf16"
                    res = rl_step.run_trl(setting, args.arch, wdir, args.steps, tmp, shape)
            except BaseException as e:  # noqa: BLE001 - one setting's failure is reported
                if isinstance(e, KeyboardInterrupt):
                    raise
                why = (
                    f"timed out after {limit:.0f} s"
                    if isinstance(e, subprocess.TimeoutExpired)
                    else f"{type(e).__name__}: {str(e)[-2500:]}"
                )
                print(f"A {name}: FAILED ({why})", flush=True)
                if not isinstance(e, (SystemExit, subprocess.TimeoutExpired)):
                    traceback.print_exc()
                report["settings"][name] = {"error": why, "s": time.perf_counter() - t0}
                save()
                continue
            r = rl_step.summarise(res)
            f = rl_step.roofline(r, cfg, n_params, prompts * n, prompt_len, roof, True)
            results[name] = r
            report["settings"][name] = {
                "summary": r,
                "roofline": f,
                "steps": res["steps"],
                "process_wall_s": res["wall_s"],
                "extra": extra + EXTRA.get(name, []),
                **{k: res[k] for k in ("proj_out", "weights") if k in res},
            }
            save()
            print(
                f"A {name}: step {r['step']:.3f}s (gen {r['gen']:.3f}, log-probs"
                f" {r['logprobs']:.3f}, update {r['update']:.3f}); first step {r['first']:.1f}s;"
                f" completion {r['len']:.1f} tokens; {r['gen_tok_s']:.0f} generated tok/s;"
                f" process wall {res['wall_s']:.0f}s; per-step"
                f" {[round(s['step'], 3) for s in res['steps']]}",
                flush=True,
            )
            print(f"ROOFLINE setting={name} " + " ".join(f"{k}={v:.6g}" for k, v in f.items()))
    lines = []
    trl = results.get("trl_gpu")
    for name, a in results.items():
        if not name.startswith("ours") or trl is None:
            continue
        b = trl
        differ = abs(a["len"] - b["len"]) > 0.1 * max(a["len"], b["len"])
        if differ:
            ratio, note = (b["step"] / b["len"]) / (a["step"] / a["len"]), "per_generated_token"
        else:
            ratio, note = b["step"] / a["step"], "per_step"
        dev = roof["device"].replace(" ", "_")
        lines.append(
            f"BENCH rl_step_vs_trl_{args.arch}_{args.device} ratio={ratio:.3f} ours={name}"
            f" trl=trl_gpu device={dev} ours_step_s={a['step']:.3f} trl_step_s={b['step']:.3f}"
            f" ours_first_s={a['first']:.1f} trl_first_s={b['first']:.1f}"
            f" ours_len={a['len']:.1f} trl_len={b['len']:.1f} normalised={note}"
        )
    if trl is None:
        lines.append("BENCH rl_step_vs_trl: no ratio (trl_gpu did not finish)")
    report["bench_lines"] = lines
    save()
    for line in lines:
        print(line, flush=True)


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
