"""`config.faults` (ml_collections) -> the device's validated injections and FaultPlan.

Every experiment scripts faults the same way:

  --config.faults.deadzone.enabled=True --config.faults.deadzone.layers=15
  --config.faults.noise.enabled=True --config.faults.noise.scale=0.05

Layers are 'all', an int, a tuple of ints, or a string of those ('5', '(3,5)', '3,5', '10:15'
for a range). Validation names the field and runs before anything compiles. Each fault kind is
one entry of `FAULT_KINDS`: its builder registered with `fault_kind`, its section's defaults
and what a study reads of it (`FaultKind`); `fault_plan` is the device alone. The treatment
(AQN, `config.aqn`) is placed among these injections by `aqn_jax.aqn.plan.build_plan`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

from aqn_jax.registry import Registry

from . import bits, formats, ops
from .bitfaults import (
    BACKWARD_POINTS,
    TARGETS,
    Abft,
    AbftBackward,
    BitFault,
    Bits,
    BitsLinear,
    ScaleFlip,
    TreeBits,
)
from .fields import check_choice, check_phases, parse_layers
from .intercept import PHASES, FaultPlan, Injection
from .sites import LINEAR_KINDS, POINTS, SiteSelector, expand_kinds
from .transforms import Deadzone, Noise, NoisyLinear, Quantize, Scale


@dataclasses.dataclass(frozen=True)
class FaultKind:
    """A fault kind (a subsection of `config.faults`): how it is built, and what a study reads
    of it. Plans list the kinds' injections in registration order, so a deadzone sees its
    site's value first; a kind's (first) injection carries the kind's name (`kind_of`)."""

    build: Callable[[Any, int], list[Injection]]  # (section, num_layers) -> [Injection]; [] off
    section: Callable[[], ml_collections.ConfigDict]  # config.faults.<name>'s defaults, off
    # A bit-level kind's transform at module calls (a class with `value_bits`, `counts_flips`):
    # `bit_injection` builds it; what the kind is is read from this class, never its name.
    bits: type | None = None
    layered: bool = True  # it sits at decoder layers: a run's fault layers (`spec.fault_layers`)
    # AQN can target it: arms healthy / targeted / srdd_guided place AQN by its layers, and
    # config.aqn.order places AQN's noise around it.
    aqn_target: bool = False
    # config.aqn.order='between': its transform applied again after AQN's noise (None: the
    # order acts as 'after_fault').
    again: Callable[[Any], Any] | None = None
    title: str = ""  # how the study report names it ('' = the kind's name)
    # It quantises to a block format (its section's format, block_size, sites and point): the
    # model's widths are checked against its blocks (`checks.check_block_widths`).
    block_format: bool = False
    # The study report's design note for the AQN settings {form, order, ...} of its AQN arms
    # (activation form), or None.
    aqn_note: Callable[[Mapping[str, Any]], str | None] | None = None


# config.faults' kinds, in plan order. A new kind is one builder registered with `fault_kind`.
FAULT_KINDS: Registry[FaultKind] = Registry("config.faults")


def fault_kind(
    name: str,
    section: Callable[[], ml_collections.ConfigDict],
    bits: type | None = None,
    **study: Any,
):
    """Registers the decorated builder `(section, num_layers) -> [Injection]` as fault kind
    `name`, whose `config.faults.<name>` defaults (everything off) are `section()`; `bits`: a
    bit-level kind's transform at module calls (built by `bit_injection` as `bits(fault,
    kind=name)` unless the builder passes its own `make`); `study`: the other `FaultKind`
    fields (layered, aqn_target, again, title, block_format, aqn_note)."""

    def register(build):
        FAULT_KINDS.register(name, FaultKind(build, section, bits, **study))
        return build

    return register


def kind_of(injection: Injection) -> FaultKind | None:
    """The entry of the fault kind that built `injection` (the injection carrying the kind's
    name), or None (AQN, ABFT, a kind's second injection)."""
    return FAULT_KINDS.get(injection.name) if injection.name in FAULT_KINDS else None


