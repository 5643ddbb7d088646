"""One module per job; each defines `run(config, workdir)`. Selected by `config.job`.

A job never imports or runs another job: `launch.py` alone picks the one a config names; the
compare study's runs are library calls (`aqn_jax.training.run`)."""

from aqn_jax.export import plain_policy
from aqn_jax.lora import lora_spec
from aqn_jax.spec import warm_start_spec
from aqn_jax.warm_start import warm_start


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


def run_policy(config, trained, workdir: str, base_print: str | None = None):
    """`export.plain_policy` of a run's trained params under the run's own `config`: its
    config.lora and weight format, over its warm start (loaded, or made, in `workdir`'s
    cache); `base_print`: the checkpoint's fingerprint of that base."""
    warm = warm_start(warm_start_spec(config), workdir)[:2]
    fmt = str(config.model.get("weight_format", "none"))
    return plain_policy(lora_spec(config.get("lora")), fmt, trained, warm, base_print)
