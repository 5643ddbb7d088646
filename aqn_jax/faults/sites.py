"""Which module calls an injection applies to.

A site is (module kind, layer index) read from a Flax module path by the model's family and
checked against the module's type: in Qwen2, `('layers_15', 'mlp', 'down_proj')` is kind
`down_proj` of layer 15 only if the module there is a `Linear`. The kinds below are the
vocabulary every family maps its modules to (`models/registry.py`).

Kinds (per decoder layer): `layer` (the decoder layer; its output is the residual stream),
`attn`, `mlp`, `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`,
`input_layernorm`, `post_attention_layernorm`. Model-level kinds (no layer index): `norm` (the
final RMSNorm), `embed_tokens`, `lm_head`. Groups: `linear` = the seven projections, `rmsnorm`
= the two per-layer norms and the final `norm`.

Model-level kinds are selected when the selector's layers are 'all' (so `rmsnorm` on all layers
includes the final norm, as in QeRL), except `embed_tokens` and `lm_head`, which match only when
named explicitly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import flax.linen as nn

from aqn_jax.models import registry

LINEAR_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYER_NORM_KINDS = ("input_layernorm", "post_attention_layernorm")
LAYER_KINDS = ("layer", "attn", "mlp", *LINEAR_KINDS, *LAYER_NORM_KINDS)
MODEL_KINDS = ("norm", "embed_tokens", "lm_head")
EXPLICIT_ONLY = ("embed_tokens", "lm_head")
GROUPS = {"linear": LINEAR_KINDS, "rmsnorm": (*LAYER_NORM_KINDS, "norm")}
KINDS = (*LAYER_KINDS, *MODEL_KINDS)
POINTS = ("input", "output")


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
    out: list[str] = []
    for kind in kinds:
        members = GROUPS.get(kind, (kind,))
        for member in members:
            if member not in KINDS:
                raise ValueError(
                    f"{field}={tuple(kinds)!r}: unknown module kind {kind!r}; allowed:"
                    f" {list(KINDS) + list(GROUPS)}"
                )
            if member not in out:
                out.append(member)
    if not out:
        raise ValueError(
            f"{field}=() selects no module kind; allowed: {list(KINDS) + list(GROUPS)}"
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
            return site.kind in EXPLICIT_ONLY or self.layers == "all"
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
