"""`config.aqn` (ml_collections): the AQN section, its injection and each step's sigma.

`aqn_injection` turns the section into one Injection (global, targeted, healthy, located or
SRDD-guided layers; QeRL's RMSNorm-weight form or the original system's activation form);
`aqn_jax.aqn.plan.build_plan` places it among the hardware faults, so faults and AQN go
through one interceptor. The injection scales its noise by the traced value AQN_SIGMA, which
`aqn_sigma` gives for each step.

With a shared prompt (faults/intercept.py) the activation form's noise on a prompt's positions
is drawn once per group of n samples; the norm-weight form draws its weights per call, so in
the update (if AQN acts there) it keeps the per-row computation.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import ml_collections

from aqn_jax.faults.fields import check_phases, parse_layers
from aqn_jax.faults.intercept import Injection
from aqn_jax.faults.sites import SiteSelector, expand_kinds
from aqn_jax.faults.transforms import Noise, NormWeightNoise, Scale
from aqn_jax.registry import Registry

from .schedules import SCHEDULES, check_epoch_options, sigma_at

AQN_SIGMA = "aqn_sigma"  # the traced value carrying this step's AQN sigma
# config.aqn.form: name -> `(aqn, layers, scale) -> (SiteSelector, transform)`, where the noise
# sits and what draws it.
AQN_FORMS: Registry = Registry("config.aqn.form")


@AQN_FORMS.register("norm_weight")
def _norm_weight(aqn: Any, layers: Any, scale: Scale) -> tuple[SiteSelector, Any]:
    """QeRL's: noise on every RMSNorm weight of the selected layers."""
    return SiteSelector(("rmsnorm",), layers, "output"), NormWeightNoise(scale)


@AQN_FORMS.register("activation")
def _activation(aqn: Any, layers: Any, scale: Scale) -> tuple[SiteSelector, Any]:
    """The original system's: y + sigma * randn * |y| at the output of `aqn.sites`."""
    sites = SiteSelector(expand_kinds(aqn.sites, "config.aqn.sites"), layers, "output")
    return sites, Noise("relative_gaussian", scale)


def aqn_config() -> ml_collections.ConfigDict:
    """The AQN section (off by default)."""
    c = ml_collections.ConfigDict()
    c.enabled = False
    c.form = "activation"  # activation: y + sigma*randn*|y| at sites | norm_weight: QeRL
    # 'all' (global) | 'healthy' (all but the deadzone's layers) | ids (targeted), e.g. '(15,)'
    # | 'located' (the layers the SRDD diagnosis locates) | 'srdd' (every layer, at the sigma
    # of the SRDD map: layer_sigmas, or the diagnosis run first)
    c.layers = "all"
    # {layer: sigma} for layers='srdd', e.g. '{3: 0.075, 4: 0.05}', or the path of an
    # srdd.json (its sigma map); '' = the diagnosis of this run. The schedule scales every
    # layer's sigma by sigma(t) / sigma_start.
    c.layer_sigmas = ""
    c.sites = ("layer",)  # activation form: module kinds (norm_weight always uses rmsnorm)
    c.sigma_start = 0.05  # QeRL default
    c.sigma_end = 0.0005
    c.num_stages = 10  # schedule intervals (the first is a sigma-0 warm-up)
    c.num_epochs = 2  # epoch_aware only
    c.schedule = "qerl"  # qerl | epoch_aware | constant | linear | cosine
    # epoch_aware only (aqn/schedules.py): the E + 1 epoch boundaries, () = geometric from
    # sigma_start to sigma_end; and which epochs open with a sigma-0 interval.
    c.epoch_sigmas = ()
    c.warmup = "every_epoch"  # every_epoch | first_epoch
    # Where AQN noise sits relative to a deadzone at the same site: between (deadzone, noise,
    # deadzone again: the original DeadzoneMatMul) | after_fault | before_fault.
    c.order = "between"
    c.phases = ("rollout",)  # QeRL: the rollout model only; validation never gets noise
    return c


