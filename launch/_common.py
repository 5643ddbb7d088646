"""What the launchers share: argument splitting and the command every process runs.

Each launcher takes its own flags, then `--`, then the arguments of `python -m aqn_jax.launch`
(`--config=...`, `--config.x.y=v`, `--workdir=...`), and adds the `config.distributed` flags
that join the processes into one run.
"""

from __future__ import annotations

import argparse
import shlex
import sys


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher flags, job args) split at the first `--`."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def job_args(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    if not any(a.startswith("--config=") for a in args):
        parser.error(
            "give the job after '--', e.g. -- --config=configs/targeted.py --workdir=runs/x"
        )
    if any(a.startswith("--config.distributed.") for a in args):
        parser.error("--config.distributed.* is set by the launcher; remove it from the job args")
    return list(args)


def job_command(python: str, args: list[str], distributed: list[str]) -> list[str]:
    return [python, "-m", "aqn_jax.launch", *args, *distributed]


def show(cmd: list[str], env: dict[str, str] | None = None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(cmd)


def default_python() -> str:
    return sys.executable or "python"
