"""The SFT warm start of the policy, cached and reused; the tokenizer of a config.

The embedded default starts RL from the tiny model after a short SFT on the task's worked
solutions (aqn_jax/rl/sft.py). The result is cached as a local HF snapshot (config.json +
safetensors, loadable by `transformers` too) under `config.sft.cache_dir` (default: `cache/`
next to the workdir, so every run under one parent shares it), keyed by a hash of everything
that determines it (model, tokenizer, data, SFT settings, seed). A later run with the same key
loads it instead of training. The jobs `pretrain`, `train`, `evaluate`, `severity` and
`compare` call `warm_start` with the `WarmStartSpec` they build once (`spec.warm_start_spec`,
from the ConfigDict: the job boundary).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from aqn_jax.data.config import DataSpec, load_split
from aqn_jax.data.gsm8k import Example
from aqn_jax.data.tokenizers import Tokenizer, load_tokenizer
from aqn_jax.metrics import progress
from aqn_jax.models.factory import load_params
from aqn_jax.models.hf import load_hf_checkpoint, save_hf_checkpoint
from aqn_jax.models.registry import ModelConfig, causal_lm
from aqn_jax.rl.sft import sft_sequences, sft_train

SFT_META = "sft.json"
# Warm starts shipped with the package (produced by `configs/warm_start.py`): a config whose
# cache key matches one loads it instead of training (the embedded default's SFT takes longer
# than a first run should wait).
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")


def sft_seed(sft: Any, seed: int) -> int:
    """The warm start's init + SFT seed: `sft.seed` (config.sft), or the run's `seed`
    (config.seed) where it is -1."""
    own = int(sft.get("seed", -1))
    return int(seed) if own < 0 else own


def check_sft(sft: Any) -> None:
    for field in ("steps", "batch_size", "examples"):
        if sft[field] < 1:
            raise ValueError(f"config.sft.{field}={sft[field]}; must be >= 1")
    if sft.batch_size > sft.examples:
        raise ValueError(
            f"config.sft.batch_size={sft.batch_size} > config.sft.examples={sft.examples}"
        )
    if not sft.lr > 0:
        raise ValueError(f"config.sft.lr={sft.lr}; must be > 0")


@dataclasses.dataclass(frozen=True)
class SftSpec:
    """The SFT's training settings (config.sft), checked (`SftSpec.of`)."""

    steps: int  # optimizer steps
    batch_size: int  # sequences per step
    lr: float  # AdamW peak learning rate
    warmup_steps: int
    schedule: str  # constant | warmup_constant | cosine
    examples: int  # the first N train examples

    @classmethod
    def of(cls, sft: Any) -> SftSpec:
        """From the `config.sft` section; raises naming the field."""
        check_sft(sft)
        return cls(
            steps=int(sft.steps),
            batch_size=int(sft.batch_size),
            lr=float(sft.lr),
            warmup_steps=int(sft.warmup_steps),
            schedule=str(sft.schedule),
            examples=int(sft.examples),
        )


@dataclasses.dataclass(frozen=True)
class WarmStartSpec:
    """What the warm start reads of an experiment config (`spec.warm_start_spec`)."""

    model: ModelConfig  # config.model, parsed (`models.factory.model_config`)
    hf_path: str  # config.model.hf_path: the snapshot whose weights start it ('' = an init)
    tokenizer_path: str  # config.tokenizer_path ('' = the model's, `tokenizer_for`)
    data: DataSpec  # config.data: the SFT trains on its train split
    sft: SftSpec | None  # None: config.sft.enabled=False, the configured model itself
    seed: int  # init + SFT seed (`sft_seed`)
    cache_dir: str  # config.sft.cache_dir; '' = <workdir>/../cache
    key: str  # the cache key: a hash of the model, tokenizer, data, SFT settings and seed


def cached_sft(spec: WarmStartSpec, workdir: str) -> str | None:
    """The directory of this warm start, finished (the cache's, else the shipped one), or None
    when the SFT would have to train."""
    path = cache_dir(spec, workdir)
    for where in (path, os.path.join(SHIPPED_DIR, os.path.basename(path))):
        if os.path.isfile(os.path.join(where, SFT_META)):
            return where
    return None


def check_sft_cache(spec: WarmStartSpec, workdir: str | None) -> None:
    """When the SFT will train (enabled, not cached or shipped): its cache must be writable, or
    the finished SFT could not be kept. The cache directory, or the nearest part of its path
    that exists, must be a directory this process can write. Without a workdir the default
    `<workdir>/../cache` is unknown: only an explicit config.sft.cache_dir is checked."""
    if spec.sft is None or (workdir is None and not spec.cache_dir):
        return
    if cached_sft(spec, workdir or ".") is not None:
        return
    root = os.path.dirname(os.path.abspath(cache_dir(spec, workdir or ".")))
    field = f"config.sft.cache_dir={spec.cache_dir!r}"
    if not spec.cache_dir:
        field += f" (the default: {root})"
    existing = root
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(
            f"{field}; must be a writable directory, and {existing} is a file: the SFT warm"
            " start would train and then fail to be cached"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"{field}; must be a writable directory, and {existing} is not writable: the SFT"
            " warm start would train and then fail to be cached"
        )


def tokenizer_for(tokenizer_path: str, hf_path: str, vocab_size: int) -> Tokenizer:
    """The tokenizer at `tokenizer_path` (config.tokenizer_path), else the snapshot's at
    `hf_path` (config.model.hf_path), else the built-in one; raises when it has more ids than
    the model's `vocab_size`."""
    path = tokenizer_path or hf_path
    field = "config.tokenizer_path" if tokenizer_path else "config.model.hf_path"
    try:
        tokenizer = load_tokenizer(path or None)
    except (OSError, ValueError) as e:  # a missing or foreign directory: the user's input
        raise ValueError(f"{field}={path!r}; {e}") from e
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"{field}={path!r}: the tokenizer has {tokenizer.vocab_size} ids but the model's"
            f" vocab_size is {vocab_size}"
        )
    return tokenizer