def check_placement(sec: Any, f: str, sites: str = "sites", points=POINTS) -> None:
    """A fault section's sites, layers (their form: the model is checked when the section is
    on), point (one of `points`; None: not read) and phases, whether the section is on or off:
    a bad name in a section that is off is a mistake too, silently ignored until someone turns
    it on. `f`: 'config.faults.<kind>'."""
    expand_kinds(sec[sites], f"{f}.{sites}")
    parse_layers(sec.layers, f"{f}.layers", None)
    if points is not None:
        check_choice(sec.point, f"{f}.point", points)
    check_phases(sec.phases, f"{f}.phases")


def faults_config() -> ml_collections.ConfigDict:
    """The hardware-fault section, everything off (a clean device): one subsection per kind."""
    return ml_collections.ConfigDict({name: k.section() for name, k in FAULT_KINDS.items()})


def _deadzone_section() -> ml_collections.ConfigDict:
    """config.faults.deadzone: the MXFP4-style deadzone."""
    c = ml_collections.ConfigDict()
    c.enabled = False  # MXFP4-style deadzone (docs/ARCHITECTURE.md)
    c.layers = "15"  # decoder layer ids: 'all', 5, '(3,5)', '10:15'
    c.site = "layer"  # module kind(s); 'layer' = the residual stream after the layer
    c.point = "output"  # input | output of the module
    # How severity is stated: amax (flush |h| < threshold * amax: the original's; a real LM's
    # massive activations make 0.01 flush 96-100% of its stream, the tiny model's 3%) |
    # quantile (flush the `quantile` fraction of smallest |h|: transfers between models).
    c.severity = "amax"
    c.threshold = 0.01  # severity='amax': flush |h| < threshold * amax; in (0, 1)
    c.quantile = 0.5  # severity='quantile': fraction of |h| flushed; in (0, 1)
    c.granularity = "tensor"  # amax over: tensor (original) | token | block
    c.block_size = 32  # lanes per block for granularity='block'
    c.sparsity = 1.0  # fraction of lanes that are faulty, (0, 1]
    c.sparsity_seed = 0  # seed of the fixed faulty-lane mask
    c.grad = "mask"  # mask: zero grad where flushed (original) | ste
    # The tokens amax (or the quantile) is taken over with granularity='tensor': call (the
    # module call's tensor, the original's: rollout and training see different faults) |
    # causal (per row, its tokens so far; amax severity only) | token (each token alone).
    # 'call' stays the default because the study's severities were calibrated under it.
    c.scope = "call"
    c.phases = PHASES  # the device is faulty in every phase
    return c


def _noise_section() -> ml_collections.ConfigDict:
    """config.faults.noise: the original system's error models (docs/ARCHITECTURE.md,
    "Hardware-error models of the original system")."""
    c = ml_collections.ConfigDict()
    c.enabled = False  # the original system's hardware error model
    c.kind = "relative_gaussian"  # relative_gaussian | absolute_gaussian | systematic_bias
    c.scale = 0.05  # relative: 0.05 = 5% error; absolute: std; bias: magnitude
    c.sites = ("linear",)  # module kinds or groups (linear, rmsnorm)
    c.layers = "all"
    c.point = "output"  # input: op(x + e) | output: op(x) + e
    c.forward = True  # error in the forward pass
    c.backward = False  # error on dX and dW of linears (operator level)
    c.phases = PHASES
    return c


def _quant_section() -> ml_collections.ConfigDict:
    """config.faults.quant: fake quantisation (MX / NVFP4)."""
    c = ml_collections.ConfigDict()
    c.enabled = False  # fake quantisation (MX / NVFP4) at sites
    c.format = "mxfp4"  # mxfp4 | mxfp6_e2m3 | mxfp6_e3m2 | mxfp8_e4m3 | mxfp8_e5m2 | mxint8 | nvfp4
    c.sites = ("linear",)
    c.layers = "all"
    c.point = "input"  # linear inputs: blocks along the contraction axis
    c.scale_rule = "floor"  # floor (OCP MX) | ceil (NVIDIA TE, torchao RCEIL)
    c.rounding = "away"  # away (microxcaling default) | even
    c.block_size = 32
    c.scope = "call"  # nvfp4's global scale over: call | token (MX: call; per block)
    c.phases = PHASES
    return c


def _between_note(aqn: Mapping[str, Any]) -> str | None:
    """The deadzone with activation-form AQN in order 'between': what the design cannot show."""
    if aqn.get("form") == "activation" and aqn.get("order") == "between":
        return (
            "AQN order 'between' (the seed's code: deadzone, noise relative to |h|, deadzone"
            " again) gives a flushed value zero noise and flushes it again: this form can"
            " never rescue a flushed value; it only perturbs the values the fault keeps"
        )
    return None


