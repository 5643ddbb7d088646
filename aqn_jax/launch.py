"""Entry point of every job.

  python -m aqn_jax.launch --config=configs/<name>.py [--config.a.b=v] [--workdir=DIR]

Parses the ml_collections config, logs the devices, and hands over to
`aqn_jax.jobs.<config.job>.run(config, workdir)`. Nothing else lives here.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from aqn_jax import jobs
from aqn_jax.lock import WorkdirLock

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory (results, checkpoints). Default: runs/<config file stem>."
)
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "Show the traceback of a configuration error (ValueError) too."
)


def available_jobs() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(jobs.__path__) if not m.name.startswith("_"))


def run(config, workdir: str) -> None:
    job = config.get("job")
    if job not in available_jobs():
        raise ValueError(f"config.job={job!r}; allowed: {available_jobs()}")
    if "distributed" in config:  # several hosts: before anything else touches the devices
        from aqn_jax import parallel

        if parallel.initialize(config.distributed):
            logging.info(
                "process %d of %d (%d local devices)",
                jax.process_index(),
                jax.process_count(),
                jax.local_device_count(),
            )
    logging.info("JAX %s, %d devices: %s", jax.__version__, jax.device_count(), jax.devices())
    jobs.check_required(config)  # every job: a config's empty local paths, before any work
    os.makedirs(workdir, exist_ok=True)
    module = importlib.import_module(f"aqn_jax.jobs.{job}")
    if jax.process_index() != 0:  # several hosts: process 0 holds the workdir for all
        module.run(config, workdir)
        return
    with WorkdirLock(workdir):  # a second run on a busy workdir refuses here, naming the holder
        module.run(config, workdir)


def main(argv=None) -> None:
    def _main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        if _CONFIG.value is None:
            raise app.UsageError("--config=configs/<name>.py is required")
        workdir = _WORKDIR.value
        if not workdir:
            stem = os.path.splitext(
                os.path.basename(config_flags.get_config_filename(flags.FLAGS["config"]))
            )[0]
            workdir = os.path.join("runs", stem.split(":")[0])
        try:
            run(_CONFIG.value, workdir)
        except ValueError as e:
            # A user error (every check raises ValueError naming the field, the value and what
            # is allowed): its message, exit 2. Other exceptions are bugs: their traceback.
            if _VERBOSE.value:
                raise
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    app.run(_main, argv=argv)


if __name__ == "__main__":
    main()
