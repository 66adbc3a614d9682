"""Training on Ray: the learner in one actor, two rollout workers in others.

- In this process (one local Ray for the module): a sync run equals the single-process run
  (tokens and rewards exactly; the learner's floats to rounding: the workers batch other
  requests together); the async pipeline at staleness 0 equals the sync run exactly, and at
  staleness 1 with in-flight updates keeps its bound; a run interrupted with ``stop_after``
  and resumed (from a different init: everything comes from disk) equals the uninterrupted
  one, checkpoint bytes included.
- The real ``specrl train`` on a tiny model directory: Ray listens on 127.0.0.1 only; SIGINT
  stops after the step in progress with its checkpoint, exit code 130 and no Ray process
  left; ``--resume`` continues from that checkpoint.
- Slow: the real default model, two short steps on two workers.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("ray")

from specrl.backends.ray_session import RaySession  # noqa: E402
from specrl.pipelines.loop import TIMING_KEYS  # noqa: E402
from specrl.pipelines.ray_run import train_on_ray  # noqa: E402
from specrl.pipelines.train import train  # noqa: E402
from tests.backends.ray_helpers import host, listeners, local_ray, ray_processes, wait_gone  # noqa: E402
from tests.conftest import ON_SERVER_WORKER  # noqa: E402
from tests.pipelines.pipeline_fakes import tiny_config, tiny_parts  # noqa: E402
from tests.pipelines.test_kill_resume import ROOT, make_model_dir, train_sets  # noqa: E402

pytestmark = ON_SERVER_WORKER  # one local Ray cluster at a time (tests/conftest.py)

RAY = ("cluster.rollout_workers=2", "cluster.threads=1", "rollout.spec=ngram")


@pytest.fixture(scope="module")
def session(one_thread):
    """A local Ray for the module; at its end nothing of it may be left running."""
    yield from local_ray()


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def untimed(rs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rs]


@pytest.fixture(scope="module")
def reference(session, tmp_path_factory) -> Path:
    """An uninterrupted sync run on Ray (4 steps, checkpoints at 2 and 4)."""
    run = tmp_path_factory.mktemp("ray") / "sync"
    lines: list[str] = []
    out = train_on_ray(
        tiny_config(*RAY), str(run), progress=False, echo=lines.append, make_parts=tiny_parts
    )
    assert [r["step"] for r in out] == [0, 1, 2, 3]
    assert sum(line.startswith("step ") for line in lines) == 4  # printed here, by the driver
    return run


def test_sync_run_matches_a_single_process_run(reference, tmp_path):
    cfg = tiny_config(*RAY[2:])  # the same run, no Ray (nor cluster.threads: it needs workers)
    train(tiny_parts(cfg), str(tmp_path), progress=False)
    for log in ("metrics.jsonl", "eval.jsonl"):
        ray_rows, ref_rows = untimed(rows(reference / log)), untimed(rows(tmp_path / log))
        assert len(ray_rows) == len(ref_rows) > 0
        for a, b in zip(ray_rows, ref_rows, strict=True):
            assert a.keys() == b.keys()
            for key in a:
                if isinstance(a[key], float):  # learner floats: rounding of other batches
                    assert math.isclose(a[key], b[key], rel_tol=1e-3, abs_tol=1e-5), key
                else:  # tokens, prompts, versions, counts
                    assert a[key] == b[key], key
    assert all(r["rollout_worker_faults"] == 0 for r in rows(reference / "metrics.jsonl"))


def test_async_at_staleness_0_equals_sync(reference, tmp_path):
    cfg = tiny_config(*RAY, "pipeline.mode=async", "pipeline.max_staleness=0")
    train_on_ray(cfg, str(tmp_path), progress=False, make_parts=tiny_parts)
    for log in ("metrics.jsonl", "eval.jsonl"):
        assert untimed(rows(tmp_path / log)) == untimed(rows(reference / log))


def test_async_in_flight_keeps_its_bound(session, tmp_path):
    cfg = tiny_config(*RAY, "pipeline.mode=async", "pipeline.max_staleness=1",
                      "pipeline.update=in_flight", "run.steps=6")  # fmt: skip
    out = train_on_ray(cfg, str(tmp_path), progress=False, make_parts=tiny_parts)
    assert [r["step"] for r in out] == list(range(6))
    assert max(r["staleness_max"] for r in out) <= 1
    assert [r["policy_version"] for r in out] == list(range(1, 7))


def test_resume_on_ray_continues_exactly(reference, tmp_path):
    cfg = tiny_config(*RAY)
    run = tmp_path / "part"
    train_on_ray(cfg, str(run), progress=False, stop_after=3, make_parts=tiny_parts)
    assert len(rows(run / "metrics.jsonl")) == 3  # a row past the last checkpoint (step 2)
    other_init = functools.partial(tiny_parts, model_seed=7)  # everything must come from disk
    out = train_on_ray(cfg, str(run), resume=True, progress=False, make_parts=other_init)
    assert [r["step"] for r in out] == [2, 3]
    for log in ("metrics.jsonl", "eval.jsonl"):
        assert untimed(rows(run / log)) == untimed(rows(reference / log))
    final = "checkpoints/step_000004/policy.safetensors"
    assert (run / final).read_bytes() == (reference / final).read_bytes()


def test_worker_killed_mid_step_is_counted_and_changes_nothing(reference, tmp_path):
    parts = tiny_parts(tiny_config(*RAY))  # the learner in this process, workers as actors
    victim = parts.backend.pids()[1]
    timers: list[threading.Timer] = []

    def freeze_then_kill(line: str) -> None:
        """After step 0's row: freeze worker 1 (it cannot finish step 1's chunk), kill it a
        moment later, whether step 1's generate call has reached it yet or not."""
        if line.startswith("step   0"):
            os.kill(victim, signal.SIGSTOP)
            timers.append(threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)))
            timers[0].start()

    try:
        train(parts, str(tmp_path), progress=False, echo=freeze_then_kill)
    finally:
        timers[0].join()
        parts.backend.close()
    got, want = (
        untimed(rows(tmp_path / "metrics.jsonl")),
        untimed(rows(reference / "metrics.jsonl")),
    )
    assert [r.pop("rollout_worker_faults") for r in got] == [0, 1, 0, 0]
    assert [r.pop("rollout_worker_faults") for r in want] == [0, 0, 0, 0]
    assert got == want  # every group generated once, by the replacement at version 1
    assert untimed(rows(tmp_path / "eval.jsonl")) == untimed(rows(reference / "eval.jsonl"))