@fault_kind(
    "deadzone",
    _deadzone_section,
    aqn_target=True,
    # Order 'between' (the original's DeadzoneMatMul): the same deadzone again after AQN's
    # noise, at the threshold of its first application.
    again=lambda t: dataclasses.replace(t, reuse_threshold=True),
    title="deadzone (flush of small |h|)",
    aqn_note=_between_note,
)
def _deadzone(dz: Any, num_layers: int) -> list[Injection]:
    """`config.faults.deadzone` -> [the deadzone injection], or [] when off."""
    # Both severities' fields, whichever one is chosen and whether the fault is on: a value
    # nothing reads is still a mistake (severity='quantile' with threshold=1.5 ran, ignoring it).
    for field, what in (("threshold", "of amax"), ("quantile", "the fraction of values flushed")):
        if not 0.0 < float(dz[field]) < 1.0:
            raise ValueError(
                f"config.faults.deadzone.{field}={dz[field]}; must be in (0, 1) ({what}; checked"
                f" with severity={dz.get('severity', 'amax')!r} too)"
            )
    f = "config.faults.deadzone"
    check_placement(dz, f, sites="site")  # its names, on or off
    check_choice(dz.get("severity", "amax"), f"{f}.severity", ops.DEADZONE_SEVERITIES)
    check_choice(dz.granularity, f"{f}.granularity", ops.GRANULARITIES)
    check_choice(dz.grad, f"{f}.grad", ops.DEADZONE_GRADS)
    check_choice(dz.get("scope", "call"), f"{f}.scope", ops.SCOPES)
    if not dz.enabled:
        return []
    layers = parse_layers(dz.layers, "config.faults.deadzone.layers", num_layers)
    kinds = expand_kinds(dz.site, "config.faults.deadzone.site")
    point = check_choice(dz.point, "config.faults.deadzone.point", POINTS)
    phases = check_phases(dz.phases, "config.faults.deadzone.phases")
    severity = check_choice(
        dz.get("severity", "amax"), "config.faults.deadzone.severity", ops.DEADZONE_SEVERITIES
    )
    try:
        transform = Deadzone(
            float(dz.threshold if severity == "amax" else dz.quantile),
            severity=severity,
            granularity=dz.granularity,
            block_size=int(dz.block_size),
            sparsity=float(dz.sparsity),
            sparsity_seed=int(dz.sparsity_seed),
            grad=dz.grad,
            scope=dz.get("scope", "call"),
        )
    except ValueError as e:
        raise ValueError(f"config.faults.deadzone.{e}") from e
    return [Injection("deadzone", SiteSelector(kinds, layers, point), transform, phases)]


@fault_kind("noise", _noise_section, title="noise (the original's hardware error model)")
def _noise(nz: Any, num_layers: int) -> list[Injection]:
    """`config.faults.noise` -> its injections: value noise at a point, or operator-level error
    on dX and dW of linears (`backward`, plus the forward part), or [] when off."""
    if nz.scale < 0:  # whether the fault is on or not
        raise ValueError(f"config.faults.noise.scale={nz.scale}; must be >= 0")
    ops.NOISE_KINDS.check(nz.kind)  # its names, on or off
    check_placement(nz, "config.faults.noise")
    if not nz.enabled:
        return []
    if not (nz.forward or nz.backward):
        raise ValueError("config.faults.noise: forward=False and backward=False inject nothing")
    layers = parse_layers(nz.layers, "config.faults.noise.layers", num_layers)
    kinds = expand_kinds(nz.sites, "config.faults.noise.sites")
    point = check_choice(nz.point, "config.faults.noise.point", POINTS)
    phases = check_phases(nz.phases, "config.faults.noise.phases")
    scale = Scale(float(nz.scale))
    if not nz.backward:
        return [
            Injection("noise", SiteSelector(kinds, layers, point), Noise(nz.kind, scale), phases)
        ]
    wrong = [k for k in kinds if k not in LINEAR_KINDS]
    if wrong:
        raise ValueError(
            f"config.faults.noise.backward=True adds error to dX and dW of linears; "
            f"config.faults.noise.sites has non-linear kinds {wrong}"
        )
    if nz.kind != "relative_gaussian":
        raise ValueError(
            f"config.faults.noise.kind={nz.kind!r}: operator-level (backward) error is"
            " relative_gaussian only"
        )
    out = [
        Injection(
            "noise",
            SiteSelector(kinds, layers, "output"),
            NoisyLinear(scale, forward=nz.forward and point == "output", backward=True),
            phases,
        )
    ]
    if nz.forward and point == "input":
        out.append(
            Injection(
                "noise_input", SiteSelector(kinds, layers, "input"), Noise(nz.kind, scale), phases
            )
        )
    return out


