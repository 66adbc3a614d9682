"""Faults of training across Ray nodes, each test on a cluster of its own (``ray_cluster``: a
head without CPUs for the driver and one-CPU nodes, everything on 127.0.0.1).

- A rank whose node cannot see the run directory (a node in a mount namespace of its own):
  refused in one line naming it, before any step.
- Node loss: the rollout worker's node removed mid-run: every step finishes exactly once, on a
  replacement on the other node; a train rank's node removed: one line naming the node, the
  rank and the checkpoint, and a resume on one rank equals the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray")

from specrl.pipelines.train_workers import SharedStorageError, TrainWorkerDied  # noqa: E402
from tests.backends.ray_cluster import blind_node, can_unshare, ray_cluster  # noqa: E402
from tests.conftest import ON_SERVER_WORKER  # noqa: E402
from tests.pipelines.test_multinode import SPREAD, WORKER, assert_same_run, run  # noqa: E402
from tests.pipelines.test_train_workers import rows  # noqa: E402

pytestmark = ON_SERVER_WORKER  # one Ray cluster at a time (tests/conftest.py)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The uninterrupted reference: one process, no Ray (4 steps, checkpoints every 2)."""
    path = tmp_path_factory.mktemp("faults") / "one"
    run(path)
    return path


@pytest.mark.skipif(not can_unshare(), reason="needs a mount namespace (unshare -m)")
def test_a_rank_that_cannot_see_the_run_dir_is_refused(one_thread, tmp_path):
    hidden = tmp_path / "shared"
    hidden.mkdir()
    with ray_cluster(node_cpus=(1,)) as local:
        blind = blind_node(local, hidden)
        path = hidden / "run"
        with pytest.raises(SharedStorageError) as refused:
            run(path, *SPREAD)
    line = str(refused.value)
    assert "\n" not in line and f"on node {blind} cannot use the run directory {path}" in line
    assert not (path / "metrics.jsonl").exists() and not (path / "checkpoints").exists()
    assert not list(path.glob(".specrl-storage-*"))  # the marker is cleaned up


def test_lost_rollout_node_every_step_once(one_thread, one_process, tmp_path):
    """worker_cpus=1: the worker fills one node; removed before step 1's rollout, it is
    replaced on the other node and the step's chunk runs again (counted in its row)."""
    sets = (*WORKER, "cluster.worker_cpus=1")
    with ray_cluster() as local:
        seen: list[str] = []

        def remove_before_step_1(parts) -> None:
            generate, calls = parts.backend.generate, []

            def wrapped(requests, *args, **kwargs):
                calls.append(requests[0].sampling.n > 1)  # a step's groups (eval: n = 1)
                step_1 = calls[-1] and sum(calls) == 2
                if step_1:
                    seen.extend(parts.backend.nodes())
                    local.remove(seen[0], parts.backend.pids())
                out = generate(requests, *args, **kwargs)
                if step_1:
                    seen.extend(parts.backend.nodes())
                return out

            parts.backend.generate = wrapped

        run(tmp_path, *sets, hook=remove_before_step_1)
    assert seen[0] != seen[1] and seen[1] in local.ids[1:]
    ours = rows(tmp_path)
    assert [r["rollout_worker_faults"] for r in ours] == [0, 1, 0, 0]
    assert_same_run(ours, rows(one_process))


def test_lost_train_node_one_line_and_resume(one_thread, one_process, tmp_path):
    with ray_cluster() as local:
        died: list[TrainWorkerDied] = []

        def remove_before_step_2(parts) -> None:
            group, step, calls = parts.learner, parts.learner.train_step, []

            def wrapped(*args, **kwargs):
                calls.append(1)
                if len(calls) == 3:
                    local.remove(group.nodes[1], [group.pids[1]])
                return step(*args, **kwargs)

            group.train_step = wrapped

        try:
            run(tmp_path, *SPREAD, *WORKER, "run.checkpoint_every=1",
                hook=remove_before_step_2)  # fmt: skip
        except TrainWorkerDied as e:
            died.append(e)
        assert died, "the run went on without its rank"
        nodes = rows(tmp_path)[0]["train_nodes"]
        line = str(died[0])
        assert "\n" not in line and line.startswith("train worker 1 ")
        assert f"on node {nodes[1]} died" in line
        assert f"last checkpoint {tmp_path / 'checkpoints/step_000002'}" in line
        run(tmp_path, *WORKER, "run.checkpoint_every=1", resume=True)
    assert_same_run(rows(tmp_path), rows(one_process))
