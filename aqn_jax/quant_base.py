"""A frozen base quantised to NVFP4 or MXFP4 (QeRL's NVFP4A16 / MXFP4A16), stored packed.

`pack(params, fmt, site_of)` quantises every decoder linear's kernel once, at load, with the
faithful kernels of `faults/formats.py` (the same arithmetic, split into its encode and decode
halves), and keeps it packed: two 4-bit e2m1 codes (sign | 3-bit magnitude) per byte plus the
block scales (NVFP4: an E4M3 byte per 16 inputs, one float32 global scale; MXFP4: an E8M0
exponent per 32 inputs). `dequantize(tree)`, called by `forward.variables` inside every jitted
program, turns each `Packed` leaf back into the kernel the forward reads, so the base costs
~0.28 of its bf16 bytes in memory and the dequantised values equal
`formats.quantize_nvfp4(kernel, axis=0)` (resp. `quantize_mx(kernel, 'mxfp4', axis=0)`) bit for
bit. Embeddings, norms and lm_head are never touched (QeRL: `ignore=["lm_head"]`, norms and
embeddings bf16).

Blocks run along the input axis (the contraction axis of `y = x W`): the kernel `[in, out]` is
stored transposed, `[out, in // 2]` bytes of codes and `[out, in // block]` scales.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aqn_jax.faults import formats
from aqn_jax.models import registry

WEIGHT_FORMATS = ("none", "nvfp4", "mxfp4")
_BLOCK = {"nvfp4": formats.NVFP4_BLOCK_SIZE, "mxfp4": formats.MX_BLOCK_SIZE}


@flax.struct.dataclass
class Packed:
    """One kernel `[in, out]` in a 4-bit block format (see the module docstring)."""

    codes: jax.Array  # uint8 [out, in // 2]: element 2j in the low nibble, 2j + 1 in the high
    scales: jax.Array  # nvfp4: uint8 E4M3 bits [out, in // 16]; mxfp4: int8 exponents [.., // 32]
    s_global: jax.Array  # float32 scalar (nvfp4's global scale; 1 for mxfp4)
    k: jax.Array  # int32 scalar (nvfp4's power-of-two normaliser; 0 for mxfp4)
    fmt: str = flax.struct.field(pytree_node=False)
    dtype: str = flax.struct.field(pytree_node=False)  # of the dequantised kernel

    @property
    def shape(self) -> tuple[int, int]:
        out, half = self.codes.shape
        return (2 * half, out)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(self))

    def with_dtype(self, dtype) -> Packed:
        return self.replace(dtype=jnp.dtype(dtype).name)


def check_format(fmt: str, field: str = "config.model.weight_format") -> None:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"{field}={fmt!r}; allowed: {WEIGHT_FORMATS}")


def check_shapes(shapes: dict[str, tuple[int, int]], fmt: str, field: str) -> None:
    """Every kernel's input length a multiple of the format's block (one line naming one)."""
    block = _BLOCK[fmt]
    for name, (n_in, _) in shapes.items():
        if n_in % block:
            raise ValueError(
                f"{field}={fmt!r}: {name} has {n_in} inputs, not a multiple of {fmt}'s block of"
                f" {block}; allowed: models whose linear inputs are multiples of {block}"
            )


# -- the e2m1 code: sign << 3 | magnitude code (0, .5, 1, 1.5, 2, 3, 4, 6 -> 0..7) -----------------
def _e2m1_code(q: jax.Array, negative: jax.Array) -> jax.Array:
    """4-bit codes of e2m1 magnitudes q (exact format values) and their signs."""
    e = jnp.clip(formats._floor_log2(q), 0, 2)  # q >= 1: its exponent 0..2
    normal = ((e + 1) * 2 + (q * formats._pow2(-e) - 1.0) * 2).astype(jnp.int32)
    mag = jnp.where(q < 1.0, (q * 2.0).astype(jnp.int32), normal)
    return (mag | (negative.astype(jnp.int32) << 3)).astype(jnp.uint8)


def _e2m1_value(code: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(magnitude as float32, negative) of 4-bit e2m1 codes; exact."""
    c = code.astype(jnp.int32)
    e, m = (c >> 1) & 3, (c & 1).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * formats._pow2(e - 1))
    return mag, (c >> 3) == 1


