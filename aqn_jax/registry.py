"""One way to map a config field's names to what they select: `Registry`.

Every name-to-entry table of the library is one `Registry` (policy losses, KL estimators,
advantage estimators, rollout corrections, reward methods, noise kinds, fault kinds, block
formats, AQN forms and schedules, model families and their HF config mappings, study arms,
vulnerability sites). Each knows the config field that names it, so an unknown name is
refused in one line naming the field, the value and the allowed names; tests and docs read the
allowed names from it (`names()`), never a restated tuple.

    LOSSES = Registry("config.algo.policy_loss")

    @LOSSES.register("ppo")
    def ppo_loss(...): ...

    LOSSES.get(config.algo.policy_loss)   # the entry, or ValueError naming the field

An entry is whatever the table holds: a function, or a frozen dataclass carrying the function
with its settings reader and attributes. Registration order is kept (the first name is the
default where a table has one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_DECORATE = object()  # `register(name)` without an entry: the decorator form


class Registry(Generic[T]):
    """Names -> entries for the config field `field` (e.g. 'config.algo.policy_loss')."""

    def __init__(self, field: str):
        self.field = field
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry=_DECORATE) -> Callable[[T], T] | T:
        """`register(name, entry)` adds `entry` (None included); `@register(name)` adds the
        decorated object. A name registered twice is an error (two tables would disagree
        silently)."""

        def add(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.field}: {name!r} is registered twice")
            self._entries[name] = obj
            return obj

        return add if entry is _DECORATE else add(entry)

    def unregister(self, name: str) -> None:
        """Remove `name` (a test's throwaway entry)."""
        self._entries.pop(name, None)

    def get(self, name: str, field: str | None = None) -> T:
        """The entry named `name`; an unknown name -> one line naming the field (`field`, or the
        registry's own), the value and the allowed names."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"{field or self.field}={name!r}; allowed: {self.names()}") from None

    def check(self, name: str, field: str | None = None) -> str:
        """`name` if registered (else `get`'s error): for a choice checked before it is used."""
        self.get(name, field)
        return name

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def items(self):
        return self._entries.items()

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __repr__(self) -> str:
        return f"Registry({self.field!r}, {self.names()})"