def parse_layer_sigmas(value: Any, num_layers: int) -> dict[int, float] | None:
    """`config.aqn.layer_sigmas`: '' -> None; a dict literal or the path of an srdd.json ->
    {layer: sigma} checked against the model."""
    field = "config.aqn.layer_sigmas"
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str) and not value.strip().startswith("{"):
        path = os.path.expanduser(value.strip())
        if not os.path.isfile(path):
            raise ValueError(
                f"{field}={value!r}: neither a {{layer: sigma}} literal nor an existing srdd.json"
            )
        with open(path) as f:
            report = json.load(f)
        try:
            value = report["sigma_map"]["sigmas"]
        except (KeyError, TypeError):
            raise ValueError(f"{field}={value!r}: that file has no sigma_map.sigmas") from None
    elif isinstance(value, str):
        try:
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"{field}={value!r}: not a {{layer: sigma}} literal ({e})") from e
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"{field}={value!r}: expected a non-empty {{layer: sigma}} mapping")
    out: dict[int, float] = {}
    for k, v in value.items():
        try:
            layer, sigma = int(k), float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{field}: entry {k!r}: {v!r} is not layer: sigma") from None
        if not 0 <= layer < num_layers:
            raise ValueError(
                f"{field}: layer {layer} but the model has {num_layers} layers"
                f" (ids 0..{num_layers - 1})"
            )
        if not sigma >= 0:
            raise ValueError(f"{field}: layer {layer} sigma={sigma}; must be >= 0")
        out[layer] = sigma
    return out


LAYER_NAMES = ("all", "healthy", "srdd", "located")  # config.aqn.layers' named selections


def check_aqn(aqn: Any) -> None:
    """`config.aqn`'s names and the values its schedule reads, whether AQN is on or off (a bad
    name in a section that is off would be silently ignored until someone turns it on): form,
    schedule, sites, phases, the layers' form (`aqn_injection` checks them against the model
    and the diagnosis when AQN is on), sigmas >= 0, and epoch_aware's epoch_sigmas and warmup
    (refused where the schedule would ignore them)."""
    AQN_FORMS.check(aqn.form)
    SCHEDULES.check(aqn.schedule)
    expand_kinds(aqn.sites, "config.aqn.sites")
    check_phases(aqn.phases, "config.aqn.phases")
    parse_layers(aqn.layers, "config.aqn.layers", None, LAYER_NAMES)
    for name in ("sigma_start", "sigma_end"):
        if not getattr(aqn, name) >= 0:
            raise ValueError(f"config.aqn.{name}={getattr(aqn, name)}; must be >= 0")
    check_epoch_options(
        aqn.schedule,
        int(aqn.num_epochs),
        getattr(aqn, "epoch_sigmas", ()),
        getattr(aqn, "warmup", "every_epoch"),
    )


def aqn_injection(aqn, num_layers, fault_layers, srdd_sigmas, srdd_layers) -> Injection:
    """The AQN injection of `config.aqn` (enabled) for a model of `num_layers` layers.

    fault_layers: the study fault's layers (what layers='healthy' leaves out); srdd_sigmas and
    srdd_layers: the SRDD diagnosis's sigma map and located layers, as in `build_plan`.
    """
    check_aqn(aqn)
    form = AQN_FORMS.get(aqn.form)
    if aqn.schedule in ("qerl", "epoch_aware") and (aqn.sigma_start <= 0 or aqn.sigma_end <= 0):
        raise ValueError(
            f"config.aqn.schedule={aqn.schedule!r} is geometric: sigma_start={aqn.sigma_start} and"
            f" sigma_end={aqn.sigma_end} must be > 0"
        )
    phases = check_phases(aqn.phases, "config.aqn.phases")
    layers = parse_layers(aqn.layers, "config.aqn.layers", num_layers, LAYER_NAMES)
    given = parse_layer_sigmas(aqn.layer_sigmas, num_layers)
    if given is not None and layers != "srdd":
        raise ValueError(
            f"config.aqn.layer_sigmas is set but config.aqn.layers={aqn.layers!r}; the sigma map"
            " applies with layers='srdd'"
        )
    layer_scales = None
    if layers == "healthy":
        if not fault_layers:
            raise ValueError(
                "config.aqn.layers='healthy' means all layers but the faulty ones; enable a"
                " layered fault (config.faults.<kind> with explicit layers)"
            )
        layers = tuple(i for i in range(num_layers) if i not in fault_layers)
    elif layers == "located":
        if srdd_layers is None:
            raise ValueError(
                "config.aqn.layers='located' targets the layers the SRDD diagnosis locates: run"
                " the diagnosis first and pass its verdict (srdd_layers)"
            )
        if not srdd_layers:
            raise ValueError(
                "config.aqn.layers='located': the SRDD diagnosis found no faulty layer, so the"
                " targeted arm has nothing to target (check config.faults, or use layers='all')"
            )
        layers = tuple(sorted(int(i) for i in srdd_layers))
    elif layers == "srdd":
        srdd_sigmas = given if given is not None else srdd_sigmas
        if not srdd_sigmas:
            raise ValueError(
                "config.aqn.layers='srdd' targets the layers the SRDD diagnosis finds: run the"
                " diagnosis first and pass its sigma map (srdd_sigmas)"
            )
        layers = tuple(sorted(srdd_sigmas))
        # The schedule scales sigma over time; the map sets each layer's level relative to
        # sigma_start.
        layer_scales = {i: float(s) / aqn.sigma_start for i, s in srdd_sigmas.items()}
    scale = Scale(1.0, value=AQN_SIGMA, layer_scales=layer_scales)
    sites, transform = form(aqn, layers, scale)
    return Injection("aqn", sites, transform, phases)


