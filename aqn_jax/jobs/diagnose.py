"""Job `diagnose`: SRDD on the faulty device - localise the faulty layer, write the sigma map.

Runs the per-layer scans (aqn_jax/diagnosis/scans.py) on calibration prompts from the train
split of `config.data`, with the hardware faults of `config.faults` active (AQN off), prints
the per-layer table and the verdict, and writes `srdd.json` (scans, z-scores, verdict, sigma
map, the `config.aqn` fragment) and `srdd.png` into the workdir.
"""

from __future__ import annotations

from aqn_jax.data.config import check_data, load_split
from aqn_jax.diagnosis import srdd
from aqn_jax.jobs.pretrain import tokenizer_for
from aqn_jax.models.factory import load_model, model_config
from aqn_jax.models.qwen2 import Qwen2ForCausalLM


def _validate(config):
    qcfg = model_config(config.model)
    srdd.check_config(config.diagnosis)
    check_data(config.data)
    tokenizer = tokenizer_for(config)
    plan = srdd.hardware_plan(config, qcfg.num_hidden_layers)
    return qcfg, tokenizer, plan


def run(config, workdir: str) -> None:
    qcfg, tokenizer, plan = _validate(config)
    ids, mask = srdd.calibration_batch(
        load_split(config.data, "train"),
        tokenizer,
        int(config.diagnosis.num_prompts),
        int(config.diagnosis.max_prompt_len),
    )
    qcfg, params = load_model(config.model, config.seed)
    model = Qwen2ForCausalLM(qcfg)
    print(plan.describe())
    base = float(config.diagnosis.base_sigma or config.aqn.sigma_start)
    report = srdd.diagnose(model, params, plan, ids, mask, config.diagnosis, base)
    print(
        f"calibration: {ids.shape[0]} prompts, {int(mask.sum())} tokens; scans in"
        f" {report['scan_seconds']:.1f}s (incl. compile)"
    )
    print(srdd.format_table(report))
    json_path, png_path = srdd.write_report(report, workdir)
    frag = report["aqn_fragment"]
    print(f"SRDD-guided AQN: {frag['flags_srdd_guided']}")
    if frag["flags_targeted"]:
        print(f"targeted AQN:    {frag['flags_targeted']}")
    print(f"wrote {json_path} and {png_path}")
