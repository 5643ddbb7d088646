"""The study (job `compare`): arms clean / deadzone / global_aqn / targeted / healthy /
srdd_guided x 5 seeds on the embedded task, each a full train run plus the robustness matrix,
sharing one SFT warm start and one SRDD diagnosis; Welch tests targeted vs global and healthy vs
global; report.md with plots and results.json.

  python -m aqn_jax.launch --config=configs/compare.py
  python -m aqn_jax.launch --config=configs/compare.py:threshold_0.1   # sweep variants:
      threshold_0.01 | threshold_0.1 | threshold_0.2 | threshold_0.5 (deadzone threshold)
      layer_early | layer_middle | layer_late (fault at layer 1 / 4 / 6) | two_layers (2 and 5)
  python -m aqn_jax.launch --config=configs/compare.py:smoke           # 2 arms x 2 seeds, tiny
  python -m aqn_jax.launch --config=configs/compare.py:layer_late,smoke

Re-running the same command reuses finished runs and resumes an interrupted one. Arms or seeds:
--config.compare.arms='("targeted","global_aqn")' --config.compare.seeds='(0,1,2)'.

Expected (2-core CPU, WORKSPACE.md issue 8): the default study takes ~53 min (one SFT 50 s, one
SRDD 7 s, 30 runs of ~3 min two at a time), the smoke study ~2 min. On the embedded model the
default deadzone (layer 4, threshold 0.01) moves the held-out loss by ~1e-5, and no arm differs
significantly from global AQN (p > 0.4).
"""

from aqn_jax.experiment import base_config
from aqn_jax.jobs.compare import compare_config

VARIANTS = {
    "default": {},
    **{f"threshold_{t}": {"threshold": t} for t in ("0.01", "0.1", "0.2", "0.5")},
    "layer_early": {"layers": "1"},
    "layer_middle": {"layers": "4"},
    "layer_late": {"layers": "6"},
    "two_layers": {"layers": "(2,5)"},
}


def get_config(arg=None):
    parts = [p for p in (arg or "").split(",") if p]
    smoke = "smoke" in parts
    names = [p for p in parts if p != "smoke"]
    if len(names) > 1 or (names and names[0] not in VARIANTS):
        raise ValueError(
            f"--config=configs/compare.py:{arg}; allowed: one of {list(VARIANTS)}, optionally"
            " followed by ',smoke'"
        )
    variant = names[0] if names else "default"
    config = base_config("smoke" if smoke else None)
    config.job = "compare"
    config.compare = compare_config()
    config.compare.variant = variant + (" (smoke)" if smoke else "")
    spec = VARIANTS[variant]
    if "threshold" in spec:
        config.faults.deadzone.threshold = float(spec["threshold"])
    if "layers" in spec:
        config.faults.deadzone.layers = spec["layers"]
    config.sft.seed = 0  # one warm start for every seed
    config.checkpoint.every = 10  # an interrupted run resumes (the job reuses finished ones)
    config.trainer.val_every = 0  # validation at the start and the end; evaluate does the rest
    config.evaluate.size = 128
    if smoke:
        config.compare.arms = ("global_aqn", "targeted")
        config.compare.seeds = (0, 1)
        config.compare.comparisons = (("targeted", "global_aqn"),)
        config.checkpoint.every = 1
        config.evaluate.size = 8
        config.evaluate.noise_levels = (0.0, 0.1)
        config.evaluate.mxfp4 = False
    return config
