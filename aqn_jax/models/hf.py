"""Hugging Face checkpoints <-> (model config, Flax params), strictly, for every registered
family (`models/registry.py`): the family translates config.json and names its keys; this
module reads and writes the safetensors.

A family's adapter (Qwen2's: `hf_mapping.py`, which also ports Llama and Mistral checkpoints)
names every config field its port cannot honour, and the saver writes back the `model_type` it
read.

`load_hf_checkpoint` reads a local snapshot directory: `config.json` (every field is either
used, listed as harmless and ignored, or rejected with a ValueError naming it) and single or
sharded safetensors (bf16/f16/f32 storage). Every expected key must be present with its exact
shape; missing and unexpected keys raise, naming them. `save_hf_checkpoint` writes a directory
that `transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
from absl import logging
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from . import registry
from .hf_mapping import DERIVED_KEY_SUFFIXES

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_STORAGE_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> tuple[Any, list]:
    """The model config of an HF config dict, by its family (`models/registry.py`); returns
    (config, names of ignored fields). Raises naming the field on anything not ported."""
    model_type = hf.get("model_type")
    family = registry.family_of_type(model_type)
    if family is None:
        raise ValueError(
            f"{source}: model_type={model_type!r}; allowed: {registry.model_types()} (llama and"
            " mistral as the Qwen2 decoder without q/k/v biases)"
        )
    return family.config_from_hf(hf, source)


def config_to_hf(config) -> dict[str, Any]:
    """config.json content that transformers 4.4x and 5.x both load as this architecture."""
    return registry.family_of(config).config_to_hf(config)


def abstract_params(config) -> dict:
    """Param tree of ShapeDtypeStructs (no memory), from `jax.eval_shape` of init."""
    model = registry.causal_lm(config)
    ids = jax.ShapeDtypeStruct((1, 1), np.int32)
    shapes = jax.eval_shape(lambda ids: model.init(jax.random.key(0), ids), ids)
    return nn.unbox(shapes)["params"]


def _weight_files(path: str) -> dict[str, str]:
    """HF key -> safetensors file, for a single-file or an index-sharded checkpoint."""
    single = os.path.join(path, SINGLE_FILE)
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(single):
        with _NamedSafetensors(single) as f:
            return dict.fromkeys(f.keys(), single)
    if os.path.isfile(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e!r})") from e
        files = {k: os.path.join(path, v) for k, v in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{index} names {os.path.basename(file)}, which is missing")
        return files
    raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


class _NamedSafetensors:
    """safe_open whose errors (a truncated or garbage file) name the file."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        try:
            self._cm = safe_open(self.path, "numpy")
            self._f = self._cm.__enter__()
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{self.path}: not a readable safetensors file ({e})") from e
        return self

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_slice(self, key):
        return self._f.get_slice(key)

    def get_tensor(self, key):
        try:
            return self._f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{self.path}: tensor {key} is unreadable ({e})") from e


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def load_hf_checkpoint(path: str, dtype: str | None = None) -> tuple[Any, dict]:
    """Read a local HF snapshot of a registered family into (model config, params), params as
    numpy arrays.

    dtype: None keeps the checkpoint's storage dtype (config.json `torch_dtype`/`dtype`) as
    both param and compute dtype; 'float32' / 'bfloat16' / 'float16' casts on load.
    Host numpy arrays (not device arrays) so that callers can place them with their own
    shardings without a second copy on the default device.
    """
    config = _read_config(path, dtype)
    expected = registry.family_of(config).checkpoint_keys(config)
    files = _weight_files(path)
    tied_head = config.tie_word_embeddings and "lm_head.weight" in files
    _check_keys(path, config, expected, files, tied_head)
    params, tied_copy = _read_tensors(config, expected, files, tied_head)
    if tied_copy is not None:
        embedding = params["embed_tokens"]["embedding"]
        if tied_copy.shape != embedding.shape or not np.array_equal(
            tied_copy.astype(_NP_DTYPES[config.param_dtype]), embedding
        ):
            raise ValueError(
                f"{path}: tie_word_embeddings is true but lm_head.weight differs from"
                " model.embed_tokens.weight"
            )
    return config, params


