"""FaultPlan -> one Flax interceptor that applies it, with a manifest and functional telemetry.

A `FaultPlan` is an ordered list of `Injection(name, sites, transform, phases)`. For a phase
(`rollout`, `train`, `eval`) `plan.apply(phase, key, values)` is a context manager that must be
entered *inside* the jitted function (jit caches ignore the interceptor stack):

    def forward(params, ids, key, sigma):
        with plan.apply("rollout", key=key, values={"aqn_sigma": sigma}):
            return model.apply({"params": params}, ids, mutable=["fault_stats"])

Per call of a selected module (`__call__` only, never during init):
  1. input-point transforms act on the first argument, in plan order;
  2. an op-level transform (noisy linear, AQN on RMSNorm weights) replaces the module's own
     computation, reading its params; otherwise the module runs as is;
  3. output-point transforms act on the output (the tensor part of `(out, kv)`), in plan order.
So several injections at one site compose in the declared order: deadzone -> AQN noise ->
deadzone (`Deadzone(reuse_threshold=True)`) is the original system's `DeadzoneMatMul`.
A transform is a function: `transform(x, ctx) -> x` at a point, or `transform(module, args,
ctx) -> out` for an op-level one; `Ctx` gives it the site, its key, the traced values, `sow`
and the state shared along the chain. The interceptor knows no transform types.

Scope of a tensor-wide statistic (a deadzone's amax, NVFP4's global scale; `ops.SCOPES`):
`call` takes it over whatever the module sees at this call, so teacher forcing (the whole
sequence, later tokens included) and cached decoding (one token per row) apply different
faults; `token` takes it per token; `causal` per row over the tokens so far, padding excluded.
For `causal` the model call's attention mask is read at the root `Qwen2ForCausalLM` call, and
a cached decode carries each site's running statistic in the `fault_state` collection: pass it
in with the params and make it mutable (`rl/sampler.py` keeps it next to the KV cache), and
cached decoding equals teacher forcing.

At trace time the plan records which module paths each injection hit (`plan.manifest`); an
active injection that hit nothing raises ValueError when the context exits, before anything
runs. Telemetry is `sow`n into the `fault_stats` collection (returned when the caller makes it
mutable; otherwise the statistics are dead code that XLA removes).

Randomness is a function of (key, site, injection): the caller passes
`key = step_key(seed, step, phase)`; each site folds in a stable hash of its path and the
injection's index, so the same (seed, step, phase) gives identical noise and different sites
get different noise. Per-step knobs (AQN sigma) are traced `values`: a new value never retraces.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from aqn_jax.models import qwen2

from . import formats, ops
from .sites import GROUPS, LINEAR_KINDS, Site, SiteSelector, classify

PHASES = ("rollout", "train", "eval")
_PHASE_IDS = {p: i for i, p in enumerate(PHASES)}
STATS_COLLECTION = "fault_stats"


# The innermost `fault_trial` (trace-time state, scoped to the current context rather than
# kept in a module-global stack).
_TRIAL: contextvars.ContextVar[Any] = contextvars.ContextVar("fault_trial", default=None)


@contextlib.contextmanager
def fault_trial(trial) -> Iterator[None]:
    """Re-run the device: inside this context every random fault draws fresh noise.

    Each site key additionally folds in `trial` (a Python int or a traced int32), so running
    the same input under trials 0, 1, 2 gives three independent draws of a noisy device (SRDD's
    instability scan) while a deterministic fault (deadzone, quantisation) gives identical
    outputs. Outside any trial context keys are unchanged.
    """
    token = _TRIAL.set(trial)
    try:
        yield
    finally:
        _TRIAL.reset(token)


def step_key(seed: int, step, phase: str) -> jax.Array:
    """The base key of one (seed, step, phase): what a resumed run recomputes from scratch."""
    if phase not in _PHASE_IDS:
        raise ValueError(f"phase={phase!r}; allowed: {PHASES}")
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.fold_in(key, _PHASE_IDS[phase])


# --- what a transform sees ----------------------------------------------------------------------
STATE_COLLECTION = "fault_state"


class Ctx:
    """What a transform sees at one site and point of one model call.

    `site` and `module` are where it acts, `name` the injection's name (the telemetry prefix).
    `chain` is shared by the transforms at this site and point, in plan order: a deadzone leaves
    its threshold there (`reuse_threshold`), the first noise its input (the "rescued" count).
    """

    def __init__(self, run: _Run, site: Site, module: nn.Module, index: int, name: str, chain):
        self.site, self.module, self.name, self.chain = site, module, name, chain
        self._run, self._index = run, index

    @property
    def key(self) -> jax.Array:
        """The key of this (site, injection), folded with the innermost `fault_trial`."""
        return self._run.site_key(self.site, self._index)

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


def _check_scope(scope: str, allowed: tuple[str, ...], why: str) -> None:
    if scope not in ops.SCOPES:
        raise ValueError(f"scope={scope!r}; allowed: {ops.SCOPES}")
    if scope not in allowed:
        raise ValueError(f"scope={scope!r}; {why} allows: {allowed}")


# --- transforms ---------------------------------------------------------------------------------
# A value-level transform is `transform(x, ctx) -> x`, applied to a module's input or output; an
# op-level one is `transform(module, args, ctx) -> out` and replaces the module's computation.
# Each says which with `level`; the interceptor knows nothing else about them.
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
class Deadzone:
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
class Noise:
    """x + e with e of `kind` (see `ops.noise_error`) at the site's scale."""

    kind: str
    scale: Scale
    level = "value"

    def __post_init__(self):
        if self.kind not in ops.NOISE_KINDS:
            raise ValueError(f"kind={self.kind!r}; allowed: {ops.NOISE_KINDS}")

    def __call__(self, x, ctx: Ctx):
        e = ops.noise_error(self.kind, x, self.scale.at(ctx.site, ctx.values), ctx.key)
        ctx.chain.setdefault("pre_noise", x)
        ctx.sow("noise_rms_rel", _rms(e) / (_rms(x) + 1e-30))
        return x + e

    def describe(self) -> str:
        return f"{self.kind}(scale={self.scale.describe()})"


