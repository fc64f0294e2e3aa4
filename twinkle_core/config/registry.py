"""A registry of named things (row kinds, objectives, backends): each name once, and a clear error for an
unknown one that lists what exists."""
from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, option: str, noun: str):
        self.option, self.noun = option, noun  # e.g. "kind", "row kind": the option and the thing in messages
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        """Add `item` under `name`; a name can be registered only once."""
        if name in self._items:
            raise ValueError(f"{self.noun} {name!r} is already registered; register the new one under another name.")
        self._items[name] = item
        return item

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"{self.option}={name!r} is not a known {self.noun}; use one of: "
                             f"{', '.join(self.names())}.") from None

    def names(self) -> list[str]:
        return sorted(self._items)
