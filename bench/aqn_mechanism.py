"""The seed's mechanism, measured (issue 68 item 3): the original design claims AQN's noise lets
signal survive the deadzone. At the seed study's operating point (`configs/
qwen2p5_coder_0p5b_gsm8k.py:seed_study,arith`: a per-token deadzone of 0.07 x amax on layer 15's
output, the seed's AQN, relative activation noise y + sigma*eps*|y|, on the same output in the
seed's order "between": the deadzone, the noise, the deadzone again at the same threshold), this
prints, for the warm start and for a trained run's final policy, the share of layer 15's output
the first deadzone flushes, the share flushed after the noise and the second deadzone, and the
values the noise carried back over the threshold ("rescued": below it before the noise, at or
above it after), at sigma = 0 (the control), 0.05 and 0.01; and the same with the noise before
the deadzone (order "before_fault"), the order in which a rescue is possible at all.

  python bench/aqn_mechanism.py --hf-path=/models/qwen05 \
      [--run=runs/qwen05_seed_study/runs/targeted/seed0] [--size=64] [--record]
  python bench/aqn_mechanism.py --tiny   # the embedded model, the same plan (a smoke test)

Why the order decides it: the first deadzone sets a flushed value to exactly 0; relative noise
scales with |y|, so it adds sigma*eps*0 = 0 to it, and the second deadzone (same threshold)
flushes it again. In the order "between" no flushed value can come back (rescued = 0 for
every sigma), and a surviving value just above the threshold can be pushed below it, so the
share flushed can only grow. Only noise that comes before the deadzone (or noise that does not
scale with |y|) can carry a value over it.

Measured teacher-forced, on the held-out problems with their worked solutions (the fault
telemetry's `flushed` and `rescued`: means over layer 15's whole padded output tensor, as the
rollout device sees it); phase "rollout", where the seed's AQN acts. Prints
`BENCH aqn_mechanism_<policy>_<order>_s<sigma> ratio=<flushed at sigma / at sigma 0>`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import check_load, cpu_description, cpu_flags, record  # noqa: E402

from aqn_jax.aqn.config import AQN_SIGMA  # noqa: E402
from aqn_jax.aqn.plan import build_plan  # noqa: E402
from aqn_jax.data.config import load_split  # noqa: E402
from aqn_jax.faults.intercept import STATS_COLLECTION, step_key, summarize_stats  # noqa: E402
from aqn_jax.forward import token_nll  # noqa: E402
from aqn_jax.jobs.evaluate import load_policy  # noqa: E402
from aqn_jax.models.factory import model_config  # noqa: E402
from aqn_jax.models.registry import causal_lm, layer_name  # noqa: E402
from aqn_jax.rl.sft import sft_sequences  # noqa: E402
from aqn_jax.warm_start import tokenizer_for  # noqa: E402

SIGMAS = (0.0, 0.05, 0.01)
ORDERS = ("between", "before_fault")


def _config(hf_path: str, tiny: bool):
    """The seed study's config (or, `tiny`, the embedded default's model with the seed study's
    fault and AQN sections: layer 15 becomes the tiny model's last layer)."""
    import importlib

    config = importlib.import_module("configs.qwen2p5_coder_0p5b_gsm8k").get_config(
        "seed_study,arith"
    )
    if tiny:
        small = importlib.import_module("configs.targeted").get_config()
        for section in ("model", "sft", "data", "rollout"):
            config[section] = small[section]
        config.tokenizer_path = small.tokenizer_path
    else:
        config.model.hf_path = hf_path
    return config


def _arm(config, workdir: str, tiny: bool, n_layers: int):
    """The study's targeted arm as the compare job configures its runs (`compare.run_config`),
    with SRDD's verdict (layer 15; the tiny model's last layer) made explicit."""
    from aqn_jax.jobs.compare import run_config

    layer = n_layers - 1 if tiny else 15
    rc = run_config(config, "targeted", 0, workdir, {"verdict": {"layers": [layer]}})
    with rc.unlocked():
        rc.faults.deadzone.layers = str(layer)
    return rc, layer


def _program(model, plan):
    @jax.jit
    def fn(params, ids, mask, loss_mask, key, values):
        _, state = token_nll(
            model,
            params,
            ids,
            mask,
            loss_mask,
            plan=plan,
            phase="rollout",
            key=key,
            values=values,
            mutable=[STATS_COLLECTION],
        )
        return state[STATS_COLLECTION]

    return fn


