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
and the state shared along the chain. The interceptor knows no transform types; they are
in `transforms.py`.

Scope of a tensor-wide statistic (a deadzone's amax, NVFP4's global scale; `ops.SCOPES`):
`call` takes it over whatever the module sees at this call, so teacher forcing (the whole
sequence, later tokens included) and cached decoding (one token per row) apply different
faults; `token` takes it per token; `causal` per row over the tokens so far, padding excluded.
For `causal` the attention mask is read at the root model call (`registry.is_causal_lm`), and a
cached decode carries each site's running statistic in the `fault_state` collection: pass it
in with the params and make it mutable (`rl/sampler.py` keeps it next to the KV cache), and
cached decoding equals teacher forcing.

A shared prompt (config.rollout.share_prompt, config.actor.share_prompt) computes a group's
prompt once: the sampler prefills each distinct prompt once and repeats its KV cache, last
logits and fault state to its n rows; the passes over rollout rows run the prompts as one call
and the responses, attending to their prompt's K/V, as another (`forward.SharedPrompt`). So a
random fault or activation-form AQN on a prompt's positions is drawn once per group, as on
hardware that serves the prompt once. Deterministic faults give the same values, and so do
per-token, per-block and causal statistics and, in the prefill, a call's maximum (the maximum
over duplicated rows is the maximum). What would differ keeps the per-row computation, said
in the run's log (`FaultPlan.split_refusals`): a call's quantile; in the update also a call's
maximum (the prompt and the responses are two calls), a draw made once per call (AQN's norm
weights, a noisy linear's dW), a fault on the weights as read, and any bit fault (its counts).
The manifest and the telemetry still count every site; a stat of the two calls is their
mean weighted by their tokens.

At trace time `plan.apply` yields which module paths each injection hit (the manifest, also
`forward.trace_manifest`); an active injection that hit nothing raises ValueError when the context
exits, before anything runs. Telemetry is `sow`n into the `fault_stats` collection (returned
when the caller makes it mutable; otherwise the statistics are dead code that XLA removes).

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

from aqn_jax.models import registry

from .sites import Site, SiteSelector, classify
from .transforms import STATS_COLLECTION, Ctx

PHASES = ("rollout", "train", "eval")
_PHASE_IDS = {p: i for i, p in enumerate(PHASES)}


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


# The part of a module call split into parts (the log-prob readout's chunk of positions),
# folded into every site key so that each part draws its own noise.
_PART: contextvars.ContextVar[Any] = contextvars.ContextVar("fault_part", default=None)


@contextlib.contextmanager
def fault_part(part) -> Iterator[None]:
    """Inside this context every site key also folds in `part` (a Python or traced int): a
    module applied a chunk at a time (`aqn_jax/logprobs.py`) draws independent noise per chunk,
    as it would over the whole call, instead of repeating one chunk's draw."""
    token = _PART.set(part)
    try:
        yield
    finally:
        _PART.reset(token)


def step_key(seed: int, step, phase: str) -> jax.Array:
    """The base key of one (seed, step, phase): what a resumed run recomputes from scratch."""
    if phase not in _PHASE_IDS:
        raise ValueError(f"phase={phase!r}; allowed: {PHASES}")
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.fold_in(key, _PHASE_IDS[phase])


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
        allowed = self.transform.allowed_kinds
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

    def __bool__(self) -> bool:
        return bool(self.injections)

    def validate(self, num_layers: int) -> None:
        """Layer ids within the model; raised before anything compiles."""
        for inj in self.injections:
            inj.sites.check_layers(num_layers, field=f"injection {inj.name!r} layers")
            ls = inj.transform.layer_ids()
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

    def tree_faults(self, phase: str, target: str) -> list[tuple[int, Injection]]:
        """The active tree-level injections of `phase` on `target` (weight | gradient |
        optimizer), with their plan indices."""
        return [
            (i, inj)
            for i, inj in self.active(phase)
            if inj.transform.level == "tree" and inj.transform.target == target
        ]

    def split_refusals(self, phase: str, split: bool) -> list[str]:
        """Why a shared prompt would change what `phase`'s device computes, one line per
        injection (empty: it may share). Prefilling a group's prompt once (`split=False`)
        changes only a call-wide quantile (a maximum over duplicated rows is the maximum);
        running the prompt and the responses as two calls (`split=True`, the update) also
        changes a call-wide maximum, a draw made once per call (AQN's norm weights, a noisy
        linear's dW) and a fault on the weights as read. A bit fault is counted per call:
        never shared."""
        out = []
        for _, inj in self.active(phase):
            t = inj.transform
            stat = t.call_statistic
            if stat == "quantile" or (split and stat is not None):
                out.append(f"{inj.name}: a statistic over the whole call ({stat}, scope='call')")
            elif t.counts_flips or t.counts_detections:
                out.append(f"{inj.name}: SDC telemetry counts per call ({t.describe()})")
            elif split and (t.per_call_draw or t.level == "tree"):
                out.append(f"{inj.name}: {t.describe()} draws once per call")
        return out

    def prefix_refusals(self, phase: str) -> list[str]:
        """Why prefilling the prefix that every prompt of a batch shares once, in a call of
        its own, would change what `phase`'s device computes (empty: it may): what a split
        into two calls changes (`split_refusals(split=True)`), and a transform that draws
        random values per call."""
        out = self.split_refusals(phase, split=True)
        named = {line.split(":", 1)[0] for line in out}
        for _, inj in self.active(phase):
            if inj.transform.draws and inj.name not in named:
                out.append(f"{inj.name}: {inj.transform.describe()} draws its values per call")
        return out

    def describe(self) -> str:
        if not self.injections:
            return "fault plan: empty (clean model)"
        return "fault plan:\n" + "\n".join("  " + inj.describe() for inj in self.injections)

    def manifest_json(self, hits: Mapping[str, Mapping[str, list[str]]]) -> str:
        """The injections and `hits` ({phase: {injection name: [site:point]}}, as
        `trace_manifest` returns per phase) as the run's manifest.json."""
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
                        "scope": inj.transform.scope,
                    }
                    for inj in self.injections
                ],
                "hits": {phase: dict(h) for phase, h in hits.items()},
            },
            indent=2,
        )

    @contextlib.contextmanager
    def apply(
        self,
        phase: str,
        key: jax.Array | None = None,
        values: Mapping[str, Any] | None = None,
    ) -> Iterator[dict[str, list[str]]]:
        """Intercept every model call inside this context with the injections of `phase`.

        Yields the trace's hits, {injection name: [site:point]}, filled when the context exits
        after a model call (empty when nothing ran or no injection is active); an active
        injection that hit no module raises then. The plan itself is never written."""
        hits: dict[str, list[str]] = {}
        # Faults on trees act outside module calls (the forward seam, the optimizer).
        active = [(i, inj) for i, inj in self.active(phase) if inj.transform.level != "tree"]
        if not active:
            yield hits
            return
        run = _Run(active, key, dict(values or {}))
        with nn.intercept_methods(run.intercept):
            yield hits
        if run.applied:
            # A module traced twice (e.g. recomputed under remat) is one site.
            hits.update({inj.name: list(dict.fromkeys(run.hits[inj.name])) for _, inj in active})
            missing = [inj for _, inj in active if not hits[inj.name]]
            if missing:
                raise ValueError(
                    f"phase {phase!r}: fault injection(s) matched no module: "
                    + "; ".join(inj.describe() for inj in missing)
                )

    def value_names(self) -> set[str]:
        """The traced values the plan's transforms read (`plan.apply(values=...)`)."""
        return {name for inj in self.injections for name in inj.transform.value_names()}


