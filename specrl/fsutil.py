"""Files written so that nothing is ever half-written, and paths checked before any work.

A leaf (imports nothing from specrl). ``atomic_write(path, data)`` and ``atomic_writer(path)``
(a context manager yielding the temporary path) replace ``path`` through a temporary file,
fsync, rename and directory fsync: ``path`` holds its old content or the new, never a part.
``fsync_path`` flushes a file or directory; ``writable_problem(path, kind)`` is ``None`` or one
line saying why ``path`` cannot be written as a file or dir (it creates nothing).
Details: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's or a directory's data and metadata to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: int = 0o644) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on a clean exit it is fsynced and renamed over
    ``path`` (then the directory is fsynced), on an exception it is removed."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, mode)
        fsync_path(tmp)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def atomic_write(path: str | os.PathLike, data: str | bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically (see docs/internals.md)."""
    raw = data.encode() if isinstance(data, str) else data
    with atomic_writer(path, mode) as tmp:
        tmp.write_bytes(raw)


def writable_problem(path: str | os.PathLike, kind: Literal["file", "dir"]) -> str | None:
    """Why ``path`` cannot be written as a ``kind`` (one line), or ``None`` if it can."""
    path = Path(path)
    if path.exists():
        if kind == "file" and path.is_dir():
            return f"{path} is a directory"
        if kind == "dir" and not path.is_dir():
            return f"{path} is not a directory"
    probe = path if kind == "dir" and path.is_dir() else path.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{path} cannot be created: {probe} is a file"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{path}: no permission to write in {probe}"
    if kind == "file" and path.exists() and not os.access(path, os.W_OK):
        return f"{path}: no permission to write it"
    return None