def measure(model, params, plan, data, bs: int, key, sigma: float, site: str) -> dict:
    """The telemetry at `site` (means over batches, weighted by rows) at this sigma."""
    fn = _program(model, plan)
    rows: dict[str, list[float]] = {}
    weights = []
    for start in range(0, len(data.ids), bs):
        sl = slice(start, start + bs)
        stats = fn(
            params,
            data.ids[sl],
            data.mask[sl],
            data.loss_mask[sl],
            jax.random.fold_in(key, start),
            {AQN_SIGMA: np.float32(sigma)},
        )
        flat = summarize_stats(stats)
        for k, v in flat.items():
            if k.endswith("/" + site):
                rows.setdefault(k.split("/")[0], []).append(v)
        weights.append(len(data.ids[sl]))
    return {k: float(np.average(v, weights=weights)) for k, v in rows.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-path", default="")
    p.add_argument("--tiny", action="store_true", help="the embedded model (no snapshot)")
    p.add_argument("--run", default="", help="a trained run's workdir (its final checkpoint)")
    p.add_argument("--size", type=int, default=64, help="held-out problems")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--record", action="store_true", help="append the table to WORKSPACE.md")
    args = p.parse_args(argv)
    if not args.tiny and not args.hf_path:
        p.error("--hf-path=DIR (the Qwen2.5-Coder-0.5B snapshot) or --tiny")
    load = check_load()
    config = _config(args.hf_path, args.tiny)
    vocab = model_config(config.model).vocab_size
    tokenizer = tokenizer_for(config.tokenizer_path, config.model.hf_path, vocab)
    test = load_split(config.data, "test")[: args.size]
    data = sft_sequences(test, tokenizer)
    key = step_key(int(config.seed), 0, "rollout")
    policies = [("warm_start", "")] + ([("trained", args.run)] if args.run else [])
    table = [
        "| policy | order | sigma | flushed by the first deadzone | flushed in the end"
        " | rescued | flushed in the end / at sigma 0 |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as workdir:
        for label, run in policies:
            config.evaluate.run = run
            model_cfg, params, what, _ = load_policy(config, workdir)
            n_layers = model_cfg.num_hidden_layers
            rc, layer = _arm(config, workdir, args.tiny, n_layers)
            model = causal_lm(model_cfg)
            site = layer_name(model.config, layer)
            print(f"{label}: {what}; layer {layer} ({site}), {len(test)} problems")
            for order in ORDERS:
                rc.aqn.order = order
                plan = build_plan(rc.faults, rc.aqn, n_layers, srdd_layers=[layer])
                if label == policies[0][0] and order == ORDERS[0]:
                    print(plan.describe())
                zero = None
                for sigma in SIGMAS:
                    got = measure(model, params, plan, data, args.batch, key, sigma, site)
                    # "between": deadzone, noise, deadzone_after_aqn; "before_fault": noise,
                    # deadzone (the deadzone then sees the noise's input as its pre_noise).
                    first = got["deadzone.flushed"]
                    end = got.get("deadzone_after_aqn.flushed", first)
                    rescued = got.get("deadzone_after_aqn.rescued", got.get("deadzone.rescued"))
                    zero = end if zero is None else zero
                    ratio = end / zero if zero else float("nan")
                    shown = "n/a" if rescued is None else f"{rescued:.2e}"
                    print(
                        f"BENCH aqn_mechanism_{label}_{order}_s{sigma:g} ratio={ratio:.5f}"
                        f" flushed_first={first:.5f} flushed_end={end:.5f} rescued={shown}"
                        f" layer={layer} n={len(test)} flags={cpu_flags().replace(' ', ',')}"
                    )
                    table.append(
                        f"| {label} | {order} | {sigma:g} | {first:.4f} | {end:.4f} | {shown}"
                        f" | {ratio:.4f} |"
                    )
    print("\n".join(table))
    if args.record:
        intro = (
            f"{cpu_description()}; flags {cpu_flags()}; load {load}. Layer {layer}'s output,"
            " teacher-forced on the held-out problems, phase rollout."
        )
        record("bench/aqn_mechanism.py", intro, table)


if __name__ == "__main__":
    main()
