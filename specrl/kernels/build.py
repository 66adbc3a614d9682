"""The native kernel library's build cache: compile ``gemv_bf16.c`` once, load only if verified.

``open_library(compiler, directory=None, source=SOURCE, flags=FLAGS)`` returns the loaded
``ctypes.CDLL`` or ``None`` with a warning; it never raises. A library is keyed by source, flags
and compiler identity, published content-addressed with a JSON record in
``$SPECRL_CACHE/kernels/``, and loaded only after ownership, mode, record and sha256 checks,
through the very descriptor that was checked. Residual risk: the checks keep other users out; a
library planted by the current user with a matching record loads.
Details (the checks, the record format): docs/internals.md.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import stat
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from specrl.fsutil import atomic_write
from specrl.paths import cache_dir

SOURCE = Path(__file__).with_name("gemv_bf16.c")
FLAGS = (
    "-O3",
    "-fopenmp",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-mamx-tile",
    "-mamx-bf16",
    "-shared",
    "-fPIC",
)
STEM = "gemv_bf16"
RECORD_FORMAT = "specrl-kernel-build"
RECORD_VERSION = 1
COMPILE_TIMEOUT_S = 120


class UnsafeCacheError(OSError):
    """A cache directory or file that another user could have written."""


@dataclass(frozen=True)
class BuildKey:
    """What a built library depends on: source, flags and compiler identity."""

    source_sha256: str
    flags: tuple[str, ...]
    compiler: str  # the path $CC (or gcc) resolves to on PATH
    compiler_realpath: str
    compiler_version: str  # its --version output

    @property
    def digest(self) -> str:
        """16 hex digits of the sha256 of every field (the cache key)."""
        fields = [self.source_sha256, list(self.flags), self.compiler, self.compiler_realpath,
                  self.compiler_version]  # fmt: skip
        return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]

    def record_name(self) -> str:
        return f"{STEM}-{self.digest}.json"

    def library_name(self, sha256: str) -> str:
        return f"{STEM}-{self.digest}-{sha256[:16]}.so"

    def record(self, sha256: str) -> dict:
        """The build record of the library whose sha256 is ``sha256``."""
        return {
            "format": RECORD_FORMAT,
            "version": RECORD_VERSION,
            "key": self.digest,
            "source_sha256": self.source_sha256,
            "flags": list(self.flags),
            "compiler": {
                "path": self.compiler,
                "realpath": self.compiler_realpath,
                "version": self.compiler_version,
            },
            "library": self.library_name(sha256),
            "sha256": sha256,
        }


def build_key(compiler: str, source: Path = SOURCE, flags: tuple[str, ...] = FLAGS) -> BuildKey:
    """The key of building ``source`` with ``flags`` by ``compiler`` (which is run: --version)."""
    done = subprocess.run(
        [compiler, "--version"],
        capture_output=True,
        timeout=60,
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return BuildKey(
        source_sha256=hashlib.sha256(Path(source).read_bytes()).hexdigest(),
        flags=tuple(flags),
        compiler=str(compiler),
        compiler_realpath=os.path.realpath(compiler),
        compiler_version=done.stdout.decode(errors="replace").strip(),
    )


def open_library(
    compiler: str,
    directory: Path | None = None,
    source: Path = SOURCE,
    flags: tuple[str, ...] = FLAGS,
) -> ctypes.CDLL | None:
    """The verified library of this key from ``directory`` (default ``cache_dir()/kernels``),
    built there first when missing or refused; ``None`` with a warning when that fails. The
    library is loaded through the descriptor its checks read (``/proc/self/fd/N``)."""
    directory = Path(directory) if directory is not None else cache_dir() / "kernels"
    try:
        if directory == cache_dir() / "kernels" and cache_dir().is_symlink():
            raise UnsafeCacheError(f"SPECRL_CACHE {cache_dir()} is a symlink; point it at a "
                                   "real directory")  # fmt: skip
        key = build_key(compiler, source, flags)
        ensure_safe_directory(directory)
        fd = verified_library(key, directory)
        if fd is None:
            built = build_library(key, directory, compiler, source)
            fd = verified_library(key, directory)
            if fd is None:
                raise UnsafeCacheError(f"the library just built, {built}, failed its checks")
        try:
            return _load_descriptor(fd)
        except OSError:
            os.close(fd)
            raise
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        unavailable(e)
        return None


def _load_descriptor(fd: int) -> ctypes.CDLL:
    """dlopen the file open at ``fd`` through ``/proc/self/fd/N``. On success ``fd`` stays open
    for the life of the process, on purpose: glibc answers a later dlopen of the same name with
    the library it already loaded, so the number must never name another file."""
    return ctypes.CDLL(f"/proc/self/fd/{fd}")


def ensure_safe_directory(directory: Path) -> None:
    """Create ``directory`` (mode 0700) if missing; ``UnsafeCacheError`` unless it is a
    directory, not a symlink, owned by the current user and not writable by group or others,
    and no parent up to ``/`` is writable by others without the sticky bit."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCacheError(f"{directory} is a symlink; point SPECRL_CACHE at a real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheError(f"{directory} is not a directory")
    _check_owner_and_mode(st, directory)
    for parent in _parents(directory):
        pst = os.stat(parent)
        if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
            raise UnsafeCacheError(
                f"{parent}, a parent of the kernel cache {directory}, is writable by others "
                f"without the sticky bit (mode {stat.S_IMODE(pst.st_mode):o}); point "
                "SPECRL_CACHE elsewhere"
            )