@fault_kind("quant", _quant_section, title="fake quantisation (MX / NVFP4)", block_format=True)
def _quant(qt: Any, num_layers: int) -> list[Injection]:
    """`config.faults.quant` -> [the fake-quantisation injection], or [] when off."""
    check_placement(qt, "config.faults.quant")  # its names, on or off
    check_formats(qt, "config.faults.quant")
    check_choice(qt.get("scope", "call"), "config.faults.quant.scope", ops.SCOPES)
    if not qt.enabled:
        return []
    try:
        transform = Quantize(
            qt.format,
            scale_rule=qt.scale_rule,
            rounding=qt.rounding,
            block_size=int(qt.block_size),
            scope=qt.get("scope", "call"),
        )
    except ValueError as e:
        raise ValueError(f"config.faults.quant.{e}") from e
    sites = SiteSelector(
        expand_kinds(qt.sites, "config.faults.quant.sites"),
        parse_layers(qt.layers, "config.faults.quant.layers", num_layers),
        check_choice(qt.point, "config.faults.quant.point", POINTS),
    )
    return [
        Injection("quant", sites, transform, check_phases(qt.phases, "config.faults.quant.phases"))
    ]


def check_formats(sec: Any, f: str) -> None:
    """A quantising section's format, scale rule and rounding (config.faults.quant,
    mx_scale_flip) by name, on or off (`Quantize` checks them again, with the block size and
    scope, when the section is on)."""
    formats.FORMATS.check(sec.format, f"{f}.format")
    formats.SCALE_RULES.check(sec.scale_rule, f"{f}.scale_rule")
    formats.ROUNDINGS.check(sec.rounding, f"{f}.rounding")


def bit_section(**extra) -> ml_collections.ConfigDict:
    """A bit-level fault's section (bitflip, stuck_at, mx_scale_flip, any kind registered with
    `fault_kind(..., bits=...)`), off."""
    c = ml_collections.ConfigDict()
    c.enabled = False
    c.target = "activation"  # activation | weight | gradient | optimizer
    c.sites = ("linear",)  # module kinds or groups hit (trees: the params those modules hold)
    c.layers = "all"
    c.point = "output"  # activation: input | output | dx | dw (a linear's backward products)
    c.phases = PHASES  # gradient, optimizer, dx, dw: 'train' only (no backward elsewhere)
    # sign | exponent | mantissa | all | bit positions, 0 = the least significant, e.g. (30,)
    c.bits = "exponent"
    c.rate = ml_collections.config_dict.placeholder(float)  # per element and bit, [0, 1]; or
    c.count = ml_collections.config_dict.placeholder(int)  # elements per tensor per call
    c.steps = "all"  # RL steps a transient fault fires at (first attempt only): 'all' | (3,)
    c.permanent = False  # fixed lanes: an activation's last axis, a tree leaf's elements
    c.lane_seed = 0  # seed of a permanent fault's lanes
    # One bit position passed to the programs at run time, not compiled in: runs differing only
    # in `bits` share their compiled programs (the vulnerability study); needs one position.
    c.traced_bit = False
    c.update(extra)
    return c


def _bitflip_section() -> ml_collections.ConfigDict:
    """config.faults.bitflip: flips of stored bits (silent data corruption)."""
    return bit_section()


def _stuck_at_section() -> ml_collections.ConfigDict:
    """config.faults.stuck_at: bits forced to `value` on fixed lanes (a permanent fault)."""
    return bit_section(value=1, permanent=True)  # value: 0 | 1


