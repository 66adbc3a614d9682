"""Training on N train workers (``cluster.train_workers``): FSDP2 ranks as Ray actors over gloo.

- In this process (one local Ray for the module), tiny model: three sync steps with 2 train
  workers equal three with 1 (the same tokens and rewards; loss, metrics, final parameters and
  AdamW state within float32 rounding), and so does the async pipeline at staleness 0; each
  rank holds about half the learner's bytes; a 2-worker checkpoint resumes with 1 worker and a
  1-worker one with 2, both ending where the uninterrupted run does.
- A train worker killed mid-run: the run ends with ``TrainWorkerDied`` naming the worker and
  the checkpoint to resume from (no hang), and the resume repeats and skips no step.
- The real ``specrl train`` on a tiny model directory: the same kill is one ``error:`` line and
  exit code 1; ``--resume`` finishes the run.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray")

from specrl.pipelines.loop import PLACEMENT_KEYS, TIMING_KEYS  # noqa: E402
from specrl.pipelines.manifest import SHARDED, SHARDED_MARK  # noqa: E402
from specrl.pipelines.train import train  # noqa: E402
from specrl.pipelines.train_workers import TrainWorkerDied  # noqa: E402
from specrl.rl.learner import Learner  # noqa: E402
from specrl.rl.sharded import learner_bytes  # noqa: E402
from specrl.rl.sharded_checkpoint import load_learner  # noqa: E402
from tests.backends.ray_helpers import local_ray, ray_processes, wait_gone  # noqa: E402
from tests.conftest import ON_SERVER_WORKER, make_tiny  # noqa: E402
from tests.pipelines.pipeline_fakes import tiny_config, tiny_parts  # noqa: E402
from tests.pipelines.test_kill_resume import finish, launch, make_model_dir, train_sets  # noqa: E402

pytestmark = ON_SERVER_WORKER  # one local Ray cluster at a time (tests/conftest.py)

TWO = ("cluster.train_workers=2",)
THREE = ("run.steps=3", "run.checkpoint_every=3")
ASYNC = ("pipeline.mode=async", "pipeline.max_staleness=0")
RTOL, ATOL = 1e-4, 1e-6  # float32 rounding: two ranks sum their shares' gradients in another order
# the work done, which depends on the split: a GRPO group cut between two ranks runs its prompt
# on each (forward tokens, micro-batches) and the figures derived from it
WORK = ("learner_forward_tokens", "learner_micro_batches", "learner_model_tflops", "learner_mfu")


@pytest.fixture(scope="module")
def session(one_thread):
    """A local Ray for the module; at its end nothing of it may be left running."""
    yield from local_ray()


def rows(run: Path, log: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(x) for x in (run / log).read_text().splitlines()]


def assert_rows_match(ours: list[dict], theirs: list[dict]) -> None:
    """Equal keys and values, floats to float32 rounding; timings, ``WORK`` and where the
    ranks ran (``PLACEMENT_KEYS``) aside."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() - PLACEMENT_KEYS == b.keys() - PLACEMENT_KEYS
        keys = a.keys() - set(TIMING_KEYS) - set(WORK) - PLACEMENT_KEYS
        for key in sorted(keys):
            x, y = a.get(key), b.get(key)
            if isinstance(x, float) or isinstance(y, float):
                assert math.isclose(x, y, rel_tol=RTOL, abs_tol=ATOL), (a["step"], key, x, y)
            else:
                assert x == y, (a["step"], key, x, y)


def assert_released(pids: list[int]) -> None:
    """The train workers' processes are gone and no placement group is left."""
    import ray

    assert not wait_gone(set(pids), 30), "train workers survived their close"
    states = {g["state"] for g in ray.util.placement_group_table().values()}
    assert states <= {"REMOVED"}, states


def run_tiny(session, path: Path, *sets: str, stop_after=None, resume=False):
    """``train`` a tiny run; (its parts, closed; each rank's learner bytes at the end, for
    train workers, whose release is checked)."""
    parts, memory = tiny_parts(tiny_config(*sets)), None
    try:
        train(parts, str(path), progress=False, stop_after=stop_after, resume=resume)
        memory = parts.learner.memory() if hasattr(parts.learner, "memory") else None
    finally:
        parts.close()
    if memory is not None:
        assert_released(parts.learner.pids)
    return parts, memory


@pytest.fixture(scope="module")
def one_worker(session, tmp_path_factory):
    run = tmp_path_factory.mktemp("tw") / "one"
    return run, run_tiny(session, run, *THREE)[0]


@pytest.fixture(scope="module")
def two_workers(session, tmp_path_factory):
    run = tmp_path_factory.mktemp("tw") / "two"
    return run, *run_tiny(session, run, *THREE, *TWO)


def test_two_workers_equal_one(one_worker, two_workers):
    (run1, parts1), (run2, parts2, _) = one_worker, two_workers
    assert_rows_match(rows(run2), rows(run1))
    assert all(r["train_nodes"] == parts2.learner.nodes for r in rows(run2))  # rank order
    assert len(parts2.learner.nodes) == 2 and "train_nodes" not in rows(run1)[0]
    assert_rows_match(rows(run2, "eval.jsonl"), rows(run1, "eval.jsonl"))
    ours = dict(parts2.learner.model.named_parameters())
    for name, p in parts1.learner.model.named_parameters():
        torch.testing.assert_close(ours[name], p, rtol=RTOL, atol=ATOL, msg=name)


