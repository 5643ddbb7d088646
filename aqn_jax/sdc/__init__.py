"""Silent data corruption (SDC) around the RL step: what is counted, what is checked and what
the run does with a corrupted step.

  config.py     `config.sdc`'s defaults
  guard.py      `config.sdc` typed (GuardSpec) and the verdict on each attempt of a step (`Guard`)
  telemetry.py  what the step programs report: `SdcSpec`, the per-site counts of bits flipped
                and rows ABFT flagged, the backward ABFT probe, the update's and the rollout's
                totals, the step's sdc/* metrics, and the traced values the bit faults read
  trees.py      bit faults on the gradients and the AdamW moments (optax wrappers) and the
                moments' range check
  recovery.py   `Recovery`: the attempts of one RL step (fault keys, verdicts, skip,
                recompute, rollback), around the rollout and the train function it is given

The fault transforms themselves are aqn_jax/faults/bitfaults.py; a transform says whether it
counts flips (`counts_flips`) or detections (`counts_detections`), and this wing reads that.
"""
