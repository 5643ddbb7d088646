"""The fault transforms: what a `FaultPlan` injection does at a site (`intercept.py` applies
them and knows no transform types).

Every transform follows `Transform` (below; `TransformBase` gives the defaults). Its `level`
says how the interceptor calls it:
  value  `transform(x, ctx) -> x` on a module's input or output;
  op     `transform(module, args, ctx) -> out`, replacing the module's computation;
  check  `transform(module, args, out, ctx) -> None` after the outputs (a detector: ABFT);
  tree   not at a module call: a fault on a tree (weights, gradients, optimizer moments) that
         the forward seam or the optimizer applies (`bitfaults.TreeBits`).
`allowed_kinds`, when set, limits the module kinds it may select. `ctx` (`Ctx`, below) gives
the site, its key, the traced values, `sow` and the state shared along the chain at one site
and point. A transform's `describe()` is its line in the plan, `value_names()` the traced
values it reads, `layer_ids()` the layers its static per-layer settings name.

  Deadzone        |x| below a threshold -> 0 (`ops.deadzone`; the MXFP4 deadzone fault)
  Noise           x + e, e of a noise kind at the site's `Scale` (`ops.noise_error`)
  Quantize        fake quantisation: MX formats, NVFP4 (`formats.py`)
  NoisyLinear     operator-level error on a linear's output and its dX, dW (`ops.noisy_linear`)
  NormWeightNoise QeRL's AQN: noise on an RMSNorm's weight vector for this call
The bit-level faults and ABFT are in `bitfaults.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from aqn_jax.models import registry

from . import formats, ops, sites
from .sites import Site

# --- what a transform sees ----------------------------------------------------------------------
STATS_COLLECTION = "fault_stats"  # telemetry, sown at each site
STATE_COLLECTION = "fault_state"  # running statistics carried across cached decode calls
# Telemetry that counts (bits, blocks, rows): summed when a module call is split into parts
# (the log-prob readout's chunks, `aqn_jax/logprobs.py`); every other statistic is a mean,
# weighted by the part's size.
COUNT_STATS = frozenset({"flips", "blocks_hit", "bwd_flips", "detected", "rows"})
# A traced value (raw key data) that a caller running one device state over several model
# calls passes to all of them (the sampler: a rollout's prefill and decode steps): a draw that
# models the weights as the device holds them (`Ctx.draw_key`) is then made once, not per call.
DRAW_KEY = "draw_key"


class Ctx:
    """What a transform sees at one site and point of one model call.

    `site` and `module` are where it acts, `name` the injection's name (the telemetry prefix).
    `run` is the interceptor's state of this `plan.apply` (`intercept._Run`): the keys, the
    traced values and the model call's token mask. `chain` is shared by the transforms at this
    site and point, in plan order: a deadzone leaves
    its threshold there (`reuse_threshold`), the first noise its input (the "rescued" count).
    """

    def __init__(self, run: Any, site: Site, module: nn.Module, index: int, name: str, chain):
        self.site, self.module, self.name, self.chain = site, module, name, chain
        self._run, self._index = run, index

    @property
    def key(self) -> jax.Array:
        """The key of this (site, injection), folded with the innermost `fault_trial`."""
        return self._run.site_key(self.site, self._index)

    @property
    def draw_key(self) -> jax.Array:
        """The key of a draw that holds over the caller's calls (`DRAW_KEY`: a rollout's), as
        `key` folds it; this call's `key` when the caller passes none."""
        data = self._run.values.get(DRAW_KEY)
        if data is None:
            return self.key
        return self._run.site_key(self.site, self._index, jax.random.wrap_key_data(data))

    @property
    def values(self) -> Mapping[str, Any]:
        return self._run.values

    def value(self, name: str) -> jax.Array:
        return traced_value(self._run.values, name, self.site)

    def sow(self, stat: str, value) -> None:
        self.module.sow(STATS_COLLECTION, f"{self.name}.{stat}", value)

    def token_mask(self, x: jax.Array) -> jax.Array:
        """The model call's `[B, T]` token mask (1 real, 0 padding), checked against x."""
        mask = self._run.token_mask
        if mask is None:  # no model call seen (a bare module): every token is real
            mask = jnp.ones(x.shape[:2], jnp.int32)
        if x.ndim < 2 or tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(
                f"{self.name}: scope='causal' at {self.site} sees a tensor of shape {x.shape}"
                f" but the model call has [B, T] = {tuple(mask.shape)} tokens; a causal scope"
                " needs one row per token (lm_head under last_only has only the last)"
            )
        return mask

    def carried(self, stat: str) -> jax.Array | None:
        """This site's running statistic from the previous call of a cached decode (the
        `fault_state` collection passed in next to the KV cache), or None."""
        name = f"{self.name}.{stat}"
        if self.module.has_variable(STATE_COLLECTION, name):
            return self.module.get_variable(STATE_COLLECTION, name)
        return None

    def carry(self, stat: str, value: jax.Array) -> None:
        """Hands the running statistic to the next call (when the caller carries the state)."""
        if self.module.is_mutable_collection(STATE_COLLECTION):
            self.module.put_variable(STATE_COLLECTION, f"{self.name}.{stat}", value)