def test_two_workers_adamw_state_equals_one(one_worker, two_workers):
    """The 2-worker checkpoint (DCP, two shards) loaded into one process holds the 1-worker
    run's AdamW state."""
    (_, parts1), (run2, _, _) = one_worker, two_workers
    ckpt = run2 / "checkpoints/step_000003"
    assert (ckpt / SHARDED_MARK).is_file()
    assert len(list((ckpt / SHARDED).glob("shard-*.safetensors"))) == 2
    cfg = tiny_config(*THREE)
    fresh = Learner(make_tiny(0), cfg.learner, max_len=cfg.rollout.max_new_tokens)
    load_learner(fresh, ckpt / SHARDED)
    names = {id(p): n for n, p in parts1.learner.model.named_parameters()}
    theirs = {names[id(p)]: s for p, s in parts1.learner.optimizer.state.items()}
    mine = {n: fresh.optimizer.state[p] for n, p in fresh.model.named_parameters()}
    assert theirs.keys() == mine.keys()
    for name, state in theirs.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(mine[name][key], state[key], rtol=RTOL, atol=ATOL)


def test_async_staleness_zero_on_two_workers_equals_sync_on_one(session, one_worker, tmp_path):
    run1, _ = one_worker
    run_tiny(session, tmp_path, *THREE, *TWO, *ASYNC)
    assert_rows_match(rows(tmp_path), rows(run1))


def test_each_rank_holds_half(one_worker, two_workers):
    """Parameters, gradients and AdamW state after three steps: ~1/2 of the one-process
    learner's on each rank (dimension 0 split in two; a row count that is odd pads a row)."""
    (_, parts1), (_, _, ranks) = one_worker, two_workers
    whole = learner_bytes(parts1.learner)
    assert len(ranks) == 2 and whole["grads"] > 0 and whole["optimizer"] > 0
    for kind in ("params", "grads", "optimizer", "total"):
        assert sum(r[kind] for r in ranks) == pytest.approx(whole[kind], rel=0.02)
        assert max(r[kind] for r in ranks) <= 0.55 * whole[kind]


@pytest.mark.parametrize("first, then", [(TWO, ()), ((), TWO)], ids=["2to1", "1to2"])
def test_resume_with_another_worker_count(session, tmp_path, first, then):
    """Two steps on ``first`` workers, checkpointed, then two more on ``then``: the run an
    uninterrupted one-worker run is (tiny config: 4 steps, checkpoints every 2)."""
    reference = tmp_path / "reference"
    run_tiny(session, reference)
    run = tmp_path / "run"
    run_tiny(session, run, *first, stop_after=2)
    run_tiny(session, run, *then, resume=True)
    assert [r["step"] for r in rows(run)] == [0, 1, 2, 3]
    assert_rows_match(rows(run), rows(reference))


def test_killed_worker_ends_the_run_and_resume_repeats_no_step(session, tmp_path):
    sets = ("run.checkpoint_every=1",)
    reference = tmp_path / "reference"
    run_tiny(session, reference, *sets)
    run = tmp_path / "run"
    parts = tiny_parts(tiny_config(*sets, *TWO))
    group, calls = parts.learner, []
    step = group.train_step

    def kill_before_the_third(*args, **kwargs):  # deterministic: rank 1 dies before step 2
        calls.append(1)
        if len(calls) == 3:
            os.kill(group.pids[1], signal.SIGKILL)
        return step(*args, **kwargs)

    group.train_step = kill_before_the_third
    try:
        with pytest.raises(TrainWorkerDied) as died:
            train(parts, str(run), progress=False)
    finally:
        parts.close()
    assert_released(group.pids)
    line = str(died.value)
    assert "\n" not in line
    assert line.startswith(f"train worker 1 (pid {group.pids[1]}) on node {group.nodes[1]} died")
    assert f"last checkpoint {run / 'checkpoints/step_000002'}" in line
    run_tiny(session, run, *sets, *TWO, resume=True)
    assert [r["step"] for r in rows(run)] == [0, 1, 2, 3]
    assert_rows_match(rows(run), rows(reference))


def _train_ranks(root: int) -> set[int]:
    """Live train worker processes under ``root``."""
    return {p for p in ray_processes(root) if "TrainRank" in Path(f"/proc/{p}/cmdline").read_text()}


def _kill_train_ranks(root: int) -> set[int]:
    pids = _train_ranks(root)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


