"""SRDD diagnosis: the batched scan (every probe of every layer in one compiled forward) vs the
naive per-layer loop (the reference: one full forward per layer per probe).

Purpose: the speed-up of `aqn_jax.diagnosis.scans.make_scan` over `scan_layers_naive` on a full
diagnosis (all probes of all layers) of the Qwen2.5-0.5B architecture (24 layers, random f32
weights) with a deadzone fault at the middle layer (12 for 0.5B, threshold 0.01) active on the
simulated device. Target from the issue: ratio >= 5 (steady state). Also checks that both give
the same metrics and that both locate the faulty layer.

Command (from the repository root):

    .venv/bin/python bench/srdd.py [--preset qwen2p5_0p5b] [--prompts 4] [--seq 64]
        [--repeats 5] [--trials 3] [--layers-naive LAYERS] [--naive-keep-logits] [--record]

Method:
  * Weights: bench/common's `random_params` (numpy N(0, 0.02), 1.0 for RMSNorm weights).
  * Batch: `--prompts` rows of random token ids, left-padded: row i has
    seq - i * (seq // 2) // prompts real tokens (row 0 is full), pad id 0.
  * Device: `build_plan` of `faults.deadzone` enabled at `--fault-layer` (default
    num_layers // 2), threshold `--threshold` (0.01), phase `eval`; fault key
    `step_key(0, 0, 'eval')`, probe key `jax.random.key(1)` (as the diagnose job with seed 0).
  * Batched: `make_scan(model, plan, ScanSettings(trials=R))`; compile = `lower(...).compile()`
    (one program); then one warm-up call and `--repeats` timed calls of the compiled scan,
    each blocked until ready; steady state = the median; wall incl. compile = compile + the
    warm-up call. The timed calls are spread evenly through the naive loop's steady pass
    (before every L / repeats-th layer; their time is not counted in the naive's), so that a
    slow spell of the shared host (the naive pass lasts minutes) hits both.
  * Naive: `scan_layers_naive`'s loop, rewritten here only to time compile and run apart. Per
    layer the same jitted program (probe `_OneLayerProbe` at that layer, delta and trial
    traced) runs R + 2 times: trial 0, trials 1..R-1, the noise probe, the DC probe; the
    metrics are computed eagerly with the same `_probe_inputs` / `layer_metrics` and pulled to
    floats per layer, exactly as `scan_layers_naive` does. Its jit compiles TWO programs per
    layer, not one: the noise probe's delta is [B, T, D] while the others' delta is a scalar,
    so it retraces; here both are compiled ahead of time (`lower(...).compile()`), and the
    naive compile time is the sum over the 2 * L programs. First pass = compile + run of
    every layer (wall incl. compile); second pass = the same runs with the compiled programs
    (steady state).
  * Note on the naive programs: they return only the target layer's input and output, so XLA
    removes as dead code every layer after the target and the lm_head: a naive program at
    layer l runs l + 1 layers, not the whole model (cheaper than the hook-based original,
    where PyTorch runs every forward in full). `--naive-keep-logits` also returns the sum of
    the logits so that every forward runs in full, as the original does.
  * `--layers-naive` restricts the naive loop to some layers (e.g. '0,12,23' or '10:14');
    the naive totals are then EXTRAPOLATED (x num_layers / len(subset)) and labelled so; the
    default is the full loop.
  * The machine is a small VM that others may share: the 1-min load average before the run
    is printed (and recorded), with a WARNING above 0.5.

Checks (assertions): every metric agrees between the batched scan and the naive loop within a
relative tolerance `--rtol` (1e-4: max over layers of |batched - naive| divided by the largest
|naive| of that metric over the layers), except the dead fraction, compared in absolute terms
(`--dead-atol`, 1e-4); the dead fraction exceeds the diagnosis' declaration floor
(`diagnosis_config().dead_floor`, 1e-3) at the fault layer only, in both; the verdict of both
(`analysis.verdict`, defaults) is the fault layer. Why not "dead > 0 at the fault layer only":
on healthy layers a single element's DC shift can round to exactly 0 in f32 (the probe's
shift b + d(attn + mlp) cancels to below half an ulp of the output), so healthy layers show
dead fractions of one or two elements (~5e-6 at 4 x 64 tokens), and which elements do so
depends on the compiled program (the batched and naive programs differ by one element at some
layers). Both are far below the floor and the fault's ~3e-2.

Prints informational lines as it goes, then

    BENCH srdd_<tag> ratio=<naive_s/batched_s> batched_s=.. naive_s=.. ...
    BENCH srdd_<tag>_wall ratio=<naive_wall_s/batched_wall_s> ...

(tag 0p5b for qwen2p5_0p5b, else the preset name; steady state, then wall incl. compiles).
With --record (only then) a markdown table is appended to WORKSPACE.md in the repository root
under `### bench/srdd.py — <date> <cpu model, cores>` with the command line.
"""

