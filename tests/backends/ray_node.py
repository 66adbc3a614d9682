"""One Ray worker node on 127.0.0.1, joined to the cluster at argv[1] with argv[2] CPUs and its
files in argv[3]; it runs until SIGTERM, which stops its processes (``ray_cluster.blind_node``
starts it in a mount namespace of its own)."""

from __future__ import annotations

import signal
import sys
import time

from ray._private.node import Node
from ray._private.parameter import RayParams


def main() -> None:
    gcs, cpus, temp_dir = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    params = RayParams(gcs_address=gcs, node_ip_address="127.0.0.1", num_cpus=cpus,
                       object_store_memory=150 * 1024 * 1024, include_log_monitor=False,
                       node_manager_port=0, min_worker_port=0, max_worker_port=0,
                       temp_dir=temp_dir)  # fmt: skip
    params.dashboard_agent_listen_port = None
    node = Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)

    def stop(*_: object) -> None:
        node.kill_all_processes(check_alive=False, allow_graceful=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
