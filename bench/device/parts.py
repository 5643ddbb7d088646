"""A file carried to the device machine in parts: one part a call, under the 64 MiB a call carries
(issue 49; bench/device/CALL.md, "Carrying the weights").

  python bench/device/parts.py split --file=F --out=DIR --max-mib=N   # or --file=A,B,... (a set)
  python bench/device/parts.py split --source=qwen2.5-coder-0.5b-instruct --out=DIR --max-mib=N
  python bench/device/parts.py check --dir=DIR [--part=K]
  python bench/device/parts.py take --dir=DIR --part=K --to=DEST  # check part K, move it
  python bench/device/parts.py paths --dir=DIR                    # A,B,... for --gguf=
  python bench/device/parts.py sha256 --dir=DIR                   # the whole's, for --sha256=

`split` streams the file (or a byte-split set, or a GGUF source of aqn_jax/models/gguf.py, whose
pinned size and sha256 the whole must have) into parts of at most N MiB, one folder a part
(DIR/001/part001.bin, DIR/002/part002.bin, ...: one folder is one call's `carry`), and writes
DIR/manifest.json: each part's path, size and sha256, and the whole file's. `check` exits 0
when every part (or part K) is there with its size and sha256, else 1 with one line naming the
part: missing, truncated (or too long), or another part's bytes (swapped). `take` is a part
call on the device: part K checked, then moved to DEST/00K/ with the manifest copied beside it
(a DEST holding another file's parts, or another split's of the same file, is refused);
after the last part call `check --dir=DEST` holds for the whole set. The importer joins the
parts and checks the whole file's sha256 (`python -m aqn_jax.models.gguf --gguf=$(parts.py
paths --dir=DEST) --sha256=$(parts.py sha256 --dir=DEST)`). Standard library only, plus
aqn_jax/models/gguf.py (itself standard library at import).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from aqn_jax.models.gguf import CHUNK, SOURCES, _sha256, source_paths  # noqa: E402

MANIFEST = "manifest.json"
MIB = 1 << 20


class PartError(ValueError):
    """A set that is not whole: the one line names the part."""


def part_path(k: int) -> str:
    return f"{k:03d}/part{k:03d}.bin"


def split(files: list[str], out: str, max_mib: float, expect=None) -> dict:
    """Stream `files` (one file, or a byte-split set in order) into parts of at most `max_mib`
    MiB under `out`; `expect` (a gguf.Source) pins the whole file's size and sha256. Returns the
    manifest. `out` must be absent or empty; on any failure nothing is left in it."""
    if not 0 < max_mib < math.inf:
        raise ValueError(f"--max-mib={max_mib}; allowed: > 0 and finite")
    max_bytes = int(max_mib * MIB)
    if max_bytes < 1:
        raise ValueError(
            f"--max-mib={max_mib} is less than one byte; allowed: >= {1 / MIB:.3g} (one byte)"
        )
    for f in files:
        if os.path.isdir(f):
            raise ValueError(f"--file={f!r} is a directory; allowed: a file")
        if not os.path.isfile(f):
            raise FileNotFoundError(f"--file={f!r} does not exist")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"--out={out!r} exists and is not an empty directory; choose another")
    t0 = time.perf_counter()
    whole, parts, k = hashlib.sha256(), [], 0
    h, dest, written = None, None, 0
    try:
        for f in files:
            with open(f, "rb") as src:
                while chunk := src.read(min(CHUNK, max_bytes)):
                    while chunk:
                        if dest is None or written == max_bytes:
                            if dest is not None:
                                dest.close()
                                parts.append({"path": part_path(k), "bytes": written})
                                parts[-1]["sha256"] = h.hexdigest()
                            k += 1
                            os.makedirs(os.path.join(out, f"{k:03d}"))
                            dest = open(os.path.join(out, part_path(k)), "wb")  # noqa: SIM115
                            h, written = hashlib.sha256(), 0
                        piece = chunk[: max_bytes - written]
                        chunk = chunk[len(piece) :]
                        dest.write(piece)
                        h.update(piece)
                        whole.update(piece)
                        written += len(piece)
        if dest is None:
            raise ValueError(f"--file={','.join(files)!r} is empty: nothing to split")
        dest.close()
        parts.append({"path": part_path(k), "bytes": written, "sha256": h.hexdigest()})
        total = sum(p["bytes"] for p in parts)
        if expect is not None and (total, whole.hexdigest()) != (expect.bytes, expect.sha256):
            raise ValueError(
                f"the whole file: {total:,} bytes, sha256 {whole.hexdigest()[:12]}…; the source"
                f" pins {expect.bytes:,} bytes, sha256 {expect.sha256[:12]}…; reinstall it"
            )
        manifest = {
            "file": ",".join(os.path.basename(f) for f in files),
            "bytes": total,
            "sha256": whole.hexdigest(),
            "max_bytes": max_bytes,
            "parts": parts,
        }
        with open(os.path.join(out, MANIFEST), "w") as m:
            json.dump(manifest, m, indent=1)
    except BaseException:
        if dest is not None:
            dest.close()
        for name in os.listdir(out) if os.path.isdir(out) else ():
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)
        raise
    manifest["seconds"] = round(time.perf_counter() - t0, 2)
    return manifest


def load_manifest(d: str, arg: str = "--dir") -> dict:
    """The manifest of the set in `d` (the argument `arg`), its structure checked: one line
    naming the file and what is wrong."""
    path = os.path.join(d, MANIFEST)
    if not os.path.isfile(path):
        raise PartError(f"{arg}={d!r}: no {MANIFEST} (made by `parts.py split`)")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PartError(f"{path}: not JSON ({e}); remake it with `parts.py split`") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise PartError(f"{path}: not a manifest of `parts.py split` ({problem})")
    return manifest


def _manifest_problem(m) -> str | None:
    """What makes `m` (a parsed manifest.json) unusable, or None."""
    if not isinstance(m, dict):
        return f"a JSON {type(m).__name__}, not an object"
    sha = re.compile(r"[0-9a-f]{64}")
    if not isinstance(m.get("sha256"), str) or not sha.fullmatch(m["sha256"]):
        return f"sha256={m.get('sha256')!r}; expected 64 hex digits"
    parts = m.get("parts")
    if not isinstance(parts, list) or not parts:
        return f"parts={parts!r}; expected a non-empty list"
    for k, p in enumerate(parts, 1):
        if not isinstance(p, dict):
            return f"part {k} is {p!r}; expected an object with path, bytes and sha256"
        if p.get("path") != part_path(k):
            return f"part {k}'s path={p.get('path')!r}; expected {part_path(k)!r}"
        size = p.get("bytes")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            return f"part {k}'s bytes={size!r}; expected an int >= 1"
        if not isinstance(p.get("sha256"), str) or not sha.fullmatch(p["sha256"]):
            return f"part {k}'s sha256={p.get('sha256')!r}; expected 64 hex digits"
    return None


def _check_one(d: str, manifest: dict, k: int, whole=None) -> None:
    """Part k (1-based) of the set in `d`: there, its size, its sha256 (another part's sha256 is
    named as that part: swapped). `whole`: a hash the part's bytes also feed."""
    parts = manifest["parts"]
    n = len(parts)
    if not 1 <= k <= n:
        raise ValueError(f"--part={k}; allowed: 1..{n} ({d}/{MANIFEST} lists {n} parts)")
    p = parts[k - 1]
    path = os.path.join(d, p["path"])
    what = f"part {k} of {n} ({path})"
    if os.path.isdir(path):
        raise PartError(f"{what} is a directory, not the part's file")
    if not os.path.isfile(path):
        raise PartError(f"{what} is missing")
    size = os.path.getsize(path)
    if size != p["bytes"]:
        cut = "truncated" if size < p["bytes"] else "too long"
        raise PartError(f"{what} is {cut}: {size:,} bytes, the manifest says {p['bytes']:,}")
    if whole is None:
        digest = _sha256(path)
    else:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(CHUNK), b""):
                h.update(chunk)
                whole.update(chunk)
        digest = h.hexdigest()
    if digest != p["sha256"]:
        other = [j for j, q in enumerate(parts, 1) if q["sha256"] == digest and j != k]
        if other:
            raise PartError(
                f"{what} holds part {other[0]}'s bytes (swapped): sha256 {digest[:12]}…"
            )
        raise PartError(
            f"{what}: sha256 {digest[:12]}…, the manifest says {p['sha256'][:12]}… (damaged)"
        )


