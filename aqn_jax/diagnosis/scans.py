"""SRDD's per-layer scans, all layers and all probes in one compiled program.

The model runs as the faulty device runs it (the hardware fault plan active, phase `eval`).
At every decoder layer a probe interceptor (outside the fault plan's, so each call it makes goes
through the faults) takes the layer's input `x` from that forward and calls the layer again:

  out_0    = layer(x)                 trial 0: the forward itself continues with this output
  out_t    = layer(x), t = 1..R-1     trials: the device re-run, fresh fault noise
  out_n    = layer(x + n)             n = randn * gain_scale * std(x)        (trial 0)
  out_b    = layer(x + b)             b = dc_scale * std(x), the same on every element (trial 0)

so every probe of a layer is local (the same input for every call) and the whole scan costs
about R + 2 layer calls per layer: one forward's worth of work per probe instead of one forward
per layer per probe (`scan_layers_naive`, the reference). Metrics over the real (unpadded)
tokens only, in float32:

  instability  mean_t std(out_t - out_0)                     the original's 3 runs
  gain         std(out_n - out_0) / std(n)                    a deadzone gives gain < 1
  kurtosis     Fisher kurtosis of out_0 (flattened)
  min_gain     0.1% quantile of (out_b - out_0) / b, per element
  max_gain     99.9% quantile of the same
  dead         fraction of elements with out_b == out_0 exactly: a healthy layer's residual
               output moves with every input element; an element held at zero by a deadzone
               does not (this project's addition: an exact signature of flushing)
  out_std      std(out_0) (scale, for reading instability)

`fault_trial(t)` (faults.intercept) folds t into every fault key, so random faults redraw per
trial while deterministic ones repeat exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from aqn_jax.faults.intercept import FaultPlan, Injection, fault_trial
from aqn_jax.faults.sites import SiteSelector, classify
from aqn_jax.faults.transforms import Deadzone
from aqn_jax.forward import forward

METRICS = ("instability", "gain", "kurtosis", "min_gain", "max_gain", "dead", "out_std")


@dataclasses.dataclass(frozen=True)
class ScanSettings:
    """Probe sizes, the original's: 3 runs for instability, noise 0.1 * std(h) for gain, DC bias
    quantiles 0.1% / 99.9%."""

    trials: int = 3
    gain_scale: float = 0.1
    dc_scale: float = 0.01
    low_quantile: float = 0.001
    high_quantile: float = 0.999

    def __post_init__(self):
        if self.trials < 2:
            raise ValueError(f"config.diagnosis.trials={self.trials}; must be >= 2")
        for name in ("gain_scale", "dc_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"config.diagnosis.{name}={getattr(self, name)}; must be > 0")
        if not 0.0 <= self.low_quantile < self.high_quantile <= 1.0:
            raise ValueError(
                f"config.diagnosis quantiles ({self.low_quantile}, {self.high_quantile}); need"
                " 0 <= low < high <= 1"
            )


# --- masked statistics over the real tokens ------------------------------------------------------
def _weights(mask_BT, like_BTD):
    w = jnp.broadcast_to(mask_BT[..., None].astype(jnp.float32), like_BTD.shape)
    return w, jnp.maximum(jnp.sum(w), 1.0)


def _mean(x, w, n):
    return jnp.sum(x * w) / n


def _std(x, w, n):
    mu = _mean(x, w, n)
    return jnp.sqrt(_mean(jnp.square(x - mu), w, n))


def _kurtosis(x, w, n):
    mu = _mean(x, w, n)
    d = x - mu
    var = _mean(d * d, w, n)
    return _mean(d**4, w, n) / jnp.maximum(var * var, 1e-30) - 3.0


def layer_metrics(settings: ScanSettings, mask_BT, out0, trials, out_n, noise, out_b, bias):
    """The metric dict of one layer from its probe outputs (float32 scalars)."""
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    out0 = f32(out0)
    w, n = _weights(mask_BT, out0)
    instability = jnp.mean(jnp.stack([_std(f32(o) - out0, w, n) for o in trials]))
    gain = _std(f32(out_n) - out0, w, n) / jnp.maximum(_std(f32(noise), w, n), 1e-30)
    shift = f32(out_b) - out0
    per_elem = jnp.where(w > 0, shift / bias, jnp.nan).reshape(-1)
    lo, hi = jnp.nanquantile(per_elem, jnp.array([settings.low_quantile, settings.high_quantile]))
    return {
        "instability": instability,
        "gain": gain,
        "kurtosis": _kurtosis(out0, w, n),
        "min_gain": lo,
        "max_gain": hi,
        "dead": _mean((shift == 0).astype(jnp.float32), w, n),
        "out_std": _std(out0, w, n),
    }


def _probe_inputs(settings, key, layer, x, mask_BT):
    """(noise, bias) of one layer's probes: sized by std(x) over the real tokens."""
    xf = x.astype(jnp.float32)
    w, n = _weights(mask_BT, xf)
    scale = _std(xf, w, n)
    noise = (
        settings.gain_scale
        * scale
        * jax.random.normal(jax.random.fold_in(key, layer), x.shape, jnp.float32)
    )
    bias = settings.dc_scale * scale
    return noise, bias


