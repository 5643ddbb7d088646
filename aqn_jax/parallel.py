"""Device mesh, logical-axis sharding rules and batch placement.

`config.mesh` gives the sizes of the axes ('data', 'fsdp', 'tensor'); -1 takes the devices
left over (at most one axis). Params carry logical axis names (models/qwen2.py); the rules map
them to mesh axes:

    embed -> fsdp     (FSDP: every weight matrix split along its model dimension)
    heads, kv_heads, mlp, vocab -> tensor   (Megatron-style tensor parallelism)
    norm, None -> replicated

Batches are split along axis 0 over ('data', 'fsdp'). Meshes are made with Auto axis types
(JAX 0.10 defaults to explicit sharding, which refuses ambiguous contractions).

Several hosts (`config.distributed`, `initialize`): every process runs the same program over the
global mesh. Host-side inputs are built identically on every process (the prompt batcher is
deterministic) and each process places only the rows its own devices hold (`put_batch`,
`put_global`); results come back to every host with `to_host` (an all-gather across processes
where an array is not fully addressable). Only process 0 writes logs and reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
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


def check_distributed(dist: Any) -> None:
    """Raise naming the field before anything starts."""
    if dist.auto and dist.coordinator:
        raise ValueError(
            f"config.distributed.auto=True and coordinator={dist.coordinator!r}: give one"
            " (auto detects the coordinator itself)"
        )
    if dist.coordinator:
        host, _, port = str(dist.coordinator).rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"config.distributed.coordinator={dist.coordinator!r}; expected 'host:port'"
            )
        if int(dist.num_processes) < 1:
            raise ValueError(
                f"config.distributed.num_processes={dist.num_processes}; must be >= 1 with a"
                " coordinator"
            )
        if not 0 <= int(dist.process_id) < int(dist.num_processes):
            raise ValueError(
                f"config.distributed.process_id={dist.process_id}; must be in"
                f" [0, num_processes={dist.num_processes})"
            )
    if dist.local_device_ids:
        try:
            [int(i) for i in str(dist.local_device_ids).split(",")]
        except ValueError:
            raise ValueError(
                f"config.distributed.local_device_ids={dist.local_device_ids!r}; expected"
                " comma-separated integers such as '0,1'"
            ) from None


def initialize(dist: Any) -> bool:
    """`jax.distributed.initialize` when `config.distributed` asks for it (before any other JAX
    call touches the devices). Returns whether the run is multi-process."""
    check_distributed(dist)
    if not (dist.coordinator or dist.auto):
        return False
    kwargs = {}
    if dist.coordinator:
        kwargs = dict(
            coordinator_address=str(dist.coordinator),
            num_processes=int(dist.num_processes),
            process_id=int(dist.process_id),
        )
    if dist.local_device_ids:
        kwargs["local_device_ids"] = [int(i) for i in str(dist.local_device_ids).split(",")]
    jax.distributed.initialize(**kwargs)
    return True


def to_host(x: Any) -> np.ndarray:
    """The full value of a (possibly multi-process) array as numpy, on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def put_global(tree: Any, shardings: Any) -> Any:
    """Host values (the same on every process) -> global arrays with `shardings`; each
    process transfers only the shards its devices hold."""

    def one(x, sharding):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree_util.tree_map(one, tree, shardings)


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


def check_splits(mesh_cfg: Any, num_devices: int, sizes: Mapping[str, int]) -> None:
    """Every row count in `sizes` ({what it is, as the error names it: rows}) must split over
    the data x fsdp devices of `config.mesh`; raises naming the first that does not."""
    data, fsdp, _ = mesh_shape(mesh_cfg, num_devices)
    for what, rows in sizes.items():
        if int(rows) % (data * fsdp):
            raise ValueError(
                f"{what} does not split over the data x fsdp = {data * fsdp} devices of config.mesh"
            )


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
    """Place host arrays (the global batch, identical on every process) split along axis 0
    over (data, fsdp), scalars replicated; each process transfers only its own rows."""

    def sharding(x):
        x = np.asarray(x)
        return replicated(mesh) if x.ndim == 0 else batch_sharding(mesh, x.ndim)

    return put_global(tree, jax.tree_util.tree_map(sharding, tree))
