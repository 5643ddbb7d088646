"""One process per workdir: an exclusive `flock` on `<workdir>/.lock`, held for the whole job.

Two runs on one workdir would both do all the work and interleave `metrics.jsonl` and the
checkpoints. The second one now refuses at once, naming the holder (pid, host, start time, its
command). The lock is the kernel's: it goes away with the process however that ends (SIGKILL
included), so a lock left by a killed run is taken over without a timeout, and the takeover is
printed. On several hosts only process 0 takes it (the others write nothing of their own).
`flock` is advisory and local to one machine's kernel (on NFS it depends on the mount).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys

LOCK_FILE = ".lock"


class WorkdirBusy(ValueError):
    """Another live process holds the workdir (a user error: one line, exit 2)."""


class WorkdirLock:
    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> dict | None:
        """Take the lock; returns the record of a previous holder that is gone (or None).
        Raises WorkdirBusy naming the live holder."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise WorkdirBusy(
                f"workdir {os.path.dirname(self.path)!r} is in use by pid {holder.get('pid', '?')}"
                f" on {holder.get('host', '?')} since {holder.get('start', '?')}"
                f" ({holder.get('command', '?')}); wait for it to finish or use another --workdir"
            ) from None
        previous = _read(fd) or None
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "start": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return previous

    def discard(self) -> None:
        """Remove the lock file while holding it (a refused command leaves no `.lock` behind in a
        workdir that had none); `release` then only unlocks."""
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # a clean exit leaves no holder behind
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> WorkdirLock:
        previous = self.acquire()
        if previous:
            print(
                f"workdir lock: the previous holder (pid {previous.get('pid')} on"
                f" {previous.get('host')}, started {previous.get('start')}) is gone; taken over"
            )
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