# --------------------------------------------------------------------------- the CLI


def launch(args: list[str]) -> subprocess.Popen:
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "specrl.cli", "train", "--no-compare", "--no-progress", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=os.environ | env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--set", "rollout.placement=process"], "each Ray worker is its own process"),
        (["--set", "rollout.spec=suffx"], "did you mean suffix"),
        (["--set", "pipeline.update=in_flight"], "needs pipeline.mode='async'"),
    ],
)
def test_cli_checks_before_ray_starts(tmp_path, monkeypatch, args, match):
    from typer.testing import CliRunner

    from specrl.cli import app

    monkeypatch.setattr(RaySession, "open", lambda *a: pytest.fail("Ray started"))
    argv = ["train", "--run-dir", str(tmp_path / "run"), "--set", "cluster.rollout_workers=2"]
    result = CliRunner().invoke(app, [*argv, *args])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_cli_sigint_on_ray_then_resume(tmp_path):
    model = make_model_dir(tmp_path / "model")
    run = tmp_path / "run"
    sets = [*train_sets(model), "--set", "cluster.rollout_workers=2", "--set", "run.steps=40"]
    proc = launch(["--run-dir", str(run), *sets])
    seen = []
    for line in proc.stdout:  # wait for the first step's row
        seen.append(line)
        if line.startswith("step "):
            break
    ray_pids = ray_processes(proc.pid)
    assert len(ray_pids) >= 5, seen  # gcs, raylet, learner, 2 workers (and helpers)
    try:
        found = listeners(ray_pids)
    except FileNotFoundError:
        found = None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    if found is not None:
        assert found and all(host(a) in {"127.0.0.1", "[::ffff:127.0.0.1]"} for a, _ in found)
    assert not wait_gone(ray_pids), "Ray processes survived the run"
    last = err.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGINT after ") and "checkpoint saved" in last
    assert f"continue with: specrl train --resume {run}" in last
    done = len(rows(run / "metrics.jsonl"))
    assert 1 <= done < 40 and (run / f"checkpoints/step_{done:06d}").is_dir()
    # resume (two more steps) on Ray again
    resumed = launch(["--resume", str(run), "--set", f"run.steps={done + 2}"])
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert [r["step"] for r in rows(run / "metrics.jsonl")] == list(range(done + 2))
    assert f"step {done:3d}" in out and "metrics:" in out


@pytest.mark.slow
def test_default_model_on_two_workers(tmp_path):
    sets = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
            "env.num_eval=4", "run.steps=2", "run.eval_every=2", "run.checkpoint_every=2",
            "cluster.rollout_workers=2"]  # fmt: skip
    proc = launch(["--run-dir", str(tmp_path / "run"), *[a for s in sets for a in ("--set", s)]])
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    metrics = rows(tmp_path / "run/metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1]
    assert all(r["logprob_delta_mean"] < 0.1 for r in metrics)
    backend = json.loads((tmp_path / "run/checkpoints/step_000002/backend.json").read_text())
    assert [w["drafter"]["name"] for w in backend["workers"]] == ["suffix", "suffix"]


def test_an_online_drafter_reaches_every_worker(session, tmp_path, monkeypatch):
    """The head trained on the learner side is pushed to both Ray workers with its version:
    what they serve is the trainer's head, by fingerprint."""
    from specrl.models.fingerprint import fingerprint, fingerprint_dtype

    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))  # no head: trained from scratch
    cfg = tiny_config(*RAY, "rollout.spec=eagle3", "rollout.max_new_tokens=12", "drafter.vocab=0",
                      "drafter.mode=online", "run.steps=2", "run.eval_every=0")  # fmt: skip
    parts = tiny_parts(cfg)  # the learner in this process, the workers as actors
    trainer = parts.drafter.trainer
    monkeypatch.setattr(trainer, "_affordable", lambda: 1)  # a push every step
    try:
        out = train(parts, str(tmp_path / "run"), progress=False)
        served = parts.backend.served()
    finally:
        parts.backend.close()
    assert [r["drafter_version"] for r in out] == [1, 2] and trainer.ledger.version == 2
    assert served.drafter_version == 2
    assert served.drafter == fingerprint(trainer.state(), fingerprint_dtype(served.drafter))
    assert sum(r["drafting_steps"] for r in out) > 0  # the workers drafted with the head
