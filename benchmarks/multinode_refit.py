"""Refit across Ray nodes: bytes and seconds of a step's weight push, one node vs several.

One script, one process (the driver), on the bundled model with 2 train workers and 1 rollout
worker (``cluster.worker_cpus=1``), on a Ray cluster of raylets on this machine
(``tests/backends/ray_cluster.py``: a head without CPUs, everything on 127.0.0.1):

- ``one node``: one node with 3 CPUs, ``cluster.placement=pack`` (ranks and worker together);
- ``two nodes``: three nodes with 1 CPU each, ``cluster.placement=spread``: a rank on each of
  two, the worker (1 CPU) on the third, so its fetch crosses nodes.

In each layout, ``--repeats`` pushes of the policy (``RunParts.push_weights``, a step's refit:
the ranks gather the weights block by block into rank 0's object store in the engine's dtype,
the worker fetches them from there, the guard checks its fingerprint) and as many through this
process (the ranks' blocks gathered into the driver's float32 copy, then put and fetched: the
path a learned drafter needs). Reported per path: the median seconds, the bytes the worker
fetches, the bytes through the driver, and the copy-bandwidth floor of those bytes (the
machine's copy bandwidth measured in the same run, ``specrl.bench.measure_machine``). All
nodes share this machine's 2 cores and memory: two nodes cannot be faster here; the figures
show what crossing a node costs (a copy between two object stores over loopback).

    .venv/bin/python benchmarks/multinode_refit.py --out benchmarks/results/multinode_refit.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.backends.ray_cluster

from specrl.bench import measure_machine, run_metadata, write_result  # noqa: E402
from specrl.config import load_config  # noqa: E402
from specrl.pipelines.build import build_run  # noqa: E402
from tests.backends.ray_cluster import ray_cluster  # noqa: E402

LAYOUTS = {
    "one node": ((3,), "pack"),
    "two nodes": ((1, 1, 1), "spread"),
}


def through_driver(parts, version: int) -> float:
    """A push through this process: the ranks' blocks into the driver's copy, then put."""
    t0 = time.perf_counter()
    parts.learner.pull_weights()
    named = dict(parts.learner.model.named_parameters())
    return time.perf_counter() - t0 + parts.guard.push(parts.backend, named, version)


def measure(layout: str, repeats: int, bandwidth: float) -> dict:
    cpus, placement = LAYOUTS[layout]
    sets = ["cluster.train_workers=2", f"cluster.placement={placement}",
            "cluster.rollout_workers=1", "cluster.worker_cpus=1", "cluster.threads=1"]  # fmt: skip
    with ray_cluster(node_cpus=cpus):
        parts = build_run(load_config(None, sets))
        try:
            direct, driver, version = [], [], 1
            for _ in range(repeats):
                direct.append(parts.push_weights(version))
                driver.append(through_driver(parts, version + 1))
                version += 2
            update = parts.learner.weight_blocks(parts.guard.dtype)
            fetched = update.nbytes()
            gathered = sum(p.numel() * p.element_size() for p in parts.learner.model.parameters())
            nodes = {"train": list(parts.learner.nodes), "rollout": parts.backend.nodes()}
        finally:
            parts.close()
    return {
        "placement": placement,
        "node_cpus": list(cpus),
        "nodes": nodes,
        "direct": {
            "seconds": statistics.median(direct),
            "all_s": direct,
            "worker_fetch_bytes": fetched,
            "driver_bytes": 0,
            "copy_floor_s": fetched / bandwidth,
        },  # fmt: skip
        "through_driver": {
            "seconds": statistics.median(driver),
            "all_s": driver,
            "worker_fetch_bytes": fetched,
            "driver_bytes": gathered + fetched,
            "copy_floor_s": (gathered + 2 * fetched) / bandwidth,
        },  # fmt: skip
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="pushes per path and layout")
    ap.add_argument("--out", default="benchmarks/results/multinode_refit.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    machine = measure_machine()
    bandwidth = machine["copy_bandwidth_bytes_s"]
    result = run_metadata() | {"roofline": machine, "layouts": {}}
    for layout in LAYOUTS:
        result["layouts"][layout] = row = measure(layout, args.repeats, bandwidth)
        direct, driver = row["direct"], row["through_driver"]
        print(f"{layout}: direct {direct['seconds']:.2f} s, through the driver "
              f"{driver['seconds']:.2f} s, {direct['worker_fetch_bytes'] / 2**20:.0f} MiB "
              "fetched", flush=True)  # fmt: skip
    one, two = result["layouts"]["one node"], result["layouts"]["two nodes"]
    result["ratios"] = {
        "direct_two_over_one": two["direct"]["seconds"] / one["direct"]["seconds"],
        "driver_over_direct_one": one["through_driver"]["seconds"] / one["direct"]["seconds"],
        "driver_over_direct_two": two["through_driver"]["seconds"] / two["direct"]["seconds"],
    }
    print(result["ratios"])
    write_result(result, args.out)


if __name__ == "__main__":
    main()
