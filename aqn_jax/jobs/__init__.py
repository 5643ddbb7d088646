"""One module per job; each defines `run(config, workdir)`. Selected by `config.job`.

A job never imports another job: `run_job` runs the one a config names (the compare job runs
its train runs through it)."""

import importlib


def run_job(config, workdir: str) -> None:
    """Run the job `config.job` in this process (without launch's workdir lock or distributed
    initialisation: the caller holds those)."""
    importlib.import_module(f"aqn_jax.jobs.{config.job}").run(config, workdir)


def check_required(config) -> None:
    """`config.required`: fields a config leaves empty for the user to fill (local paths)."""
    for field in config.get("required", ()):
        node = config
        for part in field.split("."):
            node = node[part]
        if node in ("", None):
            raise ValueError(
                f"config.{field} is required by this config and is empty; pass"
                f" --config.{field}=<local path> (nothing can be downloaded at run time)"
            )
