"""One module per job; each defines `run(config, workdir)`. Selected by `config.job`.

A job never imports or runs another job: `launch.py` alone picks the one a config names; the
compare study's runs are library calls (`aqn_jax.training.run`)."""


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
