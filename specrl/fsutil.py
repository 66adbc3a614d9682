"""Files written so that nothing is ever half-written, and paths checked before any work.

A leaf (imports nothing from specrl). ``atomic_write(path, data)`` and ``atomic_writer(path)``
(a context manager yielding the temporary path) replace ``path`` through a temporary file,
fsync, rename and directory fsync: ``path`` holds its old content or the new, never a part.
``fsync_path`` flushes a file or directory; ``writable_problem(path, kind)`` is ``None`` or one
line saying why ``path`` cannot be written as a file or dir (it creates nothing).
``write_manifest(folder, names)`` records the size and sha256 of files in ``folder`` in
``manifest.json`` (written last); ``manifest_problem(folder)`` is ``None`` or one line naming
the first file that does not match it. ``replace_dir(tmp, dest)`` renames a finished directory
into place (an old ``dest`` is moved aside first and removed after).
Out of space or permission: ``disk_problem(e)`` is one line for an OSError that says so
(``ENOSPC``, ``EDQUOT``, ``EACCES``, ``EPERM``, ``EROFS``) naming its path, else ``None``;
``naming(path)`` gives such errors a path (a safetensors error carrying ``os error N`` becomes
that OSError); ``room_problem(path, needed)`` is ``None`` or one line when the file system of
``path`` has less than ``needed`` bytes free; ``tree_bytes`` sizes a file or directory.
Details: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

MANIFEST = "manifest.json"
OLD_SUFFIX = ".old"  # a directory ``replace_dir`` is replacing
TMP_SUFFIX = ".tmp"  # a directory being written, renamed into place when complete
_CHUNK = 1 << 20
# OS errors a user fixes outside specrl (space, quota, permission, a read-only mount): one line.
DISK_ERRORS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
}
_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")  # how Rust (safetensors) reports errno


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
    with naming(path), atomic_writer(path, mode) as tmp:  # a full disk names ``path``
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


def file_digest(path: str | os.PathLike) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of a file."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def write_manifest(folder: str | os.PathLike, names: list[str]) -> None:
    """fsync each file ``names`` in ``folder``, then write and fsync ``manifest.json``
    (``{"format": 1, "files": {name: file_digest}}``): a folder with a manifest is complete."""
    folder = Path(folder)
    files = {}
    for name in names:
        fsync_path(folder / name)
        files[name] = file_digest(folder / name)
    with (folder / MANIFEST).open("w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(folder: str | os.PathLike) -> dict[str, tuple[int, str]] | str:
    """The files ``folder/manifest.json`` lists, ``{name: (bytes, sha256)}``, or one line saying
    why it cannot be used (missing, unreadable, naming a path outside ``folder``)."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return f"{MANIFEST}: missing"
    try:
        files = json.loads((folder / MANIFEST).read_bytes())["files"]
        listed = {name: (int(d["bytes"]), str(d["sha256"])) for name, d in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST}: unreadable"
    if any(Path(name).name != name or name.startswith(".") for name in listed):
        return f"{MANIFEST}: lists a path outside {folder.name}"
    return listed


def listed_problem(folder: str | os.PathLike, listed: dict[str, tuple[int, str]]) -> str | None:
    """``None`` when every listed file in ``folder`` has its size and sha256, else one line naming
    the first that does not (``x: sha256 mismatch``)."""
    for name, (size, sha) in listed.items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{name}: missing"
        found = path.stat().st_size
        if found != size:
            return f"{name}: {found} bytes, the manifest says {size}"
        if file_digest(path)["sha256"] != sha:
            return f"{name}: sha256 mismatch"
    return None


def manifest_problem(folder: str | os.PathLike, exact: bool = False) -> str | None:
    """``None`` when ``folder/manifest.json`` is readable and every file it lists has its size
    and sha256, else one line naming the file and what is wrong (``x: sha256 mismatch``);
    ``exact``: a file the manifest does not list is a problem too."""
    listed = read_manifest(folder)
    if isinstance(listed, str):
        return listed
    problem = listed_problem(folder, listed)
    if problem is not None or not exact:
        return problem
    extra = sorted(p.name for p in Path(folder).iterdir() if p.name not in {*listed, MANIFEST})
    return f"{extra[0]}: not in the manifest" if extra else None


def replace_dir(tmp: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Rename the finished directory ``tmp`` to ``dest`` and fsync their parent; a ``dest``
    already there is renamed to ``<dest>.old`` first and removed after."""
    tmp, dest = Path(tmp), Path(dest)
    old = dest.with_name(dest.name + OLD_SUFFIX)
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    fsync_path(dest.parent)
    shutil.rmtree(old, ignore_errors=True)


def disk_problem(e: BaseException) -> str | None:
    """One line for an OSError of ``DISK_ERRORS`` (``"no space left on device: PATH"``), else
    ``None``."""
    what = DISK_ERRORS.get(getattr(e, "errno", None)) if isinstance(e, OSError) else None
    if what is None:
        return None
    where = f": {e.filename}" if e.filename else ""
    return f"{what}{where}" + (f" (and {e.filename2})" if e.filename2 else "")


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Errors of the block that carry an OS error code name ``path``: an OSError without a file
    name gets it, a library's error whose message says ``(os error N)`` (safetensors) becomes
    ``OSError(N, ..., path)``."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e
    except Exception as e:
        found = _OS_ERROR_CODE.search(str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from e


def tree_bytes(path: str | os.PathLike) -> int:
    """Bytes in a file, or in the files under a directory (0 for a path that is not there)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes (for this user) on the file system that holds ``path`` or would hold it."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def room_problem(path: str | os.PathLike, needed: int) -> str | None:
    """``None`` when ``path``'s file system has ``needed`` bytes free, else one line saying how
    much is needed and free."""
    free = free_bytes(path)
    if free >= needed:
        return None
    return f"not enough space for {path}: needs ~{_size(needed)}, {_size(free)} free"


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def result_file_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be written as a results file (one line), or ``None`` if it can.
    ``writable_problem`` first; then a temporary file is made and removed at
    once in the nearest existing directory, which catches what permission bits do not show (a
    read-only or special file system such as /proc, where even root cannot create a file).
    Nothing is left behind: no file, no directory."""
    problem = writable_problem(path, "file")
    if problem:
        return problem
    probe = Path(path).absolute().parent
    while not probe.exists():
        probe = probe.parent
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        return f"{path}: cannot create a file in {probe} ({e.strerror or e})"
    return None
