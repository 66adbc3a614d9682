"""Reward calls run apart from the trainer: in worker processes, each with a timeout, contained.

Contract: ``RewardPool(workers, timeout_s)`` runs ``RewardCall``s (one reward function on one
batch of prompts and completions, TRL's convention) in ``workers`` spawned processes (pebble:
a call past ``timeout_s`` has its worker killed and replaced; a worker that dies is replaced),
or, with ``workers=0``, in the calling thread when its outcome is first asked for (no timeout).
``submit(call) -> Pending``; ``Pending.outcome()`` waits and returns an ``Outcome``: the raw
return value or a one-line ``error`` ("raised E: msg", "timed out after Ns", "killed its worker
(exit code N)"), and the call's start and end on the host's monotonic clock (shared by every
process on the host). Nothing a reward does (``SystemExit`` included) reaches the caller as an
exception: the worker sends back text, never an exception object; a pool a call broke is
replaced; a worker ends once the trainer is gone. Rewards are called by keyword
(``fn(prompts=..., completions=..., **columns)``), as TRL calls them. The pool starts its
processes on the first submit; ``close()`` stops them (idempotent). ``Named(spec)``: a
reward named as the config names it, resolved in the process that calls it (a file-loaded
function cannot be pickled by reference). Torch-free.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from specrl.errors import one_line

RewardFn = Callable[..., Sequence[float | None]]
NO_WORKERS = (
    "could not run: the reward worker processes did not start (a script that starts training "
    "must do so under `if __name__ == '__main__':`, as Python's spawn start method needs; or "
    "set reward.workers=0)"
)


@dataclass(frozen=True)
class Named:
    """A reward by its configured name ('math', 'pkg.mod:fn', 'path/f.py:fn'), resolved where it
    runs; ``bound`` keywords (the regex reward's pattern) are passed to every call."""

    spec: str
    bound: tuple[tuple[str, Any], ...] = ()

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> Any:
        from specrl.rewards.loading import resolve_reward

        fn = resolve_reward(self.spec)
        return fn(prompts=prompts, completions=completions, **columns, **dict(self.bound))


@dataclass(frozen=True)
class RewardCall:
    """One reward function on one batch (``columns``: name -> one value per completion)."""

    fn: RewardFn
    prompts: list[str]
    completions: list[str]
    columns: Mapping[str, list[Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    """What a call gave: ``value`` (as returned, unchecked) or a one-line ``error``."""

    value: Any = None
    error: str | None = None
    start: float = 0.0  # time.monotonic() when the function began (0: never ran)
    end: float = 0.0  # ... and when it returned or failed


def run_call(call: RewardCall) -> tuple[Any, str | None, float, float]:
    """The function's value (or, whatever it raised, even ``SystemExit``, a one-line error as
    plain text: no exception object crosses back from a worker) and its start and end
    (``time.monotonic``). Called by keyword, as TRL calls rewards."""
    start = time.monotonic()
    try:
        value = call.fn(prompts=call.prompts, completions=call.completions, **call.columns)
    except BaseException as e:  # the user's code: anything it raises is its outcome
        return None, f"raised {one_line(e)}", start, time.monotonic()
    if not isinstance(value, list | tuple | int | float | str | type(None)):
        value = _plain(value)
    return value, None, start, time.monotonic()


def _plain(value: Any) -> Any:
    """A numpy array or other sequence as a list (what travels back from a worker)."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else repr(value)[:200]


class Pending:
    """A submitted call's outcome, waited for on ``outcome()``."""

    def __init__(self, future: Future | None, call: RewardCall, timeout_s: float | None) -> None:
        self._future, self._call, self._timeout_s = future, call, timeout_s
        self._outcome: Outcome | None = None

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def outcome(self) -> Outcome:
        """Wait for the call (run it here when the pool has no workers)."""
        if self._outcome is None:
            self._outcome = self._run_here() if self._future is None else self._wait()
        return self._outcome

    def _run_here(self) -> Outcome:
        return Outcome(*run_call(self._call))

    def _wait(self) -> Outcome:
        from pebble import ProcessExpired

        assert self._future is not None
        try:
            return Outcome(*self._future.result())
        except (FutureTimeout, TimeoutError):  # pebble's: a reward's own is caught in run_call
            return Outcome(error=f"timed out after {self._timeout_s:g}s (worker killed)")
        except ProcessExpired as e:
            return Outcome(error=f"killed its worker (exit code {e.exitcode})")
        except BrokenProcessPool:
            return Outcome(error=NO_WORKERS)
        except Exception as e:  # the call or its value could not cross (e.g. not picklable)
            return Outcome(error=f"could not run in a worker: {one_line(e)}")


class RewardPool:
    """Worker processes for reward calls (see the module docstring)."""

    def __init__(self, workers: int, timeout_s: float) -> None:
        if workers < 0:
            raise ValueError(f"reward workers must be >= 0, got {workers}")
        self.workers, self.timeout_s = workers, timeout_s
        self._pool: Any = None  # pebble.ProcessPool, started on the first submit
        self._closed = False

    def submit(self, call: RewardCall) -> Pending:
        """Start ``call`` in a worker (queued while all are busy); with no workers it runs on
        ``outcome()``."""
        if self._closed:
            raise RuntimeError("the reward pool is closed")
        if self.workers == 0:
            return Pending(None, call, None)
        try:
            future = self._started().schedule(run_call, (call,), timeout=self.timeout_s)
        except RuntimeError:  # a pool broken by an earlier call: a new one
            self._discard()
            future = self._started().schedule(run_call, (call,), timeout=self.timeout_s)
        return Pending(future, call, self.timeout_s)

    def _started(self) -> Any:
        if self._pool is None:
            from pebble import ProcessPool

            context = multiprocessing.get_context("spawn")  # no fork of a threaded trainer
            self._pool = ProcessPool(max_workers=self.workers, context=context,
                                     initializer=die_with_parent)  # fmt: skip
        return self._pool

    def _discard(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.stop()
            pool.join(timeout=10)

    def close(self) -> None:
        """Stop the workers (a call still running is killed)."""
        self._closed = True
        self._discard()


def die_with_parent() -> None:
    """A worker's initializer: a daemon thread that ends the worker once the process that
    started it is gone (its parent pid changes), so a reward that hangs never outlives a
    killed trainer. (Not ``PR_SET_PDEATHSIG``: that follows the parent *thread*, and the pool
    may be started from a pipeline thread that ends before the run.)"""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
