"""Stopping a training run cleanly on SIGINT (Ctrl-C) or SIGTERM.

``stop_on_signals()`` (a context manager; handlers only in the main thread) yields a
``StopRequest``: the first SIGINT/SIGTERM is recorded (one notice line on stderr) and the loops
stop after checkpointing the step in progress; a second one kills the process unsaved; the
previous handlers are restored on exit. ``StopRequest.interrupting(notice)`` marks work a
signal cuts short (it raises ``Interrupted``, a ``BaseException``). ``Stopped`` (one line) is
raised by ``train.train`` / ``train.run_training`` when a signal ended a run: ``complete`` or
not, with its ``checkpoint``, ``skipped`` and ``summary``. Details: docs/internals.md.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
STDERR_FD = 2


class Interrupted(BaseException):
    """Raised by a signal inside ``StopRequest.interrupting``."""


class StopRequest:
    """Whether (and by which signal) a stop was requested."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._interrupt: str | None = None  # the notice while inside ``interrupting``

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum is not None else 0

    def handle(self, signum: int, frame: FrameType | None = None) -> None:
        """The signal handler: record the first signal (raising ``Interrupted`` inside
        ``interrupting``), abort on the second."""
        if self.signum is None:
            self.signum = signum
            if self._interrupt is not None:
                _notice(f"{self.name} received: {self._interrupt}")
                raise Interrupted(self.name)
            _notice(f"{self.name} received: stopping after the current step "
                    "(send it again to abort without saving)")  # fmt: skip
            return
        _notice(f"second signal ({signal.Signals(signum).name}): aborting without saving")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    @contextmanager
    def interrupting(self, notice: str) -> Iterator[None]:
        """See the module docstring."""
        if self.requested:
            raise Interrupted(self.name)
        self._interrupt = notice
        try:
            yield
        finally:
            self._interrupt = None


class Stopped(Exception):
    """A run ended by a signal (see the module docstring)."""

    def __init__(
        self,
        stop: StopRequest,
        updates: int,
        checkpoint: Path | None,
        run_dir: Path,
        *,
        complete: bool = False,
        skipped: str = "",
        summary: dict[str, Any] | None = None,
    ) -> None:
        self.signal_name, self.exit_code = stop.name, stop.exit_code
        self.updates, self.checkpoint, self.run_dir = updates, checkpoint, run_dir
        self.complete, self.skipped, self.summary = complete, skipped, summary
        super().__init__(self._message())

    def _message(self) -> str:
        if not self.complete:
            saved = f"checkpoint saved: {self.checkpoint}" if self.checkpoint else "no checkpoint"
            return f"stopped by {self.signal_name} after {self.updates} steps; {saved}"
        skipped = f" ({self.skipped} was skipped)" if self.skipped else ""
        summary = self.run_dir / "summary.json"
        written = f"; summary written: {summary}" if self.summary is not None else ""
        return (f"stopped by {self.signal_name} after the run completed all {self.updates} "
                f"steps{skipped}{written}")  # fmt: skip


def _notice(line: str) -> None:
    """One line straight to file descriptor 2 (no Python buffer: safe in a signal handler)."""
    with suppress(OSError):  # no stderr at all
        os.write(STDERR_FD, f"\n{line}\n".encode())


@contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """See the module docstring."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, stop.handle)
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
