"""LoRA adapters over a frozen base (QeRL mode), in one place.

Which way in: the family's `Linear` reads an optional `lora` collection (`{a, b, scale}` beside
its kernel, passed by `forward.variables`) and adds `scale * (x A) B` after its own product.
Chosen over an interceptor under the fault interceptors because `Linear` is the one module that
owns the product: a fault at a linear's output and an op-level fault that redoes the product
(`NoisyLinear`, which never calls the module) both see base plus adapter, and faults keep
matching the one `Linear` type (no wrapper module that would be a second site). The model file
only computes with the adapter; what is trained, initialised, frozen and merged is here.

Config (`config.lora`): rank (0 = off), alpha (scale = alpha / rank), target_modules
('all-linear' or comma-separated names of the model family's linears: `Family.linear_kinds`,
Qwen2's q_proj ... down_proj), train_norms (QeRL's `--ln`: the family's norm weights,
`Family.norm_kinds`, are trained too). A is Kaiming-uniform
(PEFT's `kaiming_uniform_(a=sqrt(5))`: U(-1/sqrt(in), 1/sqrt(in))), B is zero, so a fresh
adapter leaves the model's outputs bitwise unchanged.

The trainable tree of a LoRA run is `{"lora": adapters}` (+ `{"norms": ...}` with
train_norms): only these have gradients and optimizer state; `weights(base, trainable)` makes
the `forward.Weights` the device reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from aqn_jax import quant_base
from aqn_jax.forward import Weights, override
from aqn_jax.models import registry


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    train_norms: bool

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


# No adapters (full fine-tuning): what an absent config.lora section means.
OFF = LoraSpec(0, 16.0, registry.linear_kinds(), False)


def lora_spec(section) -> LoraSpec:
    """The typed `config.lora`, validated (one line naming the field)."""
    if section is None:
        return OFF
    rank = section.rank
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"config.lora.rank={rank!r}; allowed: an int >= 0 (0 = off)")
    alpha = section.alpha
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise ValueError(f"config.lora.alpha={alpha!r}; allowed: a number > 0")
    tm, linear = section.target_modules, registry.linear_kinds()
    if isinstance(tm, str):
        targets = linear if tm == "all-linear" else tuple(t.strip() for t in tm.split(","))
    else:
        targets = tuple(tm)
    bad = [t for t in targets if t not in linear]
    if bad or not targets:
        raise ValueError(
            f"config.lora.target_modules={tm!r}; allowed: 'all-linear' or comma-separated names"
            f" from {linear}"
        )
    if section.train_norms and rank == 0:
        raise ValueError(
            "config.lora.train_norms=True needs config.lora.rank > 0 (without LoRA every weight,"
            " norms included, is trained)"
        )
    return LoraSpec(
        int(rank), float(alpha), tuple(dict.fromkeys(targets)), bool(section.train_norms)
    )


def _target_kernels(params, site_of: Callable, targets) -> list[tuple[tuple[str, ...], Any]]:
    """(module path, kernel) of every targeted decoder linear, in tree order."""
    return [
        (path[:-1], quant_base.leaf_at(params, path))
        for path in quant_base.linear_kernel_paths(params, site_of)
        if site_of(path[:-1])[0] in targets
    ]


def check_ranks(spec: LoraSpec, params, site_of: Callable) -> None:
    """A rank above min(in, out) of a targeted linear is refused, naming the narrowest one
    and the real limit: the smallest min(in, out) over every targeted linear."""
    kernels = _target_kernels(params, site_of, spec.targets)
    if not kernels:
        return
    path, kernel = min(kernels, key=lambda pk: min(pk[1].shape))
    n_in, n_out = kernel.shape
    if spec.rank > min(n_in, n_out):
        raise ValueError(
            f"config.lora.rank={spec.rank} exceeds min(in, out) = {min(n_in, n_out)} of"
            f" {'/'.join(path)} ({n_in} x {n_out}), the narrowest targeted linear; allowed:"
            f" 1..{min(n_in, n_out)}"
        )


def _nest(flat: Mapping[tuple[str, ...], Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return out


def init_adapters(spec: LoraSpec, params, site_of: Callable, key: jax.Array, dtype=jnp.float32):
    """{module path: {"a": Kaiming-uniform [in, r], "b": zeros [r, out]}} for every targeted
    linear, nested like `params` (each A drawn from its own fold of `key`)."""
    flat = {}
    for i, (path, kernel) in enumerate(_target_kernels(params, site_of, spec.targets)):
        n_in, n_out = kernel.shape
        bound = 1.0 / np.sqrt(n_in)  # kaiming_uniform_(a=sqrt(5)) on a [r, in] weight
        a = jax.random.uniform(
            jax.random.fold_in(key, i), (n_in, spec.rank), jnp.float32, -bound, bound
        )
        flat[path] = {"a": a.astype(dtype), "b": jnp.zeros((spec.rank, n_out), dtype)}
    return _nest(flat)


def norm_weights(params, site_of: Callable) -> dict:
    """The norm weights of `params` (train_norms' trainable copy), nested like `params`."""
    flat, norms = {}, registry.norm_kinds()
    for path, leaf in jax.tree_util.tree_leaves_with_path(
        params, is_leaf=lambda x: isinstance(x, quant_base.Packed)
    ):
        names = tuple(k.key for k in path)
        site = site_of(names[:-1]) if names[-1] == "weight" else None
        if site is not None and site[0] in norms:
            flat[names] = leaf
    return _nest(flat)


def init_trainable(spec: LoraSpec, params, site_of: Callable, key: jax.Array) -> dict:
    """The trainable tree of a LoRA run: {"lora": adapters} (+ {"norms": ...})."""
    out = {"lora": init_adapters(spec, params, site_of, key)}
    if spec.train_norms:
        out["norms"] = jax.tree.map(jnp.asarray, norm_weights(params, site_of))
    return out


def weights(spec: LoraSpec, base, trainable) -> Weights:
    """What the device reads: the frozen base with the trained adapters (and norms)."""
    return Weights(base, trainable["lora"], trainable.get("norms"), spec.scale)


def merged(spec: LoraSpec, base, trainable):
    """A plain param tree: W' = W + (alpha / rank) A B for every adapted linear (W the
    dequantised base when it is packed), the trained norms put in (the export)."""
    params = override(quant_base.dequantize(base), trainable.get("norms"))

    def walk(node, ad):
        if "a" in ad and not isinstance(ad["a"], Mapping):
            w = node["kernel"]
            delta = spec.scale * (np.asarray(ad["a"], np.float64) @ np.asarray(ad["b"], np.float64))
            return {**node, "kernel": (np.asarray(w, np.float64) + delta).astype(w.dtype)}
        return {**node, **{k: walk(node[k], v) for k, v in ad.items()}}

    host = jax.tree.map(np.asarray, params)
    return walk(host, jax.tree.map(np.asarray, trainable["lora"]))


def fingerprint(params) -> str:
    """sha256 over the base's leaves (paths, dtypes, shapes, bytes): a LoRA checkpoint holds
    this instead of the base, and a resume over another base is refused."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        arr = np.asarray(jax.device_get(leaf))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(f"{arr.dtype}{arr.shape}".encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def trainable_axes(spec: LoraSpec, axes, site_of: Callable) -> dict:
    """Logical axes of the trained tree: A `[in, r]` takes its kernel's input axis, B `[r, out]`
    its output axis (the rank is never split), so adapters shard with their kernels."""
    flat, norms = {}, registry.norm_kinds()
    for path, names in jax.tree_util.tree_leaves_with_path(
        axes, is_leaf=lambda x: isinstance(x, tuple)
    ):
        keys = tuple(k.key for k in path)
        site = site_of(keys[:-1])
        if site is None:
            continue
        if keys[-1] == "kernel" and site[0] in spec.targets:
            flat[("lora", *keys[:-1])] = {"a": (names[0], None), "b": (None, names[1])}
        elif keys[-1] == "weight" and site[0] in norms and spec.train_norms:
            flat[("norms", *keys)] = names
    return _nest(flat)
