"""Helpers for the Ray tests: the Ray processes under a process, and what they listen on."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from specrl.backends.ray_session import RaySession

LOOPBACK_HOSTS = {"127.0.0.1", "[::ffff:127.0.0.1]", "[::1]", "::1"}


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process now (Linux /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def _cmdline(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")).decode()
    except OSError:
        return ""


def ray_processes(root: int | None = None) -> set[int]:
    """Live descendants of ``root`` (default: this process) whose command line names Ray
    (gcs_server, raylet, ``ray::`` workers, Ray's Python helpers)."""
    root = os.getpid() if root is None else root
    parents = _parents()
    found, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return {p for p in found if "ray" in _cmdline(p).lower() and alive(p)}


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: set[int], seconds: float = 60.0) -> set[int]:
    """The pids still alive after waiting up to ``seconds`` for them to end."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = {p for p in pids if alive(p)}
        if not left:
            return left
        time.sleep(0.1)
    return {p for p in pids if alive(p)}


def listeners(pids: set[int]) -> list[tuple[str, int]]:
    """(local address, pid) of every TCP/UDP socket these processes listen on (``ss``)."""
    ss = shutil.which("ss")
    if ss is None:
        raise FileNotFoundError("ss")
    text = subprocess.run([ss, "-ltunp"], capture_output=True, text=True, check=True).stdout
    out = []
    for line in text.splitlines()[1:]:  # after the header
        fields = line.split()
        if len(fields) < 7 or "pid=" not in line:
            continue
        local = fields[4]
        for part in line.split("pid=")[1:]:
            pid = int(part.split(",")[0])
            if pid in pids:
                out.append((local, pid))
    return out


def host(address: str) -> str:
    """The host part of an ``ss`` local address (``host:port``)."""
    return address.rsplit(":", 1)[0].split("%")[0]


def local_ray() -> Iterator[RaySession]:
    """A module fixture's body: a local Ray started here, and at its end nothing of it left
    running (``pytest.fixture(scope="module")`` over ``yield from local_ray()``)."""
    session = RaySession.open(None)
    assert session.started_here
    yield session
    pids = ray_processes()
    assert pids, "the local Ray's processes were not found (the check below would be void)"
    session.close()
    assert not wait_gone(pids), "Ray processes survived the session's close"
