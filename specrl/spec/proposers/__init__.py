"""Drafters behind one ``Proposer`` base class (see ``base``), looked up by name.

``register_proposer(name)`` records a ``Proposer`` subclass under a unique name (``TypeError``
for a class that is not one);
``get_proposer_class(name)`` returns it (a miss imports every module of the package once, so a
new drafter is just a module here). ``proposer_takes(name, arg)``, ``head_kind(name)`` and
``takes_siblings(name)`` say what a drafter needs. The registry dict is the only module-level
mutable state. Details: docs/internals.md.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from typing import TypeVar

from specrl.spec.proposers.base import Draft, Proposer, ProposerBatch

__all__ = [
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

_REGISTRY: dict[str, type[Proposer]] = {}
T = TypeVar("T", bound=type[Proposer])


def register_proposer(name: str) -> Callable[[T], T]:
    """Class decorator: register ``cls`` (a ``Proposer`` subclass) under ``name``."""

    def decorate(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, Proposer)):
            raise TypeError(f"proposer {name!r}: {cls!r} does not subclass specrl's Proposer")
        existing = _REGISTRY.get(name)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"proposer name {name!r} already registered by {existing!r}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def _import_all() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def get_proposer_class(name: str) -> type[Proposer]:
    """The proposer class registered under ``name``; ``KeyError`` listing the known names."""
    if name not in _REGISTRY:
        _import_all()
    if name not in _REGISTRY:
        raise KeyError(f"unknown proposer {name!r}; known: {', '.join(available_proposers())}")
    return _REGISTRY[name]


def proposer_takes(name: str, argument: str) -> bool:
    """Whether the proposer registered as ``name`` takes constructor ``argument``; False for
    'none' or an unknown name (which ``SpecConfig.validate`` reports)."""
    if name not in _REGISTRY:
        _import_all()
    cls = _REGISTRY.get(name)
    return cls is not None and argument in inspect.signature(cls).parameters


def takes_siblings(name: str) -> bool:
    """Whether drafter ``name`` is stochastic (its class's ``deterministic`` is False), the only
    kind whose first draft token gets sibling candidates; False for 'none' or an unknown name."""
    if name not in _REGISTRY:
        _import_all()
    cls = _REGISTRY.get(name)
    return cls is not None and getattr(cls, "deterministic", True) is False


def head_kind(name: str) -> str:
    """The kind of trained head drafter ``name`` loads and trains (its class's ``kind``: the
    ``hybrid`` drafter's head is an ``eagle3`` one), else ``name`` itself."""
    if name not in _REGISTRY:
        _import_all()
    return getattr(_REGISTRY.get(name), "kind", name)


def available_proposers() -> list[str]:
    """Sorted names of every registered proposer (after importing all drafter modules)."""
    _import_all()
    return sorted(_REGISTRY)