class _LayerHost(nn.Module):
    """Runs one decoder layer under its own name (its path in the model), so that a probe's
    extra calls of the layer are fault sites exactly like the model's call (Linen does not allow
    calling a bound compact module twice)."""

    config: Any
    layer_name: str
    layer_cls: Any

    @nn.compact
    def __call__(self, *args, **kwargs):
        return self.layer_cls(self.config, name=self.layer_name)(*args, **kwargs)


class _BatchedProbe:
    """Interceptor: every decoder layer runs all its probes on its own input."""

    def __init__(self, settings: ScanSettings, key, mask_BT):
        self.settings, self.key, self.mask = settings, key, mask_BT
        self.results: dict[int, dict[str, jax.Array]] = {}
        self._inside = False

    def __call__(self, next_fun, args, kwargs, context):
        module = context.module
        if self._inside or context.method_name != "__call__" or module.is_initializing():
            return next_fun(*args, **kwargs)
        site = classify(module.path, module)
        if site is None or site.kind != "layer":
            return next_fun(*args, **kwargs)
        x, rest = args[0], args[1:]
        with fault_trial(0):
            out0, kv = next_fun(*args, **kwargs)
        host = _LayerHost(module.config, module.name, type(module))
        # The layer's own variables: its params and, in QeRL mode, its LoRA adapters.
        variables = {c: {module.name: nn.unbox(v)} for c, v in module.variables.items()}

        def again(x_in, trial):
            self._inside = True
            try:
                with fault_trial(trial):
                    return host.apply(variables, x_in, *rest, **kwargs)[0]
            finally:
                self._inside = False

        trials = [again(x, t) for t in range(1, self.settings.trials)]
        noise, bias = _probe_inputs(self.settings, self.key, site.layer, x, self.mask)
        out_n = again((x.astype(jnp.float32) + noise).astype(x.dtype), 0)
        out_b = again((x.astype(jnp.float32) + bias).astype(x.dtype), 0)
        self.results[site.layer] = layer_metrics(
            self.settings, self.mask, out0, trials, out_n, noise, out_b, bias
        )
        return out0, kv


def _stack(results: Mapping[int, Mapping[str, jax.Array]], num_layers: int):
    missing = [i for i in range(num_layers) if i not in results]
    if missing:
        raise RuntimeError(f"SRDD probe saw no call of decoder layers {missing}")
    return {m: jnp.stack([results[i][m] for i in range(num_layers)]) for m in METRICS}


def make_scan(
    model: nn.Module, plan: FaultPlan | None, settings: ScanSettings, phase: str = "eval"
):
    """A jitted `scan(params, ids, mask, fault_key, probe_key, values) -> {metric: [L]}`: one
    forward with every layer's probes (see the module docstring)."""
    plan = plan or FaultPlan()
    num_layers = model.config.num_hidden_layers
    # Forward only: the probe's per-layer results would leak out of a remat (jax.checkpoint)
    # trace, and remat changes no forward value, so a training config (remat=True) probes
    # the same model without it.
    model = type(model)(dataclasses.replace(model.config, remat=False))

    @jax.jit
    def scan(params, ids, mask, fault_key, probe_key, values):
        probe = _BatchedProbe(settings, probe_key, mask)
        # The probe is entered first, so it is the outer interceptor: the layer calls it makes
        # go through the fault plan's interceptor (faults inside and at the layer apply).
        forward(
            model,
            params,
            ids,
            mask,
            plan=plan,
            phase=phase,
            key=fault_key,
            values=values,
            interceptors=(probe,),
        )
        return _stack(probe.results, num_layers)

    return scan