def _read_config(path: str, dtype: str | None) -> Any:
    """The model config of the snapshot's config.json, cast to `dtype` when given."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"HF checkpoint directory {path!r} does not exist")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path!r} has no config.json")
    with open(config_path) as f:
        try:
            hf_config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path}: invalid JSON ({e})") from e
    config, ignored = config_from_hf(hf_config, source=config_path)
    if dtype is not None:
        if dtype not in _NP_DTYPES:
            raise ValueError(f"dtype={dtype!r}; allowed: {sorted(_NP_DTYPES)} or None")
        config = dataclasses.replace(config, param_dtype=dtype, dtype=dtype)
    logging.info("%s: ignored harmless config fields %s", config_path, sorted(ignored))
    return config


def _check_keys(path: str, config, expected: Mapping, files: Mapping, tied_head: bool) -> None:
    """The files hold exactly the expected keys (derived buffers and a tied head's copy aside);
    one line naming the missing and unexpected ones otherwise."""
    derived = [k for k in files if k.endswith(DERIVED_KEY_SUFFIXES)]
    unexpected = sorted(
        set(files) - set(expected) - set(derived) - ({"lm_head.weight"} if tied_head else set())
    )
    missing = sorted(set(expected) - set(files))
    if missing or unexpected:
        raise ValueError(
            f"{path}: checkpoint keys do not match the config ({config.num_hidden_layers} layers,"
            f" tie_word_embeddings={config.tie_word_embeddings}): missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''} ({len(missing)}), unexpected"
            f" {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
        )


def _read_tensors(config, expected: Mapping, files: Mapping, tied_head: bool):
    """(params, the tied head's copy or None): every expected tensor, file by file, checked
    for its storage dtype and shape and cast to the config's param dtype."""
    shapes = abstract_params(config)
    target = _NP_DTYPES[config.param_dtype]
    params: dict = {}
    by_file: dict[str, list[str]] = {}
    for key in sorted(expected):
        by_file.setdefault(files[key], []).append(key)
    if tied_head:
        by_file.setdefault(files["lm_head.weight"], []).append("lm_head.weight")
    tied_copy = None
    for file, keys in by_file.items():
        with _NamedSafetensors(file) as f:
            for key in keys:
                storage = f.get_slice(key).get_dtype()
                if storage not in _STORAGE_DTYPES:
                    raise ValueError(
                        f"{file}: tensor {key} has dtype {storage}; allowed:"
                        f" {sorted(_STORAGE_DTYPES)} (quantised checkpoints are not supported)"
                    )
                value = f.get_tensor(key)
                if key == "lm_head.weight" and tied_head:
                    tied_copy = value
                    continue
                flax_path, transpose = expected[key]
                if transpose:
                    value = value.T
                want = _lookup(shapes, flax_path).shape
                if value.shape != want:
                    shown = value.T.shape if transpose else value.shape
                    want_hf = tuple(reversed(want)) if transpose else want
                    raise ValueError(
                        f"{file}: tensor {key} has shape {shown}; the config implies {want_hf}"
                    )
                _set(params, flax_path, np.ascontiguousarray(value.astype(target, copy=False)))
    return params, tied_copy


def _lookup(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def save_hf_checkpoint(
    path: str, config: Any, params: Mapping, max_shard_bytes: int = 4 * 2**30
) -> None:
    """Write config.json + safetensors (sharded with an index above max_shard_bytes).

    Tensors keep the params' dtype; config.json's torch_dtype says config.param_dtype.
    """
    params = nn.unbox(params)
    if "params" in params and "embed_tokens" not in params:
        params = params["params"]
    shapes = abstract_params(config)
    tensors: dict[str, np.ndarray] = {}
    for key, (flax_path, transpose) in registry.family_of(config).checkpoint_keys(config).items():
        try:
            value = np.asarray(jax.device_get(_lookup(params, flax_path)))
        except KeyError as e:
            raise ValueError(f"params lack {'/'.join(flax_path)} (HF key {key})") from e
        want = _lookup(shapes, flax_path).shape
        if value.shape != want:
            raise ValueError(
                f"params {'/'.join(flax_path)} has shape {value.shape}; expected {want}"
            )
        tensors[key] = np.ascontiguousarray(value.T if transpose else value)

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(config), f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    metadata = {"format": "pt"}  # transformers refuses safetensors without a format tag
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SINGLE_FILE), metadata=metadata)
        return
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.nbytes for t in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