def _parents(directory: Path) -> list[Path]:
    """Every directory above ``directory`` up to ``/``: along its path as written (a symlinked
    parent stands for its target) and along its real path (where the targets live)."""
    lexical = Path(os.path.abspath(directory)).parents
    real = Path(os.path.realpath(directory))
    return sorted({*lexical, *real.parents}, key=lambda p: (len(p.parts), str(p)))


def verified_library(key: BuildKey, directory: Path) -> int | None:
    """An open read-only descriptor of the recorded library of ``key`` in ``directory`` if every
    check (docs/internals.md) passes (the caller closes it); ``None`` when there is none, or
    (with a warning naming the file) when one fails."""
    record_path = directory / key.record_name()
    if not os.path.lexists(record_path):
        return None
    try:
        fd = _open_safe_file(record_path)
        try:
            record = json.loads(_read_all(fd))
        finally:
            os.close(fd)
    except (OSError, ValueError) as e:
        return _refuse(record_path, str(e))
    problem = _record_mismatch(record, key)
    if problem:
        return _refuse(record_path, problem)
    lib = directory / record["library"]
    try:
        fd = _open_safe_file(lib)
    except OSError as e:
        return _refuse(lib, str(e))
    try:
        digest = hashlib.sha256(_read_all(fd)).hexdigest()
    except OSError as e:
        os.close(fd)
        return _refuse(lib, str(e))
    if digest != record["sha256"]:
        os.close(fd)
        return _refuse(lib, "its sha256 differs from the one recorded when it was built")
    return fd


def build_library(key: BuildKey, directory: Path, compiler: str, source: Path = SOURCE) -> Path:
    """Compile ``source`` and publish it and its record in ``directory`` (see
    docs/internals.md); returns the library path."""
    with tempfile.TemporaryDirectory(prefix=f".{STEM}-build-", dir=directory) as work:
        out = Path(work) / f"{STEM}.so"
        _compile(compiler, key.flags, Path(source), out)
        data = out.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    lib = directory / key.library_name(digest)
    atomic_write(lib, data, mode=0o755)
    atomic_write(directory / key.record_name(), json.dumps(key.record(digest), indent=1))
    return lib


def _compile(compiler: str, flags: tuple[str, ...], source: Path, out: Path) -> None:
    cmd = [compiler, *flags, str(source), "-o", str(out)]
    done = subprocess.run(
        cmd, capture_output=True, timeout=COMPILE_TIMEOUT_S, stdin=subprocess.DEVNULL
    )
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines() or ["no message"]
        raise subprocess.SubprocessError(
            f"{compiler} exited with status {done.returncode}: {lines[0]}"
        )


def _record_mismatch(record: object, key: BuildKey) -> str | None:
    """Why ``record`` is not the record of ``key`` (None: it is)."""
    if not isinstance(record, dict):
        return "not a JSON object"
    sha = record.get("sha256")
    if not isinstance(sha, str) or len(sha) != 64 or not all(c in "0123456789abcdef" for c in sha):
        return "no valid sha256"
    expected = key.record(sha)
    for field, want in expected.items():
        if record.get(field) != want:
            return f"its {field!r} does not match this build (source, flags, compiler)"
    if set(record) != set(expected):
        return f"unexpected fields {sorted(set(record) - set(expected))}"
    return None


def _open_safe_file(path: Path) -> int:
    """A read-only descriptor of ``path``, opened without following symlinks, after checking
    that it is a regular file owned by the current user and not group/world-writable."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCacheError(f"{path} is not a regular file")
        _check_owner_and_mode(st, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_all(fd: int) -> bytes:
    """Every byte of the file open at ``fd``, from its start (the offset is left unchanged)."""
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _check_owner_and_mode(st: os.stat_result, path: Path) -> None:
    if st.st_uid != os.getuid():
        raise UnsafeCacheError(f"{path} is owned by uid {st.st_uid}, not by you ({os.getuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheError(
            f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
            "run chmod go-w on it or point SPECRL_CACHE elsewhere"
        )


def _refuse(path: Path, why: str) -> None:
    warnings.warn(f"specrl: refusing kernel library file {path}: {why}; rebuilding", stacklevel=3)
    return None


def unavailable(e: BaseException) -> None:
    """Warn that the native kernels cannot run here, and why (callers then use PyTorch)."""
    warnings.warn(f"specrl: native GEMV kernel unavailable ({e}); using PyTorch ops", stacklevel=3)
