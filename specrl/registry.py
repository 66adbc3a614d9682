"""Named things looked up from config: one registry mechanism for every kind of them.

Contract (a leaf: imports only ``specrl.errors``): ``Registry(kind)`` maps unique names to
objects of one kind (policy losses, advantage estimators, off-policy corrections, drafters,
rollout backends). ``register(name)`` is a decorator that adds the decorated object and returns
it; ``register(name, obj)`` adds ``obj`` directly; a taken name raises ``ValueError``.
``get(name)`` (also ``registry[name]``) returns the object, or raises ``UnknownName`` (both a
``KeyError`` and a ``ValueError``) whose message is one line naming the unknown name, the closest
match ("did you mean") and the valid names (``specrl.errors.unknown``). ``names()`` is the sorted
names, which iteration also yields; ``items()`` the sorted (name, object) pairs; ``name in
registry`` tests one.

``discover``, if given, is called once before the registry is first read (a lookup, a listing,
a membership test): it imports the modules whose objects register themselves when imported
(the drafters of ``specrl.spec.proposers``), so that registering is all a new module does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, overload

from specrl.errors import unknown

T = TypeVar("T")
_NOTHING: Any = object()


class UnknownName(KeyError, ValueError):
    """A name that no entry of a registry has. ``str()`` is the message itself (a bare
    ``KeyError`` would quote it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """See the module docstring."""

    def __init__(self, kind: str, *, discover: Callable[[], None] | None = None) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._discover = discover

    @overload
    def register(self, name: str) -> Callable[[T], T]: ...
    @overload
    def register(self, name: str, obj: T) -> T: ...
    def register(self, name: str, obj: T = _NOTHING) -> Callable[[T], T] | T:
        def add(item: T) -> T:
            if name in self._items:
                taken = self._items[name]
                raise ValueError(f"{self.kind} {name!r} is already registered ({taken!r})")
            self._items[name] = item
            return item

        return add if obj is _NOTHING else add(obj)

    def _read(self) -> dict[str, T]:
        """The entries, discovered first (once; a discovery that raises is tried again on the
        next read, and a read during discovery sees what has registered so far)."""
        discover, self._discover = self._discover, None
        if discover is not None:
            try:
                discover()
            except BaseException:
                self._discover = discover
                raise
        return self._items

    def get(self, name: str) -> T:
        items = self._read()
        if name not in items:
            raise UnknownName(unknown(self.kind, name, items))
        return items[name]

    __getitem__ = get

    def names(self) -> list[str]:
        return sorted(self._read())

    def items(self) -> list[tuple[str, T]]:
        items = self._read()
        return [(name, items[name]) for name in sorted(items)]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._read())

    def __contains__(self, name: object) -> bool:
        return name in self._read()

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(sorted(self._items))})"
