"""A random-weight HF snapshot at the shapes of a carried config.json, with its tokenizer files
(device section B): N(0, 0.02) float32 weights, 1.0 for the norms (bench/common.random_params),
written by our own save_hf_checkpoint, so that our loader reads it as it reads the real one.

  python bench/device/make_snapshot.py SRC_DIR OUT_DIR [--tiny]
  python bench/device/make_snapshot.py SRC_DIR OUT_DIR --first-layers=N

--tiny (the local smoke): hidden 64, 4 heads, MLP 128; the real depth (the config's fault
layer) and vocabulary (the tokenizer's ids). --first-layers=N: a copy of the real snapshot
SRC_DIR with its first N decoder layers only (the CPU dry runs: compile time is about linear in
the layers).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


def first_layers(snapshot, out, n: int) -> Path:
    """A copy of the HF snapshot `snapshot` in `out` with its first `n` decoder layers only (the
    embedding, final norm and tied head kept): the same weights up to layer n-1."""
    from safetensors.numpy import load_file, save_file

    snapshot, out = Path(snapshot), Path(out)
    shutil.copytree(snapshot, out, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    if not 0 < n < config["num_hidden_layers"]:
        raise ValueError(f"--first-layers={n}; allowed: 1..{config['num_hidden_layers'] - 1}")
    config["num_hidden_layers"] = n
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(str(snapshot / "model.safetensors"))
    keep = {
        k: v
        for k, v in tensors.items()
        if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= n)
    }
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    cut = [a for a in sys.argv[3:] if a.startswith("--first-layers=")]
    if cut:
        n = int(cut[0].split("=", 1)[1])
        first_layers(src, out, n)
        print(f"snapshot {out}: the first {n} layers of {src}")
        return
    tiny = "--tiny" in sys.argv[3:]
    from common import random_params

    from aqn_jax.models.hf import config_from_hf, save_hf_checkpoint

    hf = json.loads((src / "config.json").read_text())
    if tiny:
        hf.update(hidden_size=64, intermediate_size=128, num_attention_heads=4)
    t0 = time.perf_counter()
    cfg, _ = config_from_hf(hf)
    save_hf_checkpoint(str(out), cfg, random_params(cfg))
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    print(f"random snapshot {out}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size},"
          f" vocab {cfg.vocab_size} ({time.perf_counter() - t0:.0f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
