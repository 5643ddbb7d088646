"""Writing a file whole or not at all: a reader (a resumed run, the study report, a user's
editor) never sees half of it."""

from __future__ import annotations

import json
import os
from typing import Any


def write_atomic(path: str, text: str) -> None:
    """`text` into `path` through `<path>.tmp` and a rename (atomic on POSIX)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: str, obj: Any, **dumps_kwargs) -> None:
    """`obj` as indented JSON, atomically (`write_atomic`)."""
    write_atomic(path, json.dumps(obj, indent=2, **dumps_kwargs))


def write_jsonl(path: str, rows: list[dict]) -> None:
    """One JSON object a line, atomically."""
    write_atomic(path, "".join(json.dumps(r, default=str) + "\n" for r in rows))


def put_step_records(path: str, step: int, rows: list[dict]) -> None:
    """`rows` as step `step`'s lines of the JSON-lines file `path` (each gets "step"): the
    lines of `step` and later that an earlier, interrupted attempt wrote are dropped first,
    so a resumed run writes no line twice."""
    kept = []
    if os.path.isfile(path):
        with open(path) as f:
            kept = [r for r in map(json.loads, filter(str.strip, f)) if r["step"] < step]
    write_jsonl(path, kept + [{"step": int(step), **r} for r in rows])
