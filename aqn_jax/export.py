"""A trained policy out of the product: an HF snapshot that transformers, vLLM and our own
evaluate job load (verl's `model_merger`, tunix's `save_lora_merged_model_as_safetensors`).

`export_policy(out, model_cfg, params, tokenizer_source)` writes `config.json`, the safetensors
and the tokenizer's files into `out` through a temporary directory renamed into place (a
half-written export is never found). In QeRL mode `params` is `lora.merged(...)`: the adapters
merged into the dequantised base, W' = W + (alpha / rank) A B.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import jax

from aqn_jax import quant_base
from aqn_jax.data.tokenizers import CHAR_TOKENIZER_FILE, HF_TOKENIZER_FILE, load_tokenizer
from aqn_jax.lora import fingerprint, lora_spec, merged
from aqn_jax.models.hf import save_hf_checkpoint
from aqn_jax.models.registry import family_of
from aqn_jax.warm_start import warm_start, warm_start_spec

EXPORT_DIR = "export"
# The files of an HF snapshot that describe its tokenizer and generation (copied when present).
TOKENIZER_FILES = (
    HF_TOKENIZER_FILE,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    CHAR_TOKENIZER_FILE,
)


def export_policy(out: str, model_cfg, params, tokenizer_source: str) -> str:
    """Write the snapshot into `out` (replacing an earlier export); returns `out`.
    `tokenizer_source`: the directory the run's tokenizer came from ('' = the embedded one)."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        save_hf_checkpoint(tmp, model_cfg, params)
        copied = 0
        if tokenizer_source:
            for name in TOKENIZER_FILES:
                src = os.path.join(tokenizer_source, name)
                if os.path.isfile(src):
                    shutil.copy2(src, os.path.join(tmp, name))
                    copied += 1
        if not copied:  # the embedded character tokenizer
            load_tokenizer(tokenizer_source or None).save(tmp)
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def plain_policy(config, trained, workdir: str, base_print: str | None = None):
    """(model config, a plain param tree) of a run's trained params: as they are for full
    fine-tuning; for a LoRA run (`{"lora": ...}`) the adapters merged into its base, the warm
    start of `config` (the run's own config) in config.model.weight_format. `base_print`: the
    checkpoint's fingerprint of its base; a different base is refused (one line)."""
    model_cfg, base, _ = warm_start(warm_start_spec(config), workdir)
    if "lora" not in trained:
        return model_cfg, trained
    base = jax.device_get(base)
    fmt = config.model.get("weight_format", "none")
    if base_print is not None and base_print != f"{fmt}:{fingerprint(base)}":
        raise ValueError(
            f"the checkpoint's adapters were trained over base {base_print}, but config.model /"
            f" config.sft / weight_format give {fmt}:{fingerprint(base)[:12]}...; pass the run's"
            " own config"
        )
    packed = quant_base.pack(base, fmt, family_of(model_cfg).site_of)
    return model_cfg, merged(lora_spec(config.get("lora")), packed, trained)
