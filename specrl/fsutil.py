"""Files written so that nothing is ever half-written, and paths checked before any work.

Contract (a leaf: imports nothing from specrl; the simulator may use it too):
- ``atomic_write(path, data)`` replaces ``path`` with ``data`` (``str`` as UTF-8, or ``bytes``):
  written to a uniquely named temporary file in the same directory, flushed and fsynced, renamed
  over ``path``, then the directory is fsynced. On any failure the temporary file is removed and
  the ``OSError`` raised; ``path`` is then either its old content or absent, never partial.
- ``atomic_writer(path)`` is the same as a context manager yielding the temporary path, for
  writers that take a file name (safetensors' ``save_file``); ``mode`` sets the file's mode.
- ``fsync_path(path)`` flushes a file's or a directory's data and metadata to disk.
- ``writable_problem(path, kind)`` is ``None`` when ``path`` can be written as a ``"file"`` or
  created/used as a ``"dir"``, else one line saying why (a parent is a file, the path is a
  directory/file of the wrong kind, no permission). It creates nothing.
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
    """Replace ``path`` with ``data`` atomically (see the module docstring)."""
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
