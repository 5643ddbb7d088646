"""SRDD on a real pretrained LM (SmolLM2-135M-Instruct, llama, 30 layers): fault placement ->
verdict, top-1 hit rate and confidence, and the metric that misled it where it is wrong.

  python -m aqn_jax.models.gguf --out=/tmp/smollm2          # once (needs '.[gguf]')
  python bench/srdd_real.py --hf-path=/tmp/smollm2 [--layers 3,5,10,15,20,25]
      [--thresholds 0.01,0.1] [--noise-layer 15] [--prompts 4] [--record]
  # Qwen2.5-Coder-0.5B on GSM8K prompts (configs/qwen2p5_coder_0p5b_gsm8k.py's diagnosis):
  python bench/srdd_real.py --hf-path=/tmp/qwen05 --config=qwen2p5_coder_0p5b_gsm8k \
      --gsm8k=../shared/datasets/gsm8k --layers 3,5,9,15,18,20 [--granularity token]

The calibration prompts are the embedded task's train prompts in the model's chat format
(`configs/smollm2_135m.py`), SRDD's settings are that config's `diagnosis` section. Placements:
the seed's deadzone (`|h| < t * max|h|`, tensor-wide, on the residual stream after the layer) at
each layer x threshold (one compiled scan: the threshold is a traced per-layer vector;
`--granularity token|block` takes each token's or 32-lane block's own max instead), 5%
relative Gaussian noise on one layer's linear outputs, and the clean device. A placement is a
hit when the verdict names exactly the faulty layer (and the clean device's is "no fault
found"). Prints `BENCH srdd_real_<kind> ratio=<hit rate>` (ratio = hit rate: there is no
reference implementation to time against).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import check_load, cpu_description, record  # noqa: E402

from aqn_jax.data.config import load_split  # noqa: E402
from aqn_jax.diagnosis import analysis, srdd  # noqa: E402
from aqn_jax.diagnosis.scans import make_scan, swept_deadzone_plan  # noqa: E402
from aqn_jax.faults.config import fault_plan  # noqa: E402
from aqn_jax.faults.intercept import step_key  # noqa: E402
from aqn_jax.models.factory import load_params, model_config  # noqa: E402
from aqn_jax.models.qwen2 import Qwen2ForCausalLM  # noqa: E402
from aqn_jax.warm_start import tokenizer_for  # noqa: E402


def _config(hf_path: str, name: str = "smollm2_135m", gsm8k: str = ""):
    """`configs/<name>.py:deadzone` on the snapshot; `gsm8k`: the directory of GSM8K's
    train/test.jsonl, for a config that requires data paths (its prompts then calibrate)."""
    import importlib

    config = importlib.import_module(f"configs.{name}").get_config("deadzone")
    config.model.hf_path = hf_path
    config.tokenizer_path = ""
    if gsm8k:
        config.data.train_path = str(Path(gsm8k) / "train.jsonl")
        config.data.test_path = str(Path(gsm8k) / "test.jsonl")
    return config


def _verdict(scans, diag):
    declare = (diag.declare,) if isinstance(diag.declare, str) else tuple(diag.declare)
    return analysis.verdict(
        scans,
        z_threshold=float(diag.z_threshold),
        declare=declare,
        dead_floor=float(diag.dead_floor),
        instability_floor=float(diag.instability_floor),
    )


def _misled(v, layer: int | None) -> str:
    """Why a wrong verdict was wrong: the metrics that declared the top suspect, and how the
    faulty layer's own z-scores compare."""
    if not v["suspects"]:
        return ""
    top = v["suspects"][0]
    ev = ", ".join(f"{m} z={e['z']:.1f}" for m, e in top["evidence"].items() if e["z"] is not None)
    text = f"top suspect L{top['layer']} ({ev or 'no metric over the threshold'})"
    if layer is not None and top["layer"] != layer:
        zs = {m: v["z"][m][layer] for m in analysis.DIRECTIONS}
        own = ", ".join(f"{m} z={z:.1f}" for m, z in zs.items() if np.isfinite(z))
        text += f"; at L{layer}: {own}"
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-path", required=True)
    ap.add_argument("--config", default="smollm2_135m", help="configs/<name>.py (diagnosis, data)")
    ap.add_argument("--gsm8k", default="", help="GSM8K jsonl directory (Qwen2.5 + GSM8K config)")
    ap.add_argument("--layers", default="3,5,10,15,20,25")
    ap.add_argument("--thresholds", default="0.01,0.1")
    ap.add_argument("--noise-layer", type=int, default=15)
    ap.add_argument("--noise-scale", type=float, default=0.05)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--granularity", default="tensor", choices=("tensor", "token", "block"))
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    print(cpu_description(), check_load())
    layers = [int(x) for x in args.layers.split(",")]
    thresholds = [float(x) for x in args.thresholds.split(",")]

    config = _config(args.hf_path, args.config, args.gsm8k)
    diag = config.diagnosis
    qcfg = model_config(config.model)
    tok = tokenizer_for(config.tokenizer_path, config.model.hf_path, qcfg.vocab_size)
    ids, mask = srdd.calibration_batch(
        load_split(config.data, "train"), tok, args.prompts, int(diag.max_prompt_len)
    )
    params = load_params(qcfg, config.model.hf_path, config.seed)
    model = Qwen2ForCausalLM(qcfg)
    n = qcfg.num_hidden_layers
    keys = (step_key(int(diag.seed), 0, "eval"), jax.random.key(int(diag.seed) + 1))
    print(f"{qcfg.model_type}, {n} layers; calibration {ids.shape[0]} prompts, {mask.sum()} tokens")

    # The seed's deadzone at every placement through one compiled scan: Deadzone(0.5) scaled by
    # a traced per-layer vector (0 = off; an amax threshold of 0 flushes nothing).
    plan = swept_deadzone_plan("dz", granularity=args.granularity)
    scan = make_scan(model, plan, srdd.settings_from(diag))
    rows, hits, conf = [], {}, {}
    t0 = time.perf_counter()
    for thr in thresholds:
        hits[thr], conf[thr] = 0, []
        for layer in layers:
            vec = np.zeros(n, np.float32)
            vec[layer] = thr / 0.5
            out = scan(params, ids, mask, *keys, {"dz": vec})
            scans = {m: np.asarray(x, np.float64) for m, x in out.items()}
            v = _verdict(scans, diag)
            ok = v["layers"] == [layer]
            hits[thr] += ok
            conf[thr].append(v["confidence"] if ok else 0.0)
            rows.append(
                f"| deadzone {thr:g} x {args.granularity} max | {layer} | {v['message']} |"
                f" {v['confidence']:.3f} |"
                f" {scans['dead'][layer]:.3f} | {scans['gain'][layer]:.3f} |"
                f" {'' if ok else _misled(v, layer)} |"
            )
            print(rows[-1], flush=True)
    sweep_s = time.perf_counter() - t0

    config.faults.deadzone.enabled = False
    config.faults.noise.enabled = True
    config.faults.noise.scale = args.noise_scale
    config.faults.noise.layers = str(args.noise_layer)
    r = srdd.diagnose(
        model, params, fault_plan(config.faults, n), ids, mask, srdd.SrddSpec.of(diag, 0.05)
    )
    noise_ok = r["verdict"]["layers"] == [args.noise_layer]
    lay = r["layers"][args.noise_layer]
    v_noise = {"suspects": r["suspects"], "z": _z_of(r)}
    rows.append(
        f"| noise {args.noise_scale:g} (linear outputs) | {args.noise_layer} |"
        f" {r['verdict']['message']} | {r['verdict']['confidence']:.3f} | {lay['dead']:.3f} |"
        f" {lay['gain']:.3f} | {'' if noise_ok else _misled(v_noise, args.noise_layer)} |"
    )
    print(rows[-1], flush=True)
    config.faults.noise.enabled = False
    clean = srdd.diagnose(
        model, params, fault_plan(config.faults, n), ids, mask, srdd.SrddSpec.of(diag, 0.05)
    )
    clean_ok = not clean["verdict"]["layers"]
    v_clean = {"suspects": clean["suspects"], "z": _z_of(clean)}
    rows.append(
        f"| none | - | {clean['verdict']['message']} | {clean['verdict']['confidence']:.3f} |"
        f" | | {'' if clean_ok else _misled(v_clean, None)} |"
    )
    print(rows[-1], flush=True)

    summary = []
    for thr in thresholds:
        summary.append(
            f"BENCH srdd_real_dz{thr:g} ratio={hits[thr] / len(layers):.3f}"
            f" placements={len(layers)} mean_conf_hits={np.mean(conf[thr]):.3f}"
        )
    summary.append(f"BENCH srdd_real_noise ratio={float(noise_ok):.3f} placements=1")
    summary.append(f"BENCH srdd_real_clean ratio={float(clean_ok):.3f} placements=1")
    for s in summary:
        print(s)
    print(f"{len(thresholds) * len(layers)} deadzone diagnoses in {sweep_s:.0f}s (one compile)")
    table = [
        "| fault | layer | verdict | confidence | dead at layer | gain at layer | what misled |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]
    if args.record:
        where = f"{qcfg.model_type} ({args.hf_path}), SRDD settings of configs/{args.config}.py"
        calib = f"{ids.shape[0]} calibration prompts ({int(mask.sum())} tokens)"
        timing = f"{len(thresholds) * len(layers)} deadzone diagnoses in {sweep_s:.0f}s"
        bench_lines = [f"`{s}`" for s in summary]
        record("bench/srdd_real.py", f"{where}; {calib}; {timing}.", [*bench_lines, "", *table])
        print("recorded in WORKSPACE.md")


def _z_of(report) -> dict:
    """The per-layer z-scores of a `srdd.diagnose` report, as `analysis.verdict` gives them."""
    return {
        m: np.array(
            [np.nan if r["z"][m] is None else r["z"][m] for r in report["layers"]], np.float64
        )
        for m in analysis.DIRECTIONS
    }


if __name__ == "__main__":
    main()
