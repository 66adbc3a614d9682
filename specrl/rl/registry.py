"""Named variants (losses, advantage estimators, off-policy corrections) looked up from config.

Contract: ``Registry(kind)`` maps names to functions. ``register(name)`` is a decorator that adds
one (a taken name raises ``ValueError``); ``get(name)`` returns it or raises ``ValueError`` with one
line naming the unknown name, the closest match ("did you mean") and the valid names
(``specrl.errors.unknown``); iterating
yields the names, ``name in registry`` tests one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from specrl.errors import unknown

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """See the module docstring."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def wrap(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = fn
            return fn

        return wrap

    def get(self, name: str) -> F:
        if name not in self._items:
            raise ValueError(unknown(self.kind, name, self._items))
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items
