"""The study's final evaluation on the real Qwen2.5-Coder-0.5B with the prompts' shared prefix
prefilled once (config.rollout.share_prefix), then with finished rows retired from the decode as
well (config.rollout.retire_rows), against each prompt prefilled whole and every row decoded to
its batch's end (the evaluation before both levers).

  python bench/evaluate_speed.py --hf-path=/models/qwen05 [--caps 64,32] [--reps 1] [--record]
      [--size 256]   # the faulty device's problems (the clean device: half as many)
      [--batches 32,128]   # the study's decode batch, then larger ones (sharing on)

The evaluation is `configs/qwen2p5_coder_0p5b_gsm8k.py:study,arith`'s (f32, greedy, the 192
bucket, batches of 32): the first 256 arith test problems on the faulty device (the per-token
deadzone 0.07 at layer 15) and the first 128 on the clean one, 384 problems, of the imported
snapshot (the warm start: its answers often run to the 64-token cap). `--caps`: the new-token
caps timed; 32 stands in for a trained policy, whose answers end at ~30 tokens. Each (cap,
setting) runs in its own process (its peak RSS its own), in the order off, on, retire (and the
larger batches) per repetition; each compiles on one batch of each device first (timed apart),
then evaluates the 384 problems.
Prints each process's seconds, then per cap `BENCH evaluate_shared_prefix ratio=<off s / on s>`
with the peak RSS of both, and whether both settings gave the same greedy answers (the share of
problems whose response text is equal, per device); `BENCH evaluate_retire ratio=<on s / on and
retiring s>` with `off_over_both` (the two levers against neither: the evaluation's cost before
and after) and the answers against "off". `--batches=32,128`: also the same evaluation
with sharing on at each further decode batch size, `BENCH evaluate_batch ratio=<on at the first
/ on at it>` (a decode step reads every weight once for the whole batch, so on a CPU a larger
batch amortises it), with its answers against the first batch's. `--record` appends the table to
WORKSPACE.md with the CPU's flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time


def _config(
    hf_path: str,
    cap: int,
    share: bool,
    size: int = 256,
    batch: int | None = None,
    retire: bool = False,
):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
    import qwen2p5_coder_0p5b_gsm8k as preset

    config = preset.get_config("study,arith")
    config.model.hf_path = hf_path
    config.rollout.max_new_tokens = cap
    config.rollout.share_prefix = share
    config.rollout.retire_rows = retire
    config.evaluate.size, config.evaluate.clean_size = size, size // 2
    if batch is not None:
        config.evaluate.batch_size = batch
    return config


def child(args) -> None:
    """One (cap, setting) in this process: compile on one batch a device, then time the whole
    evaluation; print its seconds, peak RSS and every response."""
    from aqn_jax import parallel
    from aqn_jax.data.config import load_split
    from aqn_jax.evaluation import robustness
    from aqn_jax.faults.config import fault_plan
    from aqn_jax.models.factory import logical_axes, model_config
    from aqn_jax.models.hf import load_hf_checkpoint
    from aqn_jax.spec import eval_spec
    from aqn_jax.warm_start import tokenizer_for

    cap, setting = int(args.cap), args.child
    batch = int(args.batch) if args.batch else None
    share, retire = setting in ("on", "retire"), setting == "retire"
    config = _config(args.hf_path, cap, share, int(args.size), batch, retire)
    model_cfg = model_config(config.model)
    _, params = load_hf_checkpoint(args.hf_path, model_cfg.dtype)
    tok = tokenizer_for(config.tokenizer_path, config.model.hf_path, model_cfg.vocab_size)
    test = load_split(config.data, "test")[: int(config.evaluate.size)]
    mesh = parallel.make_mesh(config.mesh)
    params = parallel.put_global(params, parallel.param_shardings(logical_axes(model_cfg), mesh))
    hardware = fault_plan(config.faults, model_cfg.num_hidden_layers)
    spec = eval_spec(config)
    programs: dict = {}
    warm = dataclasses.replace(spec, clean_size=spec.batch_size)
    t0 = time.perf_counter()
    robustness(
        warm, model_cfg, params, tok, test[: spec.batch_size], hardware, mesh, print, programs
    )
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = robustness(spec, model_cfg, params, tok, test, hardware, mesh, print, programs)
    seconds = time.perf_counter() - t0
    conds = result["conditions"]
    out = {
        "cap": cap,
        "setting": setting,
        "compile_s": t_compile,
        "eval_s": seconds,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "acc": {k: c["acc"] for k, c in conds.items()},
        "n": {k: c["n"] for k, c in conds.items()},
        "clipped": {k: c["clipped"] for k, c in conds.items()},
        "tokens_mean": {
            k: sum(r["tokens"] for r in c["records"]) / len(c["records"]) for k, c in conds.items()
        },
        "responses": {k: [r["response"] for r in c["records"]] for k, c in conds.items()},
    }
    print("RESULT " + json.dumps(out), flush=True)


def _same(a: dict, b: dict) -> dict:
    """Per device, the share of problems whose response text is equal in both runs."""
    return {
        k: sum(x == y for x, y in zip(a["responses"][k], b["responses"][k], strict=True))
        / len(a["responses"][k])
        for k in a["responses"]
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf-path", required=True)
    p.add_argument("--caps", default="64,32")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--record", action="store_true")
    p.add_argument("--size", type=int, default=256, help="faulty-device problems (clean: half)")
    p.add_argument(
        "--batches",
        default="32",
        help="decode batch sizes: the first is the study's (off and on); each further one runs"
        " with sharing on and is printed as BENCH evaluate_batch (first / it)",
    )
    p.add_argument("--batch", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cap", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    try:
        caps = [int(c) for c in args.caps.split(",")]
    except ValueError:
        sys.exit(f"--caps={args.caps!r}; allowed: comma-separated positive ints")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        sys.exit(f"--batches={args.batches!r}; allowed: comma-separated positive ints")
    if not batches or min(batches) < 1 or len(set(batches)) != len(batches):
        sys.exit(f"--batches={args.batches!r}; allowed: distinct positive ints")
    settings = [("off", batches[0]), ("on", batches[0]), ("retire", batches[0])]
    settings += [("on", b) for b in batches[1:]]
    if not caps or min(caps) < 1 or not os.path.isdir(args.hf_path):
        sys.exit(f"--caps={args.caps!r} (positive ints) or --hf-path={args.hf_path!r} not a dir")
    sys.path.insert(0, os.path.dirname(__file__))
    from common import check_load, cpu_description, cpu_flags, record

    load = check_load()
    runs: dict[tuple[int, str], list[dict]] = {}
    for cap in caps:
        for rep in range(args.reps):
            for setting, batch in settings:
                cmd = [sys.executable, __file__, f"--hf-path={args.hf_path}", f"--size={args.size}"]
                proc = subprocess.run(
                    [*cmd, f"--child={setting}", f"--cap={cap}", f"--batch={batch}"],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode or not line:
                    sys.exit(
                        f"cap {cap} {setting} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
                    )
                res = json.loads(line[0][7:])
                brief = {k: v for k, v in res.items() if k != "responses"}
                name = setting if batch == batches[0] else f"on b{batch}"
                name = "on+retire" if setting == "retire" else name
                print(f"cap {cap} rep {rep} {name}: " + json.dumps(brief), flush=True)
                runs.setdefault((cap, name), []).append(res)
    table = [
        f"| cap | setting (batch {batches[0]} unless named) | eval s (median) | compile s |"
        " peak RSS GiB | acc fault / clean |"
        " mean tokens fault / clean | clipped fault / clean |",
        "|---|---|---|---|---|---|---|---|",
    ]
    benches = []
    for cap in caps:
        med = {}
        names = ["off", "on", "on+retire"] + [f"on b{b}" for b in batches[1:]]
        for setting in names:
            rs = sorted(runs[(cap, setting)], key=lambda r: r["eval_s"])
            r = rs[len(rs) // 2]
            med[setting] = r
            table.append(
                f"| {cap} | {setting} | {r['eval_s']:.1f} | {r['compile_s']:.1f} |"
                f" {r['peak_rss_gib']:.2f} | {r['acc']['fault']:.3f} / {r['acc']['clean']:.3f} |"
                f" {r['tokens_mean']['fault']:.1f} / {r['tokens_mean']['clean']:.1f} |"
                f" {r['clipped']['fault']:.2f} / {r['clipped']['clean']:.2f} |"
            )
        off, on = med["off"], med["on"]
        same = _same(off, on)
        benches.append(
            f"BENCH evaluate_shared_prefix ratio={off['eval_s'] / on['eval_s']:.2f} cap={cap}"
            f" off_s={off['eval_s']:.1f} on_s={on['eval_s']:.1f}"
            f" rss_off_gib={off['peak_rss_gib']:.2f} rss_on_gib={on['peak_rss_gib']:.2f}"
            f" same_answers_fault={same['fault']:.4f} same_answers_clean={same['clean']:.4f}"
            f" problems={sum(off['n'].values())} reps={args.reps}"
        )
        both = med["on+retire"]
        same = _same(off, both)
        benches.append(
            f"BENCH evaluate_retire ratio={on['eval_s'] / both['eval_s']:.2f} cap={cap}"
            f" on_s={on['eval_s']:.1f} both_s={both['eval_s']:.1f}"
            f" off_over_both={off['eval_s'] / both['eval_s']:.2f}"
            f" rss_off_gib={off['peak_rss_gib']:.2f} rss_both_gib={both['peak_rss_gib']:.2f}"
            f" same_answers_fault={same['fault']:.4f} same_answers_clean={same['clean']:.4f}"
        )
        for b in batches[1:]:
            big = med[f"on b{b}"]
            same = _same(on, big)
            benches.append(
                f"BENCH evaluate_batch ratio={on['eval_s'] / big['eval_s']:.2f} cap={cap}"
                f" batch={batches[0]}_vs_{b} on_s={on['eval_s']:.1f} big_s={big['eval_s']:.1f}"
                f" rss_gib={on['peak_rss_gib']:.2f}/{big['peak_rss_gib']:.2f}"
                f" same_answers_fault={same['fault']:.4f} same_answers_clean={same['clean']:.4f}"
                f" off_over_big={off['eval_s'] / big['eval_s']:.2f}"
            )
    print("\n".join(table))
    print("\n".join(benches))
    if args.record:
        intro = (
            f"`python bench/evaluate_speed.py --hf-path={args.hf_path} --caps={args.caps}"
            f" --reps={args.reps} --size={args.size} --batches={args.batches}`"
            f" on {cpu_description()} ({cpu_flags()}); load: {load}"
        )
        print(f"recorded in {record('evaluate_speed.py', intro, [*table, '', *benches])}")


if __name__ == "__main__":
    main()