# -- pack / dequantize one kernel ----------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(1,))
def _pack(kernel_IO: jax.Array, fmt: str):
    x_OI = kernel_IO.astype(jnp.float32).T
    O, I = x_OI.shape
    blocks = x_OI.reshape(O, I // _BLOCK[fmt], _BLOCK[fmt])
    if fmt == "nvfp4":
        q, negative, s_block, s_global, k, poisoned = formats.nvfp4_encode(blocks)
        scales = lax.bitcast_convert_type(s_block[..., 0].astype(jnp.float8_e4m3fn), jnp.uint8)
    else:
        spec = formats.FORMATS["mxfp4"].spec
        q, negative, e, poisoned = formats.mx_encode(blocks, spec, "floor", "away")
        scales, s_global, k = e[..., 0].astype(jnp.int8), jnp.float32(1.0), jnp.int32(0)
    codes = _e2m1_code(q, negative).reshape(O, I // 2, 2)
    codes = codes[..., 0] | (codes[..., 1] << 4)
    return codes, scales, s_global, k, jnp.any(poisoned)


@jax.jit
def _dequantize(p: Packed) -> jax.Array:
    O, half = p.codes.shape
    I = 2 * half
    codes = jnp.stack([p.codes & 0xF, p.codes >> 4], axis=-1).reshape(O, I)
    q, negative = _e2m1_value(codes)
    block = _BLOCK[p.fmt]
    q = q.reshape(O, I // block, block)
    negative = negative.reshape(O, I // block, block)
    if p.fmt == "nvfp4":
        s_block = lax.bitcast_convert_type(p.scales, jnp.float8_e4m3fn).astype(jnp.float32)
        out = formats.nvfp4_decode(q, negative, s_block[..., None], p.s_global, p.k)
    else:
        out = formats.mx_decode(q, negative, p.scales.astype(jnp.int32)[..., None])
    return out.reshape(O, I).T.astype(p.dtype)


@functools.lru_cache(maxsize=64)
def packed_shapes(shape_IO: tuple[int, int], fmt: str) -> tuple[jax.ShapeDtypeStruct, ...]:
    """(codes, scales, s_global, k) of an `[in, out]` kernel packed in `fmt`, as shapes and
    dtypes (traced, nothing computed): the memory planner's layout of a packed base."""
    x = jax.ShapeDtypeStruct(tuple(shape_IO), jnp.float32)
    return tuple(jax.eval_shape(lambda k: _pack(k, fmt)[:4], x))


def pack_kernel(kernel_IO, fmt: str, name: str = "kernel") -> Packed:
    """One `[in, out]` kernel packed in `fmt` (nvfp4 | mxfp4)."""
    codes, scales, s_global, k, poisoned = _pack(jnp.asarray(kernel_IO), fmt)
    if bool(poisoned):
        raise ValueError(f"{name}: a non-finite weight; a {fmt} base needs finite kernels")
    dtype = jnp.dtype(getattr(kernel_IO, "dtype", jnp.float32)).name
    return Packed(codes, scales, s_global, k, fmt, dtype)


def _is_packed(x) -> bool:
    return isinstance(x, Packed)


def dequantize(tree):
    """`tree` with every `Packed` leaf dequantised to its kernel (other leaves as they are)."""
    return jax.tree.map(lambda x: _dequantize(x) if _is_packed(x) else x, tree, is_leaf=_is_packed)


def cast(tree, dtype):
    """`tree` in `dtype` (the generation weights of bf16 compute): float leaves cast, a
    `Packed` leaf dequantising to `dtype` (its codes stay as they are)."""
    dt = jnp.dtype(dtype)
    return jax.tree.map(
        lambda x: x.with_dtype(dt) if _is_packed(x) else x.astype(dt), tree, is_leaf=_is_packed
    )


def linear_kernel_paths(params, site_of: Callable) -> list[tuple[str, ...]]:
    """Paths of the decoder linears' kernels (`site_of(module path)` kind a family's linear)."""
    linear, out = registry.linear_kinds(), []
    for path, _ in jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_packed):
        names = tuple(k.key for k in path)
        site = site_of(names[:-1]) if names[-1] == "kernel" else None
        if site is not None and site[0] in linear:
            out.append(names)
    return out


def leaf_at(tree, path):
    """The leaf of a nested dict at `path`."""
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    if not path:
        return value
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def check_model(params, fmt: str, site_of: Callable) -> list[tuple[str, ...]]:
    """The decoder kernels' paths of `params` (arrays or shapes), every input length a multiple
    of `fmt`'s block; one line naming the field and the kernel otherwise."""
    paths = linear_kernel_paths(params, site_of)
    if not paths:
        raise ValueError(f"config.model.weight_format={fmt!r}: the model has no decoder linears")
    check_shapes(
        {"/".join(p[:-1]): tuple(leaf_at(params, p).shape) for p in paths},
        fmt,
        "config.model.weight_format",
    )
    return paths


def pack(params, fmt: str, site_of: Callable):
    """`params` with every decoder linear's kernel packed in `fmt` ('none': unchanged)."""
    check_format(fmt)
    if fmt == "none":
        return params
    paths = check_model(params, fmt, site_of)
    for path in paths:
        params = _set(params, path, pack_kernel(leaf_at(params, path), fmt, "/".join(path)))
    return params


def fake_quantized(params, fmt: str, site_of: Callable):
    """`params` with every decoder linear's kernel replaced by its dequantised `fmt` values
    (what `pack` + `dequantize` give; the export's W and a weight-quantised device)."""
    return dequantize(pack(params, fmt, site_of))


def packed_axes(axes, fmt: str, site_of: Callable, dtype: str = "float32"):
    """The logical axes of a param tree after `pack`: a decoder kernel's (in, out) become its
    codes' and scales' (out, in) (stored transposed); the scalars are replicated."""
    if fmt == "none":
        return axes
    linear = registry.linear_kinds()

    def walk(node, path):
        if isinstance(node, tuple):
            site = site_of(path[:-1]) if path[-1] == "kernel" else None
            if site is not None and site[0] in linear:
                a_in, a_out = node
                return Packed((a_out, a_in), (a_out, a_in), (), (), fmt, jnp.dtype(dtype).name)
            return node
        return {k: walk(v, (*path, k)) for k, v in node.items()}

    return walk(axes, ())


def nbytes(tree) -> int:
    """Bytes of a param tree as stored (packed leaves at their packed size)."""
    total = 0
    for leaf in jax.tree.leaves(tree, is_leaf=_is_packed):
        total += leaf.nbytes if _is_packed(leaf) else int(np.prod(leaf.shape)) * leaf.dtype.itemsize
    return total
