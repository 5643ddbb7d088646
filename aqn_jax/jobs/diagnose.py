"""Job `diagnose`: SRDD on the faulty device - localise the faulty layer, write the sigma map.

Runs the per-layer scans (aqn_jax/diagnosis/scans.py) on calibration prompts from the train
split of `config.data`, with the hardware faults of `config.faults` active (AQN off), prints
the per-layer table and the verdict, and writes `srdd.json` (scans, z-scores, verdict, sigma
map, the `config.aqn` fragment) and `srdd.png` into the workdir.
"""

from __future__ import annotations

import os

from aqn_jax.data.config import check_data, load_split
from aqn_jax.diagnosis import srdd
from aqn_jax.faults.config import fault_plan
from aqn_jax.models.factory import load_params, model_config
from aqn_jax.spec import srdd_spec
from aqn_jax.warm_start import tokenizer_for


def run(config, workdir: str) -> None:
    # -- Check the config (nothing compiled or written before this passes) ----------------
    model_cfg = model_config(config.model)
    spec = srdd_spec(config)
    check_data(config.data)
    tokenizer = tokenizer_for(config.tokenizer_path, config.model.hf_path, model_cfg.vocab_size)
    plan = fault_plan(config.faults, model_cfg.num_hidden_layers)

    # -- Diagnose ------------------------------------------------------------------------
    params = load_params(model_cfg, config.model.hf_path, config.seed)
    print(plan.describe())
    report = srdd.run_srdd(
        spec, model_cfg, params, plan, load_split(config.data, "train"), tokenizer, workdir
    )

    # -- Summary -------------------------------------------------------------------------
    cal = report["calibration"]
    print(
        f"calibration: {cal['prompts']} prompts, {cal['tokens']} tokens; scans in"
        f" {report['scan_seconds']:.1f}s (incl. compile)"
    )
    print(srdd.format_table(report))
    frag = report["aqn_fragment"]
    print(f"SRDD-guided AQN: {frag['flags_srdd_guided']}")
    if frag["flags_targeted"]:
        print(f"targeted AQN:    {frag['flags_targeted']}")
    json_path, png_path = (os.path.join(workdir, f) for f in (srdd.SRDD_FILE, srdd.PLOT_FILE))
    print(f"wrote {json_path} and {png_path}")
