"""From the `config.model` section of an experiment config to a model config and params, for
every registered family (`models/registry.py`: its presets, its HF config translation).

Validation (`model_config`) reads only config.json and never compiles, so a bad field fails
in a second, not after a compile.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from aqn_jax import compute_dtype

from . import registry
from .config import LOGPROB_CHUNK
from .hf import config_from_hf, load_hf_checkpoint
from .precision import DTYPES
from .registry import ModelConfig, causal_lm


def model_config(model_cfg: Any) -> ModelConfig:
    """The model config for `config.model` (fields: preset, hf_path, num_layers, param_dtype,
    dtype, remat, logprob_chunk).

    hf_path set: the architecture comes from its config.json (preset is ignored); otherwise
    from the named preset. Raises ValueError naming the field on bad input.
    """
    for field in ("param_dtype", "dtype"):
        value = model_cfg[field]
        auto = (compute_dtype.AUTO,) if field == "dtype" else ()
        if value not in (*DTYPES, *auto):
            raise ValueError(
                f"config.model.{field}={value!r}; allowed: {sorted(DTYPES) + list(auto)}"
            )
    dtype = model_cfg.dtype
    if dtype == compute_dtype.AUTO:  # launch resolves and logs it; a direct caller measures
        dtype = compute_dtype.choose()[0]
    numerics = dict(param_dtype=model_cfg.param_dtype, dtype=dtype, remat=bool(model_cfg.remat))
    chunk = model_cfg.get("logprob_chunk", LOGPROB_CHUNK)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"config.model.logprob_chunk={chunk!r}; allowed: an int >= 1")
    numerics["logprob_chunk"] = chunk
    num_layers = model_cfg.get("num_layers", 0)
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 0:
        raise ValueError(
            f"config.model.num_layers={num_layers!r}; allowed: an int >= 0 (0 = the preset's depth)"
        )
    if num_layers and model_cfg.hf_path:
        raise ValueError(
            f"config.model.num_layers={num_layers}; applies to presets only, and"
            f" config.model.hf_path={model_cfg.hf_path!r} is set (use 0: the snapshot's depth)"
        )
    if num_layers:
        numerics["num_hidden_layers"] = num_layers
    if model_cfg.hf_path:
        path = os.path.expanduser(model_cfg.hf_path)
        config_json = os.path.join(path, "config.json")
        if not os.path.isfile(config_json):
            raise ValueError(
                f"config.model.hf_path={model_cfg.hf_path!r}: no config.json there; expected a"
                " local Hugging Face snapshot directory (config.json + *.safetensors)"
            )
        with open(config_json) as f:
            config, _ = config_from_hf(json.load(f), source=config_json)
        return dataclasses.replace(config, **numerics)
    presets = registry.presets()
    if model_cfg.preset not in presets:
        raise ValueError(
            f"config.model.preset={model_cfg.preset!r}; allowed: {list(presets)}"
            " (or set config.model.hf_path to a local HF snapshot)"
        )
    return presets[model_cfg.preset](**numerics)


def init_params(config: ModelConfig, seed: int) -> dict:
    """Random params (Linen init, std 0.02), jitted, without logical-axis boxes."""
    model = causal_lm(config)
    init = jax.jit(lambda key: nn.unbox(model.init(key, np.zeros((1, 1), np.int32)))["params"])
    return init(jax.random.key(seed))


def load_params(config: ModelConfig, hf_path: str, seed: int) -> dict:
    """The params of `config` (`model_config`'s): the HF snapshot's weights at `hf_path`
    (config.model.hf_path), or a random init of the preset from `seed` where it is ''."""
    if hf_path:
        return load_hf_checkpoint(os.path.expanduser(hf_path), config.param_dtype)[1]
    return init_params(config, seed)


def logical_axes(config: ModelConfig, head: str = "lm") -> dict:
    """Param tree of logical axis-name tuples (e.g. ('embed', 'heads')), from eval_shape."""
    model = causal_lm(config, head=head)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), np.zeros((1, 1), np.int32)))
    return jax.tree_util.tree_map(
        lambda box: tuple(box.names),
        boxed["params"],
        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned),
    )