def _frozen(value: Any) -> Any:
    """A list as a tuple (what a frozen section holds); anything else as it is."""
    return tuple(value) if isinstance(value, list | tuple) else value


@dataclasses.dataclass(frozen=True)
class AqnSpec:
    """config.aqn, typed (`AqnSpec.of`): what `aqn_injection` and `aqn.plan.place_aqn` read
    once the SRDD diagnosis ran. Its values are checked there (`checks.check_train` places it
    once with stand-in SRDD results)."""

    enabled: bool
    form: str  # AQN_FORMS
    layers: str  # 'all' | 'healthy' | 'located' | 'srdd' | layer ids
    layer_sigmas: str  # '' | a {layer: sigma} literal | an srdd.json path
    sites: tuple[str, ...]  # the activation form's module kinds
    sigma_start: float
    sigma_end: float
    num_stages: int
    num_epochs: int
    schedule: str  # SCHEDULES
    epoch_sigmas: tuple[float, ...]
    warmup: str  # schedules.WARMUPS
    order: str  # aqn.plan.AQN_ORDERS
    phases: tuple[str, ...]

    @classmethod
    def of(cls, aqn: Any) -> AqnSpec:
        return cls(
            enabled=bool(aqn.enabled),
            form=aqn.form,
            layers=_frozen(aqn.layers),
            layer_sigmas=_frozen(aqn.layer_sigmas),
            sites=_frozen(aqn.sites),
            sigma_start=float(aqn.sigma_start),
            sigma_end=float(aqn.sigma_end),
            num_stages=int(aqn.num_stages),
            num_epochs=int(aqn.num_epochs),
            schedule=aqn.schedule,
            epoch_sigmas=tuple(float(x) for x in aqn.get("epoch_sigmas", ())),
            warmup=str(aqn.get("warmup", "every_epoch")),
            order=aqn.order,
            phases=_frozen(aqn.phases),
        )


@dataclasses.dataclass(frozen=True)
class AqnSchedule:
    """The AQN sigma over a run, typed from `config.aqn` (`AqnSchedule.of`)."""

    enabled: bool
    schedule: str
    sigma_start: float
    sigma_end: float
    num_stages: int
    num_epochs: int
    epoch_sigmas: tuple[float, ...] = ()
    warmup: str = "every_epoch"

    @classmethod
    def of(cls, aqn: Any) -> AqnSchedule:
        return cls(
            enabled=bool(aqn.enabled),
            schedule=str(aqn.schedule),
            sigma_start=float(aqn.sigma_start),
            sigma_end=float(aqn.sigma_end),
            num_stages=int(aqn.num_stages),
            num_epochs=int(aqn.num_epochs),
            epoch_sigmas=tuple(float(x) for x in aqn.get("epoch_sigmas", ())),
            warmup=str(aqn.get("warmup", "every_epoch")),
        )

    def sigma(self, step: int, total_steps: int) -> float:
        """This step's AQN sigma (0.0 when AQN is off)."""
        if not self.enabled:
            return 0.0
        return sigma_at(
            self.schedule,
            step,
            total_steps,
            self.sigma_start,
            self.sigma_end,
            num_stages=self.num_stages,
            num_epochs=self.num_epochs,
            epoch_sigmas=self.epoch_sigmas,
            warmup=self.warmup,
        )


def aqn_sigma(aqn: Any, step: int, total_steps: int) -> float:
    """This step's AQN sigma (0.0 when AQN is off), from the AQN section `aqn` (config.aqn)."""
    return AqnSchedule.of(aqn).sigma(step, total_steps)
