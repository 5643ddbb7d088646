"""SRDD localisation sweep on the warm-started embedded model: fault layer x kind -> verdict.

  python bench/srdd_sweep.py [--sft-steps 60] [--record]

SFT of the tiny model on the arithmetic task (as the tests' short warm start, longer), then one
diagnosis per placement: a deadzone on the residual stream of each layer at thresholds 0.01,
0.1, 0.2 and 0.5 (one compiled scan: the threshold is a traced per-layer vector), a 5% relative
noise fault on each layer's linears (instability), and the clean device. Prints a
`BENCH srdd_localisation ratio=<hit rate>` line per threshold (ratio = top-1 hit rate; no
reference implementation to compare speed with here) and, with --record, the table into
WORKSPACE.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import check_load, cpu_description, record  # noqa: E402

from aqn_jax.aqn.config import aqn_config  # noqa: E402
from aqn_jax.aqn.plan import build_plan  # noqa: E402
from aqn_jax.data.arithmetic import ArithmeticTask  # noqa: E402
from aqn_jax.data.tokenizers import CharTokenizer  # noqa: E402
from aqn_jax.diagnosis import analysis, srdd  # noqa: E402
from aqn_jax.diagnosis.config import diagnosis_config  # noqa: E402
from aqn_jax.diagnosis.scans import make_scan, swept_deadzone_plan  # noqa: E402
from aqn_jax.faults.config import faults_config  # noqa: E402
from aqn_jax.faults.intercept import step_key  # noqa: E402
from aqn_jax.models.factory import init_params  # noqa: E402
from aqn_jax.models.qwen2 import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from aqn_jax.rl.sft import sft_sequences, sft_train  # noqa: E402

THRESHOLDS = (0.01, 0.1, 0.2, 0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    print(cpu_description(), check_load())

    tok, task = CharTokenizer(), ArithmeticTask()
    cfg = Qwen2Config.preset("tiny")
    model = Qwen2ForCausalLM(cfg)
    params = init_params(cfg, 0)
    t0 = time.perf_counter()
    if args.sft_steps:
        params, hist = sft_train(
            model,
            params,
            sft_sequences(task.examples("train", 512), tok),
            steps=args.sft_steps,
            batch_size=16,
            lr=3e-3,
            warmup_steps=5,
        )
        print(f"SFT {args.sft_steps} steps: loss {hist['loss'][0]:.3f} -> {hist['loss'][-1]:.3f}")
    sft_s = time.perf_counter() - t0
    ids, mask = srdd.calibration_batch(task.examples("train", 64), tok, args.prompts, 256)
    diag = diagnosis_config()
    n = cfg.num_hidden_layers
    keys = (step_key(0, 0, "eval"), jax.random.key(1))
    plan = swept_deadzone_plan("dz")
    scan = make_scan(model, plan, srdd.settings_from(diag))
    rows, hits = [], {}
    t0 = time.perf_counter()
    for thr in THRESHOLDS:
        hits[thr] = 0
        for layer in range(n):
            vec = np.zeros(n, np.float32)
            vec[layer] = thr / 0.5
            out = scan(params, ids, mask, *keys, {"dz": vec})
            scans = {m: np.asarray(v, np.float64) for m, v in out.items()}
            v = analysis.verdict(scans)
            ok = v["layers"] == [layer] and v["suspects"][0]["layer"] == layer
            hits[thr] += ok
            rows.append(
                f"| deadzone {thr:g} | {layer} | {v['layers']} | {v['confidence']:.4f} |"
                f" {scans['dead'][layer]:.4f} | {scans['gain'][layer]:.4f} |"
            )
    sweep_s = time.perf_counter() - t0
    noise_hits = 0
    for layer in range(n):
        c = ml_collections.ConfigDict()
        c.faults, c.aqn = faults_config(), aqn_config()
        c.faults.noise.enabled, c.faults.noise.layers = True, str(layer)
        r = srdd.diagnose(
            model, params, build_plan(c.faults, c.aqn, n), ids, mask, srdd.SrddSpec.of(diag, 0.05)
        )
        ok = r["verdict"]["layers"] == [layer] and "instability" in r["suspects"][0]["evidence"]
        noise_hits += ok
        rows.append(
            f"| noise 5% | {layer} | {r['verdict']['layers']} | {r['verdict']['confidence']:.4f}"
            f" | {r['layers'][layer]['dead']:.4f} | {r['layers'][layer]['gain']:.4f} |"
        )
    c = ml_collections.ConfigDict()
    c.faults, c.aqn = faults_config(), aqn_config()
    clean = srdd.diagnose(
        model, params, build_plan(c.faults, c.aqn, n), ids, mask, srdd.SrddSpec.of(diag, 0.05)
    )
    rows.append(
        f"| clean | - | {clean['verdict']['layers']} | {clean['verdict']['confidence']:.4f} | | |"
    )

    summary = []
    for thr in THRESHOLDS:
        line = f"BENCH srdd_localisation_dz{thr:g} ratio={hits[thr] / n:.3f} placements={n}"
        print(line)
        summary.append(line)
    line = f"BENCH srdd_localisation_noise ratio={noise_hits / n:.3f} placements={n}"
    print(line)
    summary.append(line)
    print(f"clean device: {clean['verdict']['message']}")
    print(f"SFT {sft_s:.1f}s; deadzone sweep {len(THRESHOLDS) * n} diagnoses in {sweep_s:.1f}s")
    table = [
        "| fault | layer | verdict | confidence | dead at layer | gain at layer |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    for r in table:
        print(r)
    if args.record:
        intro = (
            f"Tiny model after {args.sft_steps} SFT steps, {args.prompts} calibration prompts."
            f" SFT {sft_s:.1f}s; {len(THRESHOLDS) * n} deadzone diagnoses {sweep_s:.1f}s (one"
            f" compile). Clean device: {clean['verdict']['message']}.\n\n"
            + "\n".join(f"`{s}`" for s in summary)
        )
        print("recorded in", record("bench/srdd_sweep.py", intro, table))


if __name__ == "__main__":
    main()