class Transform(Protocol):
    """What the interceptor and the plan read of a transform (see the module docstring)."""

    level: ClassVar[str]  # value | op | check | tree
    allowed_kinds: ClassVar[tuple[str, ...] | None]  # module kinds it may select; None: any
    scope: str | None  # the tokens a tensor-wide statistic covers (ops.SCOPES), for the manifest
    fallback: ClassVar[bool]  # an op-level one that yields to another op-level one at a site
    counts_flips: ClassVar[bool]  # SDC telemetry: it sows the bits it changes (`flips`)
    counts_detections: ClassVar[bool]  # SDC telemetry: it sows the rows it flags (`detected`)
    value_bits: ClassVar[bool]  # a bit fault's positions are in the value's dtype

    def describe(self) -> str: ...

    def value_names(self) -> frozenset[str]: ...

    def layer_ids(self) -> tuple[int, ...]: ...


class TransformBase:
    """`Transform`'s defaults: a value-level transform of any kind reading no traced value."""

    level: ClassVar[str] = "value"
    allowed_kinds: ClassVar[tuple[str, ...] | None] = None
    scope: str | None = None
    fallback: ClassVar[bool] = False
    # Silent data corruption (aqn_jax/sdc/): a bit-level fault counts the bits it changes (sows
    # `flips`, or `bwd_flips` for a backward product), which the trainer totals as sdc/injected;
    # a check (ABFT) counts the rows it flags (`detected`). `value_bits`: a bit fault's positions
    # are bits of the value it hits, checked against the value's dtype (`faults.config.
    # check_bit_dtypes`) and allowed at a linear's backward products; False: bits of something
    # else (a block scale: `ScaleFlip` checks them against the scale's dtype itself).
    counts_flips: ClassVar[bool] = False
    counts_detections: ClassVar[bool] = False
    value_bits: ClassVar[bool] = True
    # A shared prompt (rl/sampler.py, rl/step.py) computes a group's prompt once: see
    # `call_statistic` and `per_call_draw`, read by `FaultPlan.split_refusals`.
    per_call_draw: ClassVar[bool] = False  # one draw per call that the whole pass should share
    # Its values are random draws keyed per call and shaped by it: a prefix shared by every
    # prompt of a batch (computed once, in a call of its own) would draw other values.
    draws: ClassVar[bool] = False

    @property
    def call_statistic(self) -> str | None:
        """'amax' or 'quantile' when a value at a token depends on the other tokens of the
        call (a tensor-wide statistic with scope 'call'); None when it is per token, per
        block or causal."""
        return None

    def value_names(self) -> frozenset[str]:
        return frozenset()

    def layer_ids(self) -> tuple[int, ...]:
        return ()


class _Scaled(TransformBase):
    """A transform at a `Scale` (`self.scale`): its traced value and per-layer scales."""

    def value_names(self) -> frozenset[str]:
        return frozenset({self.scale.value} if self.scale.value else ())

    def layer_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.scale.layer_scales or ()))


def _check_scope(scope: str, allowed: tuple[str, ...], why: str) -> None:
    if scope not in ops.SCOPES:
        raise ValueError(f"scope={scope!r}; allowed: {ops.SCOPES}")
    if scope not in allowed:
        raise ValueError(f"scope={scope!r}; {why} allows: {allowed}")