def check(d: str, part: int | None = None) -> dict:
    """Every part of the set in `d` (or part `part` only) there and intact; the whole set's
    bytes then also hash to the manifest's whole sha256."""
    manifest = load_manifest(d)
    if part is not None:
        _check_one(d, manifest, part)
        return manifest
    whole = hashlib.sha256()
    for k in range(1, len(manifest["parts"]) + 1):
        _check_one(d, manifest, k, whole)
    if whole.hexdigest() != manifest["sha256"]:
        raise PartError(
            f"--dir={d!r}: every part is intact but the whole hashes to"
            f" {whole.hexdigest()[:12]}…, the manifest says {manifest['sha256'][:12]}…"
        )
    return manifest


def _place(manifest: dict, k: int) -> tuple[int, int, str] | None:
    """Part k (1-based) of `manifest`'s split: (offset in the whole file, bytes, sha256), or
    None where the split has fewer parts."""
    parts = manifest["parts"]
    if k > len(parts):
        return None
    offset = sum(p["bytes"] for p in parts[: k - 1])
    return offset, parts[k - 1]["bytes"], parts[k - 1]["sha256"]


def _describe(place: tuple[int, int, str] | None) -> str:
    if place is None:
        return "not in it"
    offset, size, sha = place
    return f"{size:,} bytes at offset {offset:,} (sha256 {sha[:12]}…)"


