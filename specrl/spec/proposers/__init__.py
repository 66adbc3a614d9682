"""Drafters behind one ``Proposer`` base class (see ``base``), looked up by name.

``PROPOSERS`` is their ``specrl.registry.Registry``; ``register_proposer(name)`` records a
``Proposer`` subclass there under a unique name (``TypeError`` for a class that is not one) and
sets its ``name``. The registry's first read imports every module of this package once, so a
new drafter is just a module here. ``get_proposer_class(name)`` returns a class (``UnknownName``,
a ``KeyError``, with a did-you-mean, for a name none has); ``available_proposers()`` lists the
names; ``proposer_takes(name, arg)``, ``head_kind(name)`` and ``takes_siblings(name)`` say what a
drafter needs. The registry is the only module-level mutable state. Details: docs/internals.md.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from typing import TypeVar

from specrl.registry import Registry
from specrl.spec.proposers.base import Draft, Proposer, ProposerBatch

__all__ = [
    "PROPOSERS",
    "Draft",
    "Proposer",
    "ProposerBatch",
    "available_proposers",
    "get_proposer_class",
    "head_kind",
    "proposer_takes",
    "register_proposer",
    "takes_siblings",
]

T = TypeVar("T", bound=type[Proposer])


def _import_all() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


PROPOSERS: Registry[type[Proposer]] = Registry("proposer", discover=_import_all)


def register_proposer(name: str) -> Callable[[T], T]:
    """Class decorator: register ``cls`` (a ``Proposer`` subclass) under ``name``."""

    def decorate(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, Proposer)):
            raise TypeError(f"proposer {name!r}: {cls!r} does not subclass specrl's Proposer")
        PROPOSERS.register(name, cls)
        cls.name = name
        return cls

    return decorate


def get_proposer_class(name: str) -> type[Proposer]:
    """The proposer class registered under ``name`` (``UnknownName``, a ``KeyError``)."""
    return PROPOSERS.get(name)


def _registered(name: str) -> type[Proposer] | None:
    return PROPOSERS.get(name) if name in PROPOSERS else None


def proposer_takes(name: str, argument: str) -> bool:
    """Whether the proposer registered as ``name`` takes constructor ``argument``; False for
    'none' or an unknown name (which ``SpecConfig.validate`` reports)."""
    cls = _registered(name)
    return cls is not None and argument in inspect.signature(cls).parameters


def takes_siblings(name: str) -> bool:
    """Whether drafter ``name`` is stochastic (its class's ``deterministic`` is False), the only
    kind whose first draft token gets sibling candidates; False for 'none' or an unknown name."""
    cls = _registered(name)
    return cls is not None and getattr(cls, "deterministic", True) is False


def head_kind(name: str) -> str:
    """The kind of trained head drafter ``name`` loads and trains (its class's ``kind``: the
    ``hybrid`` drafter's head is an ``eagle3`` one), else ``name`` itself."""
    return getattr(_registered(name), "kind", name)


def available_proposers() -> list[str]:
    """Sorted names of every registered proposer (every drafter module imported)."""
    return PROPOSERS.names()
