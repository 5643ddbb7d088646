"""Config-field parsing shared by `faults/config.py` and `aqn/config.py`: layer selections,
phases and choices. Every error names the field.
"""

from __future__ import annotations

import ast
from typing import Any

from .intercept import PHASES


def parse_layers(value: Any, field: str, num_layers: int | None, named=("all",)) -> Any:
    """'all' / a named selection, or a sorted tuple of layer ids within the model.
    `num_layers` None: the form alone (ids >= 0), for a section that is off (its layers are
    checked against the model when it is on: a default such as '15' stays valid for a smaller
    model while its section is off)."""
    given = value
    if isinstance(value, str):
        text = value.strip()
        if text in named:
            return text
        if ":" in text and not text.startswith("("):
            lo, hi = text.split(":")
            value = range(int(lo), int(hi))
        else:
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError) as e:
                raise ValueError(
                    f"{field}={text!r}; expected {' | '.join(map(repr, named))}, an int, a tuple"
                    " of ints or 'lo:hi'"
                ) from e
    if isinstance(value, int):
        value = (value,)
    try:
        layers = tuple(sorted({int(i) for i in value}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field}={value!r}; expected layer ids") from e
    within = "" if num_layers is None else f" within 0..{num_layers - 1}"
    if not layers:
        raise ValueError(
            f"{field}={given!r} selects no layer; expected {' | '.join(map(repr, named))}, an"
            f" int, a tuple of ints or 'lo:hi'{within}"
        )
    if num_layers is None:
        if min(layers) < 0:
            raise ValueError(f"{field}={given!r}; expected layer ids >= 0")
        return layers
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"{field}={given!r} but the model has {num_layers} layers (ids 0..{num_layers - 1})"
        )
    return layers


def check_phases(value, field) -> tuple[str, ...]:
    """A phase or phases, as a tuple, each one of PHASES."""
    phases = (value,) if isinstance(value, str) else tuple(value)
    bad = [p for p in phases if p not in PHASES]
    if bad or not phases:
        raise ValueError(f"{field}={phases}; allowed: subsets of {PHASES}")
    return phases


def check_choice(value, field, allowed):
    """`value`, if it is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{field}={value!r}; allowed: {tuple(allowed)}")
    return value
