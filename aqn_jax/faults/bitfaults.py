"""Silent data corruption as fault transforms: bit flips and stuck bits at module calls and on
trees, a flipped MX/NVFP4 block scale, and ABFT checksums that detect corrupted linears.

  BitFault   which bits of which elements, when (static; the bit ops are `bits.py`)
  Bits       value level: a module's input or output, in the value's own dtype
  ScaleFlip  value level: the tensor fake-quantised in an MX/NVFP4 format with bits of its
             block scales flipped (GoldenEye's metadata fault): one bit rescales a block
  BitsLinear op level: a linear whose backward product dX or dW is corrupted (custom_vjp)
  TreeBits   tree level: weights as the forward reads them, gradients before the optimizer,
             the AdamW moments after it; leaves selected by param path (`sites_of_param`)
  Abft       check level: the row checksum of a linear, `(x W) 1` against `x (W 1)`, with a
             tolerance derived from the dtype's rounding and the sizes (`abft_tolerance`)

Keys: a transient fault draws from the run's key of (seed, step, attempt, phase) folded with
its site (`Ctx.key`, `TreeBits.apply`), so a recomputed step (a new attempt, a new key) draws
anew. With `steps` set it fires on the first attempt of those RL steps only, read from the
traced values `sdc_step` / `sdc_attempt`: a planted one-off, as a real SDC would be. A
permanent fault uses fixed lanes, drawn from `lane_seed` and the site alone: the last axis of
an activation (the same lanes for every token), every element of a tree's leaf.

Telemetry (`flips`, sown per site and call): the bits that changed; for the backward products
(`BitsLinear`, `bwd_flips`) the bits the mask selects (stuck bits: those forced, whether or not
they were already set), since a backward pass cannot sow; they count only in a differentiated
call.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import zlib
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from aqn_jax.models import registry

from . import bits, formats
from .sites import LINEAR_KINDS, Site, SiteSelector
from .transforms import Ctx, TransformBase, traced_value

SDC_STEP, SDC_ATTEMPT = "sdc_step", "sdc_attempt"  # the traced values of a `steps` fault
SDC_BIT = "sdc_bit"  # the traced bit position of a `traced_bit` fault
TARGETS = ("activation", "weight", "gradient", "optimizer")
BACKWARD_POINTS = ("dx", "dw")  # a linear's backward products


@dataclasses.dataclass(frozen=True)
class BitFault:
    """Which bits of which elements are hit, and when.

    mode: flip | stuck0 | stuck1 (`bits.MODES`). bits: a field of `bits.BIT_FIELDS` or bit
    positions (resolved against the value's dtype when it is seen). rate: per (element, bit);
    count: elements per tensor per call, one bit each; exactly one is set. permanent: fixed
    lanes from `lane_seed`. steps: the RL steps a transient fault fires at (first attempt
    only); None fires at every step. traced_bit: `bits` is one position, read at run time
    from the traced value `sdc_bit` (the caller passes `bits[0]`), so faults that differ only
    in the bit compile to the same program (the vulnerability study's cells)."""

    mode: str = "flip"
    bits: str | tuple[int, ...] = "exponent"
    rate: float | None = None
    count: int | None = None
    permanent: bool = False
    lane_seed: int = 0
    steps: tuple[int, ...] | None = None
    traced_bit: bool = False

    def __post_init__(self):
        if self.mode not in bits.MODES:
            raise ValueError(f"mode={self.mode!r}; allowed: {bits.MODES}")
        object.__setattr__(self, "bits", bits.parse_bits(self.bits))
        if (self.rate is None) == (self.count is None):
            raise ValueError(
                f"rate={self.rate}, count={self.count}: give exactly one (a bit-error rate per"
                " element and bit, or a count of elements per tensor)"
            )
        if self.rate is not None and not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate={self.rate}; must be in [0, 1]")
        if self.count is not None and not (isinstance(self.count, int) and self.count >= 1):
            raise ValueError(f"count={self.count!r}; must be an int >= 1")
        if self.traced_bit and (isinstance(self.bits, str) or len(self.bits) != 1):
            raise ValueError(f"bits={self.bits!r} with traced_bit=True; give one bit position")
        if self.steps is not None:
            if self.permanent:
                raise ValueError(
                    f"steps={self.steps} with permanent=True: a permanent fault fires at every step"
                )
            object.__setattr__(self, "steps", tuple(int(s) for s in self.steps))

    def value_names(self) -> frozenset[str]:
        names = {SDC_STEP, SDC_ATTEMPT} if self.steps is not None else set()
        return frozenset(names | ({SDC_BIT} if self.traced_bit else set()))

    def fires(self, values: Mapping[str, Any], site: Site | None) -> jax.Array | None:
        """Whether it fires at this call (None: always)."""
        if self.steps is None:
            return None
        step = traced_value(values, SDC_STEP, site)
        attempt = traced_value(values, SDC_ATTEMPT, site)
        return jnp.isin(step, jnp.asarray(self.steps, jnp.float32)) & (attempt == 0)

    def mask(
        self, key_fn, tag: str, shape, dtype, values, site: Site | None, tree: bool = False
    ) -> jax.Array:
        """The mask for a tensor of `shape` and `dtype`. A permanent fault's lanes are the last
        axis (broadcast over the others), or every element of a tree's leaf (`tree`).
        `key_fn()` gives the transient key (called only when transient)."""
        pos = bits.positions(self.bits, dtype)
        if self.traced_bit:  # draw bit 0, then shift it to the traced position
            pos = (0,)
        draw = functools.partial(bits.draw_mask, dtype=dtype, pos=pos, rate=self.rate)
        draw = functools.partial(draw, count=self.count)
        if self.permanent:
            lanes = tuple(shape) if tree else tuple(shape[-1:])
            mask = jnp.broadcast_to(draw(bits.lane_key(self.lane_seed, tag), lanes), shape)
        else:
            mask = draw(key_fn(), tuple(shape))
        if self.traced_bit:
            bit = traced_value(values, SDC_BIT, site).astype(mask.dtype)
            mask = jax.lax.shift_left(mask, bit)
        fire = self.fires(values, site)
        return mask if fire is None else jnp.where(fire, mask, jnp.zeros((), mask.dtype))

    def describe(self) -> str:
        how = f"rate={self.rate:g}" if self.rate is not None else f"count={self.count}"
        when = "permanent" if self.permanent else f"steps={list(self.steps or ['all'])}"
        return f"{self.mode}(bits={self.bits}, {how}, {when})"


def _describe(kind: str, fault: BitFault) -> str:
    return f"{kind}({fault.describe().split('(', 1)[1]}"


# --- at module calls ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Bits(TransformBase):
    """A module's input or output with bits flipped or stuck, in its own dtype."""

    fault: BitFault
    kind: str = "bitflip"  # the config section, for the plan's line
    counts_flips = True

    def __call__(self, x, ctx: Ctx):
        tag = f"{ctx.site}:{ctx.name}"
        mask = self.fault.mask(lambda: ctx.key, tag, x.shape, x.dtype, ctx.values, ctx.site)
        y = bits.corrupt(x, mask, self.fault.mode)
        ctx.sow("flips", bits.changed_bits(x, y).astype(jnp.float32))
        return y

    def value_names(self) -> frozenset[str]:
        return self.fault.value_names()

    def describe(self) -> str:
        return _describe(self.kind, self.fault)


@dataclasses.dataclass(frozen=True, eq=False)
class ScaleFlip(TransformBase):
    """The tensor fake-quantised in `format` along its last axis, with bits of its block scales
    flipped (`formats.quantize_scale_fault`; the fault's bits are the scale's: E8M0 for MX,
    E4M3 for NVFP4)."""

    fault: BitFault
    format: str = "mxfp4"
    block_size: int = formats.MX_BLOCK_SIZE
    scale_rule: str = "floor"
    rounding: str = "away"
    counts_flips = True
    value_bits = False  # the bits are the block scale's (checked here, against `scale_dtype`)

    def __post_init__(self):
        allowed = (*formats.MX_FORMATS, "nvfp4")
        if self.format not in allowed:
            raise ValueError(f"format={self.format!r}; allowed: {allowed}")
        formats.check_block_size(self.format, self.block_size)
        bits.positions(self.fault.bits, self.scale_dtype)  # a position the scale has

    @property
    def scale_dtype(self):
        return jnp.float8_e4m3fn if self.format == "nvfp4" else jnp.float8_e8m0fnu

    def __call__(self, x, ctx: Ctx):
        shape = formats.scale_blocks(x.shape, self.format, self.block_size)
        tag = f"{ctx.site}:{ctx.name}"
        mask = self.fault.mask(lambda: ctx.key, tag, shape, self.scale_dtype, ctx.values, ctx.site)
        ctx.sow("flips", bits.popcount(mask).astype(jnp.float32))
        ctx.sow("blocks_hit", jnp.sum(mask != 0, dtype=jnp.float32))
        return formats.quantize_scale_fault(
            x,
            self.format,
            mask,
            block_size=self.block_size,
            scale_rule=self.scale_rule,
            rounding=self.rounding,
        )

    def value_names(self) -> frozenset[str]:
        return self.fault.value_names()

    def describe(self) -> str:
        return f"mx_scale_flip[{self.format}]({self.fault.describe().split('(', 1)[1]}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _sdc_linear(which, mode, cell, product, x, w, b, lora, mask, probe):
    """The linear `product` (its family's, `registry.linear_of`) whose backward product `which`
    (dx | dw | None) gets `mask`'s bits, and, with a `probe` (backward ABFT), whose backward
    products are then checked: the rows flagged in dX and dW are added at `probe[cell]` of the
    probe's cotangent."""
    return product(x, w, b, lora)


def _sdc_linear_fwd(which, mode, cell, product, x, w, b, lora, mask, probe):
    y, vjp = jax.vjp(product, x, w, b, lora)
    return y, (vjp, mask, None if probe is None else (x, w, probe))


def _sdc_linear_bwd(which, mode, cell, product, res, g):
    vjp, mask, check = res
    dx, dw, db, dlora = vjp(g)  # the products autodiff forms, in x's and w's dtypes
    # The product as the unit writes it back, then corrupted.
    if which == "dx":
        dx = bits.apply_bits(dx, mask, mode)
    elif which == "dw":
        dw = bits.apply_bits(dw, mask, mode)
    dprobe = None
    if check is not None:  # the checks see the products as written (after the fault)
        x, w, probe = check
        at = np.zeros(probe.shape, np.float32)  # a constant one-hot of the cell (no scatter)
        at[cell] = 1.0
        dprobe = jnp.asarray(at) * backward_detections(x, w, g, dx, dw)
    return dx, dw, db, dlora, None, dprobe


_sdc_linear.defvjp(_sdc_linear_fwd, _sdc_linear_bwd)


def _module_linear(module, args):
    """(product, (x, kernel, bias, lora)) of a linear call: its family's linear contract
    (`registry.linear_of`), the operands read from the module as the unit reads them."""
    operands, product = registry.linear_of(module)
    return product, operands(module, args[0])


@dataclasses.dataclass(frozen=True, eq=False)
class BitsLinear(TransformBase):
    """A linear whose backward product `which` (dx: g Wᵀ (plus the adapter's term), dw: xᵀ g)
    has bits flipped or stuck; its forward is the module's own computation (its family's
    linear contract, with the LoRA adapter when the module has one: under LoRA the base's dW
    is unused)."""

    fault: BitFault
    which: str = "dx"
    kind: str = "bitflip"
    abft: bool = False  # backward ABFT on this linear too (`AbftBackward` yields to it here)
    level = "op"
    allowed_kinds = LINEAR_KINDS
    counts_flips = True  # `bwd_flips`, where the call is differentiated

    def __post_init__(self):
        if self.which not in BACKWARD_POINTS:
            raise ValueError(f"which={self.which!r}; allowed: {BACKWARD_POINTS}")

    def __call__(self, module, args, ctx: Ctx):
        product, (x, w, b, lora) = _module_linear(module, args)
        shape = x.shape if self.which == "dx" else w.shape
        tag = f"{ctx.site}:{ctx.name}"
        mask = self.fault.mask(lambda: ctx.key, tag, shape, x.dtype, ctx.values, ctx.site)
        # `bwd_flips`: they happen only if this call is differentiated (the update's passes,
        # not prepare's or the sampler's); the caller counts them where it differentiates.
        ctx.sow("bwd_flips", bits.popcount(mask).astype(jnp.float32))
        probe = _PROBE.get() if self.abft else None
        cell = _probe_cell(ctx.site)
        return _sdc_linear(self.which, self.fault.mode, cell, product, x, w, b, lora, mask, probe)

    def value_names(self) -> frozenset[str]:
        return self.fault.value_names()

    def describe(self) -> str:
        return f"{_describe(self.kind, self.fault)} on {self.which}"


# --- on trees -----------------------------------------------------------------------------------
def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _path_tuple(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def selected(tree, sites: SiteSelector) -> list[bool]:
    """For each leaf of a param-shaped tree (flatten order): whether a site holding it matches
    `sites` (`registry.sites_of_param`: a leaf of down_proj also belongs to its mlp and layer)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [
        any(sites.matches(Site(*s)) for s in registry.sites_of_param(_path_tuple(p)))
        for p, _ in leaves
    ]


@dataclasses.dataclass(frozen=True, eq=False)
class TreeBits(TransformBase):
    """Bits flipped or stuck in the selected leaves of a param-shaped tree: the weights as the
    forward reads them, the gradients before the optimizer, the AdamW moments after it."""

    fault: BitFault
    target: str = "weight"  # weight | gradient | optimizer
    kind: str = "bitflip"
    level = "tree"
    counts_flips = True  # on the weights: `forward`'s; gradients and moments: the optimizer's

    def __post_init__(self):
        if self.target not in TARGETS[1:]:
            raise ValueError(f"target={self.target!r}; allowed: {TARGETS[1:]}")

    def paths(self, tree, sites: SiteSelector) -> list[str]:
        """The selected leaves' paths (the manifest's hits)."""
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return [_path_str(p) for (p, _), s in zip(leaves, selected(tree, sites), strict=True) if s]

    def apply(self, tree, sites: SiteSelector, key, values, tag: str = ""):
        """(the tree with its selected leaves corrupted, the bits that changed: int32)."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        out, flips = [], jnp.zeros((), jnp.int32)
        for (path, leaf), chosen in zip(leaves, selected(tree, sites), strict=True):
            if not chosen:
                out.append(leaf)
                continue
            name = f"{tag}{_path_str(path)}"
            leaf_key = lambda name=name: jax.random.fold_in(key, zlib.crc32(name.encode()))
            mask = self.fault.mask(leaf_key, name, leaf.shape, leaf.dtype, values, None, True)
            new = bits.corrupt(leaf, mask, self.fault.mode)
            flips = flips + bits.changed_bits(leaf, new)
            out.append(new)
        return jax.tree_util.tree_unflatten(treedef, out), flips

    def value_names(self) -> frozenset[str]:
        return self.fault.value_names()

    def describe(self) -> str:
        return f"{_describe(self.kind, self.fault)} on {self.target}"


# --- ABFT ---------------------------------------------------------------------------------------
def _gamma(n: int, u: float) -> float:
    """γ_n = n u / (1 - n u): the bound on the relative error of an n-term float sum or dot in
    any order (Higham, Accuracy and Stability, Lemma 3.1)."""
    return n * u / (1.0 - n * u)


def abft_tolerance(absprod_N, absy_N, absb: jax.Array, K: int, O: int, out_dtype) -> jax.Array:
    """The bound on |Σ_j y_ij - x_i·(W 1) - Σ_j b_j| that rounding alone can reach, per row.

    With u = 2^-24 (float32 accumulation), u_out the output dtype's unit roundoff, A_i =
    |x_i|·(|W| 1) (`absprod_N`), B_i = Σ_j |y_ij| (`absy_N`) and Σ|b| (`absb`):
      y_ij = fl_out(fl_out(fl_K(x_i·W_j)) + b_j): the K-term dot errs by γ_K Σ_k |x_ik W_kj|,
        the casts (product, then bias add) by u_out |y_ij| each;
      Σ_j y_ij summed in float32 errs by γ_O (B_i + Σ|b|);
      W 1 errs by γ_O Σ_j |W_kj| per k, then x·(W 1) by γ_K: (γ_O + γ_K) A_i.
    So |residual| ≤ (2 γ_K + γ_O) A_i + (2 u_out + γ_O)(B_i + Σ|b|) to first order; the
    factor 1 + max(2^-10, 2 γ_max(K,O)) covers the second-order terms and the float32
    evaluation of A and B themselves (each within γ_K or γ_O of exact); K+O+2 times the
    smallest normal covers results that flush. A worst case over summation orders and signs:
    in bf16 the output casts dominate (2^-7 of Σ|y|), so only flips that move a row's sum by
    more than that are caught; in float32 the bound is ~K 2^-24 of Σ|x||W|.
    """
    u = 2.0**-24
    u_out = float(jnp.finfo(out_dtype).eps) / 2
    # The evaluation of A and B errs by at most γ_max(K,O) relatively: 2^-10 covers it below
    # K, O of 2^13; a longer sum (dW's inner dimension is the batch's tokens) widens the factor.
    slack = 1 + max(2.0**-10, 2 * _gamma(max(K, O), u))
    coef_a = slack * (2 * _gamma(K, u) + _gamma(O, u))
    coef_b = slack * (2 * u_out + _gamma(O, u))
    tiny = (K + O + 2) * float(jnp.finfo(jnp.float32).tiny)
    return coef_a * absprod_N + coef_b * (absy_N + absb) + tiny


def abft_check(x, w, b, y) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(flagged rows: bool [N], |residual| [N], tolerance [N]) of `y = x W (+ b)` (the rows of
    x's leading axes flattened), all checksums in float32. A non-finite residual is flagged."""
    K, O = w.shape
    x_NK = x.reshape(-1, K).astype(jnp.float32)
    y_NO = y.reshape(-1, O).astype(jnp.float32)
    w = w.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    checksum = jnp.dot(x_NK, jnp.sum(w, axis=1), precision=hi)
    absprod = jnp.dot(jnp.abs(x_NK), jnp.sum(jnp.abs(w), axis=1), precision=hi)
    bsum = absb = jnp.zeros((), jnp.float32)
    if b is not None:
        bsum, absb = jnp.sum(b.astype(jnp.float32)), jnp.sum(jnp.abs(b.astype(jnp.float32)))
    resid = jnp.abs(jnp.sum(y_NO, axis=1) - checksum - bsum)
    absy = jnp.sum(jnp.abs(y_NO), axis=1)
    tol = abft_tolerance(absprod, absy, absb, K, O, y.dtype)
    # An Inf in y makes the tolerance Inf too: a non-finite row is flagged on its own.
    return ~(resid <= tol) | ~jnp.isfinite(absy), resid, tol


@dataclasses.dataclass(frozen=True, eq=False)
class Abft(TransformBase):
    """ABFT on a linear's output as the next module reads it (after any output fault): sows
    `detected` (rows whose checksum residual exceeds `abft_tolerance`) and `rows`."""

    level = "check"
    allowed_kinds = LINEAR_KINDS
    counts_detections = True

    def __call__(self, module, args, out, ctx: Ctx) -> None:
        # The operands of the family's contract: the checksum is of the matrix multiplied.
        _, (x, w, b, _) = _module_linear(module, args)
        flagged, _, _ = abft_check(x, w, b, out)
        ctx.sow("detected", jnp.sum(flagged, dtype=jnp.float32))
        ctx.sow("rows", jnp.float32(flagged.shape[0]))

    def describe(self) -> str:
        return "abft(row checksums, derived tolerance)"


# Backward ABFT: a backward pass cannot sow, so the rows its checks flag leave it as the
# cotangent of a probe, zeros of [layers, LINEAR_KINDS, (dX, dW)] that the update differentiates
# beside the params (`sdc/telemetry.abft_accumulate`) and hands to the checks through this variable.
_PROBE: contextvars.ContextVar = contextvars.ContextVar("abft_backward_probe", default=None)
PRODUCTS = ("dx", "dw")  # the probe's last axis


def abft_probe(num_layers: int) -> jax.Array:
    return jnp.zeros((num_layers, len(LINEAR_KINDS), len(PRODUCTS)), jnp.float32)


@contextlib.contextmanager
def backward_probe(probe):
    """Within (while a differentiated pass is traced): the linears' backward checks add the
    rows they flag to `probe`'s cotangent; outside, a backward ABFT linear is the plain one."""
    token = _PROBE.set(probe)
    try:
        yield
    finally:
        _PROBE.reset(token)


def _probe_cell(site: Site) -> tuple[int, int]:
    return site.layer, LINEAR_KINDS.index(site.kind)


def backward_checks(x, w, g, dx, dw):
    """`abft_check` of a linear's backward products, (dX's, dW's), each as the forward is
    checked (its derived tolerance): dX = g Wᵀ as a linear of g with kernel Wᵀ (inner
    dimension O, checksum g (Wᵀ 1)), dW = xᵀ g as a linear of xᵀ with kernel g (inner
    dimension N, the tokens; checksum xᵀ (g 1))."""
    K, O = w.shape
    x_NK, g_NO = x.reshape(-1, K), g.reshape(-1, O)
    return abft_check(g_NO, w.T, None, dx.reshape(-1, K)), abft_check(x_NK.T, g_NO, None, dw)


def backward_detections(x, w, g, dx, dw) -> jax.Array:
    """Rows flagged in a linear's backward products, [dX rows, dW rows] (float32)."""
    return jnp.stack([jnp.sum(c[0], dtype=jnp.float32) for c in backward_checks(x, w, g, dx, dw)])


@dataclasses.dataclass(frozen=True, eq=False)
class AbftBackward(TransformBase):
    """ABFT on a linear's backward products dX and dW (`backward_detections`), in the passes the
    update differentiates (`backward_probe`); elsewhere the module's own computation. At a site
    where a fault redoes the linear (an op-level transform) it yields (`fallback`): a
    `BitsLinear` there carries the check itself (`abft=True`, `faults.config.with_abft`); a
    noisy linear's products are not checked (its error is the device's, not a corruption)."""

    level = "op"
    allowed_kinds = LINEAR_KINDS
    fallback: ClassVar[bool] = True

    def __call__(self, module, args, ctx: Ctx):
        product, (x, w, b, lora) = _module_linear(module, args)
        probe = _PROBE.get()
        if probe is None:
            return product(x, w, b, lora)
        cell = _probe_cell(ctx.site)
        return _sdc_linear(None, "flip", cell, product, x, w, b, lora, None, probe)

    def describe(self) -> str:
        return "abft_backward(dX and dW row checksums, derived tolerance)"


def traced_bit(plan) -> int | None:
    """The bit position a plan's `traced_bit` faults read from `sdc_bit` (one per plan), or
    None."""
    found = {
        inj.transform.fault.bits[0]
        for inj in plan.injections
        if getattr(inj.transform, "fault", None) is not None and inj.transform.fault.traced_bit
    }
    if len(found) > 1:
        raise ValueError(f"traced_bit faults with different bits {sorted(found)}: one per plan")
    return found.pop() if found else None