def _mx_scale_flip_section() -> ml_collections.ConfigDict:
    """config.faults.mx_scale_flip: the tensor in an MX/NVFP4 format with flipped bits of its
    block scales (`bits`: the scale's, E8M0 for MX: 8 exponent bits; E4M3 for nvfp4)."""
    return bit_section(
        point="input",  # linear inputs: blocks along the contraction axis
        format="mxfp4",  # an MX format (config.faults.quant.format's) | nvfp4
        block_size=32,
        scale_rule="floor",
        rounding="away",
    )


def parse_steps(value: Any, field: str) -> tuple[int, ...] | None:
    """'all' -> None, else RL steps (>= 1) as a sorted tuple."""
    if isinstance(value, str) and value.strip() == "all":
        return None
    allowed = "RL steps count from 1; allowed: 'all', a step, a tuple of steps or 'lo:hi'"
    try:
        steps = parse_layers(value, field, 1 << 30)
    except ValueError:  # its message speaks of layers
        raise ValueError(f"{field}={value!r}; {allowed}") from None
    if 0 in steps:
        raise ValueError(f"{field}={value!r}; {allowed}")
    return steps


def bit_injection(
    kind: str, sec: Any, num_layers: int, mode: str, make: Callable | None = None
) -> list[Injection]:
    """A bit-level fault section (kind `kind`, registered with `fault_kind(..., bits=cls)`) ->
    [its injection], or [] when off. Activations get `make(fault)` (default `cls(fault,
    kind=kind)`), a linear's backward products dX / dW `BitsLinear` (where `cls.value_bits`:
    the flipped bits are the value's), weights, gradients and moments `TreeBits`."""
    f = f"config.faults.{kind}"
    cls = FAULT_KINDS.get(kind).bits
    value_bits = cls.value_bits
    target = check_choice(sec.target, f"{f}.target", TARGETS)  # its names, on or off
    points = (*POINTS, *BACKWARD_POINTS) if value_bits else POINTS
    check_placement(sec, f, points=points if target == "activation" else None)
    bits.parse_bits(sec.bits, f"{f}.bits")
    parse_steps(sec.steps, f"{f}.steps")
    if not sec.enabled:
        return []
    kinds = expand_kinds(sec.sites, f"{f}.sites")
    layers = parse_layers(sec.layers, f"{f}.layers", num_layers)
    phases = check_phases(sec.phases, f"{f}.phases")
    point = check_choice(sec.point, f"{f}.point", points) if target == "activation" else None
    steps = parse_steps(sec.steps, f"{f}.steps")  # its message names the field already
    try:
        fault = BitFault(
            mode,
            bits=sec.bits,
            rate=None if sec.rate is None else float(sec.rate),
            count=None if sec.count is None else int(sec.count),
            permanent=bool(sec.permanent),
            lane_seed=int(sec.lane_seed),
            steps=steps,
            traced_bit=bool(sec.get("traced_bit", False)),
        )
        if not isinstance(fault.bits, str):  # the widest storage; the dtype's own width is
            bits.positions(fault.bits, "float32")  # checked by `check_bit_dtypes`
    except ValueError as e:
        raise ValueError(f"{f}.{e}") from e
    backward = "the gradients" if target == "gradient" else "the AdamW moments"
    backward = f"point={point!r} (a backward product)" if point in BACKWARD_POINTS else backward
    if (target in ("gradient", "optimizer") or point in BACKWARD_POINTS) and phases != ("train",):
        raise ValueError(
            f"{f}.phases={phases}: {backward} exist only in phase 'train' (rollout and"
            f" eval run no backward pass); set {f}.phases=('train',)"
        )
    if target != "activation":
        transform = TreeBits(fault, target, kind)
        point = "output"
    elif point in BACKWARD_POINTS:
        transform, point = BitsLinear(fault, point, kind), "output"
    else:
        try:
            transform = (make or functools.partial(cls, kind=kind))(fault)
        except ValueError as e:
            raise ValueError(f"{f}.{e}") from e
    return [Injection(kind, SiteSelector(kinds, layers, point), transform, phases)]


@fault_kind("bitflip", _bitflip_section, bits=Bits)
def _bitflip(sec: Any, num_layers: int) -> list[Injection]:
    """`config.faults.bitflip` -> [its injection], or [] when off."""
    return bit_injection("bitflip", sec, num_layers, "flip")


