"""The device and the treatment in one plan: `config.faults`' injections with the AQN injection
of `config.aqn` placed among them (`config.aqn.order`), so faults and AQN go through one
interceptor.

  --config.aqn.enabled=True --config.aqn.layers='(15,)'

AQN's layers also take 'healthy' (all but the deadzone's layers), 'located' (the layers the SRDD
diagnosis locates, passed in as `srdd_layers`) and 'srdd' (the layers and sigmas of the SRDD
map, passed in as `srdd_sigmas`). The device alone is `aqn_jax.faults.config.fault_plan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from aqn_jax.faults.config import fault_injections
from aqn_jax.faults.fields import check_choice
from aqn_jax.faults.intercept import FaultPlan, Injection

from .config import aqn_injection

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
    deadzone = [i for i in device if i.name == "deadzone"]
    others = [i for i in device if i.name != "deadzone"]
    fault_layers = deadzone[0].sites.layers if deadzone else ()
    fault_layers = () if fault_layers == "all" else fault_layers
    aqn_noise: Injection | None = None
    if aqn.enabled:
        aqn_noise = aqn_injection(aqn, num_layers, fault_layers, srdd_sigmas, srdd_layers)
    # Composition at a shared site follows list order.
    order = check_choice(aqn.order, "config.aqn.order", AQN_ORDERS)
    if aqn_noise is None:
        injections = deadzone + others
    elif order == "before_fault":
        injections = [aqn_noise] + deadzone + others
    elif order == "after_fault" or not deadzone:
        injections = deadzone + [aqn_noise] + others
    else:  # between: deadzone -> AQN noise -> the same deadzone again
        again = Injection(
            "deadzone_after_aqn",
            deadzone[0].sites,
            dataclasses.replace(deadzone[0].transform, reuse_threshold=True),
            tuple(p for p in deadzone[0].phases if p in aqn_noise.phases),
        )
        injections = deadzone + [aqn_noise] + ([again] if again.phases else []) + others
    plan = FaultPlan(injections)
    plan.validate(num_layers)
    return plan
