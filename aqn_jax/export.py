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

from aqn_jax.data.tokenizers import CHAR_TOKENIZER_FILE, HF_TOKENIZER_FILE, load_tokenizer
from aqn_jax.models.hf import save_hf_checkpoint

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
