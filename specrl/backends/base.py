"""The rollout-backend seam: the only thing a pipeline knows about generation.

``RolloutBackend``: ``generate(requests, spec=None) -> Rollout`` (``n`` completions per request
in request order, ``specrl.rollout_types.Completion``; the call's own stats, wall seconds,
``faults``; a bad request comes back as an ``"error"`` completion), ``update_weights`` /
``update_drafter`` (copied before returning, served from the next safe point), ``versions()``,
``served()`` (the engine's own tensors fingerprinted, for ``pipelines.guard``), ``state_dict`` /
``load_state_dict`` (JSON-able resume state) and ``close()`` (idempotent); ``spec`` and
``features`` (``IN_FLIGHT``; ``GROUP_DONE``: ``generate`` also takes ``on_done``, called with a
request's index and completions as soon as they are all finished), so a pipeline refuses what a
backend cannot honour and uses what it can.
Details: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from specrl.rollout_plan import GROUP_DONE, IN_FLIGHT
from specrl.rollout_types import Completion, EngineStats, Request
from specrl.spec.config import SpecConfig

__all__ = ["GROUP_DONE", "IN_FLIGHT", "Rollout", "RolloutBackend", "Served", "Versions"]


@dataclass(frozen=True)
class Versions:
    """What a backend serves now."""

    policy: int
    drafter: int = 0


@dataclass(frozen=True)
class Served:
    """What a backend's engine serves now (see ``RolloutBackend.served``)."""

    policy_version: int
    policy: str | None  # fingerprint of the policy's tensors; None: nothing to fingerprint
    drafter_version: int = 0
    drafter: str | None = None  # fingerprint of a learned drafter's tensors; None: none


@dataclass
class Rollout:
    """One ``generate`` call's result."""

    completions: list[Completion]
    stats: EngineStats = field(default_factory=EngineStats)
    seconds: float = 0.0
    faults: int = 0  # rollout workers that died (and were replaced) since the previous call

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    def first_error(self) -> Completion | None:
        return next((c for c in self.completions if c.error), None)


@runtime_checkable
class RolloutBackend(Protocol):
    """See the module docstring."""

    spec: SpecConfig
    features: frozenset[str]

    def generate(self, requests: Sequence[Request], spec: SpecConfig | None = None) -> Rollout: ...

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> float: ...

    def update_drafter(self, state: Mapping[str, torch.Tensor], version: int) -> float: ...

    def versions(self) -> Versions: ...

    def served(self) -> Served: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...
