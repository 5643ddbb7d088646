"""Device mesh, logical-axis sharding rules and batch placement.

`config.mesh` gives the sizes of the axes ('data', 'fsdp', 'tensor'); -1 takes the devices
left over (at most one axis). Params carry logical axis names (models/qwen2.py); the rules map
them to mesh axes:

    embed -> fsdp     (FSDP: every weight matrix split along its model dimension)
    heads, kv_heads, mlp, vocab -> tensor   (Megatron-style tensor parallelism)
    norm, None -> replicated

Batches are split along axis 0 over ('data', 'fsdp'). Meshes are made with Auto axis types
(JAX 0.10 defaults to explicit sharding, which refuses ambiguous contractions).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
DEFAULT_RULES = (
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("norm", None),
)


def mesh_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.data = -1  # -1: all devices not used by the other axes
    c.fsdp = 1
    c.tensor = 1
    return c


def mesh_shape(mesh_cfg: Any, num_devices: int) -> tuple[int, int, int]:
    """The (data, fsdp, tensor) sizes for `num_devices`; raises naming config.mesh."""
    sizes = [int(mesh_cfg[a]) for a in AXES]
    given = f"config.mesh=(data={sizes[0]}, fsdp={sizes[1]}, tensor={sizes[2]})"
    if sum(s == -1 for s in sizes) > 1:
        raise ValueError(f"{given}: at most one axis may be -1")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"{given}: sizes must be positive or -1")
    fixed = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if num_devices % fixed:
            raise ValueError(
                f"{given} does not divide the {num_devices} devices (the fixed axes need a"
                f" multiple of {fixed})"
            )
        sizes[sizes.index(-1)] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"{given} uses {fixed} devices but {num_devices} are present; the product must equal"
            " the device count (or set one axis to -1)"
        )
    return tuple(sizes)


def make_mesh(mesh_cfg: Any, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(mesh_cfg, len(devices))
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices)


def param_shardings(logical_axes_tree: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
    """NamedSharding per param from its logical axis names."""

    def one(names):
        spec = nn.logical_to_mesh_axes(names, rules)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map(one, logical_axes_tree, is_leaf=lambda x: isinstance(x, tuple))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_divisor(mesh: Mesh) -> int:
    return int(mesh.shape["data"] * mesh.shape["fsdp"])


def put_batch(tree: Any, mesh: Mesh) -> Any:
    """Place arrays split along axis 0 over (data, fsdp); scalars replicated."""

    def one(x):
        x = np.asarray(x)
        if x.ndim == 0:
            return jax.device_put(x, replicated(mesh))
        return jax.device_put(x, batch_sharding(mesh, x.ndim))

    return jax.tree_util.tree_map(one, tree)
