"""The process backend: the native engine in its own worker process, behind ``RolloutBackend``.

``ProcessBackend(plan, policy)`` (or ``build_process``) spawns one worker that builds
``build_native`` over a shared-memory copy of the policy (the staging area of weight updates),
with ``plan.threads`` torch threads. A request pipe (generate, state) and a control pipe
(updates, versions, ``served``) let an update arrive while a generate runs: one generating plus
one updating thread is safe. A worker's error is re-raised here in one line; a dead worker
raises ``RuntimeError`` from every call, never a hang. ``close()`` is idempotent (also at exit).
Details: docs/internals.md.
"""

from __future__ import annotations

import functools
import io
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp  # registers the reductions that share tensor storage
from torch import nn
from tqdm import tqdm

from specrl.backends.base import GROUP_DONE, Rollout, Served, Versions
from specrl.backends.native import NativeBackend, build_native
from specrl.config import ConfigError
from specrl.models.precision import torch_dtype
from specrl.models.weights import copy_weights, engine_copy
from specrl.rollout_plan import RolloutPlan
from specrl.rollout_types import Request
from specrl.spec.config import SpecConfig

POLL_S = 0.1  # how often a waiting call checks that the worker is alive
GRACE_S = 5.0  # how long close() waits for each stage of a worker's exit
ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "ConfigError": ConfigError,
    "RuntimeError": RuntimeError,
}

Reply = tuple[Any, ...]  # ("ok", value) | ("error", type name, ERRORS kind | None, line, trace)


def worker_threads(threads: int) -> int:
    """Torch threads of a worker: ``threads``, or half the cores (>= 1) for 0."""
    return threads if threads > 0 else max(1, (os.cpu_count() or 2) // 2)


# --------------------------------------------------------------------------- main-process side


@dataclass
class _Channel:
    """One pipe end in the main process and the lock that serialises its calls."""

    conn: Connection
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Worker:
    """The worker process and its two channels (holds no reference to the backend, so a
    finalizer can stop it)."""

    def __init__(self, plan: RolloutPlan, model: nn.Module, threads: int) -> None:
        ctx = mp.get_context("spawn")
        req_here, req_there = ctx.Pipe()
        ctl_here, ctl_there = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_main,
            args=(plan, model, threads, req_there, ctl_there),
            name="specrl-rollout",
            daemon=True,  # multiprocessing's own exit hook terminates it, as a last resort
        )
        self.request, self.control = _Channel(req_here), _Channel(ctl_here)
        self.closed = threading.Event()
        self.process.start()
        req_there.close()  # only the worker holds these now: its death reads as EOF here
        ctl_there.close()

    def call(
        self, channel: _Channel, op: str, *args: Any, prepare: Callable[[], object] | None = None
    ) -> Any:
        """Send ``op`` and wait for its reply (see the module docstring for errors);
        ``prepare`` runs first, under the channel's lock (e.g. filling the staging area)."""
        with channel.lock:
            self._check(op)
            if prepare is not None:
                prepare()
            try:
                channel.conn.send((op, args))
            except OSError:
                raise self._gone(op) from None
            return _unwrap(self.wait(channel, op))

    def wait(self, channel: _Channel, op: str, timeout: float | None = None) -> Reply:
        """The next reply on ``channel``; ``RuntimeError`` once the worker is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            try:
                if channel.conn.poll(POLL_S):
                    return channel.conn.recv()
            except (EOFError, OSError):
                raise self._gone(op) from None
            if not self.process.is_alive():
                raise self._gone(op)
        raise TimeoutError(f"rollout worker: no reply to {op!r} within {timeout} s")

    def _check(self, op: str) -> None:
        if self.closed.is_set() or not self.process.is_alive():
            raise self._gone(op)

    def _gone(self, op: str) -> RuntimeError:
        if self.closed.is_set():
            return RuntimeError(f"rollout backend is closed (call {op!r})")
        self.process.join(1.0)  # the exit code is set a moment after the pipe closes
        hint = (
            "its stderr says why (a script that starts one needs an `if __name__ == "
            "'__main__':` guard: workers are spawned)"
            if op == "start"
            else "its engine state is lost: close() this backend and build a new one"
        )
        return RuntimeError(
            f"rollout worker process died (exit code {self.process.exitcode}) during or before "
            f"{op!r}; {hint}"
        )

    def stop(self) -> None:
        """Ask the worker to exit, then join, terminate, kill (run once, by a finalizer)."""
        if self.request.lock.acquire(timeout=GRACE_S):  # else a generate still runs: terminate
            try:
                if not self.closed.is_set() and self.process.is_alive():
                    self.request.conn.send(("close", ()))
                    self.wait(self.request, "close", timeout=GRACE_S)
            except (OSError, RuntimeError, TimeoutError):
                pass  # it is gone or stuck; the steps below see to it
            finally:
                self.closed.set()
                self.request.lock.release()
        self.closed.set()
        _end_process(self.process)
        self.request.conn.close()
        self.control.conn.close()


def _end_process(process: Any) -> None:
    process.join(GRACE_S)
    for end in (process.terminate, process.kill):
        if process.is_alive():
            end()
            process.join(GRACE_S)


def _unwrap(reply: Reply) -> Any:
    if reply[0] == "ok":
        return reply[1]
    _, name, kind, message, trace = reply
    if kind is not None:
        raise ERRORS[kind](message)
    err = RuntimeError(f"{name} in the rollout worker: {message}")
    err.add_note(trace)
    raise err


class ProcessBackend:
    """See the module docstring."""

    spec: SpecConfig
    features: frozenset[str]

    def __init__(self, plan: RolloutPlan, policy: nn.Module) -> None:
        self._staging = engine_copy(policy, torch_dtype(plan.dtype)).share_memory()
        self._worker = _Worker(plan, self._staging, worker_threads(plan.threads))
        self._finalizer = weakref.finalize(self, self._worker.stop)
        try:
            self.spec, features = _unwrap(self._worker.wait(self._worker.request, "start"))
            self.features = features - {GROUP_DONE}  # completions come back when a call ends
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        """The worker's process id."""
        return self._worker.process.pid

    def generate(self, requests: Sequence[Request], spec: SpecConfig | None = None) -> Rollout:
        return self._worker.call(self._worker.request, "generate", list(requests), spec)

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> float:
        t0 = time.perf_counter()
        stage = functools.partial(copy_weights, self._staging, named_tensors)  # ValueError first
        self._worker.call(self._worker.control, "update_weights", version, prepare=stage)
        return time.perf_counter() - t0

    def update_drafter(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        t0 = time.perf_counter()
        blob = _pack(state)
        self._worker.call(self._worker.control, "update_drafter", blob, version)
        return time.perf_counter() - t0

    def versions(self) -> Versions:
        return self._worker.call(self._worker.control, "versions")

    def served(self) -> Served:
        return self._worker.call(self._worker.control, "served")

    def state_dict(self) -> dict[str, Any]:
        return self._worker.call(self._worker.request, "state_dict")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._worker.call(self._worker.request, "load_state_dict", dict(state))

    def close(self) -> None:
        self._finalizer()  # runs the stop once; later calls do nothing

    def __enter__(self) -> ProcessBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_process(plan: RolloutPlan, policy: nn.Module) -> ProcessBackend:
    """The process backend of a run (see the module docstring)."""
    return ProcessBackend(plan, policy)


def _pack(state: Mapping[str, torch.Tensor]) -> bytes:
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in state.items()}, buf)
    return buf.getvalue()


