"""Training across Ray nodes: a cluster of three raylets on this machine (``ray_cluster``: a
head without CPUs for the driver, two nodes with one CPU each), everything on 127.0.0.1.

- Two train workers placed one per node (``cluster.placement=spread``) and a rollout worker:
  sync and async (staleness 0) runs equal one process (tokens exactly, floats to rounding),
  each row names both ranks' nodes (``train_nodes``), both ranks write their checkpoint shards,
  the weights reach the rollout worker from rank 0's node without this process (its copy of
  the model never changes), and the run resumes on one rank equal to an uninterrupted run.
- The real ``specrl train``, from another directory with a relative ``--run-dir``, joins the
  cluster at ``cluster.address`` (its head's 127.0.0.1 address) and spreads its ranks.

Its faults (storage a node cannot see, nodes lost): ``test_multinode_faults``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray")

from specrl.pipelines.loop import PLACEMENT_KEYS, TIMING_KEYS  # noqa: E402
from specrl.pipelines.manifest import SHARDED, SHARDED_MARK  # noqa: E402
from specrl.pipelines.train import train  # noqa: E402
from tests.backends.ray_cluster import ray_cluster  # noqa: E402
from tests.backends.ray_helpers import host, listeners, ray_processes  # noqa: E402
from tests.conftest import ON_SERVER_WORKER, make_tiny  # noqa: E402
from tests.pipelines.pipeline_fakes import tiny_config, tiny_parts  # noqa: E402
from tests.pipelines.test_kill_resume import ROOT, make_model_dir, train_sets  # noqa: E402
from tests.pipelines.test_train_workers import WORK, rows  # noqa: E402

pytestmark = ON_SERVER_WORKER  # one Ray cluster at a time (tests/conftest.py)

SPREAD = ("cluster.train_workers=2", "cluster.placement=spread")
WORKER = ("cluster.rollout_workers=1", "cluster.threads=1")
THREE = ("run.steps=3", "run.checkpoint_every=3")
ASYNC = ("pipeline.mode=async", "pipeline.max_staleness=0")
SKIP = TIMING_KEYS | PLACEMENT_KEYS | set(WORK) | {"rollout_worker_faults"}


def assert_same_run(ours: list[dict], theirs: list[dict]) -> None:
    """Equal rows: tokens, prompts, versions and counts exactly, floats to the rounding of
    other batches and other rank splits; timings, placement and the split's work aside."""
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() - SKIP == b.keys() - SKIP
        for key in sorted(a.keys() - SKIP):
            if isinstance(a[key], float) or isinstance(b[key], float):
                assert math.isclose(a[key], b[key], rel_tol=1e-3, abs_tol=1e-5), (key, a, b)
            else:
                assert a[key] == b[key], (a["step"], key)


def run(path: Path, *sets: str, stop_after=None, resume=False, hook=None):
    """``train`` a tiny run in this process (the driver); its parts, closed."""
    parts = tiny_parts(tiny_config(*sets))
    if hook is not None:
        hook(parts)
    try:
        train(parts, str(path), progress=False, stop_after=stop_after, resume=resume)
    finally:
        parts.close()
    return parts


@pytest.fixture(scope="module")
def cluster(one_thread):
    with ray_cluster() as local:
        yield local


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The uninterrupted reference: one process, no Ray (4 steps, checkpoints every 2)."""
    path = tmp_path_factory.mktemp("multinode") / "one"
    run(path)
    return path


@pytest.fixture(scope="module")
def spread(cluster, tmp_path_factory):
    """Three sync steps on two ranks on two nodes and a rollout worker."""
    path = tmp_path_factory.mktemp("multinode") / "spread"
    return path, run(path, *THREE, *SPREAD, *WORKER)


def test_every_node_listens_on_loopback_only(cluster):
    found = listeners(ray_processes())
    assert found, "no listening socket found (the check would be void)"
    assert {host(a) for a, _ in found} <= {"127.0.0.1", "[::ffff:127.0.0.1]"}, found
    assert len(cluster.ids) == 3


def test_two_ranks_on_two_nodes_equal_one_process(cluster, spread, tmp_path):
    path, parts = spread
    reference = tmp_path / "ref"
    run(reference, *THREE)
    assert_same_run(rows(path), rows(reference))
    assert_same_run(rows(path, "eval.jsonl"), rows(reference, "eval.jsonl"))
    nodes = [r["train_nodes"] for r in rows(path)]
    assert all(n == nodes[0] for n in nodes)
    assert len(set(nodes[0])) == 2 and set(nodes[0]) <= set(cluster.ids[1:])  # not the head
    shards = list((path / "checkpoints/step_000003" / SHARDED).glob("shard-*.safetensors"))
    assert (path / "checkpoints/step_000003" / SHARDED_MARK).is_file() and len(shards) == 2


def test_weights_reach_the_worker_without_this_process(spread):
    """The driver's copy is the initial model still, yet every step's weights were served
    (the guard checked each fingerprint, the rows equal one process's)."""
    _, parts = spread
    initial = dict(make_tiny(0).named_parameters())
    for name, p in parts.learner.model.named_parameters():
        assert torch.equal(p, initial[name]), name
    assert [r["policy_version"] for r in rows(spread[0])] == [1, 2, 3]


def test_async_on_two_nodes_equals_one_process(cluster, spread, tmp_path):
    run(tmp_path, *THREE, *SPREAD, *WORKER, *ASYNC)
    assert_same_run(rows(tmp_path), rows(spread[0]))


def test_resume_on_one_rank_equals_the_uninterrupted_run(cluster, one_process, tmp_path):
    run(tmp_path, *SPREAD, *WORKER, stop_after=2)
    assert {n for r in rows(tmp_path) for n in r["train_nodes"]} == set(cluster.ids[1:])
    run(tmp_path, *WORKER, resume=True)
    assert_same_run(rows(tmp_path), rows(one_process))


def test_specrl_train_joins_the_cluster(cluster, tmp_path):
    model = make_model_dir(tmp_path / "model")
    address = f'cluster.address="{cluster.cluster.address}"'
    sets = train_sets(model, "run.steps=2", address, *SPREAD, *WORKER)
    cmd = [sys.executable, "-m", "specrl.cli", "train", "--no-compare", "--no-progress",
           "--run-dir", "run", *sets]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ours = rows(tmp_path / "run")
    assert [r["step"] for r in ours] == [0, 1]
    assert all(set(r["train_nodes"]) == set(cluster.ids[1:]) for r in ours)
    shards = list((tmp_path / "run/checkpoints/step_000002" / SHARDED).glob("shard-*"))
    assert len(shards) == 2