@dataclasses.dataclass(frozen=True, eq=False)
class Scale:
    """A transform's scale at a site: `base * layer_scales[layer] * values[value]`.

    `value` names a traced per-step scalar passed to `plan.apply` (e.g. 'aqn_sigma');
    `layer_scales` holds static per-layer multipliers (targeted / SRDD-guided AQN); a layer
    missing from it gets 1.0.
    """

    base: float = 1.0
    value: str | None = None
    layer_scales: Mapping[int, float] | None = None

    def __post_init__(self):
        if self.base < 0:
            raise ValueError(f"scale={self.base}; must be >= 0")
        if self.layer_scales and any(v < 0 for v in self.layer_scales.values()):
            raise ValueError(f"layer_scales={dict(self.layer_scales)}; must be >= 0")

    def at(self, site: Site, values: Mapping[str, Any]) -> jax.Array:
        scale = jnp.float32(self.base)
        if self.layer_scales is not None and site.layer is not None:
            scale = scale * self.layer_scales.get(site.layer, 1.0)
        if self.value is not None:
            scale = scale * traced_value(values, self.value, site)
        return scale

    def describe(self) -> str:
        parts = [f"{self.base:g}"]
        if self.value:
            parts.append(self.value)
        if self.layer_scales:
            parts.append(f"layer_scales={dict(sorted(self.layer_scales.items()))}")
        return "*".join(parts)


def traced_value(values: Mapping[str, Any], name: str, site: Site) -> jax.Array:
    """values[name] at a site: a scalar, or a vector over decoder layers indexed by the site's
    layer (one compiled program then serves any per-layer setting)."""
    if name not in values:
        raise ValueError(
            f"the fault plan needs the traced value {name!r}; pass values={{{name!r}: ...}} to"
            f" plan.apply (got {sorted(values)})"
        )
    v = jnp.asarray(values[name], jnp.float32)
    if v.ndim == 0:
        return v
    if v.ndim != 1 or site.layer is None:
        raise ValueError(
            f"traced value {name!r} has shape {v.shape} at {site}: a vector over layers applies"
            " to per-layer sites only"
        )
    return v[site.layer]