def _unpack(blob: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(blob), weights_only=True)


# --------------------------------------------------------------------------- worker side


def _worker_main(
    plan: RolloutPlan, model: nn.Module, threads: int, request: Connection, control: Connection
) -> None:
    """The worker process: build the backend, serve control on a thread, requests here."""
    # Ctrl-C and SIGTERM (often sent to the whole process group) are the trainer's to handle:
    # it finishes the step and closes this worker; the worker also ends when the trainer dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # tqdm's default lock is a multiprocessing semaphore; os._exit below would leak it (the
    # resource tracker warns at exit). Progress bars in here need only a thread lock.
    tqdm.set_lock(threading.RLock())
    torch.set_num_threads(threads)
    try:
        backend = build_native(plan, model)
    except Exception as e:
        request.send(_error(e))
        return
    staging = dict(model.named_parameters())  # shared with the main process; tied once
    request.send(("ok", (backend.spec, backend.features)))
    threading.Thread(
        target=_serve, args=(control, _control_ops(backend, staging)), daemon=True
    ).start()
    _serve(request, _request_ops(backend))
    backend.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # nothing left to finalise; skips half a second of torch's interpreter teardown


def _request_ops(backend: NativeBackend) -> dict[str, Callable[..., Any]]:
    return {
        "generate": backend.generate,
        "state_dict": backend.state_dict,
        "load_state_dict": backend.load_state_dict,
        "versions": backend.versions,
    }


def _control_ops(
    backend: NativeBackend, staging: dict[str, torch.Tensor]
) -> dict[str, Callable[..., Any]]:
    return {
        "update_weights": lambda version: backend.update_weights(staging, version),
        "update_drafter": lambda blob, version: backend.update_drafter(_unpack(blob), version),
        "versions": backend.versions,
        "served": backend.served,
    }


def _serve(conn: Connection, ops: Mapping[str, Callable[..., Any]]) -> None:
    """Answer ``(op, args)`` messages until ``close`` or the main process goes away."""
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        if op == "close":
            conn.send(("ok", None))
            return
        try:
            reply: Reply = ("ok", ops[op](*args))
        except Exception as e:
            reply = _error(e)
        try:
            conn.send(reply)
        except OSError:
            return
        except Exception as e:  # the result would not pickle
            conn.send(_error(e))


def _error(e: BaseException) -> Reply:
    """The reply for ``e``: its type's name, the nearest ``ERRORS`` kind, one line, the trace."""
    names = [c.__name__ for c in type(e).__mro__]
    kind = next((n for n in names if n in ERRORS), None)
    message = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
    return ("error", type(e).__name__, kind, message, traceback.format_exc())