@fault_kind("stuck_at", _stuck_at_section, bits=Bits)
def _stuck_at(sec: Any, num_layers: int) -> list[Injection]:
    """`config.faults.stuck_at` -> [its injection], or [] when off."""
    if sec.value not in (0, 1):  # on or off
        raise ValueError(f"config.faults.stuck_at.value={sec.value!r}; allowed: 0, 1")
    if sec.enabled and not sec.permanent:
        raise ValueError(
            "config.faults.stuck_at.permanent=False: a stuck bit is a permanent fault (fixed"
            " lanes); for transient faults use config.faults.bitflip"
        )
    return bit_injection("stuck_at", sec, num_layers, f"stuck{int(sec.value)}")


@fault_kind("mx_scale_flip", _mx_scale_flip_section, bits=ScaleFlip, block_format=True)
def _mx_scale_flip(sec: Any, num_layers: int) -> list[Injection]:
    """`config.faults.mx_scale_flip` -> [its injection], or [] when off."""
    check_formats(sec, "config.faults.mx_scale_flip")  # its names, on or off
    if sec.enabled and sec.target != "activation":
        raise ValueError(
            f"config.faults.mx_scale_flip.target={sec.target!r}; allowed: 'activation' (block"
            " scales exist where a tensor is quantised)"
        )

    def make(fault: BitFault) -> ScaleFlip:
        return ScaleFlip(
            fault,
            sec.format,
            block_size=int(sec.block_size),
            scale_rule=sec.scale_rule,
            rounding=sec.rounding,
        )

    return bit_injection("mx_scale_flip", sec, num_layers, "flip", make)


def check_bit_dtypes(faults: Any, compute_dtype, param_dtype) -> None:
    """Bit positions within the width of the values each enabled bit fault hits: activations
    and backward products in the compute dtype, weights and gradients in the param dtype,
    AdamW moments in float32 (raises naming the field). Kinds whose bits are not the value's
    (`value_bits` False: a block scale's) are checked by their transform."""
    for kind, entry in FAULT_KINDS.items():
        sec = faults.get(kind)
        if entry.bits is None or sec is None or not sec.enabled or not entry.bits.value_bits:
            continue
        dtype = {"activation": compute_dtype, "optimizer": "float32"}.get(sec.target, param_dtype)
        bits.positions(bits.parse_bits(sec.bits), dtype, f"config.faults.{kind}.bits")


def fault_injections(faults: Any, num_layers: int) -> list[Injection]:
    """The validated injections of `config.faults` for a model of `num_layers` layers."""
    # A config written before a kind existed has no section for it: that kind is off.
    return [
        inj
        for kind, entry in FAULT_KINDS.items()
        if kind in faults
        for inj in entry.build(faults[kind], num_layers)
    ]


def fault_plan(faults: Any, num_layers: int) -> FaultPlan:
    """The simulated device: the FaultPlan of `config.faults` alone, without the treatment
    (AQN; `aqn_jax.aqn.plan.build_plan` adds it). SRDD diagnoses this device, validation and
    the robustness matrix measure accuracy on it, and the critic runs it with
    `config.critic.faults=True`."""
    plan = FaultPlan(fault_injections(faults, num_layers))
    plan.validate(num_layers)
    return plan


def with_abft(
    plan: FaultPlan, phases=("rollout", "train"), forward: bool = True, backward: bool = False
) -> FaultPlan:
    """`plan` with ABFT row checksums on every linear of every layer (`config.sdc.abft`),
    after the faults at each site: detection, not a fault (`bitfaults.Abft`); with `backward`
    (`config.sdc.abft_backward`) also on the backward products dX and dW of every linear in the
    passes the update differentiates (`bitfaults.AbftBackward`; where a bit fault corrupts dX
    or dW it carries the check, after its flips)."""
    every = SiteSelector(("linear",), "all", "output")
    injections = list(plan.injections)
    if backward:
        injections = [
            dataclasses.replace(inj, transform=dataclasses.replace(inj.transform, abft=True))
            if isinstance(inj.transform, BitsLinear)
            else inj
            for inj in injections
        ]
        injections.append(Injection("abft_bwd", every, AbftBackward(), ("train",)))
    if forward:
        injections.append(Injection("abft", every, Abft(), phases))
    return FaultPlan(tuple(injections))