@dataclasses.dataclass(frozen=True, eq=False)
class Deadzone(TransformBase):
    """|x| < threshold * amax -> 0 (see `ops.deadzone`); with severity='quantile' the
    `threshold` smallest fraction of |x| -> 0 instead. `reuse_threshold`: when an earlier
    deadzone ran at the same site and point, reuse its absolute threshold (the original
    `DeadzoneMatMul` re-applies the pre-noise threshold after adding noise). `scope` (with
    granularity='tensor'): call | causal (amax only; `ops.causal_amax`, carried across cached
    decode calls) | token (the per-token statistic); see the module docstring."""

    threshold: float
    granularity: str = "tensor"
    block_size: int = 32
    # Fraction of lanes (last-axis positions) that are faulty; the lane mask is drawn once from
    # sparsity_seed at trace time, the same for every token and site.
    sparsity: float = 1.0
    sparsity_seed: int = 0
    grad: str = "mask"
    reuse_threshold: bool = False
    # A traced value (scalar or per-layer vector, `traced_value`) multiplying `threshold`: with
    # a 0/1 layer vector one compiled program serves every placement (sweeps, SRDD tests).
    threshold_value: str | None = None
    severity: str = "amax"  # amax | quantile (ops.DEADZONE_SEVERITIES)
    scope: str = "call"  # the tokens amax or the quantile is taken over (ops.SCOPES)
    level = "value"

    def __post_init__(self):
        if self.severity not in ops.DEADZONE_SEVERITIES:
            raise ValueError(f"severity={self.severity!r}; allowed: {ops.DEADZONE_SEVERITIES}")
        what = "of amax" if self.severity == "amax" else "of the values flushed"
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold={self.threshold}; must be in (0, 1) (a fraction {what})")
        if self.severity == "quantile" and self.granularity == "block":
            raise ValueError(
                f"granularity={self.granularity!r}; severity='quantile' allows: tensor, token"
            )
        if self.granularity not in ops.GRANULARITIES:
            raise ValueError(f"granularity={self.granularity!r}; allowed: {ops.GRANULARITIES}")
        if self.grad not in ops.DEADZONE_GRADS:
            raise ValueError(f"grad={self.grad!r}; allowed: {ops.DEADZONE_GRADS}")
        if not 0.0 < self.sparsity <= 1.0:
            raise ValueError(f"sparsity={self.sparsity}; must be in (0, 1] (fraction of lanes)")
        if self.granularity != "tensor":
            _check_scope(self.scope, ("call",), f"granularity={self.granularity!r} (per token)")
        elif self.severity == "quantile":
            # A causal quantile would keep every earlier |x| of the row per site: not built.
            _check_scope(self.scope, ("call", "token"), "severity='quantile'")
        else:
            _check_scope(self.scope, ops.SCOPES, "")

    def __call__(self, x, ctx: Ctx):
        thr = ctx.chain.get("threshold") if self.reuse_threshold else None
        if thr is None:
            thr = self.threshold_at(x, ctx)
        lanes = self.lane_mask(x.shape[-1])
        flushed = ops.flush_below(x, thr, sparsity_mask=lanes)
        ctx.sow("flushed", jnp.mean(flushed, dtype=jnp.float32))
        pre_noise = ctx.chain.get("pre_noise")
        if pre_noise is not None:
            # |s| < thr but |s + n| >= thr: the noise carried the signal through.
            rescued = ops.flush_below(pre_noise, thr, sparsity_mask=lanes) & ~flushed
            ctx.sow("rescued", jnp.mean(rescued, dtype=jnp.float32))
        ctx.chain["threshold"] = thr
        return ops.deadzone_apply(x, flushed, grad=self.grad)

    @property
    def call_statistic(self) -> str | None:
        return self.severity if self.scope == "call" and self.granularity == "tensor" else None

    def threshold_at(self, x, ctx: Ctx) -> jax.Array:
        """The absolute threshold at this call, broadcastable to x, for the scope."""
        frac = self.threshold
        if self.threshold_value is not None:
            frac = frac * ctx.value(self.threshold_value)
        if self.scope == "causal":
            amax, running = ops.causal_amax(x, ctx.token_mask(x), ctx.carried("amax"))
            ctx.carry("amax", running)
            return jnp.asarray(frac, jnp.float32) * amax
        return ops.deadzone_threshold(
            x,
            frac,
            granularity="token" if self.scope == "token" else self.granularity,
            block_size=self.block_size,
            severity=self.severity,
        )

    def value_names(self) -> frozenset[str]:
        return frozenset({self.threshold_value} if self.threshold_value else ())

    def lane_mask(self, lanes: int) -> np.ndarray | None:
        if self.sparsity >= 1.0:
            return None
        return ops.make_sparsity_mask(self.sparsity_seed, lanes, self.sparsity)

    def describe(self) -> str:
        sparsity = "" if self.sparsity >= 1.0 else f", sparsity={self.sparsity:g}"
        again = ", reuse_threshold" if self.reuse_threshold else ""
        what = "threshold" if self.severity == "amax" else "quantile"
        return (
            f"deadzone({what}={self.threshold:g}, {self.granularity}, grad={self.grad}"
            f"{sparsity}{again}, scope={self.scope})"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Noise(_Scaled):
    """x + e with e of `kind` (see `ops.noise_error`) at the site's scale."""

    kind: str
    scale: Scale
    level = "value"

    def __post_init__(self):
        ops.NOISE_KINDS.check(self.kind, "kind")

    @property
    def draws(self) -> bool:  # a systematic bias draws nothing
        return ops.NOISE_KINDS.get(self.kind).random

    def __call__(self, x, ctx: Ctx):
        e = ops.noise_error(self.kind, x, self.scale.at(ctx.site, ctx.values), ctx.key)
        ctx.chain.setdefault("pre_noise", x)
        ctx.sow("noise_rms_rel", _rms(e) / (_rms(x) + 1e-30))
        return x + e

    def describe(self) -> str:
        return f"{self.kind}(scale={self.scale.describe()})"


@dataclasses.dataclass(frozen=True, eq=False)
class Quantize(TransformBase):
    """Fake quantisation (dequantised) of the tensor: MX formats or NVFP4, blocks along the
    last axis (the contraction axis of a linear's input)."""

    format: str
    scale_rule: str = "floor"
    rounding: str = "away"
    block_size: int = 32
    grad: str = "ste"
    # NVFP4's global scale is tensor-wide: over the call (TE's) or each token. MX formats have
    # one scale per block only.
    scope: str = "call"
    level = "value"

    def __post_init__(self):
        allowed = (*formats.MX_FORMATS, "nvfp4")
        if self.format not in allowed:
            raise ValueError(f"format={self.format!r}; allowed: {allowed}")
        if self.scale_rule not in ("floor", "ceil"):
            raise ValueError(f"scale_rule={self.scale_rule!r}; allowed: ('floor', 'ceil')")
        if self.rounding not in ("even", "away"):
            raise ValueError(f"rounding={self.rounding!r}; allowed: ('even', 'away')")
        formats.check_block_size(self.format, self.block_size)
        if self.format == "nvfp4":
            # A causal global scale would need the running amax inside the NVFP4 kernel.
            _check_scope(self.scope, ("call", "token"), "format='nvfp4'")
        else:
            _check_scope(self.scope, ("call",), f"format={self.format!r} (one scale per block)")

    def __call__(self, x, ctx: Ctx):
        q = self.quantize(x)
        err = (q - x).astype(jnp.float32)
        ctx.sow("rel_err", _rms(err) / (_rms(x) + 1e-30))
        ctx.sow("flushed", jnp.mean((q == 0) & (x != 0), dtype=jnp.float32))
        return q

    @property
    def call_statistic(self) -> str | None:
        return "amax" if self.format == "nvfp4" and self.scope == "call" else None

    def quantize(self, x):
        """The fake-quantised x (no telemetry)."""
        if self.format == "nvfp4":
            if self.scope == "token":  # the global scale of each token alone
                per_token = jax.vmap(lambda v: formats.quantize_nvfp4(v, axis=-1, grad=self.grad))
                return per_token(x.reshape(-1, x.shape[-1])).reshape(x.shape)
            return formats.quantize_nvfp4(x, axis=-1, grad=self.grad)
        return formats.quantize_mx(
            x,
            self.format,
            axis=-1,
            block_size=self.block_size,
            scale_rule=self.scale_rule,
            rounding=self.rounding,
            grad=self.grad,
        )

    def describe(self) -> str:
        return (
            f"{self.format}(scale_rule={self.scale_rule}, rounding={self.rounding},"
            f" scope={self.scope})"
        )


class _Kinds:
    """A transform's `allowed_kinds` read from the registered model families when used, so a
    family registered after this module's import counts too."""

    def __init__(self, read):
        self.read = read

    def __get__(self, obj, cls) -> tuple[str, ...]:
        return self.read()


@dataclasses.dataclass(frozen=True, eq=False)
class NoisyLinear(_Scaled):
    """Operator-level error in a linear: relative error on y (forward) and on dX, dW
    (backward), recomputed by the module's family's linear contract (`registry.linear_of`:
    its operands, the LoRA adapter among them, and its product; see `ops.noisy_linear`)."""

    scale: Scale
    forward: bool = True
    backward: bool = True
    level = "op"
    allowed_kinds = _Kinds(lambda: sites.LINEAR_KINDS)
    per_call_draw = True  # dW's error is one product's: two calls would be two products
    draws = True

    def __call__(self, module, args, ctx: Ctx):
        operands, product = registry.linear_of(module)
        # The device computes the LoRA adapter too (`forward.py`'s `lora` collection).
        x, w, b, lora = operands(module, args[0])
        return ops.noisy_linear(
            x,
            w,
            b,
            ctx.key,
            self.scale.at(ctx.site, ctx.values),
            forward=self.forward,
            backward=self.backward,
            lora=lora,
            product=product,
        )

    def describe(self) -> str:
        return (
            f"noisy_linear(scale={self.scale.describe()}, fwd={self.forward}, bwd={self.backward})"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class NormWeightNoise(_Scaled):
    """QeRL's AQN: N(0, sigma^2) added to the RMSNorm weight vector, drawn anew for each (step,
    site) from the clean weights (`Ctx.draw_key`: once for a whole rollout, its prefill and
    every decode step, as QeRL's weights hold one draw between syncs); params are never
    modified."""

    scale: Scale
    level = "op"
    allowed_kinds = _Kinds(lambda: sites.GROUPS["rmsnorm"])
    per_call_draw = True  # the weight vector is drawn per call
    draws = True

    def __call__(self, module, args, ctx: Ctx):
        weight = nn.unbox(module.variables["params"])["weight"]
        noise = self.scale.at(ctx.site, ctx.values) * jax.random.normal(
            ctx.draw_key, weight.shape, jnp.float32
        )
        ctx.sow("noise_rms_rel", _rms(noise) / (_rms(weight) + 1e-30))
        noisy = (weight.astype(jnp.float32) + noise).astype(weight.dtype)
        return registry.norm_with_weight(module, args[0], noisy)

    def describe(self) -> str:
        return f"rmsnorm_weight_noise(sigma={self.scale.describe()})"


def _rms(x):
    x = x.astype(jnp.float32)
    return jnp.sqrt(jnp.mean(x * x))
