"""The persistent XLA compilation cache every job uses: a second run of the same programs loads
them from disk instead of compiling them again.

Where it lives, first match wins: `--compile_cache=DIR` (or `--compile_cache=off`), then the
environment's `JAX_COMPILATION_CACHE_DIR` (the test suite sets its own there,
tests/conftest.py), then `default_dir()`: `$XDG_CACHE_HOME/aqn_jax/xla` (`~/.cache/aqn_jax/xla`),
one per user. JAX keys an entry by the program, the JAX and XLA versions, the backend and its
flags, so an entry is never used for another program; the directory is a run setting, not part
of the run's identity (a flag, not a config field: `check_resume_config` never sees it).
"""

from __future__ import annotations

import os
import sys
import tempfile

import jax

ENV = "JAX_COMPILATION_CACHE_DIR"
OFF = "off"


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "aqn_jax", "xla")


def resolve(flag: str | None) -> str | None:
    """The cache directory for `--compile_cache=<flag>` (None: not given), or None for off.
    A path given (the flag, or $JAX_COMPILATION_CACHE_DIR) that is not a directory this user can
    create and write is a one-line ValueError naming it (JAX would only warn and run uncached);
    the default one, unusable, turns the cache off with one line on stderr."""
    if flag is not None and flag.strip().lower() == OFF:
        return None
    path = flag or os.environ.get(ENV) or default_dir()
    path = os.path.abspath(os.path.expanduser(path))
    problem = _unusable(path)
    if problem is None:
        return path
    if not flag and not os.environ.get(ENV):
        print(
            f"compile cache off: {path} {problem} (--compile_cache=DIR sets one)", file=sys.stderr
        )
        return None
    where = f"--compile_cache={flag}" if flag else f"{ENV}={os.environ.get(ENV)}"
    raise ValueError(f"{where}: {path} {problem}; give a writable directory or '{OFF}'")


def _unusable(path: str) -> str | None:
    """Why `path` cannot hold the cache, or None. Probes by making (and removing) a directory
    in it or in its nearest existing ancestor: os.access says yes to root, also under /proc."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "is not a directory"
    where = path
    while not os.path.exists(where):
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        return f"cannot be created ({where} is a file)"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".aqn_jax-probe-", dir=where))
    except OSError as e:
        verb = "is not writable" if where == path else f"cannot be created in {where}"
        return f"{verb} ({e.strerror})"
    return None


def use(path: str | None) -> None:
    """Point this process's JAX, and the processes it starts (through the environment: compare's
    workers, a bench's runs), at the cache in `path`; None turns the cache off. Call before the
    first compile: JAX opens the cache once."""
    if path is None:
        settings = {"jax_enable_compilation_cache": False}
        os.environ.pop(ENV, None)
    else:
        settings = {
            "jax_enable_compilation_cache": True,
            "jax_compilation_cache_dir": path,
            # Every program, however small or quick to compile: a run's ~10 programs each
            # compile in 0.1-4 s on CPU, and JAX's default (>= 1 s) would keep only the largest.
            "jax_persistent_cache_min_compile_time_secs": 0.0,
            "jax_persistent_cache_min_entry_size_bytes": 0,
            # GPU: XLA's per-fusion autotuning results kept in the same directory (JAX's default
            # where the flag is known; said here so that it does not depend on that default).
            "jax_persistent_cache_enable_xla_caches": "xla_gpu_per_fusion_autotune_cache_dir",
        }
    for name, value in settings.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)
