"""QeRL mode (NVlabs/QeRL, arXiv 2510.11696): GRPO with LoRA adapters on a frozen base stored in
NVFP4 or MXFP4, with and without AQN on the rollout's RMSNorm weights; the columns of QeRL's
Table 1 as arms (aqn_jax/experiment.py ARMS, group 'qerl'):

  full            full fine-tuning (f32 master weights), the embedded study's lr 3e-5
  lora            LoRA r 16, alpha 16 on q,k,v,o,gate,up,down over the float base, lr 3e-4
  nvfp4_lora      the same over an NVFP4 base (E2M1 in groups of 16, E4M3 scales, FP32 global)
  mxfp4_lora      the same over an MXFP4 base (groups of 32, E8M0 scales)
  nvfp4_lora_aqn  nvfp4_lora + QeRL's AQN (N(0, sigma^2) on every RMSNorm weight of the rollout
                  model, 10 stages 5e-2 -> 5e-4)

  python -m aqn_jax.launch --config=configs/qerl.py:nvfp4_lora_aqn   # the default arm
  python -m aqn_jax.launch --config=configs/qerl.py:nvfp4_lora,smoke       # a wiring check
  python -m aqn_jax.launch --config=configs/qerl.py:nvfp4_lora --config.model.hf_path=<snapshot>

On the embedded model by default, with the study's device fault (the layer-4 deadzone); any
`--config.model.hf_path` runs the same arm on a real checkpoint (with its data flags). Every arm
trains on the faulty device and validates on it and on a clean device. `--config.checkpoint.
export=hf` writes <workdir>/export/, the merged policy as an HF snapshot. The five arms x 5 seeds
with statistics: `configs/compare.py:qerl_study` (results: docs/compare_results.md). A 12-step
run takes 84-98 s on 2 quiet cores (one core each, two at a time).
"""

from aqn_jax.experiment import arm_config, arm_names


def get_config(arg=None):
    parts = [p for p in (arg or "").split(",") if p]
    smoke = "smoke" in parts
    arms = [p for p in parts if p != "smoke"] or ["nvfp4_lora_aqn"]  # QeRL's own recipe
    if len(arms) != 1 or arms[0] not in arm_names("qerl"):
        raise ValueError(
            f"--config=configs/qerl.py:{arg}; allowed: one arm of {list(arm_names('qerl'))},"
            " optionally followed by ',smoke'"
        )
    return arm_config(arms[0], "smoke" if smoke else None)