def swept_deadzone_plan(
    value: str, threshold: float = 0.5, granularity: str = "tensor"
) -> FaultPlan:
    """A deadzone at the output of every layer with its threshold multiplied by the traced
    per-layer vector `values[value]` (0 = a healthy layer): one compiled scan serves every
    fault placement and severity of a sweep (each is the single-layer fault exactly). Its
    amax is taken over `granularity`: tensor (the seed's) | token | block (32 lanes)."""
    deadzone = Deadzone(threshold, threshold_value=value, granularity=granularity)
    return FaultPlan([Injection("deadzone", SiteSelector(("layer",), "all", "output"), deadzone)])


def scan_layers(
    model: nn.Module,
    params: Any,
    ids: np.ndarray,
    mask: np.ndarray,
    *,
    plan: FaultPlan | None = None,
    settings: ScanSettings = ScanSettings(),
    fault_key: jax.Array | None = None,
    probe_key: jax.Array | None = None,
    values: Mapping[str, Any] | None = None,
    phase: str = "eval",
) -> dict[str, np.ndarray]:
    """Per-layer metrics `{metric: float64 [num_layers]}` on a calibration batch (left-padded
    `ids`/`mask` [B, T]), with `plan`'s injections of `phase` active."""
    scan = make_scan(model, plan, settings, phase)
    fault_key = jax.random.key(0) if fault_key is None else fault_key
    probe_key = jax.random.key(1) if probe_key is None else probe_key
    out = scan(
        params, jnp.asarray(ids), jnp.asarray(mask), fault_key, probe_key, dict(values or {})
    )
    return {m: np.asarray(v, np.float64) for m, v in jax.device_get(out).items()}


# --- the reference: one full forward per layer per probe -----------------------------------------
class _OneLayerProbe:
    """Interceptor of the naive scan: at decoder layer `target` (static), add `delta` to the
    input and run under fault trial `trial`; every other layer runs as usual (trial 0)."""

    def __init__(self, target: int, delta, trial):
        self.target, self.delta, self.trial = target, delta, trial
        self.x = self.out = None

    def __call__(self, next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or module.is_initializing():
            return next_fun(*args, **kwargs)
        site = classify(module.path, module)
        if site is None or site.kind != "layer":
            return next_fun(*args, **kwargs)
        if site.layer != self.target:
            with fault_trial(0):
                return next_fun(*args, **kwargs)
        x = args[0]
        self.x = x
        x_in = (x.astype(jnp.float32) + self.delta).astype(x.dtype)
        with fault_trial(self.trial):
            out, kv = next_fun(x_in, *args[1:], **kwargs)
        self.out = out
        return out, kv


def scan_layers_naive(
    model: nn.Module,
    params: Any,
    ids: np.ndarray,
    mask: np.ndarray,
    *,
    plan: FaultPlan | None = None,
    settings: ScanSettings = ScanSettings(),
    fault_key: jax.Array | None = None,
    probe_key: jax.Array | None = None,
    values: Mapping[str, Any] | None = None,
    phase: str = "eval",
    layers: tuple[int, ...] | None = None,
) -> dict[str, np.ndarray]:
    """What a hook-based scan does (the original's approach): for each layer and each probe,
    one full forward of the model with the probe at that layer. Two compiled programs per layer
    (the probe's trial is traced; its delta is a scalar or a [B, T, D] array). Same metrics as
    `scan_layers` (the tests check they agree); `layers` restricts the scan (NaN elsewhere)."""
    plan = plan or FaultPlan()
    num_layers = model.config.num_hidden_layers
    fault_key = jax.random.key(0) if fault_key is None else fault_key
    probe_key = jax.random.key(1) if probe_key is None else probe_key
    values = dict(values or {})
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)

    def make(target):
        @jax.jit
        def run(params, delta, trial):
            probe = _OneLayerProbe(target, delta, trial)
            forward(
                model,
                params,
                ids,
                mask,
                plan=plan,
                phase=phase,
                key=fault_key,
                values=values,
                interceptors=(probe,),
            )
            return probe.x, probe.out

        return run

    out = {m: np.full(num_layers, np.nan) for m in METRICS}
    zero = jnp.zeros((), jnp.float32)
    for layer in range(num_layers) if layers is None else layers:
        run = make(layer)
        x, out0 = run(params, zero, 0)
        trials = [run(params, zero, t)[1] for t in range(1, settings.trials)]
        noise, bias = _probe_inputs(settings, probe_key, layer, x, mask)
        out_n = run(params, noise, 0)[1]
        out_b = run(params, bias, 0)[1]
        metrics = layer_metrics(settings, mask, out0, trials, out_n, noise, out_b, bias)
        for m, v in metrics.items():
            out[m][layer] = float(v)
    return out