class _Run:
    """State of one `plan.apply` context: the interceptor and the hits it records."""

    def __init__(self, active, key, values):
        self.active = active
        self.key = key
        self.values = values
        self.hits: dict[str, list[str]] = {inj.name: [] for _, inj in active}
        self.applied = False
        self.token_mask: jax.Array | None = None  # [B, T] of the latest model call

    def site_key(self, site: Site, index: int, base: jax.Array | None = None) -> jax.Array:
        """The key of (site, injection) from `base` (default: this call's key)."""
        base = self.key if base is None else base
        if base is None:
            raise ValueError(
                f"a random fault transform at {site} needs a key: plan.apply(phase, key=...)"
            )
        path_hash = zlib.crc32(str(site).encode()) & 0x7FFFFFFF
        key = jax.random.fold_in(jax.random.fold_in(base, path_hash), index)
        for extra in (_TRIAL.get(), _PART.get()):
            if extra is not None:
                key = jax.random.fold_in(key, extra)
        return key

    def intercept(self, next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or module.is_initializing():
            return next_fun(*args, **kwargs)
        self.applied = True
        if registry.is_causal_lm(module):
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
        checks = [(i, inj) for i, inj in chosen if inj.transform.level == "check"]
        if len(op) > 1:  # a fallback (backward ABFT's linear) yields to a fault's op
            op = [(i, inj) for i, inj in op if not inj.transform.fallback] or op[:1]
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
        for index, inj in checks:  # detectors see the output as the next module will
            y = out[0] if isinstance(out, tuple) else out
            inj.transform(module, args, y, Ctx(self, site, module, index, inj.name, {}))
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
