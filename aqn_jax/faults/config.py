"""`config.faults` (ml_collections) -> the device's validated injections and FaultPlan.

Every experiment scripts faults the same way:

  --config.faults.deadzone.enabled=True --config.faults.deadzone.layers=15
  --config.faults.noise.enabled=True --config.faults.noise.scale=0.05

Layers are 'all', an int, a tuple of ints, or a string of those ('5', '(3,5)', '3,5', '10:15'
for a range). Validation names the field and runs before anything compiles. Each fault kind is
one builder in `BUILDERS`; `fault_plan` is the device alone. The treatment (AQN, `config.aqn`)
is placed among these injections by `aqn_jax.aqn.plan.build_plan`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_collections

from . import ops
from .fields import check_choice, check_phases, parse_layers
from .intercept import PHASES, FaultPlan, Injection
from .sites import LINEAR_KINDS, POINTS, SiteSelector, expand_kinds
from .transforms import Deadzone, Noise, NoisyLinear, Quantize, Scale


def faults_config() -> ml_collections.ConfigDict:
    """The hardware-fault section, everything off (a clean device)."""
    c = ml_collections.ConfigDict()
    c.deadzone = ml_collections.ConfigDict()
    c.deadzone.enabled = False  # MXFP4-style deadzone (REFERENCE.md)
    c.deadzone.layers = "15"  # decoder layer ids: 'all', 5, '(3,5)', '10:15'
    c.deadzone.site = "layer"  # module kind(s); 'layer' = the residual stream after the layer
    c.deadzone.point = "output"  # input | output of the module
    # How severity is stated: amax (flush |h| < threshold * amax: the original's; a real LM's
    # massive activations make 0.01 flush 96-100% of its stream, the tiny model's 3%) |
    # quantile (flush the `quantile` fraction of smallest |h|: transfers between models).
    c.deadzone.severity = "amax"
    c.deadzone.threshold = 0.01  # severity='amax': flush |h| < threshold * amax; in (0, 1)
    c.deadzone.quantile = 0.5  # severity='quantile': fraction of |h| flushed; in (0, 1)
    c.deadzone.granularity = "tensor"  # amax over: tensor (original) | token | block
    c.deadzone.block_size = 32  # lanes per block for granularity='block'
    c.deadzone.sparsity = 1.0  # fraction of lanes that are faulty, (0, 1]
    c.deadzone.sparsity_seed = 0  # seed of the fixed faulty-lane mask
    c.deadzone.grad = "mask"  # mask: zero grad where flushed (original) | ste
    # The tokens amax (or the quantile) is taken over with granularity='tensor' (issue 19):
    # call (the module call's tensor: the original's; the whole sequence when teacher-forced,
    # one token per row when decoding, so rollout and training see different faults) | causal
    # (per row, its tokens so far; decoding carries the running amax: amax severity only) |
    # token (each token alone). Measured on the warm start (WORKSPACE.md, issue 19): call
    # makes the sampler's and the trainer's log-probs differ by 0.5 nats per token on average
    # (max 14) and 11-25% of flush decisions differ between rollout and training; causal and
    # token agree to 1e-5. The default stays call because the study's operating point
    # (quantile 0.75: accuracy 0.80 -> 0.48) and every recorded result were calibrated under
    # it, and token at the same quantile is a different, milder fault (0.67; 0.58 at 0.9):
    # switching needs a new severity calibration. New studies: token (quantile) or causal.
    c.deadzone.scope = "call"
    c.deadzone.phases = PHASES  # the device is faulty in every phase

    c.noise = ml_collections.ConfigDict()
    c.noise.enabled = False  # hardware error model of the original (seeds 002/003)
    c.noise.kind = "relative_gaussian"  # relative_gaussian | absolute_gaussian | systematic_bias
    c.noise.scale = 0.05  # relative: 0.05 = 5% error; absolute: std; bias: magnitude
    c.noise.sites = ("linear",)  # module kinds or groups (linear, rmsnorm)
    c.noise.layers = "all"
    c.noise.point = "output"  # input: op(x + e) | output: op(x) + e
    c.noise.forward = True  # error in the forward pass
    c.noise.backward = False  # error on dX and dW of linears (operator level)
    c.noise.phases = PHASES

    c.quant = ml_collections.ConfigDict()
    c.quant.enabled = False  # fake quantisation (MX / NVFP4) at sites
    c.quant.format = (
        "mxfp4"  # mxfp4 | mxfp6_e2m3 | mxfp6_e3m2 | mxfp8_e4m3 | mxfp8_e5m2 | mxint8 | nvfp4
    )
    c.quant.sites = ("linear",)
    c.quant.layers = "all"
    c.quant.point = "input"  # linear inputs: blocks along the contraction axis
    c.quant.scale_rule = "floor"  # floor (OCP MX) | ceil (NVIDIA TE, torchao RCEIL)
    c.quant.rounding = "away"  # away (microxcaling default) | even
    c.quant.block_size = 32
    c.quant.scope = "call"  # nvfp4's global scale over: call | token (MX: call; per block)
    c.quant.phases = PHASES
    return c


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


def _noise(nz: Any, num_layers: int) -> list[Injection]:
    """`config.faults.noise` -> its injections: value noise at a point, or operator-level error
    on dX and dW of linears (`backward`, plus the forward part), or [] when off."""
    if nz.scale < 0:  # whether the fault is on or not
        raise ValueError(f"config.faults.noise.scale={nz.scale}; must be >= 0")
    if not nz.enabled:
        return []
    check_choice(nz.kind, "config.faults.noise.kind", ops.NOISE_KINDS)
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


def _quant(qt: Any, num_layers: int) -> list[Injection]:
    """`config.faults.quant` -> [the fake-quantisation injection], or [] when off."""
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


# Fault kind (a subsection of `config.faults`) -> its builder (section, num_layers) -> injections.
# A new kind is its section in `faults_config` and one builder here; plans list the kinds'
# injections in this order, so a deadzone sees its site's value first.
BUILDERS: dict[str, Callable[[Any, int], list[Injection]]] = {
    "deadzone": _deadzone,
    "noise": _noise,
    "quant": _quant,
}


def fault_injections(faults: Any, num_layers: int) -> list[Injection]:
    """The validated injections of `config.faults` for a model of `num_layers` layers."""
    return [inj for kind, build in BUILDERS.items() for inj in build(faults[kind], num_layers)]


def fault_plan(faults: Any, num_layers: int) -> FaultPlan:
    """The simulated device: the FaultPlan of `config.faults` alone, without the treatment
    (AQN; `aqn_jax.aqn.plan.build_plan` adds it). SRDD diagnoses this device, validation and
    the robustness matrix measure accuracy on it, and the critic runs it with
    `config.critic.faults=True`."""
    plan = FaultPlan(fault_injections(faults, num_layers))
    plan.validate(num_layers)
    return plan
