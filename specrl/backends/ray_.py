"""The Ray backend: ``cluster.rollout_workers`` rollout backends as Ray actors, one protocol.

``RayBackend(plan, policy)`` (or ``build_ray``) joins Ray (``ray_session``) and starts N actors,
each a ``build_local`` backend of ``rollout_plan.worker_plan(plan)``. ``generate`` splits the
requests, whole, into N contiguous chunks (a single backend's tokens; logprobs to fp32
rounding); a worker that dies is replaced (up to ``cluster.max_restarts``) and its chunk run
again, counted in ``Rollout.faults``. An update is one ``ray.put``; ``served()`` names workers
that disagree, so the weight guard fails on it. ``state_dict`` keeps one state per worker;
``close()`` is idempotent. Thread-safe for one generating plus one updating thread.
Details: docs/internals.md.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import torch

from specrl.backends.base import GROUP_DONE, Rollout, Served, Versions
from specrl.backends.ray_session import (
    RaySession,
    actor_threads,
    check_fits,
    death_line,
    import_ray,
    task_error,
)
from specrl.backends.registry import build_local
from specrl.models.fingerprint import fingerprint_dtype
from specrl.models.precision import torch_dtype
from specrl.models.weights import check_weights, engine_copy
from specrl.rollout_plan import RolloutPlan, Workers, worker_plan
from specrl.rollout_types import EngineStats, Request
from specrl.spec.config import SpecConfig

CONTROL = "control"  # the actors' concurrency group for updates and queries


# --------------------------------------------------------------------------- the actor


class RolloutWorker:
    """The body of one rollout-worker actor: a local backend. Object refs arrive boxed in a
    list, so the actor fetches the object itself (and records which one it got)."""

    def __init__(self, plan: RolloutPlan, policy: list[Any], updates: list[tuple[str, list[Any]]],
                 threads: int) -> None:  # fmt: skip
        import ray

        torch.set_num_threads(threads)
        self.fetched: list[str] = []  # object ids of the updates it loaded, in order
        self.problem: Exception | None = None
        try:
            self.backend = build_local(plan, ray.get(policy[0]))
            for method, box in updates:  # the newest policy and drafter updates
                getattr(self, method)(box)
        except Exception as e:  # raised by ``ready``, with its own type and message
            self.problem = e

    def ready(self) -> tuple[SpecConfig, frozenset[str]]:
        if self.problem is not None:
            raise self.problem
        return self.backend.spec, self.backend.features

    def generate(self, requests: list[Request], spec: SpecConfig | None) -> Rollout:
        return self.backend.generate(requests, spec)

    def update_weights(self, box: list[Any]) -> float:
        version, named = self._fetch(box)
        return self.backend.update_weights(named, version)

    def update_drafter(self, box: list[Any]) -> float:
        version, state = self._fetch(box)
        return self.backend.update_drafter(state, version)

    def _fetch(self, box: list[Any]) -> Any:
        """(version, tensors) of the update in ``box``; blocks held elsewhere in the object
        store (``RemoteWeights``) are fetched from there one by one."""
        import ray

        self.fetched.append(box[0].hex())
        version, payload = ray.get(box[0])
        if isinstance(payload, RemoteWeights):
            named: dict[str, torch.Tensor] = {}
            for ref in payload.blocks:
                named |= ray.get(ref)
            return version, named
        return version, payload

    def node(self) -> str:
        """The id of the Ray node this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def versions(self) -> Versions:
        return self.backend.versions()

    def served(self) -> Served:
        return self.backend.served()

    def status(self) -> tuple[Served, Versions]:
        """What it serves and the newest versions it received (an update may be pending)."""
        return self.backend.served(), self.backend.versions()

    def state_dict(self) -> dict[str, Any]:
        return self.backend.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.backend.load_state_dict(state)

    def pid(self) -> int:
        return os.getpid()

    def fetched_ids(self) -> list[str]:
        return list(self.fetched)


# --------------------------------------------------------------------------- driver side


@dataclass(frozen=True)
class RemoteWeights:
    """A policy update already in Ray's object store, put by whoever gathered it (a train rank
    on its node): the workers fetch it from there; ``fingerprint`` as ``fingerprint`` of the
    whole in the engine's dtype."""

    blocks: list[Any]  # object refs, each of a dict name -> tensor [*shape]
    fingerprint: str
    shapes: dict[str, tuple[int, ...]]  # name -> shape of every parameter

    def nbytes(self) -> int:
        """The update's bytes (each worker fetches as many)."""
        size = torch.finfo(fingerprint_dtype(self.fingerprint)).bits // 8
        return sum(math.prod(s) for s in self.shapes.values()) * size


