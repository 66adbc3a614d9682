"""The rollout-backend seam: the only thing a pipeline knows about generation.

Contract (``RolloutBackend``):
- ``generate(requests, spec=None) -> Rollout``: ``n`` completions per request in request order
  (``specrl.engine.types.Completion``: token ids, processed and raw logprobs, finish reason, the
  policy version of every token), with the call's own counters (``Rollout.stats``; no shared
  mutable statistics), wall seconds and ``faults`` (rollout workers of a multi-worker backend
  that died since the previous call: their requests ran again elsewhere; 0 otherwise).
  ``spec`` overrides the configured speculation for the call (e.g. a plain rollout for a speed
  comparison). A bad request comes back as a completion with ``finish_reason == "error"``; the
  others run.
- ``update_weights(named_tensors, version)``: the policy's tensors under our parameter names;
  the backend copies what it needs before returning (the caller may mutate them at once) and
  serves ``version`` from its next safe point on: at once when idle, else between generate calls,
  or between decode steps where the backend was built for in-flight updates. Returns seconds.
- ``update_drafter(state, version)``: a learned drafter's tensors (EAGLE-3/MTP head, draft model).
- ``versions() -> Versions``: the policy and drafter versions the backend serves from its next
  generate call on (an update received during a call counts, even if that call finishes on
  the older weights; ``Completion.token_versions`` say what produced each token).
- ``served() -> Served``: what the engine serves now, read on the backend's side from the
  engine's own tensors (never from a staging copy): the policy version and its content
  fingerprint (``specrl.models.fingerprint``, in the engine's dtype), the drafter's likewise.
  When no generate call runs, an update still pending is applied first; during a call it
  answers at once (never waits for the call) with the newest record it took while idle: an
  older version, but its fingerprint is that version's. So a pipeline can ask from either
  thread, and asked right after a generate call it sees at least every update received before
  that call started. ``None`` for a fingerprint means there is nothing to fingerprint (a
  model-free drafter, a test fake without weights). The weight-sync guard
  (``specrl.pipelines.guard``) compares these with the learner's side.
- ``state_dict()`` / ``load_state_dict(state)``: JSON-able state that must survive a resume
  (e.g. the suffix drafter's history); ``{}`` when there is none.
- ``close()``: release workers and memory; idempotent.
- ``spec``: the configured speculation; ``features``: optional abilities (``IN_FLIGHT``), so a
  pipeline refuses an option a backend cannot honour instead of dropping it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from specrl.rollout_types import Completion, EngineStats, Request
from specrl.spec.config import SpecConfig

IN_FLIGHT = "in_flight"  # weights can change between decode steps of a running generate


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
