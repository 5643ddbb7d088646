"""Which module calls an injection applies to.

A site is (module kind, layer index) read from a Flax module path by the model's family and
checked against the module's type: a family maps `('layers_15', 'mlp', 'down_proj')` to kind
`down_proj` of layer 15 only if the module there is its linear. Each family brings its kinds
(`models/registry.py`: `Family.site_types`, `linear_kinds`, `norm_kinds`, `model_kinds`); a
selector accepts the kinds of every registered family.

Kinds: `layer` (every family's decoder layer; its output is the residual stream), the family's
per-layer kinds (its linears, norms and blocks), and model-level kinds without a layer index
(the final norm, `embed_tokens`, `lm_head`). Groups: `linear` = the family's decoder linears,
`rmsnorm` = its norms, per layer and final.

Model-level kinds are selected when the selector's layers are 'all' (so `rmsnorm` on all layers
includes the final norm, as in QeRL), except the explicit-only ones (`embed_tokens`, `lm_head`),
which match only when named.

The module names below (`LINEAR_KINDS`, `GROUPS`, `KINDS`, ...) are read from the registry on
each access: the union over the registered families, in registration order. A module that
imports one by name holds its value at that import (the families of `models/registry.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import flax.linen as nn

from aqn_jax.models import registry

POINTS = ("input", "output")


def _layer_norm_kinds() -> tuple[str, ...]:
    model = registry.model_kinds()
    return tuple(k for k in registry.norm_kinds() if k not in model)


def _layer_kinds() -> tuple[str, ...]:
    model = registry.model_kinds()
    return tuple(k for k in registry.kinds() if k not in model)


_NAMES = {
    "LINEAR_KINDS": registry.linear_kinds,
    "LAYER_NORM_KINDS": _layer_norm_kinds,
    "LAYER_KINDS": _layer_kinds,
    "MODEL_KINDS": registry.model_kinds,
    "EXPLICIT_ONLY": registry.explicit_only,
    "GROUPS": registry.groups,
    "KINDS": registry.kinds,
}


def __getattr__(name: str):
    """`LINEAR_KINDS`, `LAYER_NORM_KINDS`, `LAYER_KINDS`, `MODEL_KINDS`, `EXPLICIT_ONLY`,
    `GROUPS`, `KINDS`: the registered families' names (see the module docstring)."""
    if name in _NAMES:
        return _NAMES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True)
class Site:
    kind: str
    layer: int | None  # None for model-level kinds

    def __str__(self) -> str:
        return self.kind if self.layer is None else f"layers_{self.layer}/{self.kind}"


def classify(path: tuple[str, ...], module: nn.Module) -> Site | None:
    """The site of a module call, or None when the module is no fault site: the model family
    reads the kind and layer from the path and the module's type must be the kind's
    (`models/registry.py`)."""
    site = registry.site_of(path, module)
    return None if site is None else Site(*site)


def expand_kinds(kinds: Iterable[str], field: str = "sites") -> tuple[str, ...]:
    """Kinds with groups (`linear`, `rmsnorm`) expanded; unknown names raise naming `field`."""
    if isinstance(kinds, str):
        kinds = (kinds,)
    known, groups = registry.kinds(), registry.groups()
    out: list[str] = []
    for kind in kinds:
        members = groups.get(kind, (kind,))
        for member in members:
            if member not in known:
                raise ValueError(
                    f"{field}={tuple(kinds)!r}: unknown module kind {kind!r}; allowed:"
                    f" {list(known) + list(groups)}"
                )
            if member not in out:
                out.append(member)
    if not out:
        raise ValueError(
            f"{field}=() selects no module kind; allowed: {list(known) + list(groups)}"
        )
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class SiteSelector:
    """Module kinds × layer ids × the point (input or output) an injection acts on."""

    kinds: tuple[str, ...]
    layers: str | tuple[int, ...] = "all"  # 'all' or layer ids
    point: str = "output"

    def __post_init__(self):
        object.__setattr__(self, "kinds", expand_kinds(self.kinds))
        if self.point not in POINTS:
            raise ValueError(f"point={self.point!r}; allowed: {POINTS}")
        if self.layers != "all":
            object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))

    def matches(self, site: Site) -> bool:
        if site.kind not in self.kinds:
            return False
        if site.layer is None:
            return site.kind in registry.explicit_only() or self.layers == "all"
        return self.layers == "all" or site.layer in self.layers

    def check_layers(self, num_layers: int, field: str = "layers") -> None:
        if self.layers == "all":
            return
        bad = [i for i in self.layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(
                f"{field}={self.layers} but the model has {num_layers} layers"
                f" (ids 0..{num_layers - 1})"
            )