@dataclasses.dataclass(frozen=True, eq=False)
class Quantize:
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


@dataclasses.dataclass(frozen=True, eq=False)
class NoisyLinear:
    """Operator-level error in a linear: relative error on y (forward) and on dX, dW
    (backward), recomputed from the module's own kernel (see `ops.noisy_linear`)."""

    scale: Scale
    forward: bool = True
    backward: bool = True
    level = "op"
    allowed_kinds = LINEAR_KINDS

    def __call__(self, module, args, ctx: Ctx):
        params = nn.unbox(module.variables["params"])
        dtype, bias = module.dtype, params.get("bias")
        return ops.noisy_linear(
            args[0].astype(dtype),
            params["kernel"].astype(dtype),
            None if bias is None else bias.astype(dtype),
            ctx.key,
            self.scale.at(ctx.site, ctx.values),
            forward=self.forward,
            backward=self.backward,
        )

    def describe(self) -> str:
        return (
            f"noisy_linear(scale={self.scale.describe()}, fwd={self.forward}, bwd={self.backward})"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class NormWeightNoise:
    """QeRL's AQN: N(0, sigma^2) added to the RMSNorm weight vector for this call, drawn anew
    for each (step, site) from the clean weights; params are never modified."""

    scale: Scale
    level = "op"
    allowed_kinds = GROUPS["rmsnorm"]

    def __call__(self, module, args, ctx: Ctx):
        weight = nn.unbox(module.variables["params"])["weight"]
        noise = self.scale.at(ctx.site, ctx.values) * jax.random.normal(
            ctx.key, weight.shape, jnp.float32
        )
        ctx.sow("noise_rms_rel", _rms(noise) / (_rms(weight) + 1e-30))
        noisy = (weight.astype(jnp.float32) + noise).astype(weight.dtype)
        return qwen2.rms_norm(args[0], noisy, module.eps, module.dtype)

    def describe(self) -> str:
        return f"rmsnorm_weight_noise(sigma={self.scale.describe()})"


@dataclasses.dataclass(frozen=True, eq=False)
class Injection:
    name: str
    sites: SiteSelector
    transform: Any
    phases: tuple[str, ...] = PHASES

    def __post_init__(self):
        object.__setattr__(self, "phases", tuple(self.phases))
        bad = [p for p in self.phases if p not in PHASES]
        if bad or not self.phases:
            raise ValueError(f"injection {self.name!r}: phases={self.phases}; allowed: {PHASES}")
        allowed = getattr(self.transform, "allowed_kinds", None)
        if allowed is not None:
            wrong = [k for k in self.sites.kinds if k not in allowed]
            if wrong:
                raise ValueError(
                    f"injection {self.name!r}: {type(self.transform).__name__} acts on"
                    f" {list(allowed)} modules only, not {wrong}"
                )
        if "embed_tokens" in self.sites.kinds and self.sites.point == "input":
            raise ValueError(f"injection {self.name!r}: embed_tokens takes token ids as input")

    def describe(self) -> str:
        layers = self.sites.layers if self.sites.layers == "all" else list(self.sites.layers)
        return (
            f"{self.name}: {self.transform.describe()} at {self.sites.point} of"
            f" {list(self.sites.kinds)} layers={layers} phases={list(self.phases)}"
        )


# --- the plan -----------------------------------------------------------------------------------
class FaultPlan:
    """An ordered list of injections; `apply(phase, ...)` is the interceptor context."""

    def __init__(self, injections: Sequence[Injection] = ()):
        self.injections = tuple(injections)
        names = [inj.name for inj in self.injections]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"fault plan: injection names must be unique; repeated: {dup}")
        self.manifest: dict[str, dict[str, list[str]]] = {}

    def __bool__(self) -> bool:
        return bool(self.injections)

    def validate(self, num_layers: int) -> None:
        """Layer ids within the model; raised before anything compiles."""
        for inj in self.injections:
            inj.sites.check_layers(num_layers, field=f"injection {inj.name!r} layers")
            ls = getattr(getattr(inj.transform, "scale", None), "layer_scales", None)
            if ls:
                bad = sorted(i for i in ls if not 0 <= i < num_layers)
                if bad:
                    raise ValueError(
                        f"injection {inj.name!r}: layer_scales name layers {bad} but the model"
                        f" has {num_layers} layers"
                    )

    def active(self, phase: str) -> list[tuple[int, Injection]]:
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r}; allowed: {PHASES}")
        return [(i, inj) for i, inj in enumerate(self.injections) if phase in inj.phases]

    def describe(self) -> str:
        if not self.injections:
            return "fault plan: empty (clean model)"
        return "fault plan:\n" + "\n".join("  " + inj.describe() for inj in self.injections)

    def manifest_json(self) -> str:
        return json.dumps(
            {
                "injections": [
                    {
                        "name": inj.name,
                        "transform": inj.transform.describe(),
                        "point": inj.sites.point,
                        "kinds": list(inj.sites.kinds),
                        "layers": inj.sites.layers
                        if inj.sites.layers == "all"
                        else list(inj.sites.layers),
                        "phases": list(inj.phases),
                        "scope": getattr(inj.transform, "scope", None),
                    }
                    for inj in self.injections
                ],
                "hits": self.manifest,
            },
            indent=2,
        )

    @contextlib.contextmanager
    def apply(
        self,
        phase: str,
        key: jax.Array | None = None,
        values: Mapping[str, Any] | None = None,
    ) -> Iterator[None]:
        """Intercept every model call inside this context with the injections of `phase`."""
        active = self.active(phase)
        if not active:
            yield
            return
        run = _Run(active, key, dict(values or {}))
        with nn.intercept_methods(run.intercept):
            yield
        if run.applied:
            # A module traced twice (e.g. recomputed under remat) is one site.
            self.manifest[phase] = {
                inj.name: list(dict.fromkeys(run.hits[inj.name])) for _, inj in active
            }
            missing = [inj for _, inj in active if not self.manifest[phase][inj.name]]
            if missing:
                raise ValueError(
                    f"phase {phase!r}: fault injection(s) matched no module: "
                    + "; ".join(inj.describe() for inj in missing)
                )

    def trace_manifest(self, model: nn.Module, params, phase: str, seq_len: int = 2) -> dict:
        """Trace one forward abstractly (`jax.eval_shape`, nothing runs) to fill and check the
        manifest of `phase`; returns {injection name: [hit paths]}."""
        ids = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
        values = {name: jnp.float32(1.0) for name in self._value_names()}

        def forward(params, ids):
            with self.apply(phase, key=jax.random.key(0), values=values):
                return model.apply({"params": params}, ids)

        jax.eval_shape(forward, params, ids)
        return self.manifest.get(phase, {})

    def _value_names(self) -> set[str]:
        names = set()
        for inj in self.injections:
            scale = getattr(inj.transform, "scale", None)
            if isinstance(scale, Scale) and scale.value:
                names.add(scale.value)
            if getattr(inj.transform, "threshold_value", None):
                names.add(inj.transform.threshold_value)
        return names


