"""A run directory: its files, its JSONL logs, and the list of its checkpoints.

``RunDir(path)`` names config.toml, metrics.jsonl, eval.jsonl, changes.jsonl (the settings a
resume changed and the step from which they apply), summary.json, tensorboard/,
checkpoints/ and dataset/ (a ``datasets.Dataset`` handed to ``specrl.train``, saved before the
run starts: a directory holding only it is not yet used) and ``.lock``: ``locked`` holds the
one writer's lock for a run's life (a second writer is refused naming the holder's pid; the OS
drops the lock of a killed writer; a run directory it created is removed again when an OSError
(a full disk, a denied write) ends the run before any work is recorded: ``holds_work``; other
failures keep it, for a resume); ``append`` fsyncs a log row, ``rows``
reads a log (a last line cut by a kill is dropped), ``truncate`` drops the rows a resume writes
again. ``.tmp``/``.old``/``.del`` directories are never checkpoints: ``recover_interrupted``
finishes a replace cut between its renames, ``clear_interrupted`` removes leftovers, ``prune``
keeps the newest ``run.keep_checkpoints``. Details: docs/internals.md.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from specrl.fsutil import OLD_SUFFIX, atomic_write, fsync_path
from specrl.pipelines.manifest import (
    CKPT_PREFIX,
    DEL_SUFFIX,
    TMP_SUFFIX,
    RunDirError,
    checkpoint_step,
    recoverable,
)


class RunDir:
    """Paths and JSONL logs of one run directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config = self.path / "config.toml"
        self.metrics = self.path / "metrics.jsonl"
        self.evals = self.path / "eval.jsonl"
        self.summary = self.path / "summary.json"
        self.tensorboard = self.path / "tensorboard"  # event files (``run.tensorboard``)
        self.checkpoints = self.path / "checkpoints"
        self.dataset = self.path / "dataset"  # a dataset given to ``specrl.train``, saved first
        self.lock_file = self.path / ".lock"  # the writer's lock (``locked``), its pid inside
        self.changes = self.path / "changes.jsonl"  # settings a resume changed, from which step

    def create(self) -> RunDir:
        self.path.mkdir(parents=True, exist_ok=True)
        return self

    def is_used(self) -> bool:
        """Whether the path holds anything but ``dataset/`` and the lock file (a file in its
        place counts)."""
        if not self.path.exists():
            return False
        skip = (self.dataset, self.lock_file)
        return not self.path.is_dir() or any(p not in skip for p in self.path.iterdir())

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the run's writer lock for the block (the directory is created): an exclusive
        ``flock`` on ``.lock``, which the OS releases when the holder dies, so a killed run never
        blocks its resume. Another holder: ``RunDirError`` naming its pid."""
        fresh = not self.path.exists()
        self.create()
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                raise RunDirError(
                    f"run dir {self.path} is in use by another specrl process (pid {holder}): "
                    "one writer at a time; wait for it or stop it, then resume"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            yield
        except OSError:  # a full disk, a denied write: a failed start leaves no run dir
            if fresh and not self.holds_work():
                shutil.rmtree(self.path, ignore_errors=True)
            raise
        finally:
            os.close(fd)  # releases the lock

    def holds_work(self) -> bool:
        """Whether a run's work is here: a step's row, a checkpoint (even a part of one) or a
        saved dataset."""
        rows = self.metrics.is_file() and self.metrics.stat().st_size > 0
        saves = self.checkpoints.is_dir() and any(self.checkpoints.iterdir())
        return rows or saves or self.dataset.exists()

    def check_unlocked(self) -> None:
        """``RunDirError`` (naming the holder) if another process holds the writer lock now
        (nothing is written: no lock file, no holder)."""
        if self.lock_file.is_file():
            with self.locked():
                pass

    def append(self, log: Path, row: Mapping[str, Any]) -> None:
        with log.open("a") as f:
            f.write(json.dumps(dict(row)) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def rows(self, log: Path) -> list[dict[str, Any]]:
        """The log's rows (JSON objects with an integer ``step``); a last line cut mid-write
        (a killed run) is dropped, any other unreadable line is a ``RunDirError`` naming it."""
        if not log.exists():
            return []
        try:
            lines = log.read_bytes().split(b"\n")
        except OSError as e:
            raise RunDirError(f"cannot read {log}: {e.strerror or e}") from None
        numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
        out = []
        for k, (number, line) in enumerate(numbered):
            row = _parse_row(line)
            if row is None:
                if k < len(numbered) - 1:
                    raise RunDirError(f"{log}: line {number} is not a JSON row with a 'step'")
                continue
            out.append(row)
        return out

    def truncate(self, step: int) -> None:
        """Drop metric rows of steps >= ``step`` and eval rows at >= ``step`` updates."""
        for log in (self.metrics, self.evals):
            kept = [r for r in self.rows(log) if r["step"] < step]
            if kept or log.exists():
                atomic_write(log, "".join(json.dumps(r) + "\n" for r in kept))

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"{CKPT_PREFIX}{step:06d}"

    def checkpoints_newest_first(self) -> list[Path]:
        """The checkpoint directories, most updates first (an interrupted save's ``.tmp`` or
        ``.old`` directory is never one; whether each verifies is ``read_checkpoint``'s job)."""
        if not self.checkpoints.is_dir():
            return []
        found = [(checkpoint_step(p), p) for p in self.checkpoints.iterdir()]
        return [p for step, p in sorted((s, p) for s, p in found if s is not None)][::-1]

    def latest_checkpoint(self) -> Path | None:
        """The checkpoint directory with the most updates (see ``checkpoints_newest_first``)."""
        found = self.checkpoints_newest_first()
        return found[0] if found else None

    def leftovers(self) -> list[Path]:
        """What interrupted saves and removals left behind (``step_N.tmp``, ``step_N.old``,
        ``step_N.del``): by step, a ``.tmp`` before the ``.old`` of the same step."""
        if not self.checkpoints.is_dir():
            return []
        ends = (TMP_SUFFIX, OLD_SUFFIX, DEL_SUFFIX)
        found = [
            p
            for p in self.checkpoints.iterdir()
            if p.name.startswith(CKPT_PREFIX) and p.name.endswith(ends)
        ]
        return sorted(found, key=lambda p: (p.stem, p.suffix != TMP_SUFFIX))

    def recover_interrupted(self) -> list[Path]:
        """Finish interrupted replaces: for each ``step_N`` that is missing, its ``step_N.tmp``
        (a new save, manifest written last) if it ``is_complete``, else its ``step_N.old``
        (the checkpoint being replaced) if that verifies, is renamed to ``step_N``. Returns the
        checkpoints so recovered; the rest is left for ``clear_interrupted``."""
        recovered = []
        for leftover in self.leftovers():
            if leftover.suffix == DEL_SUFFIX:  # retention was removing it: never brought back
                continue
            ckpt = leftover.with_suffix("")
            if not ckpt.exists() and leftover.exists() and recoverable(leftover):
                leftover.rename(ckpt)
                fsync_path(ckpt.parent)
                recovered.append(ckpt)
        return recovered

    def prune(self, latest: Path, keep: int) -> list[Path]:
        """Checkpoint retention: keep ``latest`` (the one just written) and the newest
        ``keep - 1`` checkpoints of fewer updates; remove the older ones, each renamed to
        ``step_N.del`` first (a removal cut short is never taken for a checkpoint, and
        ``clear_interrupted`` finishes it). Checkpoints of more updates than ``latest`` (left
        by a run resumed from before them) are not touched: the run replaces them when it gets
        there. Returns the removed checkpoints."""
        step = checkpoint_step(latest)
        if step is None:
            return []
        older = [p for p in self.checkpoints_newest_first() if checkpoint_step(p) < step]
        removed = older[max(keep - 1, 0) :]
        for ckpt in removed:
            doomed = ckpt.with_name(ckpt.name + DEL_SUFFIX)
            ckpt.rename(doomed)
            fsync_path(ckpt.parent)
            shutil.rmtree(doomed, ignore_errors=True)
        return removed

    def clear_interrupted(self) -> None:
        """Remove what interrupted saves and removals left behind (``step_N.tmp``, ``.old``,
        ``.del``) and the temporaries of an interrupted ``fsutil.atomic_write`` of the run's own
        files (``.metrics.jsonl.<random>.tmp``)."""
        for p in self.leftovers():
            shutil.rmtree(p, ignore_errors=True)
        for own in (self.config, self.metrics, self.evals, self.summary, self.changes):
            for tmp in self.path.glob(f".{own.name}.*.tmp"):
                tmp.unlink(missing_ok=True)


def _parse_row(line: bytes) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    ok = isinstance(row, dict) and isinstance(row.get("step"), int)
    return row if ok else None
