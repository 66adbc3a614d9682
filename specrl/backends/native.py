"""The native rollout backend: specrl's own engine behind the ``RolloutBackend`` seam.

``NativeBackend(engine, in_flight=None)`` wraps an ``Engine``: ``generate`` returns the call's
completions with a copy of its statistics; ``update_weights`` / ``update_drafter`` apply at once
when idle, else before the next call or, with ``in_flight`` ("reverify" | "keep" | "discard"),
between two decode steps (``Engine.stage_weights``); policy weights always enter through
``Engine.load_weights``. ``served`` fingerprints the engine's own tensors (the drafter's:
``Proposer.tensors``). Thread-safe for one generating plus one updating thread.
``build_native(plan, policy)`` is the engine of a ``RolloutPlan`` over its own copy of
``policy`` in ``plan.dtype``. Details: docs/internals.md.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from specrl.backends.base import GROUP_DONE, IN_FLIGHT, Rollout, Served, Versions
from specrl.engine.engine import Engine
from specrl.engine.inflight import check_mode
from specrl.models.device import model_device
from specrl.models.fingerprint import fingerprint
from specrl.models.precision import torch_dtype
from specrl.models.weights import engine_copy, snapshot
from specrl.rollout_plan import RolloutPlan, refusing
from specrl.rollout_types import Completion, Request
from specrl.spec.config import SpecConfig
from specrl.spec.proposers import Proposer, proposer_takes


class NativeBackend:
    """See the module docstring."""

    def __init__(self, engine: Engine, in_flight: str | None = None) -> None:
        self.engine = engine
        self.in_flight = in_flight
        self.features = frozenset({GROUP_DONE, *([IN_FLIGHT] if in_flight else [])})
        self._lock = threading.Lock()  # guards _busy, _pending and the engine's weights
        self._idle = threading.Condition(self._lock)  # notified when a generate call ends
        self._busy = False
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._pending_drafter: tuple[dict[str, torch.Tensor], int] | None = None
        self._newest = engine.policy_version  # the newest version received
        self._drafter_version = 0
        if in_flight:
            check_in_flight(in_flight, engine.spec.method)
        self._record = self._fingerprints()  # what ``served`` answers during a generate call

    @property
    def spec(self) -> SpecConfig:
        return self.engine.spec

    def generate(
        self,
        requests: Sequence[Request],
        spec: SpecConfig | None = None,
        on_done: Callable[[int, list[Completion]], None] | None = None,
    ) -> Rollout:
        with self._lock:
            self._apply_pending()
            self._busy = True
        try:
            t0 = time.perf_counter()
            comps = self.engine.generate(list(requests), spec=spec, on_done=on_done)
            seconds = time.perf_counter() - t0
        finally:
            with self._lock:
                self._busy = False
                self._apply_pending()
                self._idle.notify_all()
        return Rollout(comps, copy.deepcopy(self.engine.stats), seconds)

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> float:
        t0 = time.perf_counter()
        with self._lock:
            self._newest = max(self._newest, version)
            if not self._busy:
                self.engine.load_weights(named_tensors, version)
                self._pending = None
            else:
                staged = snapshot(named_tensors, self._dtype())
                if self.in_flight:
                    self.engine.stage_weights(staged, version, self.in_flight)
                else:
                    self._pending = (staged, version)
        return time.perf_counter() - t0

    def _apply_pending(self) -> None:
        if self._pending_drafter is not None:
            state, version = self._pending_drafter
            self.engine.proposer.load_weights(state)
            self._drafter_version, self._pending_drafter = version, None
        if self._pending is not None:
            staged, version = self._pending
            self.engine.load_weights(staged, version)
            self._pending = None

    def _dtype(self) -> torch.dtype:
        return next(self.engine.model.parameters()).dtype

    def update_drafter(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        proposer = self.engine.proposer
        if proposer is None:
            raise ValueError("update_drafter: this backend runs no learned drafter")
        t0 = time.perf_counter()
        with self._lock:
            if self._busy:  # applied before the next generate call (a copy: the caller trains on)
                staged = {k: v.detach().clone() for k, v in state.items()}
                self._pending_drafter = (staged, version)
            else:
                proposer.load_weights(dict(state))
                self._drafter_version, self._pending_drafter = version, None
        return time.perf_counter() - t0

    def versions(self) -> Versions:
        with self._lock:
            return Versions(max(self._newest, self.engine.policy_version), self._drafter_version)

    def served(self) -> Served:
        with self._lock:
            if not self._busy:
                self._apply_pending()
                self._record = self._fingerprints()
            return self._record

    def _fingerprints(self) -> Served:
        """Versions and fingerprints of the weights the engine holds now (milliseconds)."""
        drafter = drafter_tensors(self.engine.proposer)
        policy = dict(self.engine.model.named_parameters())
        return Served(self.engine.policy_version, fingerprint(policy, self._dtype()),
                      self._drafter_version,
                      None if drafter is None else fingerprint(*drafter))  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        proposer = self.engine.proposer
        if proposer is None or not proposer.keeps_state:
            return {}
        with self._lock:
            self._idle.wait_for(lambda: not self._busy)  # the generating thread mutates it
            return {"drafter": proposer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "drafter" not in state:
            return
        proposer = self.engine.proposer
        if proposer is None or not proposer.keeps_state:
            name = state["drafter"].get("name")
            raise ValueError(f"saved drafter state of {name!r}, but this run's drafter keeps none")
        proposer.load_state_dict(state["drafter"])

    def close(self) -> None:
        self.engine.free_cache()  # the engine stays usable


def drafter_tensors(
    proposer: Proposer | None,
) -> tuple[dict[str, torch.Tensor], torch.dtype] | None:
    """A learned drafter's tensors as the engine holds them, and its parameters' dtype: a
    head's state dict (eagle3, mtp: the names ``update_drafter`` takes), a draft model's
    parameters (our names); ``None`` for a model-free drafter or none (``Proposer.tensors``)."""
    return None if proposer is None else proposer.tensors()


# --------------------------------------------------------------------------- building


def check_in_flight(policy: str, drafter: str) -> None:
    """``ValueError`` unless the engine can update weights in flight with ``policy`` while
    ``drafter`` drafts (the registry's rule for this backend's plans)."""
    check_mode(policy, [drafter])


def load_drafter(
    plan: RolloutPlan, dtype: torch.dtype, policy: torch.nn.Module | None = None
) -> torch.nn.Module | None:
    """The draft model of a ``draft``-style drafter (heads are loaded by their proposer): the
    saved one, or, for a run that trains it from scratch (none saved),
    ``drafters.distill.untrained_draft``."""
    if not proposer_takes(plan.spec.method, "draft_model"):
        return None
    if plan.drafter_dir is None and policy is not None:
        from specrl.drafters.distill import untrained_draft

        return untrained_draft(policy, dtype).requires_grad_(False)
    from specrl.models.checkpoints import load_model

    return load_model(plan.drafter_dir, dtype=dtype)


def make_engine(plan: RolloutPlan, policy: torch.nn.Module) -> Engine:
    """An engine over its own copy of ``policy`` with the planned drafter."""
    device = model_device(policy)  # colocated: the engine's copy lives where the policy does
    dtype = torch_dtype(plan.dtype, device)
    draft = load_drafter(plan, dtype, policy)  # the engine moves it to its device
    fraction = plan.gpu_memory_utilization if device.type == "cuda" else None
    with refusing("rollout.spec"):  # a drafter that cannot be built from what the plan names
        return Engine(engine_copy(policy, dtype), max_batch=plan.max_batch, seed=plan.seed,
                      spec=plan.spec, draft_model=draft, memory_fraction=fraction,
                      step_graphs=plan.step_graphs)  # fmt: skip


def build_native(plan: RolloutPlan, policy: torch.nn.Module) -> NativeBackend:
    """The inline native backend of a run (see the module docstring)."""
    return NativeBackend(make_engine(plan, policy), in_flight=plan.in_flight)
