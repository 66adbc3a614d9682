"""This process's connection to Ray (the ``ray`` extra), for the Ray backend and the Ray run.

``import_ray()`` is the module or a one-line ``ConfigError``. ``RaySession.open(address)`` keeps
an existing connection, joins ``cluster.address`` (never shut down; a head on 127.0.0.1, nodes
of this machine, over loopback) or starts a local Ray bound
to 127.0.0.1 in a fresh temporary directory, which ``close`` (idempotent, also at exit) shuts
down and removes. ``actor_threads`` is one actor's torch threads; ``check_fits`` raises
``ConfigError`` when the cluster cannot place the workers; ``task_error`` / ``death_line``
turn an actor's failure into one line.
Details: docs/internals.md.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

from specrl.config import ConfigError

LOOPBACK = "127.0.0.1"


def import_ray(need: str = "cluster.rollout_workers > 0") -> ModuleType:
    """The ``ray`` module (``ConfigError`` naming ``need``, the setting, and the extra when it
    is missing)."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            f"{need} needs Ray, which is not installed: pip install -e '.[ray]'"
        ) from None
    return ray


def actor_threads(threads: int, rollout_workers: int) -> int:
    """Torch threads of a Ray actor (see the module docstring)."""
    return threads if threads > 0 else max(1, (os.cpu_count() or 1) // (rollout_workers + 1))


def check_fits(ray: ModuleType, workers: int, cpus: float, gpus: float) -> None:
    """``ConfigError`` unless the cluster has ``workers * cpus`` CPUs and ``workers * gpus``
    GPUs in all (an actor that cannot be placed would wait forever)."""
    total = ray.cluster_resources()
    for key, each, name in (("CPU", cpus, "worker_cpus"), ("GPU", gpus, "worker_gpus")):
        have = float(total.get(key, 0.0))
        if workers * each > have:
            raise ConfigError(
                f"bad value for cluster.{name}: {workers} rollout workers x {each:g} {key} "
                f"need {workers * each:g}, the Ray cluster has {have:g}"
            )


def task_error(e: Exception, who: str) -> Exception:
    """An actor's own exception from Ray's ``RayTaskError`` ``e``: itself for ``ValueError`` /
    ``RuntimeError`` (one line, as in one process), else a ``RuntimeError`` naming its type
    and ``who`` raised it."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, ValueError | RuntimeError):
        return cause
    name = type(cause).__name__ if cause is not None else type(e).__name__
    text = str(cause if cause is not None else e).strip()
    line = text.splitlines()[0] if text else name
    return RuntimeError(f"{name} in {who}: {line}")


def death_line(e: Exception) -> str:
    """The first line of Ray's ``RayActorError`` ``e`` (why an actor's process is gone)."""
    text = str(e).strip()
    return text.splitlines()[0].rstrip(".") if text else type(e).__name__


@dataclass
class _Owned:
    """What a session started and must undo (no reference to the session: a finalizer)."""

    ray: ModuleType
    connected: bool = False  # this session called ray.init
    temp_dir: str | None = None  # the local Ray's directory, removed at close

    def release(self) -> None:
        if self.connected and self.ray.is_initialized():
            self.ray.shutdown()
        self.connected = False
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


class RaySession:
    """See the module docstring."""

    def __init__(self, owned: _Owned) -> None:
        self._owned = owned
        self._finalizer = weakref.finalize(self, owned.release)

    @classmethod
    def open(cls, address: str | None, need: str = "cluster.rollout_workers > 0") -> RaySession:
        ray = import_ray(need)
        owned = _Owned(ray)
        if ray.is_initialized():
            return cls(owned)
        if address:
            _join(ray, address)
            owned.connected = True
            return cls(owned)
        session = cls(owned)  # from here on, close() undoes what was started
        owned.temp_dir = tempfile.mkdtemp(prefix="specrl-ray-")
        owned.connected = True
        try:
            _start_local(ray, owned.temp_dir)
        except BaseException:
            session.close()
            raise
        return session

    @property
    def started_here(self) -> bool:
        """Whether this session started (or joined) Ray and will shut it down (disconnect)."""
        return self._owned.connected

    def close(self) -> None:
        self._finalizer()


@contextmanager
def _loopback() -> Iterator[None]:
    """Ray's single-machine switch on: it keeps 127.0.0.1 as it is (else it dials the host's
    outward address for it)."""
    from ray._private import ray_constants  # private: the single-machine switch

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _join(ray: ModuleType, address: str) -> None:
    """Join the cluster at ``address``; one whose head listens on 127.0.0.1 (nodes on this
    machine) is joined over loopback."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host not in (LOOPBACK, "localhost"):
        ray.init(address=address, configure_logging=False)
        return
    with _loopback():
        ray.init(address=address, configure_logging=False, _node_ip_address=LOOPBACK)


def _start_local(ray: ModuleType, temp_dir: str) -> None:
    """A local Ray on 127.0.0.1 only (see the module docstring)."""
    with _loopback():
        ray.init(
            address="local",
            num_cpus=os.cpu_count() or 1,
            include_dashboard=False,
            configure_logging=False,
            _node_ip_address=LOOPBACK,
            _temp_dir=temp_dir,
        )
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        raise RuntimeError(f"the local Ray node came up on {node_ip}, not {LOOPBACK}")