def _layout(manifest: dict) -> str:
    n = len(manifest["parts"])
    most = manifest.get("max_bytes", max(p["bytes"] for p in manifest["parts"]))
    return f"{n} parts of at most {most:,} bytes"


def take(d: str, part: int, to: str) -> list[int]:
    """Part `part` of the set in `d` checked, then moved to `to` (same layout, the manifest
    copied beside it; a different set's manifest there is refused: another file's, or another
    split of the same file, whose part `part` has another offset, size or sha256). Returns the
    parts `to` still lacks."""
    manifest = load_manifest(d)
    _check_one(d, manifest, part)
    if os.path.exists(to) and not os.path.isdir(to):
        raise PartError(f"--to={to!r} is a file; allowed: a directory (made if absent)")
    there = os.path.join(to, MANIFEST)
    if os.path.lexists(there):
        held = load_manifest(to, "--to")
        if held["sha256"] != manifest["sha256"]:
            raise PartError(
                f"--to={to!r} holds the parts of another file (sha256 {held['sha256'][:12]}…,"
                f" this set {manifest['sha256'][:12]}…): empty it first"
            )
        mine, theirs = _place(manifest, part), _place(held, part)
        if mine != theirs:
            raise PartError(
                f"--to={to!r} holds another split of the same file: its part {part} is"
                f" {_describe(theirs)} ({_layout(held)}), this set's {_describe(mine)}"
                f" ({_layout(manifest)}); take every part from one split, or empty it first"
            )
    rel = manifest["parts"][part - 1]["path"]
    dest = os.path.join(to, rel)
    folder = os.path.dirname(dest)
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise PartError(f"--to={to!r}: {folder} is a file, where part {part}'s folder goes")
    if os.path.isdir(dest):
        raise PartError(f"--to={to!r}: {dest} is a directory, where part {part} goes; remove it")
    os.makedirs(folder, exist_ok=True)
    if not os.path.lexists(there):
        shutil.copy(os.path.join(d, MANIFEST), there)
    shutil.move(os.path.join(d, rel), dest)
    return [
        k
        for k, p in enumerate(manifest["parts"], 1)
        if not os.path.isfile(os.path.join(to, p["path"]))
    ]


def paths(d: str) -> list[str]:
    manifest = load_manifest(d)
    return [os.path.abspath(os.path.join(d, p["path"])) for p in manifest["parts"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/device/parts.py", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("--file", default="", help="the file, or a byte-split set A,B,... in order")
    s.add_argument("--source", default="", help=f"a GGUF source instead: {sorted(SOURCES)}")
    s.add_argument("--out", required=True)
    s.add_argument("--max-mib", type=float, required=True)
    c = sub.add_parser("check")
    c.add_argument("--dir", required=True)
    c.add_argument("--part", type=int, default=None)
    t = sub.add_parser("take")
    t.add_argument("--dir", required=True)
    t.add_argument("--part", type=int, required=True)
    t.add_argument("--to", required=True)
    for name in ("paths", "sha256"):
        sub.add_parser(name).add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "split":
            if bool(args.file) == bool(args.source):
                raise ValueError(f"--file={args.file!r}, --source={args.source!r}: give one")
            files = args.file.split(",") if args.file else source_paths(args.source)
            m = split(files, args.out, args.max_mib, SOURCES[args.source] if args.source else None)
            print(
                f"split {m['file']} ({m['bytes']:,} bytes, sha256 {m['sha256'][:12]}…) into"
                f" {len(m['parts'])} parts of at most {m['max_bytes']:,} bytes in {args.out}"
                f" in {m['seconds']} s"
            )
        elif args.cmd == "check":
            m = check(args.dir, args.part)
            which = f"part {args.part} of {len(m['parts'])}" if args.part else "every part"
            print(f"{args.dir}: {which} intact (whole file sha256 {m['sha256'][:12]}…)")
        elif args.cmd == "take":
            lacking = take(args.dir, args.part, args.to)
            print(
                f"part {args.part}: intact, moved to {args.to}; still to come: {lacking or 'none'}"
            )
        elif args.cmd == "paths":
            print(",".join(paths(args.dir)))
        else:
            print(load_manifest(args.dir)["sha256"])
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
