"""The device and the treatment in one plan: `config.faults`' injections with the AQN injection
of `config.aqn` placed among them (`config.aqn.order`), so faults and AQN go through one
interceptor.

  --config.aqn.enabled=True --config.aqn.layers='(15,)'

AQN's layers also take 'healthy' (all but the layers of the fault AQN targets: a kind whose
`FaultKind.aqn_target` is set, e.g. the deadzone), 'located' (the layers the SRDD diagnosis
locates, passed in as `srdd_layers`) and 'srdd' (the layers and sigmas of the SRDD map, passed
in as `srdd_sigmas`). The device alone is `aqn_jax.faults.config.fault_plan`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aqn_jax.faults.config import fault_injections, kind_of
from aqn_jax.faults.fields import check_choice
from aqn_jax.faults.intercept import FaultPlan, Injection

from .config import aqn_injection, check_aqn

AQN_ORDERS = ("between", "after_fault", "before_fault")


def needs_srdd(aqn: Any) -> bool:
    """Whether `build_plan` needs a diagnosis first for the AQN section `aqn` (aqn.layers
    'located', or 'srdd' without a given layer_sigmas)."""
    if not aqn.enabled or not isinstance(aqn.layers, str):
        return False
    layers = aqn.layers.strip()
    return layers == "located" or (layers == "srdd" and not str(aqn.layer_sigmas).strip())


def build_plan(
    faults: Any,
    aqn: Any,
    num_layers: int,
    srdd_sigmas: Mapping[int, float] | None = None,
    srdd_layers: Sequence[int] | None = None,
) -> FaultPlan:
    """The FaultPlan of the sections `faults` (`config.faults`) and `aqn` (`config.aqn`) for a
    model of `num_layers` layers.

    srdd_sigmas: {layer: sigma} from the SRDD diagnosis, used by aqn.layers='srdd' when
      config.aqn.layer_sigmas is empty.
    srdd_layers: the layers the diagnosis located, required by aqn.layers='located'.
    """
    return place_aqn(
        fault_injections(faults, num_layers), aqn, num_layers, srdd_sigmas, srdd_layers
    )


def place_aqn(
    device: Sequence[Injection],
    aqn: Any,
    num_layers: int,
    srdd_sigmas: Mapping[int, float] | None = None,
    srdd_layers: Sequence[int] | None = None,
) -> FaultPlan:
    """`build_plan` over the device's injections already parsed (`device`: a
    `faults.config.fault_plan`'s, the run spec's), so config.faults is not read again."""
    # The faults AQN targets (`FaultKind.aqn_target`): their layers are what 'healthy' leaves
    # out, and config.aqn.order places the noise around them.
    targets = [i for i in device if _targetable(i)]
    others = [i for i in device if not _targetable(i)]
    fault_layers = targets[0].sites.layers if targets else ()
    fault_layers = () if fault_layers == "all" else fault_layers
    check_aqn(aqn)  # its names, on or off
    aqn_noise: Injection | None = None
    if aqn.enabled:
        aqn_noise = aqn_injection(aqn, num_layers, fault_layers, srdd_sigmas, srdd_layers)
    # Composition at a shared site follows list order.
    order = check_choice(aqn.order, "config.aqn.order", AQN_ORDERS)
    if aqn_noise is None:
        injections = targets + others
    elif order == "before_fault":
        injections = [aqn_noise] + targets + others
    elif order == "after_fault" or not any(kind_of(i).again for i in targets):
        injections = targets + [aqn_noise] + others
    else:  # between: the fault -> AQN noise -> the same fault again
        again = [_again(i, aqn_noise) for i in targets if kind_of(i).again is not None]
        injections = targets + [aqn_noise] + [i for i in again if i.phases] + others
    plan = FaultPlan(injections)
    plan.validate(num_layers)
    return plan


def _targetable(injection: Injection) -> bool:
    kind = kind_of(injection)
    return kind is not None and kind.aqn_target


def _again(fault: Injection, aqn_noise: Injection) -> Injection:
    """`fault` applied again after AQN's noise (order 'between'), in the phases AQN acts in."""
    return Injection(
        f"{fault.name}_after_aqn",
        fault.sites,
        kind_of(fault).again(fault.transform),
        tuple(p for p in fault.phases if p in aqn_noise.phases),
    )