class _Died(Exception):
    """A worker's process died during a call (internal: becomes a replacement)."""


@dataclass
class _Slot:
    """One worker position: its current actor and how often it was replaced."""

    index: int
    actor: Any
    restarts: int = 0


def split(n: int, parts: int) -> list[range]:
    """``range(n)`` in at most ``parts`` contiguous, non-empty, balanced chunks."""
    q, r = divmod(n, parts)
    bounds = [i * q + min(i, r) for i in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def merge(chunks: Sequence[range], outs: Sequence[Rollout], seconds: float) -> Rollout:
    """One rollout from per-chunk ones: caller's request indices, statistics added."""
    stats = EngineStats()
    comps = []
    for chunk, out in zip(chunks, outs, strict=True):
        stats.add(out.stats)
        comps += [replace(c, request_index=chunk.start + c.request_index) for c in out.completions]
    return Rollout(comps, stats, seconds)


Status = tuple[Served, Versions]  # what a worker serves, and the newest versions it received


def _pair(s: Served, drafter: bool) -> tuple[int, str | None]:
    return (s.drafter_version, s.drafter) if drafter else (s.policy_version, s.policy)


def _received(v: Versions, drafter: bool) -> int:
    return v.drafter if drafter else v.policy


def _consistent(pairs: Sequence[tuple[int, str | None]]) -> bool:
    """No version appears with two different fingerprints."""
    seen: dict[int, str | None] = {}
    return all(seen.setdefault(v, fp) == fp for v, fp in pairs)


def _sound(states: Sequence[Status], drafter: bool) -> bool:
    """Every worker received the same newest version and no two serve one version with
    different contents (an older served version is an update still pending: fine)."""
    received = {_received(v, drafter) for _, v in states}
    return len(received) == 1 and _consistent([_pair(s, drafter) for s, _ in states])


def disagreement(states: Sequence[Status], drafter: bool) -> str:
    """A fingerprint-shaped line (``"<dtype>:[...]"``, so ``fingerprint_dtype`` reads it) that
    names the workers that differ from most of them (the newest on ties)."""
    keys = [(_received(v, drafter), *_pair(s, drafter)) for s, v in states]
    counts = Counter(keys)
    major = max(counts, key=lambda k: (counts[k], k[0], k[1]))
    what = "drafter" if drafter else "policy"

    def says(k: tuple[int, int, str | None]) -> str:
        return f"version {k[1]} ({k[2]}; newest received {k[0]})"

    odd = ", ".join(f"worker {i} serves {what} {says(k)}" for i, k in enumerate(keys) if k != major)
    same = [str(i) for i, k in enumerate(keys) if k == major]
    who = f"worker {same[0]} serves" if len(same) == 1 else f"workers {', '.join(same)} serve"
    dtype = next((k[2].partition(":")[0] for k in keys if k[2]), "none")
    return f"{dtype}:[rollout workers disagree: {odd}; {who} {says(major)}]"


def agreed(states: Sequence[Status]) -> Served:
    """What the workers serve, as one ``Served`` (see the module docstring)."""
    records = [s for s, _ in states]
    if len(set(records)) == 1:
        return records[0]
    oldest = min(records, key=lambda s: (s.policy_version, s.drafter_version))
    policy_ok, drafter_ok = _sound(states, False), _sound(states, True)
    if policy_ok and drafter_ok:
        return oldest
    # failing: the newest version received (one the learner pushed, so the guard keeps its
    # fingerprint and compares) with the line naming the workers as its "fingerprint"
    policy = (oldest.policy_version, oldest.policy) if policy_ok else (
        max(v.policy for _, v in states), disagreement(states, False))  # fmt: skip
    drafter = (oldest.drafter_version, oldest.drafter) if drafter_ok else (
        max(v.drafter for _, v in states), disagreement(states, True))  # fmt: skip
    return Served(*policy, *drafter)


class _Shapes:
    """A model's parameter names and shapes (meta tensors): what ``check_weights`` reads."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._params = [
            (n, torch.empty(p.shape, device="meta")) for n, p in model.named_parameters()
        ]

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._params)


class RayBackend:
    """See the module docstring."""

    spec: SpecConfig
    features: frozenset[str]

    def __init__(self, plan: RolloutPlan, policy: torch.nn.Module) -> None:
        self._plan, cluster = worker_plan(plan), plan.workers  # what each actor builds
        assert cluster is not None  # worker_plan refuses a plan without workers
        self._workers: Workers = cluster
        self._ray = import_ray()
        self._session = RaySession.open(cluster.address)
        self._slots: list[_Slot] = []
        self._finalizer = weakref.finalize(self, _release, self._ray, self._slots, self._session)
        try:
            check_fits(self._ray, cluster.count, cluster.cpus, cluster.gpus)
            self._setup(plan, policy)
        except BaseException:
            self.close()
            raise

    def _setup(self, plan: RolloutPlan, policy: torch.nn.Module) -> None:
        ray, cluster = self._ray, self._workers
        self._dtype = torch_dtype(plan.dtype)
        model = engine_copy(policy, self._dtype)
        self._shapes = _Shapes(model)
        self._policy = ray.put(model)
        self._threads = actor_threads(cluster.threads, cluster.count)
        self._actor_class = ray.remote(concurrency_groups={CONTROL: 1})(RolloutWorker)
        self._max_restarts = cluster.max_restarts
        self._lock = threading.Lock()  # slots, refs and counters
        self._sync = threading.Lock()  # an update's broadcast vs a ``served`` read
        self._updates: dict[str, Any] = {}  # method -> ref of the newest update
        self._faults = 0  # deaths not yet reported in a Rollout
        self._slots.extend(_Slot(i, self._spawn()) for i in range(cluster.count))
        starts = self._ask_all("ready", lambda i: ())  # one dead at start is replaced too
        self.spec, features = starts[0]
        self.features = features - {GROUP_DONE}  # completions come back when a call ends

    # ----------------------------------------------------------------- actors and faults

    def _spawn(self) -> Any:
        """A new actor, loading the newest updates after the policy."""
        cluster = self._workers
        updates = [(method, [ref]) for method, ref in self._updates.items()]
        options = {"num_cpus": cluster.cpus, "num_gpus": cluster.gpus, "max_restarts": 0}
        return self._actor_class.options(**options).remote(
            self._plan, [self._policy], updates, self._threads
        )

    def _get(self, ref: Any, slot: _Slot) -> Any:
        """``ray.get``; a dead worker is ``_Died``, a worker's error its own type."""
        ex = self._ray.exceptions
        try:
            return self._ray.get(ref)
        except ex.RayActorError as e:
            raise _Died(death_line(e)) from e
        except ex.RayTaskError as e:
            raise task_error(e, f"rollout worker {slot.index}") from None

    def _replace(self, slot: _Slot, dead: Any, why: str) -> None:
        """Replace ``slot``'s dead actor (once, whichever thread finds it first)."""
        with self._lock:
            if slot.actor is not dead:
                return
            self._faults += 1
            slot.restarts += 1
            if slot.restarts > self._max_restarts:
                raise RuntimeError(
                    f"rollout worker {slot.index} died {slot.restarts} times "
                    f"(cluster.max_restarts={self._max_restarts}); last: {why}"
                )
            self._ray.kill(dead, no_restart=True)
            slot.actor = self._spawn()

    def _call(self, slot: _Slot, method: str, args: tuple, group: str | None) -> tuple[Any, Any]:
        actor = slot.actor
        call = getattr(actor, method)
        call = call.options(concurrency_group=group) if group else call
        return actor, call.remote(*args)

    def _ask_all(self, method: str, args: Callable[[int], tuple], group: str | None = CONTROL
                 ) -> list[Any]:  # fmt: skip
        """``method(*args(i))`` on every worker i; a dead one is replaced and asked again."""
        pending = {s.index: self._call(s, method, args(s.index), group) for s in self._slots}
        results = {}
        for slot in self._slots:
            while slot.index not in results:
                actor, ref = pending[slot.index]
                try:
                    results[slot.index] = self._get(ref, slot)
                except _Died as e:
                    self._replace(slot, actor, str(e))
                    pending[slot.index] = self._call(slot, method, args(slot.index), group)
        return [results[s.index] for s in self._slots]

    # ----------------------------------------------------------------- the protocol

    def generate(self, requests: Sequence[Request], spec: SpecConfig | None = None) -> Rollout:
        t0 = time.perf_counter()
        requests = list(requests)
        chunks = split(len(requests), len(self._slots))
        outs = self._run_chunks([[requests[i] for i in c] for c in chunks], spec)
        out = merge(chunks, outs, time.perf_counter() - t0)
        with self._lock:
            out.faults, self._faults = self._faults, 0
        return out

    def _run_chunks(self, chunks: list[list[Request]], spec: SpecConfig | None) -> list[Rollout]:
        """Each chunk on a free worker; a dead worker's chunk goes back to the queue."""
        todo, done = deque(range(len(chunks))), {}
        running: dict[Any, tuple[_Slot, Any, int]] = {}
        while todo or running:
            busy = {slot.index for slot, _, _ in running.values()}
            for slot in self._slots:
                if todo and slot.index not in busy:
                    c = todo.popleft()
                    actor, ref = self._call(slot, "generate", (chunks[c], spec), None)
                    running[ref] = (slot, actor, c)
            [ref], _ = self._ray.wait(list(running), num_returns=1)
            slot, actor, c = running.pop(ref)
            try:
                done[c] = self._get(ref, slot)
            except _Died as e:
                self._replace(slot, actor, str(e))
                todo.appendleft(c)
        return [done[c] for c in range(len(chunks))]

    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | RemoteWeights, version: int
    ) -> float:
        """Put the update once (a ``RemoteWeights`` is in the store already) and give every
        worker its reference."""
        t0 = time.perf_counter()
        if isinstance(named_tensors, RemoteWeights):
            meta = {k: torch.empty(s, device="meta") for k, s in named_tensors.shapes.items()}
            check_weights(self._shapes, meta)  # type: ignore[arg-type]
            self._broadcast("update_weights", named_tensors, version)
            return time.perf_counter() - t0
        check_weights(self._shapes, named_tensors)  # type: ignore[arg-type]  # ValueError before anything moves
        self._broadcast("update_weights", _cpu(named_tensors, self._dtype), version)
        return time.perf_counter() - t0

    def update_drafter(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        t0 = time.perf_counter()
        self._broadcast("update_drafter", _cpu(state, None), version)
        return time.perf_counter() - t0

    def _broadcast(
        self, method: str, tensors: dict[str, torch.Tensor] | RemoteWeights, version: int
    ) -> None:
        """One put; every worker gets the ref (a replacement loads it at start)."""
        ref = self._ray.put((version, tensors))
        with self._sync:
            with self._lock:
                previous = self._updates.get(method)
                self._updates[method] = ref
            try:
                self._ask_all(method, lambda i: ([ref],))
            except BaseException:
                with self._lock:  # a refused update must not reach replacements
                    self._updates.pop(method)
                    if previous is not None:
                        self._updates[method] = previous
                raise

    def versions(self) -> Versions:
        vs = self._ask_all("versions", lambda i: ())
        return Versions(min(v.policy for v in vs), min(v.drafter for v in vs))

    def served(self) -> Served:
        with self._sync:  # never in the middle of an update's broadcast
            return agreed(self._ask_all("status", lambda i: ()))

    def state_dict(self) -> dict[str, Any]:
        states = self._ask_all("state_dict", lambda i: (), group=None)
        return {"workers": states} if any(states) else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        saved = state.get("workers")

        def args(i: int) -> tuple:
            if saved is None:
                return (dict(state),)
            return (saved[i] if i < len(saved) else {},)

        self._ask_all("load_state_dict", args, group=None)

    def pids(self) -> list[int]:
        """The workers' process ids."""
        return self._ask_all("pid", lambda i: ())

    def nodes(self) -> list[str]:
        """The Ray node ids the workers run on."""
        return self._ask_all("node", lambda i: ())

    @property
    def actors(self) -> tuple[Any, ...]:
        """The workers' actor handles now (a replaced worker has a new one)."""
        return tuple(slot.actor for slot in self._slots)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> RayBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release(ray: ModuleType, slots: list[_Slot], session: RaySession) -> None:
    """Kill the actors, then close the session (a finalizer: no reference to the backend)."""
    if ray.is_initialized():
        for slot in slots:
            with suppress(Exception):  # already gone
                ray.kill(slot.actor, no_restart=True)
    slots.clear()
    session.close()


def _cpu(named: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Detached CPU tensors (cast to ``dtype`` when given) for the object store."""
    return {k: t.detach().to(device="cpu", dtype=dtype or t.dtype) for k, t in named.items()}


def build_ray(plan: RolloutPlan, policy: torch.nn.Module) -> RayBackend:
    """The Ray backend of a run (see the module docstring)."""
    return RayBackend(plan, policy)
