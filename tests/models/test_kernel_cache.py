"""The native kernel's cache (specrl.kernels.build.open_library): only a verified library loads.

These run on any Linux machine with gcc: building the library needs only the compiler, and
loading it runs no AVX512 instruction (nothing here calls the kernel). A planted library is a
shared object whose constructor writes a marker file: the marker exists iff it was dlopen'ed
(``test_the_planted_library_runs_when_loaded`` shows the marker works). ``loads`` records the
sha256 of every file ctypes opens, so a test knows exactly what was loaded, and the names it
was given (always a checked descriptor's ``/proc/self/fd/N``).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from specrl import fsutil
from specrl.kernels import build as kbuild
from specrl.kernels import gemv

GCC = shutil.which("gcc")
pytestmark = pytest.mark.skipif(GCC is None, reason="building the kernel library needs gcc")

PLANTED_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("the planted library ran", f); fclose(f); }
}
int specrl_gemv_bf16(void) { return 0; }
"""


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def planted(tmp_path) -> tuple[Path, Path]:
    """(a library that writes ``marker`` when loaded, marker); the marker does not exist yet."""
    src, lib, marker = tmp_path / "planted.c", tmp_path / "planted.so", tmp_path / "marker"
    src.write_text(PLANTED_C)
    cmd = [GCC, "-shared", "-fPIC", f'-DMARKER="{marker}"', str(src), "-o", str(lib)]
    subprocess.run(cmd, check=True, capture_output=True)
    return lib, marker