def test_cli_killed_worker_is_one_line_and_resumes(tmp_path):
    """``specrl train`` with 2 train workers: its ranks killed after the first checkpoint, the
    run ends with one ``error:`` line (exit code 1) naming the worker and the checkpoint;
    ``--resume`` on one worker finishes every step once."""
    model, run = make_model_dir(tmp_path / "model"), tmp_path / "run"
    sets = train_sets(model, "run.steps=4", "cluster.train_workers=2")
    proc = launch([*sets, "--run-dir", str(run)])
    deadline, killed = time.monotonic() + 240, set()
    while not killed and proc.poll() is None and time.monotonic() < deadline:
        if (run / "checkpoints/step_000001").is_dir():
            killed = _kill_train_ranks(proc.pid)
        time.sleep(0.05)
    code, _, err = finish(proc)
    assert killed and code == 1, err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "train worker" in lines[0] and "died" in lines[0], err
    assert "last checkpoint" in lines[0] and "--resume" in lines[0]
    code, _, err = finish(launch(["--resume", str(run), "--set", "cluster.train_workers=1"]))
    assert code == 0, err
    assert [r["step"] for r in rows(run)] == [0, 1, 2, 3]


def test_online_eagle3_drafter_trains_on_features_from_each_rank(session, tmp_path, monkeypatch):
    """An EAGLE-3 head trained online from the ranks' captured features (each rank its share's,
    joined in sample order) trains as on one worker: the same drafter updates and losses (one
    update a step, well within its time budget on either: the budget follows the step time)."""
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "empty-cache"))  # a fresh head
    sets = (*THREE, "rollout.spec=eagle3", "rollout.max_new_tokens=12", "drafter.vocab=0",
            "drafter.mode=online", "drafter.max_updates=1", "drafter.time_share=1.0")  # fmt: skip
    run_tiny(session, tmp_path / "one", *sets)
    run_tiny(session, tmp_path / "two", *sets, *TWO)
    ours, theirs = rows(tmp_path / "two"), rows(tmp_path / "one")
    assert [r["drafter_version"] for r in theirs] == [1, 2, 3]
    assert_rows_match(ours, theirs)


def test_ray_rollout_workers_with_two_train_workers(session, one_worker, tmp_path):
    """Two rollout workers and two train workers, the learner's pipeline in its own actor:
    the run the one-process run is (sync, and async at staleness 0)."""
    from specrl.pipelines.ray_run import train_on_ray

    ray_sets = ("cluster.rollout_workers=2", "cluster.threads=1")
    reference = tmp_path / "reference"
    run_tiny(session, reference, *THREE, "rollout.spec=ngram")
    for mode in ((), ASYNC):
        run = tmp_path / f"ray{len(mode)}"
        cfg = tiny_config(*THREE, "rollout.spec=ngram", *ray_sets, *TWO, *mode)
        train_on_ray(cfg, str(run), progress=False, make_parts=tiny_parts)
        assert_rows_match(rows(run), rows(reference))


def test_a_damaged_shard_is_named_and_an_older_checkpoint_used(session, tmp_path):
    """The run checkpoint's manifest chains to the shards: a changed byte in one, or a shard
    changed with its folder's manifest rewritten to match, is damage naming the file, and a
    resume takes the newest checkpoint that verifies."""
    from specrl.fsutil import write_manifest
    from specrl.pipelines.checkpoint import read_checkpoint
    from specrl.pipelines.loop import newest_verified
    from specrl.pipelines.manifest import CheckpointDamaged
    from specrl.pipelines.rundir import RunDir

    run_tiny(session, tmp_path, *TWO)  # 4 steps, checkpoints at 2 and 4
    ckpt = tmp_path / "checkpoints/step_000004"
    inner = ckpt / SHARDED
    shard = sorted(inner.glob("shard-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamaged, match=f"^{SHARDED}/{shard.name}: sha256 mismatch$"):
        read_checkpoint(ckpt)
    write_manifest(inner, sorted(p.name for p in inner.iterdir() if p.name != "manifest.json"))
    with pytest.raises(CheckpointDamaged, match=f"^{SHARDED}/manifest.json: not the one"):
        read_checkpoint(ckpt)
    notes: list[str] = []
    found = newest_verified(RunDir(tmp_path), notes.append)
    assert found.path.name == "step_000002" and found.sharded == found.path / SHARDED
    assert len(notes) == 1 and "step_000004" in notes[0]


def test_train_workers_without_ray_is_one_line(monkeypatch):
    from specrl.config import ConfigError

    monkeypatch.setitem(sys.modules, "ray", None)  # as if the ray extra were not installed
    with pytest.raises(ConfigError, match=r"^cluster.train_workers > 1 needs Ray, which is not"):
        tiny_parts(tiny_config(*TWO))


def test_a_ranks_own_error_is_its_one_line_and_nothing_is_left(session):
    """A setting the learner refuses fails on the ranks as in one process: the same one-line
    exception; no train worker process and no placement group is left."""
    with pytest.raises(ValueError) as alone:
        tiny_parts(tiny_config("learner.kl_coef=0.1"))
    with pytest.raises(ValueError) as ranks:
        tiny_parts(tiny_config(*TWO, "learner.kl_coef=0.1"))
    assert str(ranks.value) == str(alone.value) and "\n" not in str(alone.value)
    deadline = time.monotonic() + 30
    while _train_ranks(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _train_ranks(os.getpid())
    assert_released([])
