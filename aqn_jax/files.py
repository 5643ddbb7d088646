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