class _Run:
    """State of one `plan.apply` context: the interceptor and the hits it records."""

    def __init__(self, active, key, values):
        self.active = active
        self.key = key
        self.values = values
        self.hits: dict[str, list[str]] = {inj.name: [] for _, inj in active}
        self.applied = False
        self.token_mask: jax.Array | None = None  # [B, T] of the latest model call

    def site_key(self, site: Site, index: int) -> jax.Array:
        if self.key is None:
            raise ValueError(
                f"a random fault transform at {site} needs a key: plan.apply(phase, key=...)"
            )
        path_hash = zlib.crc32(str(site).encode()) & 0x7FFFFFFF
        key = jax.random.fold_in(jax.random.fold_in(self.key, path_hash), index)
        trial = _TRIAL.get()
        if trial is not None:
            key = jax.random.fold_in(key, trial)
        return key

    def intercept(self, next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or module.is_initializing():
            return next_fun(*args, **kwargs)
        self.applied = True
        if isinstance(module, qwen2.Qwen2ForCausalLM):
            self.token_mask = _call_token_mask(args, kwargs)
        site = classify(module.path, module)
        if site is None:
            return next_fun(*args, **kwargs)
        chosen = [(i, inj) for i, inj in self.active if inj.sites.matches(site)]
        if not chosen:
            return next_fun(*args, **kwargs)
        for _, inj in chosen:
            self.hits[inj.name].append(f"{site}:{inj.sites.point}")

        op = [(i, inj) for i, inj in chosen if inj.transform.level == "op"]
        if len(op) > 1:
            raise ValueError(
                f"{site}: more than one op-level injection ({[inj.name for _, inj in op]})"
            )
        inputs, outputs = (
            [
                (i, inj)
                for i, inj in chosen
                if inj.sites.point == p and inj.transform.level == "value"
            ]
            for p in ("input", "output")
        )
        if inputs:
            args = (self._chain(args[0], inputs, site, module), *args[1:])
        if op:  # an op-level transform redoes the module's computation
            index, inj = op[0]
            out = inj.transform(module, args, Ctx(self, site, module, index, inj.name, {}))
        else:
            out = next_fun(*args, **kwargs)
        if outputs:
            if isinstance(out, tuple):
                out = (self._chain(out[0], outputs, site, module), *out[1:])
            else:
                out = self._chain(out, outputs, site, module)
        return out

    def _chain(self, x, chain, site, module):
        """The value transforms at one site and point, composed in plan order."""
        shared: dict[str, Any] = {}
        for index, inj in chain:
            x = inj.transform(x, Ctx(self, site, module, index, inj.name, shared))
        return x


def _call_token_mask(args, kwargs) -> jax.Array:
    """The `[B, T]` attention mask of a model call (all ones when not given)."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if mask is None:
        ids = args[0] if args else kwargs["input_ids_BT"]
        return jnp.ones(jnp.shape(ids), jnp.int32)
    return jnp.asarray(mask)


def _rms(x):
    x = x.astype(jnp.float32)
    return jnp.sqrt(jnp.mean(x * x))


def summarize_stats(stats: Mapping) -> dict[str, float]:
    """Flatten a `fault_stats` tree into {'<injection>.<stat>/<site path>': value} plus
    {'<injection>.<stat>/mean': mean over sites} (host floats, for logging)."""
    stats = stats.get(STATS_COLLECTION, stats)
    flat: dict[str, float] = {}
    per_stat: dict[str, list[float]] = {}

    def walk(tree, path):
        for name, value in tree.items():
            if isinstance(value, Mapping):
                walk(value, (*path, name))
            else:
                for v in value if isinstance(value, tuple) else (value,):
                    v = float(np.asarray(v))
                    flat[f"{name}/{'/'.join(path)}"] = v
                    per_stat.setdefault(name, []).append(v)

    walk(stats, ())
    for name, vs in per_stat.items():
        flat[f"{name}/mean"] = float(np.mean(vs))
    return flat