class Loads(list):
    """The sha256 of every file passed to ctypes.CDLL (taken at the call), in order; ``names``:
    the names it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def clear(self) -> None:
        super().clear()
        self.names.clear()


@pytest.fixture
def loads(monkeypatch) -> Loads:
    """Every ctypes.CDLL call (see ``Loads``)."""
    calls = Loads()
    real = ctypes.CDLL

    def recording(name, *args, **kwargs):
        calls.append(sha256(name) if name and Path(name).is_file() else str(name))
        calls.names.append(str(name))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", recording)
    return calls


def record_of(directory: Path) -> tuple[Path, dict]:
    """The one build record in ``directory`` and its contents."""
    (path,) = directory.glob(f"{kbuild.STEM}-*.json")
    return path, json.loads(path.read_text())


def genuine(directory: Path) -> str:
    """The sha256 the record gives, after checking the library file really has it."""
    _, rec = record_of(directory)
    assert sha256(directory / rec["library"]) == rec["sha256"]
    return rec["sha256"]


def build(directory: Path, compiler: str | None = GCC):
    return kbuild.open_library(compiler, directory)


def test_the_planted_library_runs_when_loaded(planted):
    """Control: the marker is how the other tests see a load."""
    lib, marker = planted
    ctypes.CDLL(str(lib))
    assert marker.read_text() == "the planted library ran"


def test_first_use_builds_records_and_loads_the_recorded_library(tmp_path, loads):
    d = tmp_path / "kernels"
    assert build(d) is not None
    record_path, rec = record_of(d)
    key = kbuild.build_key(GCC)
    assert rec["key"] == key.digest and record_path.name == f"{kbuild.STEM}-{key.digest}.json"
    assert rec["format"] == kbuild.RECORD_FORMAT and rec["flags"] == list(kbuild.FLAGS)
    assert rec["source_sha256"] == sha256(kbuild.SOURCE)
    assert rec["compiler"] == {
        "path": GCC,
        "realpath": os.path.realpath(GCC),
        "version": subprocess.run(
            [GCC, "--version"], capture_output=True, text=True
        ).stdout.strip(),
    }
    assert rec["library"] == key.library_name(rec["sha256"])
    assert loads == [genuine(d)]
    for path in (d, record_path, d / rec["library"]):  # nobody else may write any of them
        st = path.stat()
        assert st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    assert sorted(p.name for p in d.iterdir()) == sorted([record_path.name, rec["library"]])
    before = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    assert build(d) is not None  # the second use loads what is there, builds nothing
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == before
    assert loads == [rec["sha256"]] * 2


def _swap_in(lib: Path, data: bytes) -> None:
    """Put a file with ``data`` where ``lib`` is (a new file: the one already loaded by this
    process stays mapped intact; rewriting a loaded library in place crashes the process)."""
    other = lib.with_name(lib.name + ".new")
    other.write_bytes(data)
    os.replace(other, lib)


def _replace_with_planted(lib: Path, planted: Path) -> None:
    _swap_in(lib, planted.read_bytes())


def _flip_a_byte(lib: Path, planted: Path) -> None:
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0x01
    _swap_in(lib, bytes(data))


def _truncate(lib: Path, planted: Path) -> None:
    _swap_in(lib, lib.read_bytes()[:1000])


@pytest.mark.parametrize("tamper", [_replace_with_planted, _flip_a_byte, _truncate])
def test_a_changed_library_is_refused_and_rebuilt(tmp_path, planted, loads, tamper):
    d = tmp_path / "kernels"
    build(d)
    loads.clear()
    lib = d / record_of(d)[1]["library"]
    tamper(lib, planted[0])
    with pytest.warns(UserWarning, match=f"refusing kernel library file {re.escape(str(lib))}"):
        assert build(d) is not None
    assert not planted[1].exists()
    assert loads == [genuine(d)]  # only the rebuilt library, as recorded


def test_libraries_planted_without_a_record_are_never_loaded(tmp_path, planted, loads):
    """Under the name the cache used before records (a hash of source and flags), and under a
    name of the current scheme: without a matching record neither is opened."""
    d = tmp_path / "kernels"
    d.mkdir(mode=0o700)
    old = hashlib.sha256(kbuild.SOURCE.read_bytes() + " ".join(kbuild.FLAGS).encode()).hexdigest()
    key = kbuild.build_key(GCC)
    for name in (f"gemv_bf16-{old[:16]}.so", key.library_name(sha256(planted[0]))):
        shutil.copyfile(planted[0], d / name)
    assert build(d) is not None
    assert not planted[1].exists()
    assert loads == [genuine(d)]


def _edit(change):
    def edit(path: Path, planted: Path) -> None:
        rec = json.loads(path.read_text())
        change(rec, planted)
        path.write_text(json.dumps(rec))

    return edit


def _symlink(path: Path, planted: Path) -> None:
    """The record replaced by a symlink to an identical copy."""
    shutil.copyfile(path, path.with_name("elsewhere.json"))
    path.unlink()
    path.symlink_to(path.with_name("elsewhere.json"))


RECORD_CHANGES = {
    "flags": _edit(lambda r, _: r["flags"].append("-O0")),
    "compiler version": _edit(lambda r, _: r["compiler"].update(version="gcc 1.0")),
    "source": _edit(lambda r, _: r.update(source_sha256="0" * 64)),
    "key": _edit(lambda r, _: r.update(key="0" * 16)),
    "digest": _edit(lambda r, _: r.update(sha256="0" * 64)),
    "library outside the cache": _edit(
        lambda r, planted: r.update(library=f"../{planted.name}", sha256=sha256(planted))
    ),
    "extra field": _edit(lambda r, _: r.update(note="x")),
    "not JSON": lambda path, _: path.write_text("{"),
    "a JSON list": lambda path, _: path.write_text("[]"),
    "a symlink": _symlink,
}


@pytest.mark.parametrize("change", list(RECORD_CHANGES), ids=list(RECORD_CHANGES))
def test_a_changed_record_is_refused_and_rebuilt(tmp_path, planted, loads, change):
    d = tmp_path / "kernels"
    build(d)
    loads.clear()
    RECORD_CHANGES[change](record_of(d)[0], planted[0])  # planted: beside the cache, ../
    with pytest.warns(UserWarning, match=f"refusing kernel library file .*{kbuild.STEM}"):
        assert build(d) is not None
    assert not planted[1].exists()
    assert loads == [genuine(d)]


def _plant_with_record(d: Path, planted: Path) -> tuple[Path, Path]:
    """A planted library with a record that matches it (what a digest alone cannot catch)."""
    key = kbuild.build_key(GCC)
    digest = sha256(planted)
    lib = d / key.library_name(digest)
    shutil.copyfile(planted, lib)
    lib.chmod(0o755)
    record = d / key.record_name()
    record.write_text(json.dumps(key.record(digest)))
    record.chmod(0o644)
    return lib, record


OTHER_UID = 4242


@pytest.mark.parametrize(
    ("target", "how"),
    [
        ("library", "group-writable"),
        ("library", "world-writable"),
        ("library", "someone else's"),
        ("record", "group-writable"),
        ("record", "someone else's"),
    ],
)
def test_files_others_could_write_are_refused_even_with_a_matching_record(
    tmp_path, planted, loads, target, how
):
    d = tmp_path / "kernels"
    build(d)
    loads.clear()
    lib, record = _plant_with_record(d, planted[0])
    path = lib if target == "library" else record
    if how == "someone else's":
        if os.getuid() != 0:
            pytest.skip("only root can give a file to another user")
        os.chown(path, OTHER_UID, -1)
    else:
        path.chmod(
            path.stat().st_mode | (stat.S_IWGRP if how == "group-writable" else stat.S_IWOTH)
        )
    with pytest.warns(UserWarning, match=f"refusing kernel library file {re.escape(str(path))}"):
        assert build(d) is not None
    assert not planted[1].exists()
    assert loads == [genuine(d)]


def test_a_planted_library_with_a_matching_record_is_the_documented_residual_risk(
    tmp_path, planted, loads
):
    """Control for the test above: owned by the user and not writable by others, a planted
    library with a matching record does load (the module docstring says so); it is the
    ownership and mode checks that refuse it there."""
    d = tmp_path / "kernels"
    build(d)
    _plant_with_record(d, planted[0])
    assert build(d) is not None
    assert planted[1].exists()


@pytest.mark.parametrize("how", ["world-writable", "someone else's"])
def test_an_unsafe_cache_directory_loads_nothing(tmp_path, planted, loads, how):
    d = tmp_path / "kernels"
    build(d)
    loads.clear()
    if how == "someone else's":
        if os.getuid() != 0:
            pytest.skip("only root can give a directory to another user")
        os.chown(d, OTHER_UID, -1)
        why = "is owned by uid"
    else:
        d.chmod(0o777)
        why = "is writable by group or others"
    with pytest.warns(UserWarning, match=f"native GEMV kernel unavailable .*{why}"):
        assert build(d) is None
    assert loads == []


def test_the_library_is_loaded_through_its_checked_descriptor(
    tmp_path, planted, loads, monkeypatch
):
    """ctypes gets ``/proc/self/fd/N``, never a path: a library swapped for another after its
    checks (between the check and the load) is not what loads."""
    d = tmp_path / "kernels"
    build(d)
    assert len(loads.names) == 1 and re.fullmatch(r"/proc/self/fd/\d+", loads.names[0])
    loads.clear()
    genuine_sha = genuine(d)
    lib = d / record_of(d)[1]["library"]
    real_load = kbuild._load_descriptor

    def swap_then_load(fd):
        shutil.copyfile(planted[0], lib.with_name("swap"))
        os.replace(lib.with_name("swap"), lib)  # the checked file, swapped for the planted one
        return real_load(fd)

    monkeypatch.setattr(kbuild, "_load_descriptor", swap_then_load)
    assert build(d) is not None
    assert not planted[1].exists()
    assert loads == [genuine_sha] and re.fullmatch(r"/proc/self/fd/\d+", loads.names[0])


def test_a_loaded_descriptor_number_is_never_reused(tmp_path, planted):
    """glibc returns the library it loaded under a name for the same name again: the number a
    library was loaded through stays open, so a second library gets another name and loads."""
    d = tmp_path / "kernels"
    build(d)
    first = os.open(d / record_of(d)[1]["library"], os.O_RDONLY)
    kbuild._load_descriptor(first)
    assert os.fstat(first)  # still open: its number cannot be handed to another file
    second = os.open(planted[0], os.O_RDONLY)
    try:
        assert second != first
        kbuild._load_descriptor(second)
    finally:
        os.close(second)
    assert planted[1].exists()  # the second library itself was loaded (its constructor ran)


def test_a_symlinked_cache_directory_loads_nothing(tmp_path, loads):
    real = tmp_path / "real"
    build(real)
    loads.clear()
    d = tmp_path / "kernels"
    d.symlink_to(real, target_is_directory=True)
    with pytest.warns(UserWarning, match="native GEMV kernel unavailable .*is a symlink"):
        assert build(d) is None
    assert loads == []


def test_a_symlinked_specrl_cache_loads_nothing(tmp_path, loads, monkeypatch):
    """Issue 42: SPECRL_CACHE itself a symlink (its kernels/ a real directory) was accepted."""
    real = tmp_path / "real"
    build(real / "kernels")
    loads.clear()
    (tmp_path / "cache").symlink_to(real, target_is_directory=True)
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="unavailable .*SPECRL_CACHE .*cache is a symlink"):
        assert kbuild.open_library(GCC) is None
    assert loads == []


@pytest.mark.parametrize("mode", [0o777, 0o1777], ids=["no sticky bit", "sticky bit"])
def test_a_parent_others_can_write_needs_the_sticky_bit(tmp_path, loads, mode):
    """Whoever can write a parent could rename the cache away and put their own in its place,
    unless the sticky bit keeps them to their own entries (as in /tmp)."""
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(mode)
    d = parent / "kernels"
    if mode & stat.S_ISVTX:
        assert build(d) is not None
        assert loads == [genuine(d)]
        return
    with pytest.warns(UserWarning, match="writable by others without the sticky bit"):
        assert build(d) is None
    assert loads == [] and not list(d.iterdir())


def _wrapper(path: Path, version: str | None = None) -> str:
    """A compiler script that runs gcc (optionally claiming another --version)."""
    claim = f'if [ "$1" = --version ]; then echo "{version}"; exit 0; fi\n' if version else ""
    path.write_text(f'#!/bin/sh\n{claim}exec {GCC} "$@"\n')
    path.chmod(0o755)
    return str(path)


def test_another_compiler_builds_its_own_library(tmp_path, loads):
    """The key covers the compiler: a different path or --version output builds anew and
    leaves the first build as it was."""
    d = tmp_path / "kernels"
    build(d)
    first = {p.name: p.read_bytes() for p in d.iterdir()}
    compilers = [GCC, _wrapper(tmp_path / "cc"), _wrapper(tmp_path / "cc2", "cc 99.0")]
    for cc in compilers[1:]:
        assert build(d, cc) is not None
    records = [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))]
    assert len({r["key"] for r in records}) == 3
    assert {r["compiler"]["path"] for r in records} == set(compilers)
    assert all(d.joinpath(name).read_bytes() == data for name, data in first.items())
    keys = [kbuild.build_key(cc).digest for cc in compilers]
    assert len(set(keys)) == 3 and {r["key"] for r in records} == set(keys)
    assert len(loads) == 3 and all(sha in {r["sha256"] for r in records} for sha in loads)


def test_gemv_kernel_keys_on_CC(monkeypatch, tmp_path, loads):
    """Through ``gemv_kernel`` (the CPU check faked: loading runs no AVX512 code; the kernel is
    never called): ``$CC`` names the compiler recorded in the key."""
    monkeypatch.setattr(gemv, "cpu_supported", lambda: True)
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", _wrapper(tmp_path / "mycc"))
    gemv.gemv_kernel.cache_clear()
    try:
        assert isinstance(gemv.gemv_kernel(), gemv.GemvKernel)
    finally:
        gemv.gemv_kernel.cache_clear()  # never leave a kernel this CPU cannot run cached
    _, rec = record_of(tmp_path / "cache" / "kernels")
    assert rec["compiler"]["path"] == str(tmp_path / "mycc")
    assert loads == [rec["sha256"]]


def _cache_is_a_file(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "file"))
    return GCC, tmp_path / "file" / "kernels", "Not a directory"


def _disk_full(tmp_path, monkeypatch):
    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(fsutil, "fsync_path", full)
    return GCC, tmp_path / "kernels", "No space left on device"


def _compiler_fails(tmp_path, monkeypatch):
    cc = tmp_path / "cc"
    cc.write_text(
        '#!/bin/sh\nif [ "$1" = --version ]; then echo cc 1; exit 0; fi\n'
        'echo "cc: fatal error: cannot write output: No space left on device" >&2\nexit 1\n'
    )
    cc.chmod(0o755)
    return str(cc), tmp_path / "kernels", "cannot write output"


@pytest.mark.parametrize("setup", [_cache_is_a_file, _disk_full, _compiler_fails])
def test_an_unusable_cache_warns_and_falls_back(tmp_path, monkeypatch, loads, setup):
    """No traceback: a warning, ``None`` (PyTorch ops), nothing loaded, no temporary left; the
    same through ``gemv_kernel`` (CPU check faked) with ``SPECRL_CACHE`` and ``$CC``."""
    compiler, d, why = setup(tmp_path, monkeypatch)
    with pytest.warns(UserWarning, match=f"native GEMV kernel unavailable .*{why}"):
        assert kbuild.open_library(compiler, d) is None
    assert loads == []
    assert not d.is_dir() or not list(d.iterdir())  # no library, record or temporary
    monkeypatch.setattr(gemv, "cpu_supported", lambda: True)
    monkeypatch.setenv("SPECRL_CACHE", str(d.parent))
    monkeypatch.setenv("CC", compiler)
    gemv.gemv_kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match=f"native GEMV kernel unavailable .*{why}"):
            assert gemv.gemv_kernel() is None
    finally:
        gemv.gemv_kernel.cache_clear()
    assert loads == []
