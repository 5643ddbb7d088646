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


_TRIALS: list[Any] = []  # the stack of `fault_trial` contexts (trace-time state)


@contextlib.contextmanager
def fault_trial(trial) -> Iterator[None]:
    """Re-run the device: inside this context every random fault draws fresh noise.

    Each site key additionally folds in `trial` (a Python int or a traced int32), so running
    the same input under trials 0, 1, 2 gives three independent draws of a noisy device (SRDD's
    instability scan) while a deterministic fault (deadzone, quantisation) gives identical
    outputs. Outside any trial context keys are unchanged.
    """
    _TRIALS.append(trial)
    try:
        yield
    finally:
        _TRIALS.pop()


def step_key(seed: int, step, phase: str) -> jax.Array:
    """The base key of one (seed, step, phase): what a resumed run recomputes from scratch."""
    if phase not in _PHASE_IDS:
        raise ValueError(f"phase={phase!r}; allowed: {PHASES}")
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.fold_in(key, _PHASE_IDS[phase])


# --- transforms ---------------------------------------------------------------------------------
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
    `DeadzoneMatMul` re-applies the pre-noise threshold after adding noise)."""

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
            f"{sparsity}{again})"
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
    level = "value"

    def __post_init__(self):
        allowed = (*formats.MX_FORMATS, "nvfp4")
        if self.format not in allowed:
            raise ValueError(f"format={self.format!r}; allowed: {allowed}")
        if self.scale_rule not in ("floor", "ceil"):
            raise ValueError(f"scale_rule={self.scale_rule!r}; allowed: ('floor', 'ceil')")
        if self.rounding not in ("even", "away"):
            raise ValueError(f"rounding={self.rounding!r}; allowed: ('even', 'away')")

    def __call__(self, x):
        if self.format == "nvfp4":
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
        return f"{self.format}(scale_rule={self.scale_rule}, rounding={self.rounding})"


@dataclasses.dataclass(frozen=True, eq=False)
class NoisyLinear:
    """Operator-level error in a linear: relative error on y (forward) and on dX, dW
    (backward), recomputed from the module's own kernel (see `ops.noisy_linear`)."""

    scale: Scale
    forward: bool = True
    backward: bool = True
    level = "op"
    allowed_kinds = LINEAR_KINDS

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

    def _site_key(self, site: Site, index: int) -> jax.Array:
        if self.key is None:
            raise ValueError(
                f"a random fault transform at {site} needs a key: plan.apply(phase, key=...)"
            )
        path_hash = zlib.crc32(str(site).encode()) & 0x7FFFFFFF
        key = jax.random.fold_in(jax.random.fold_in(self.key, path_hash), index)
        if _TRIALS:
            key = jax.random.fold_in(key, _TRIALS[-1])
        return key

    def intercept(self, next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or module.is_initializing():
            return next_fun(*args, **kwargs)
        self.applied = True
        site = classify(module.path, module)
        if site is None:
            return next_fun(*args, **kwargs)
        chosen = [(i, inj) for i, inj in self.active if inj.sites.matches(site)]
        if not chosen:
            return next_fun(*args, **kwargs)
        for _, inj in chosen:
            self.hits[inj.name].append(f"{site}:{inj.sites.point}")

        inputs = [(i, inj) for i, inj in chosen if inj.sites.point == "input"]
        outputs = [(i, inj) for i, inj in chosen if inj.sites.point == "output"]
        op = [(i, inj) for i, inj in chosen if inj.transform.level == "op"]
        if len(op) > 1:
            raise ValueError(
                f"{site}: more than one op-level injection ({[inj.name for _, inj in op]})"
            )
        value_inputs = [(i, inj) for i, inj in inputs if inj.transform.level == "value"]
        value_outputs = [(i, inj) for i, inj in outputs if inj.transform.level == "value"]

        if value_inputs:
            args = (self._chain(args[0], value_inputs, site, module), *args[1:])
        # An op-level transform redoes the module's computation; otherwise the module runs.
        out = self._op(op[0], site, module, args, kwargs) if op else next_fun(*args, **kwargs)
        if value_outputs:
            if isinstance(out, tuple):
                out = (self._chain(out[0], value_outputs, site, module), *out[1:])
            else:
                out = self._chain(out, value_outputs, site, module)
        return out

    # -- value transforms, composed in order at one site and point --------------------------------
    def _chain(self, x, chain, site, module):
        pre_noise = None  # the signal before the first noise at this point (for "rescued")
        thr = None  # the absolute threshold of the last deadzone at this point
        for index, inj in chain:
            t = inj.transform
            if isinstance(t, Deadzone):
                if t.reuse_threshold and thr is not None:
                    this_thr = thr
                else:
                    frac = t.threshold
                    if t.threshold_value is not None:
                        frac = frac * traced_value(self.values, t.threshold_value, site)
                    this_thr = ops.deadzone_threshold(
                        x,
                        frac,
                        granularity=t.granularity,
                        block_size=t.block_size,
                        severity=t.severity,
                    )
                lanes = t.lane_mask(x.shape[-1])
                flushed = jnp.abs(x) < this_thr
                if lanes is not None:
                    flushed = flushed & jnp.asarray(lanes)
                _sow(module, inj, "flushed", jnp.mean(flushed, dtype=jnp.float32))
                if pre_noise is not None:
                    # |s| < thr but |s + n| >= thr: the noise carried the signal through.
                    rescued = (jnp.abs(pre_noise) < this_thr) & ~flushed
                    if lanes is not None:
                        rescued = rescued & jnp.asarray(lanes)
                    _sow(module, inj, "rescued", jnp.mean(rescued, dtype=jnp.float32))
                x = ops.deadzone_apply(x, flushed, grad=t.grad)
                thr = this_thr
            elif isinstance(t, Noise):
                scale = t.scale.at(site, self.values)
                e = ops.noise_error(t.kind, x, scale, self._site_key(site, index))
                if pre_noise is None:
                    pre_noise = x
                _sow(module, inj, "noise_rms_rel", _rms(e) / (_rms(x) + 1e-30))
                x = x + e
            elif isinstance(t, Quantize):
                q = t(x)
                err = (q - x).astype(jnp.float32)
                _sow(module, inj, "rel_err", _rms(err) / (_rms(x) + 1e-30))
                _sow(module, inj, "flushed", jnp.mean((q == 0) & (x != 0), dtype=jnp.float32))
                x = q
            else:
                raise TypeError(f"injection {inj.name!r}: unknown transform {t!r}")
        return x

    # -- op-level transforms: redo the module's computation from its params ---------------------
    def _op(self, chosen, site, module, args, kwargs):
        index, inj = chosen
        t = inj.transform
        params = nn.unbox(module.variables["params"])
        x = args[0]
        key = self._site_key(site, index)
        scale = t.scale.at(site, self.values)
        if isinstance(t, NoisyLinear):
            dtype = module.dtype
            bias = params.get("bias")
            return ops.noisy_linear(
                x.astype(dtype),
                params["kernel"].astype(dtype),
                None if bias is None else bias.astype(dtype),
                key,
                scale,
                forward=t.forward,
                backward=t.backward,
            )
        if isinstance(t, NormWeightNoise):
            weight = params["weight"]
            noise = scale * jax.random.normal(key, weight.shape, jnp.float32)
            _sow(module, inj, "noise_rms_rel", _rms(noise) / (_rms(weight) + 1e-30))
            noisy = (weight.astype(jnp.float32) + noise).astype(weight.dtype)
            return qwen2.rms_norm(x, noisy, module.eps, module.dtype)
        raise TypeError(f"injection {inj.name!r}: unknown op transform {t!r}")


def _rms(x):
    x = x.astype(jnp.float32)
    return jnp.sqrt(jnp.mean(x * x))


def _sow(module, inj: Injection, stat: str, value) -> None:
    module.sow(STATS_COLLECTION, f"{inj.name}.{stat}", value)


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
