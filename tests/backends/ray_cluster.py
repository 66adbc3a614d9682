"""A Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``: one raylet
per node, each with its own node id and resources), every part on 127.0.0.1.

``ray_cluster(head_cpus, node_cpus)`` starts the head (this process's driver joins it through
``RaySession.open(address)``, as ``cluster.address`` does) and the other nodes, and at its end
leaves nothing running. ``blind_node(cluster, hidden)`` adds a node whose processes see an empty
directory at ``hidden`` (a mount namespace over it: a node without the shared storage).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specrl.backends.ray_session import LOOPBACK, RaySession
from tests.backends.ray_helpers import ray_processes, wait_gone

NODE_SCRIPT = Path(__file__).with_name("ray_node.py")
SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps 127.0.0.1 as it is


@dataclass
class LocalCluster:
    """The cluster, this process's session on it and its nodes' ids (head first)."""

    cluster: Any
    session: RaySession
    temp_dir: str
    nodes: list[Any] = field(default_factory=list)  # ray._private.node.Node, head first
    blind: list[subprocess.Popen] = field(default_factory=list)

    @property
    def ids(self) -> list[str]:
        return [n.node_id for n in self.nodes]

    def remove(self, node_id: str, workers: Sequence[int] = ()) -> None:
        """Remove the node ``node_id`` as a lost machine goes: its raylet and services killed,
        and its worker processes ``workers`` (pids; an orphaned worker would otherwise answer
        calls until it notices) with them."""
        node = next(n for n in self.nodes if n.node_id == node_id)
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)
        for pid in workers:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert not wait_gone(set(workers), 30), "the lost node's workers survived"


@contextmanager
def _single_machine(temp_dir: str) -> Iterator[None]:
    """Ray's temp files in ``temp_dir`` and its single-machine switch on (in this process and
    the nodes' processes) for the block's duration."""
    from ray._private import ray_constants

    saved_env = {k: os.environ.get(k) for k in ("RAY_TMPDIR", SINGLE_MACHINE)}
    saved = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update({"RAY_TMPDIR": temp_dir, SINGLE_MACHINE: "0"})
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def ray_cluster(head_cpus: float = 0, node_cpus: tuple[float, ...] = (1, 1)
                ) -> Iterator[LocalCluster]:  # fmt: skip
    """See the module docstring."""
    import ray
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized(), "this process is on another Ray already"
    temp_dir = tempfile.mkdtemp(prefix="specrl-ray-")
    os.makedirs(os.path.join(temp_dir, "ray"))
    with _single_machine(temp_dir):
        args = {"node_ip_address": LOOPBACK, "include_dashboard": False}
        cluster = Cluster(initialize_head=True, head_node_args=args | {"num_cpus": head_cpus})
        local = None
        try:
            nodes = [cluster.head_node]
            nodes += [cluster.add_node(node_ip_address=LOOPBACK, num_cpus=c) for c in node_cpus]
            local = LocalCluster(cluster, RaySession.open(cluster.address), temp_dir, nodes)
            yield local
        finally:
            pids = ray_processes()
            if local is not None:
                local.session.close()
                for proc in local.blind:
                    _stop(proc)
            cluster.shutdown()
            left = wait_gone(pids)
            shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, f"Ray processes survived the cluster: {sorted(left)}"


def blind_node(local: LocalCluster, hidden: Path, cpus: float = 1) -> str:
    """Add a node whose processes see an empty ``hidden`` (``unshare -m``: a tmpfs mounted over
    it in their own mount namespace); its node id."""
    import ray

    before = {n["NodeID"] for n in ray.nodes()}
    cmd = (f"mount -t tmpfs tmpfs {hidden} && exec {sys.executable} {NODE_SCRIPT} "
           f"{local.cluster.address} {cpus} {local.temp_dir}")  # fmt: skip
    proc = subprocess.Popen(["unshare", "-m", "sh", "-c", cmd], start_new_session=True,
                            env=os.environ | {SINGLE_MACHINE: "0"})  # fmt: skip
    local.blind.append(proc)
    for _ in range(300):
        new = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - before
        if new:
            return new.pop()
        if proc.poll() is not None:
            raise RuntimeError(f"the blind node did not start (exit code {proc.returncode})")
        time.sleep(0.2)
    raise RuntimeError("the blind node did not join in 60 s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def can_unshare() -> bool:
    """Whether this process may make a mount namespace (root, or a user namespace allowed)."""
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return probe.returncode == 0
