"""The native rollout backend: specrl's own engine behind the ``RolloutBackend`` seam.

Contract:
- ``NativeBackend(engine, in_flight=None)`` wraps an ``Engine``. ``generate`` returns the call's
  completions with a copy of the engine's per-call statistics. ``update_weights`` copies the
  tensors into the engine's own model at once when no generate call is running and packs them
  for inference there (``linear.prepack``: the update, not the next rollout's first
  forward, pays for packing); during one it snapshots them (engine dtype) and applies them the
  same way before the next call, or, with ``in_flight``
  ("reverify" | "keep" | "discard", the fate of unfinished sequences' older tokens), between two
  decode steps of the running call (``Engine.stage_weights``). ``update_drafter`` loads a learned
  drafter's tensors into the engine's proposer at once, or during a generate call (the async
  learner trains the drafter while the producer generates) before the next call. ``served``
  fingerprints the engine's own model and drafter tensors (``drafter_tensors``) when no call
  runs (after applying pending updates), and during a call returns the newest record taken
  while idle. ``state_dict`` holds the drafter's cross-call state (the suffix drafter's
  history); during a generate call it waits for the call to end.
  Thread-safe for one generating thread plus one updating thread (the async pipeline's producer
  and learner).
- ``build_native(cfg, policy)`` resolves everything from a run ``Config``: the drafter (a
  ``draft`` model or a head directory: ``rollout.drafter_path`` or the one ``specrl
  train-drafter`` cached; missing -> ``ConfigError`` naming that command), the ``auto`` token
  cap, the engine's own copy of ``policy`` in ``model.dtype`` ('auto' resolved for this CPU).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from specrl.backends.base import IN_FLIGHT, Rollout, Served, Versions
from specrl.config import Config, ConfigError
from specrl.engine.engine import Engine
from specrl.engine.inflight import check_mode
from specrl.models.device import model_device
from specrl.models.fingerprint import fingerprint
from specrl.models.linear import prepack
from specrl.models.precision import torch_dtype
from specrl.models.weights import copy_weights, engine_copy, snapshot
from specrl.paths import cached_drafter
from specrl.rollout_types import Request
from specrl.spec.config import SpecConfig, auto_tokens_per_forward
from specrl.spec.proposers import (
    available_proposers,
    get_proposer_class,
    head_kind,
    proposer_takes,
)


class NativeBackend:
    """See the module docstring."""

    def __init__(self, engine: Engine, in_flight: str | None = None) -> None:
        self.engine = engine
        self.in_flight = in_flight
        self.features = frozenset({IN_FLIGHT}) if in_flight else frozenset()
        self._lock = threading.Lock()  # guards _busy, _pending and the engine's weights
        self._idle = threading.Condition(self._lock)  # notified when a generate call ends
        self._busy = False
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._pending_drafter: tuple[dict[str, torch.Tensor], int] | None = None
        self._newest = engine.policy_version  # the newest version received
        self._drafter_version = 0
        if in_flight:
            check_mode(in_flight, [engine.spec.method])
        self._record = self._fingerprints()  # what ``served`` answers during a generate call

    @property
    def spec(self) -> SpecConfig:
        return self.engine.spec

    def generate(self, requests: Sequence[Request], spec: SpecConfig | None = None) -> Rollout:
        with self._lock:
            self._apply_pending()
            self._busy = True
        try:
            t0 = time.perf_counter()
            comps = self.engine.generate(list(requests), spec=spec)
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
                self._load(named_tensors)
                self.engine.policy_version = version
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
            self._load(staged)
            self.engine.policy_version = version
            self._pending = None

    def _load(self, named: Mapping[str, torch.Tensor]) -> None:
        """The engine's weights := ``named``, packed for inference now (the update pays for
        that, not the next rollout's first forward)."""
        copy_weights(self.engine.model, named)
        prepack(self.engine.model)

    def _dtype(self) -> torch.dtype:
        return next(self.engine.model.parameters()).dtype

    def update_drafter(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        proposer = self.engine.proposer
        if proposer is None or not hasattr(proposer, "load_weights"):
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
        if proposer is None or not hasattr(proposer, "state_dict"):
            return {}
        with self._lock:
            self._idle.wait_for(lambda: not self._busy)  # the generating thread mutates it
            return {"drafter": proposer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "drafter" not in state:
            return
        proposer = self.engine.proposer
        if proposer is None or not hasattr(proposer, "load_state_dict"):
            name = state["drafter"].get("name")
            raise ValueError(f"saved drafter state of {name!r}, but this run's drafter keeps none")
        proposer.load_state_dict(state["drafter"])

    def close(self) -> None:
        self.engine._cache = None  # free the KV cache; the engine stays usable


def drafter_tensors(proposer: object) -> tuple[dict[str, torch.Tensor], torch.dtype] | None:
    """A learned drafter's tensors as the engine holds them, and its parameters' dtype: a
    head's state dict (eagle3, mtp: the names ``update_drafter`` takes), a draft model's
    parameters (our names); ``None`` for a model-free drafter or none."""
    head = getattr(proposer, "head", None)
    model = getattr(proposer, "model", None)
    if isinstance(head, torch.nn.Module):
        module, named = head, dict(head.state_dict())
    elif isinstance(model, torch.nn.Module):
        module, named = model, dict(model.named_parameters())
    else:
        return None
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    return named, dtype


# --------------------------------------------------------------------------- building


def drafter_dir(cfg: Config) -> str | None:
    """The drafter directory a ``draft`` model or learned-head drafter (eagle3, mtp, hybrid) reads:
    ``rollout.drafter_path``, else the one ``specrl train-drafter --drafter SPEC`` cached for
    the model, if it exists."""
    if cfg.rollout.drafter_path is not None:
        return str(Path(cfg.rollout.drafter_path).expanduser())
    cached = cached_drafter(cfg.model.name, head_kind(cfg.rollout.spec))
    return None if cached is None else str(cached)


def learned_drafter(spec: str) -> bool:
    """Whether ``spec`` drafts with weights specrl can train: a head (eagle3, mtp: it takes a
    ``drafter_path``) or a ``draft`` model (it takes a ``draft_model``)."""
    known = spec in available_proposers()
    return known and (proposer_takes(spec, "drafter_path") or proposer_takes(spec, "draft_model"))


def training_mode(cfg: Config) -> str | None:
    """``drafter.mode`` resolved: 'online' or 'refresh' when the run trains its drafter during
    RL, else None. 'auto' is 'refresh' for a learned drafter (eagle3, mtp, draft) on the native
    engine; an explicit mode for a drafter with nothing to train is refused (it would be
    ignored)."""
    mode, spec = cfg.drafter.mode, cfg.rollout.spec
    learned = learned_drafter(spec)
    if mode == "auto":
        return "refresh" if learned and cfg.rollout.backend == "native" else None
    if not learned:
        raise ConfigError(
            f"drafter.mode={mode!r} needs a learned drafter (rollout.spec='eagle3', 'mtp' or "
            f"'draft'), got rollout.spec={spec!r}: it would be ignored"
        )
    if mode != "frozen" and cfg.rollout.backend != "native":
        raise ConfigError(
            f"drafter.mode={mode!r} needs rollout.backend='native' (vLLM serves an exported "
            "head that specrl does not train during RL)"
        )
    return None if mode == "frozen" else mode


def check_drafter(cfg: Config) -> None:
    """A drafter that takes a draft model or a trained head needs one (checked up front),
    unless the run trains its head from scratch (``training_mode``)."""
    spec = cfg.rollout.spec
    if training_mode(cfg) is not None:
        return
    for takes, what in (("draft_model", "a model directory"), ("drafter_path", "a head directory")):
        if proposer_takes(spec, takes) and drafter_dir(cfg) is None:
            raise ConfigError(
                f"rollout.spec={spec!r} needs rollout.drafter_path ({what}; make one with "
                f"`specrl train-drafter --drafter {head_kind(spec)}`)"
            )


def load_drafter(
    cfg: Config, dtype: torch.dtype, policy: torch.nn.Module | None = None
) -> torch.nn.Module | None:
    """The draft model of a ``draft``-style drafter (heads are loaded by their proposer): the
    saved one, or, for a run that trains it from scratch (none saved), ``untrained_draft``."""
    if not proposer_takes(cfg.rollout.spec, "draft_model"):
        return None
    path = drafter_dir(cfg)
    if path is None and policy is not None:
        return untrained_draft(policy, dtype).requires_grad_(False)
    from specrl.models.checkpoints import load_model

    return load_model(path, dtype=dtype)


def untrained_draft(policy: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The draft model a run without one starts from and trains: the policy's embedding, first
    ``specrl.drafters.distill.DEFAULT_LAYERS`` layers (at most half of its layers, at least
    one), final norm and LM head (a copy)."""
    from specrl.drafters.distill import DEFAULT_LAYERS, init_draft

    layers = max(1, min(DEFAULT_LAYERS, policy.config.num_layers // 2))
    return init_draft(policy, layers).to(dtype)


def spec_config(cfg: Config, native: bool = True) -> SpecConfig:
    """The speculation settings from ``rollout.*`` for the native engine, or (``native`` False)
    for vLLM. ``max_tokens_per_forward='auto'`` is the native engine's cost-model controller
    (``SpecConfig.adaptive``); for vLLM, which takes a per-batch-size schedule, the fixed cap
    ``auto_tokens_per_forward`` gives. ``spec_exact='auto'``: ``exact_rule``."""
    cap = cfg.rollout.max_tokens_per_forward
    adaptive = cap == "auto" and native
    if cap == "auto":
        cap = None if adaptive else auto_tokens_per_forward(torch_dtype(cfg.model.dtype))
    heads = proposer_takes(cfg.rollout.spec, "drafter_path")
    return SpecConfig(
        cfg.rollout.spec,
        cfg.rollout.num_spec_tokens,
        options={"drafter_path": drafter_dir(cfg)} if heads else {},
        max_tokens_per_forward=cap,
        siblings=cfg.rollout.spec_siblings,
        exact=exact_rule(cfg, native),
        adaptive=adaptive,
    )


def exact_rule(cfg: Config, native: bool = True) -> str:
    """``rollout.spec_exact`` with 'auto' resolved: 'sample' for a deterministic drafter on the
    native engine without siblings (no acceptance lost), else 'distribution'."""
    exact, method = cfg.rollout.spec_exact, cfg.rollout.spec
    if exact != "auto":
        return exact
    known = method in available_proposers()
    plain_draft = known and get_proposer_class(method).deterministic
    return "sample" if native and plain_draft and not cfg.rollout.spec_siblings else "distribution"


def make_engine(cfg: Config, policy: torch.nn.Module) -> Engine:
    """An engine over its own copy of ``policy`` with the configured drafter."""
    check_drafter(cfg)
    device = model_device(policy)  # colocated: the engine's copy lives where the policy does
    dtype = torch_dtype(cfg.model.dtype, device)
    draft = load_drafter(cfg, dtype, policy)  # the engine moves it to its device
    fraction = cfg.model.gpu_memory_utilization if device.type == "cuda" else None
    try:
        return Engine(engine_copy(policy, dtype), max_batch=cfg.rollout.max_batch,
                      seed=cfg.run.seed, spec=spec_config(cfg), draft_model=draft,
                      memory_fraction=fraction)  # fmt: skip
    except ValueError as e:
        raise ConfigError(f"bad value for rollout.spec: {e}") from None


def in_flight_mode(cfg: Config) -> str | None:
    """The in-flight token policy when the async pipeline updates weights between decode steps."""
    p = cfg.pipeline
    return p.in_flight_tokens if p.mode == "async" and p.update == "in_flight" else None


def build_native(cfg: Config, policy: torch.nn.Module) -> NativeBackend:
    """The inline native backend of a run (see the module docstring)."""
    try:
        return NativeBackend(make_engine(cfg, policy), in_flight=in_flight_mode(cfg))
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"bad value for pipeline.in_flight_tokens: {e}") from None