from __future__ import annotations

import argparse
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from common import check_load, random_params, record, time_calls

from aqn_jax.aqn.config import aqn_config
from aqn_jax.aqn.plan import build_plan
from aqn_jax.diagnosis import analysis
from aqn_jax.diagnosis.config import diagnosis_config
from aqn_jax.diagnosis.scans import (
    METRICS,
    ScanSettings,
    _OneLayerProbe,
    _probe_inputs,
    layer_metrics,
    make_scan,
)
from aqn_jax.faults.config import faults_config
from aqn_jax.faults.fields import parse_layers
from aqn_jax.faults.intercept import FaultPlan, step_key
from aqn_jax.models.qwen2 import PRESETS, Qwen2Config, Qwen2ForCausalLM

PHASE = "eval"
TAGS = {"qwen2p5_0p5b": "0p5b"}
DEAD_FLOOR = diagnosis_config().dead_floor  # the dead fraction a declaration needs (1e-3)


def make_batch(vocab: int, prompts: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Random ids, left-padded: row i has seq - i * (seq // 2) // prompts real tokens."""
    rng = np.random.default_rng(1)
    ids = rng.integers(1, vocab, size=(prompts, seq), dtype=np.int32)
    mask = np.ones((prompts, seq), np.int32)
    for i in range(prompts):
        pad = i * (seq // 2) // prompts
        ids[i, :pad] = 0
        mask[i, :pad] = 0
    return ids, mask


def deadzone_plan(num_layers: int, layer: int, threshold: float) -> FaultPlan:
    config = ml_collections.ConfigDict({"faults": faults_config(), "aqn": aqn_config()})
    config.faults.deadzone.enabled = True
    config.faults.deadzone.layers = str(layer)
    config.faults.deadzone.threshold = threshold
    return build_plan(config.faults, config.aqn, num_layers)


# --- batched -------------------------------------------------------------------------------------
def prepare_batched(model, plan, settings, params, ids, mask, fault_key, probe_key) -> dict:
    """Compile (timed) and warm up the batched scan; `call` is one blocking call."""
    scan = make_scan(model, plan, settings, PHASE)
    args = (params, ids, mask, fault_key, probe_key, {})
    t0 = time.perf_counter()
    compiled = scan.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    print(f"batched: compile {compile_s:.1f}s", flush=True)
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    first_s = time.perf_counter() - t0
    print(f"batched: first call {first_s:.2f}s", flush=True)
    metrics = {m: np.asarray(v, np.float64) for m, v in jax.device_get(out).items()}
    return dict(
        metrics=metrics,
        compile_s=compile_s,
        first_s=first_s,
        wall_s=compile_s + first_s,
        programs=1,
        call=lambda: jax.block_until_ready(compiled(*args)),
    )


# --- naive (scan_layers_naive's loop, compile and run timed apart) -------------------------------
def naive_program(model, plan, ids, mask, fault_key, target: int, keep_logits: bool):
    """`scan_layers_naive`'s per-layer program (optionally keeping the logits alive)."""
    values: dict = {}

    @jax.jit
    def run(params, delta, trial):
        probe = _OneLayerProbe(target, delta, trial)
        with nn.intercept_methods(probe), plan.apply(PHASE, key=fault_key, values=values):
            logits = model.apply({"params": params}, ids, attention_mask=mask)
        if keep_logits:
            return probe.x, probe.out, jnp.sum(logits)
        return probe.x, probe.out

    return run


def naive_compile(run, params, shape):
    """The two programs `scan_layers_naive`'s jit compiles for one layer: scalar delta (trials,
    DC probe) and [B, T, D] delta (noise probe)."""
    zero = jnp.zeros((), jnp.float32)
    scalar = run.lower(params, zero, 0).compile()
    full = run.lower(params, jax.ShapeDtypeStruct(shape, jnp.float32), 0).compile()
    return scalar, full


def naive_layer(programs, layer, settings, params, mask, probe_key) -> dict[str, float]:
    """One layer's R + 2 forwards and metrics, as in `scan_layers_naive`."""
    scalar, full = programs
    zero = jnp.zeros((), jnp.float32)
    x, out0 = scalar(params, zero, 0)[:2]
    trials = [scalar(params, zero, t)[1] for t in range(1, settings.trials)]
    noise, bias = _probe_inputs(settings, probe_key, layer, x, mask)
    out_n = full(params, noise, 0)[1]
    out_b = scalar(params, bias, 0)[1]
    metrics = layer_metrics(settings, mask, out0, trials, out_n, noise, out_b, bias)
    return {m: float(v) for m, v in metrics.items()}


def bench_naive(
    model, plan, settings, params, ids, mask, fault_key, probe_key, layers, keep, between
):
    """First pass (compile + run per layer), then the steady pass; `between[j]` batched calls
    (timed apart, not counted here) run before the j-th layer of the steady pass."""
    num_layers = model.config.num_hidden_layers
    shape = (*ids.shape, model.config.hidden_size)
    metrics = {m: np.full(num_layers, np.nan) for m in METRICS}
    programs, compile_s, first_s, run_s = {}, {}, {}, {}
    t_pass = time.perf_counter()
    for layer in layers:  # first pass: compile + run
        t0 = time.perf_counter()
        programs[layer] = naive_compile(
            naive_program(model, plan, ids, mask, fault_key, layer, keep), params, shape
        )
        compile_s[layer] = time.perf_counter() - t0
        t0 = time.perf_counter()
        naive_layer(programs[layer], layer, settings, params, mask, probe_key)
        first_s[layer] = time.perf_counter() - t0
        print(
            f"naive layer {layer:2d}: compile {compile_s[layer]:.1f}s, first run"
            f" {first_s[layer]:.2f}s",
            flush=True,
        )
    first_pass_s = time.perf_counter() - t_pass
    t_pass = time.perf_counter()
    for j, layer in enumerate(layers):  # second pass: steady state
        between[j]()
        t0 = time.perf_counter()
        row = naive_layer(programs[layer], layer, settings, params, mask, probe_key)
        run_s[layer] = time.perf_counter() - t0
        for m, v in row.items():
            metrics[m][layer] = v
    print(f"naive: steady run per layer {[round(run_s[i], 2) for i in layers]} s", flush=True)
    scale = num_layers / len(layers)  # 1 unless --layers-naive (extrapolated)
    return dict(
        metrics=metrics,
        compile_s=scale * sum(compile_s.values()),
        run_s=scale * sum(run_s.values()),
        wall_s=scale * first_pass_s,
        programs=2 * num_layers,
        extrapolated=len(layers) < num_layers,
        layers=tuple(layers),
    )


def spread_calls(call, repeats: int, slots: int, times: list[float]) -> list:
    """`slots` functions that together make `repeats` timed calls of `call` (appended to
    `times`), spread evenly: the timed batched calls are interleaved with the naive steady
    pass, so that a slow spell of the shared host hits both."""
    counts = [0] * slots
    for k in range(repeats):
        counts[k * slots // repeats] += 1
    return [lambda n=n: times.extend(time_calls(call, n)) for n in counts]


# --- checks --------------------------------------------------------------------------------------
def compare(batched: dict, naive: dict, layers, rtol: float, dead_atol: float) -> dict:
    """Per metric, the max over `layers` of |batched - naive|: relative to the largest |naive|
    of the metric (floored at 1e-12) for every metric but `dead`, absolute for `dead` (a
    fraction of elements, where single elements flip, see the module docstring)."""
    idx = list(layers)
    errs, tols = {}, {}
    for m in METRICS:
        a, b = batched[m][idx], naive[m][idx]
        diff = float(np.max(np.abs(a - b)))
        if m == "dead":
            errs[m], tols[m] = diff, dead_atol
        else:
            errs[m], tols[m] = diff / max(float(np.max(np.abs(b))), 1e-12), rtol
    print(
        "diff batched vs naive (relative; dead absolute): "
        + ", ".join(f"{m} {e:.2e}" for m, e in errs.items())
    )
    for m in METRICS:
        assert errs[m] <= tols[m], (
            f"batched and naive metrics disagree: {m} differs by {errs[m]:.2e}"
            f" ({'absolute' if m == 'dead' else 'relative to its largest |value|'}) >"
            f" {tols[m]}; batched {batched[m][idx].tolist()}, naive {naive[m][idx].tolist()}"
        )
    return errs


def check_located(name: str, metrics: dict, layers, fault_layer: int, floor: float) -> None:
    """The dead fraction passes the diagnosis' floor at the fault layer only."""
    idx = list(layers)
    dead = metrics["dead"][idx]
    hits = [i for i, d in zip(idx, dead, strict=True) if d > floor]
    expected = [fault_layer] if fault_layer in idx else []
    assert hits == expected, (
        f"{name}: the dead fraction is > {floor} at layers {hits}, expected only at the fault"
        f" layer {fault_layer} (dead = {dead.tolist()})"
    )
    specks = [i for i, d in zip(idx, dead, strict=True) if 0 < d <= floor]
    at_fault = metrics["dead"][fault_layer]
    print(
        f"{name}: dead {at_fault:.4f} at layer {fault_layer}, > {floor} nowhere else; layers"
        f" with 0 < dead <= {floor}: {specks}"
        f" (max {max([metrics['dead'][i] for i in specks], default=0.0):.1e})"
    )


# --- main ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen2p5_0p5b")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of the batched scan")
    parser.add_argument("--trials", type=int, default=3, help="ScanSettings.trials (R)")
    parser.add_argument("--fault-layer", type=int, default=None, help="default num_layers // 2")
    parser.add_argument("--threshold", type=float, default=0.01, help="deadzone threshold")
    parser.add_argument(
        "--layers-naive",
        default="all",
        help="naive loop on these layers only ('0,12,23', '10:14'); totals are extrapolated",
    )
    parser.add_argument(
        "--naive-keep-logits",
        action="store_true",
        help="naive programs also return sum(logits): every forward runs in full",
    )
    parser.add_argument("--rtol", type=float, default=1e-4, help="metric agreement")
    parser.add_argument(
        "--dead-atol", type=float, default=1e-4, help="agreement of the dead fraction (absolute)"
    )
    parser.add_argument("--record", action="store_true", help="append a table to WORKSPACE.md")
    args = parser.parse_args(argv)
    if args.preset not in PRESETS:
        parser.error(f"unknown preset {args.preset!r}; allowed: {', '.join(PRESETS)}")
    for name in ("prompts", "seq", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")

    cfg = Qwen2Config.preset(args.preset)
    num_layers = cfg.num_hidden_layers
    fault_layer = num_layers // 2 if args.fault_layer is None else args.fault_layer
    if not 0 <= fault_layer < num_layers:
        parser.error(f"--fault-layer must be in 0..{num_layers - 1}")
    try:
        sel = parse_layers(args.layers_naive, "--layers-naive", num_layers)
    except ValueError as e:
        parser.error(str(e))
    naive_layers = tuple(range(num_layers)) if sel == "all" else sel
    settings = ScanSettings(trials=args.trials)
    tag = TAGS.get(args.preset, args.preset)

    load = check_load()
    t0 = time.perf_counter()
    params = jax.device_put(random_params(cfg))
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    print(f"{args.preset}: {n_params / 1e6:.1f}M params, built in {time.perf_counter() - t0:.1f}s")
    model = Qwen2ForCausalLM(cfg)
    ids_np, mask_np = make_batch(cfg.vocab_size, args.prompts, args.seq)
    ids, mask = jnp.asarray(ids_np), jnp.asarray(mask_np)
    tokens = int(mask_np.sum())
    plan = deadzone_plan(num_layers, fault_layer, args.threshold)
    fault_key, probe_key = step_key(0, 0, PHASE), jax.random.key(1)
    print(
        f"batch {args.prompts}x{args.seq} ({tokens} real tokens), deadzone at layer {fault_layer}"
        f" threshold {args.threshold}, trials {settings.trials}: {settings.trials + 2} layer"
        " calls per layer",
        flush=True,
    )

    batched = prepare_batched(model, plan, settings, params, ids, mask, fault_key, probe_key)
    v = analysis.verdict(batched["metrics"])
    batched_times: list[float] = []
    print(f"batched verdict: {v['message']} (confidence {v['confidence']:.3f})")
    naive = bench_naive(
        model,
        plan,
        settings,
        params,
        ids,
        mask,
        fault_key,
        probe_key,
        naive_layers,
        args.naive_keep_logits,
        spread_calls(batched["call"], args.repeats, len(naive_layers), batched_times),
    )
    batched["run_s"] = statistics.median(batched_times)
    print(f"batched: times {[round(t, 3) for t in batched_times]} s", flush=True)

    errs = compare(batched["metrics"], naive["metrics"], naive_layers, args.rtol, args.dead_atol)
    check_located("batched", batched["metrics"], range(num_layers), fault_layer, DEAD_FLOOR)
    check_located("naive", naive["metrics"], naive_layers, fault_layer, DEAD_FLOOR)
    assert v["layers"] == [fault_layer], f"batched verdict {v['message']!r}, fault at {fault_layer}"
    if not naive["extrapolated"]:
        vn = analysis.verdict(naive["metrics"])
        print(f"naive verdict: {vn['message']} (confidence {vn['confidence']:.3f})")
        assert vn["layers"] == [fault_layer], f"naive verdict {vn['message']!r}"

    rel = max(e for m, e in errs.items() if m != "dead")
    ratio = naive["run_s"] / batched["run_s"]
    wall_ratio = naive["wall_s"] / batched["wall_s"]
    extra = " naive_extrapolated=1" if naive["extrapolated"] else ""
    extra += " naive_full_forward=1" if args.naive_keep_logits else ""
    common_kv = (
        f"prompts={args.prompts} seq={args.seq} tokens={tokens} layers={num_layers}"
        f" trials={settings.trials} fault_layer={fault_layer}"
        f" naive_layers={len(naive_layers)}/{num_layers}{extra}"
    )
    print(
        f"BENCH srdd_{tag} ratio={ratio:.3f} batched_s={batched['run_s']:.3f}"
        f" naive_s={naive['run_s']:.3f} max_rel_diff={rel:.2e}"
        f" dead_abs_diff={errs['dead']:.1e} {common_kv}"
    )
    print(
        f"BENCH srdd_{tag}_wall ratio={wall_ratio:.3f} batched_wall_s={batched['wall_s']:.2f}"
        f" naive_wall_s={naive['wall_s']:.2f} batched_compile_s={batched['compile_s']:.2f}"
        f" naive_compile_s={naive['compile_s']:.2f} naive_programs={naive['programs']}"
        f" {common_kv}"
    )

    if args.record:
        label = " (extrapolated)" if naive["extrapolated"] else ""
        table = [
            "| scan | programs | compile s | steady run s | wall incl. compile s |",
            "|---|---|---|---|---|",
            f"| batched (make_scan) | {batched['programs']} | {batched['compile_s']:.2f}"
            f" | {batched['run_s']:.3f} | {batched['wall_s']:.2f} |",
            f"| naive (scan_layers_naive loop){label} | {naive['programs']}"
            f" | {naive['compile_s']:.2f} | {naive['run_s']:.3f} | {naive['wall_s']:.2f} |",
            f"| ratio naive / batched | | {naive['compile_s'] / batched['compile_s']:.2f}"
            f" | {ratio:.3f} | {wall_ratio:.3f} |",
        ]
        intro = (
            f"Full SRDD scan of {args.preset} ({num_layers} layers, random f32 weights),"
            f" {args.prompts} prompts x {args.seq} random tokens left-padded ({tokens} real),"
            f" deadzone at layer {fault_layer} (threshold {args.threshold}) active, trials"
            f" {settings.trials}. Batched: one compiled forward with every probe, median of"
            f" {args.repeats} calls after a warm-up, spread through the naive steady pass; wall ="
            " compile + first call. Naive: per layer"
            f" {settings.trials + 2} forwards of the per-layer program (2 compiled programs per"
            " layer: scalar and [B,T,D] delta), steady = second full pass, wall = first pass"
            " incl. compiles"
            + (
                f"; naive on layers {naive_layers} only, totals EXTRAPOLATED to all layers"
                if naive["extrapolated"]
                else ""
            )
            + (
                "; naive programs keep the logits (every forward in full)"
                if args.naive_keep_logits
                else "; naive programs return only the target layer's input/output, so XLA"
                " drops the later layers and the lm_head (l + 1 layers run at layer l)"
            )
            + f". Metrics agree (max relative diff {rel:.1e}, dead fraction"
            f" {errs['dead']:.1e} absolute); dead > {DEAD_FLOOR} only at layer {fault_layer} in"
            f" both; batched verdict: {v['message']}."
            f" Load average before the run: {load}."
        )
        print(f"recorded in {record('bench/srdd.py', intro, table)}")


if __name__ == "__main__":
    main()