def cache_dir(spec: WarmStartSpec, workdir: str) -> str:
    """The cache entry of this warm start: `<cache_dir>/sft-<key>`."""
    root = spec.cache_dir or os.path.join(os.path.dirname(os.path.abspath(workdir)), "cache")
    return os.path.join(root, f"sft-{spec.key}")


def _set_aside_damaged(where: str, found: str, error: Exception) -> None:
    """A cache entry that does not load is moved aside (kept for inspection) and recomputed,
    as unreadable checkpoints are; a damaged shipped asset is named and left in place."""
    if found == "hit" and jax.process_index() == 0:
        aside = f"{where}.damaged-{int(time.time())}"
        os.rename(where, aside)
        print(f"SFT cache {where} is damaged ({error}); moved to {aside}; recomputing")
    else:
        print(f"SFT warm start {where} is damaged ({error}); recomputing (reinstall to repair)")


def warm_start(
    spec: WarmStartSpec,
    workdir: str,
    verbose: bool = True,
    train: Sequence[Example] | None = None,
) -> tuple[ModelConfig, Any, dict]:
    """(model config, params, info): the SFT'd policy (from the cache when present), or the
    configured model itself when config.sft.enabled is False (`spec.sft` None). `train`: the
    train split of `spec.data` where the caller loaded it already (the SFT trains on it; else
    it is loaded when the SFT trains)."""
    if spec.sft is None:
        return spec.model, load_params(spec.model, spec.hf_path, spec.seed), {"sft": "off"}
    path = cache_dir(spec, workdir)
    where = cached_sft(spec, workdir)
    if where is not None:
        loaded = _load_cached(spec, where, "hit" if where == path else "shipped", verbose)
        if loaded is not None:
            return loaded
    check_sft_cache(spec, workdir)  # before training: a cache that cannot be written
    model_cfg, params, info = _train_sft(spec, verbose, train)
    saved = jax.process_index() != 0 or _save(path, model_cfg, params, info)
    if verbose:
        print(
            f"SFT warm start: {info['steps']} steps, loss {info['loss_first']:.3f} ->"
            f" {info['loss_last']:.3f} in {info['wall_time_s']:.0f}s;"
            + (f" cached {path}" if saved else " not cached")
        )
    return model_cfg, params, info


def _load_cached(spec: WarmStartSpec, where: str, found: str, verbose: bool):
    """The finished warm start at `where` (`found`: 'hit' the cache's, 'shipped'), or None when
    it does not load (then set aside, `_set_aside_damaged`)."""
    model_cfg = spec.model
    try:
        _, params = load_hf_checkpoint(where, model_cfg.param_dtype)
        with open(os.path.join(where, SFT_META)) as f:
            info = json.load(f)
    except (ValueError, OSError) as e:  # a damaged entry (truncated, garbage, half-copied)
        _set_aside_damaged(where, found, e)
        return None
    info["cache"] = found
    if verbose:
        print(f"SFT warm start: {'cached' if found == 'hit' else 'shipped'} {where}")
    return model_cfg, params, info


def _train_sft(
    spec: WarmStartSpec, verbose: bool, train: Sequence[Example] | None
) -> tuple[ModelConfig, Any, dict]:
    """The SFT from the configured model's init, on `train` (the train split; loaded when
    None); (model config, params, info)."""
    sft = spec.sft
    tokenizer = tokenizer_for(spec.tokenizer_path, spec.hf_path, spec.model.vocab_size)
    train = load_split(spec.data, "train") if train is None else train
    examples = list(train[: sft.examples])
    data = sft_sequences(examples, tokenizer)
    model_cfg, params = spec.model, load_params(spec.model, spec.hf_path, spec.seed)
    model = causal_lm(model_cfg)
    bar = progress(sft.steps, "SFT", enabled=verbose and jax.process_index() == 0)

    def tick(step, loss):
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss:.3f}")

    t0 = time.perf_counter()
    params, hist = sft_train(
        model,
        params,
        data,
        steps=sft.steps,
        batch_size=sft.batch_size,
        lr=sft.lr,
        warmup_steps=sft.warmup_steps,
        schedule=sft.schedule,
        seed=spec.seed,
        callback=tick,
    )
    bar.close()
    info = {
        "cache": "miss",
        "key": spec.key,
        "steps": sft.steps,
        "examples": len(examples),
        "loss_first": hist["loss"][0],
        "loss_last": float(np.mean(hist["loss"][-10:])),
        "wall_time_s": time.perf_counter() - t0,
    }
    return model_cfg, params, info


def _save(path: str, model_cfg, params, info: dict) -> bool:
    """Cache the SFT at `path` (written aside, then renamed; a concurrent run's kept); False
    when it could not be written (`info['cache']` then 'unsaved': the run goes on)."""
    tmp = path + f".tmp{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf_checkpoint(tmp, model_cfg, jax.device_get(params))
        with open(os.path.join(tmp, SFT_META), "w") as f:
            json.dump(info, f, indent=2)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path):  # a concurrent run finished first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except OSError as e:  # a full disk, a cache made read-only meanwhile: keep the SFT
        shutil.rmtree(tmp, ignore_errors=True)
        info["cache"] = "unsaved"
        print(
            f"warning: the SFT warm start could not be cached in {path} ({e}); this run"
            " goes on with it, the next one trains it again",
            file=sys.stderr,
        )
        return False
    return True
