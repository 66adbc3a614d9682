"""One writer per run directory: a run holds an exclusive lock on ``RUN/.lock`` for its life
(released by the OS when the holder dies, so a killed run never blocks its resume); a second
writer, in this process or another, is one line naming the holder's pid, before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from specrl.cli import app
from specrl.pipelines.manifest import RunDirError
from specrl.pipelines.rundir import RunDir
from specrl.pipelines.train import run_training, train
from tests.pipelines.pipeline_fakes import tiny_config, tiny_parts

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0); os.pwrite(fd, str(os.getpid()).encode(), 0)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def holder(lock_file, seconds: float = 120.0) -> subprocess.Popen:
    """Another process holding the lock (as a running ``specrl train`` would)."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD), str(lock_file),
                             str(seconds)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def steps(run: RunDir) -> list[int]:
    return [r["step"] for r in run.rows(run.metrics)]


def test_a_second_writer_is_refused_naming_the_holder_and_resumes_after(tmp_path):
    run = RunDir(tmp_path / "run")
    parts = tiny_parts(tiny_config("run.steps=2", "run.checkpoint_every=1", "run.eval_every=0"))
    try:
        train(parts, str(run.path), progress=False, stop_after=1)
        proc = holder(run.lock_file)
        try:
            with pytest.raises(RunDirError) as e:
                train(parts, str(run.path), resume=True, progress=False)
            assert f"pid {proc.pid}" in str(e.value) and "\n" not in str(e.value)
            with pytest.raises(RunDirError, match=f"pid {proc.pid}"):
                run_training(parts, str(run.path), resume=True, progress=False)
        finally:
            proc.kill()  # the OS drops its lock with it
            proc.wait()
        assert steps(run) == [0]  # the refused writers wrote nothing
        train(parts, str(run.path), resume=True, progress=False)
    finally:
        parts.close()
    assert steps(run) == [0, 1]


def test_the_same_process_cannot_write_one_run_twice(tmp_path):
    run = RunDir(tmp_path / "run")
    with run.locked():
        assert run.lock_file.read_text() == str(os.getpid())
        with pytest.raises(RunDirError, match=f"pid {os.getpid()}"):
            run.check_unlocked()
    run.check_unlocked()  # released
    assert not run.is_used()  # the lock file alone does not make a run directory used


def test_cli_resume_of_a_run_in_use_is_one_line_before_any_work(tmp_path, monkeypatch):
    import specrl.models.checkpoints as ckpt

    monkeypatch.setattr(ckpt, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    run = RunDir(tmp_path / "run").create()
    run.config.write_text(tiny_config().to_toml())
    run.metrics.write_text(json.dumps({"step": 0}) + "\n")
    proc = holder(run.lock_file)
    try:
        result = CliRunner().invoke(app, ["train", "--resume", str(run.path), "--no-progress"])
    finally:
        proc.kill()
        proc.wait()
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"pid {proc.pid}" in lines[0]


def test_two_resumes_at_once_one_refused_and_every_step_once(tmp_path):
    """The case found at 54e03a2: two ``specrl train --resume R`` at once both ran step 1 and
    left steps [0, 1, 1]. Now the first holds the lock (stopped with SIGSTOP mid-run so the two
    surely overlap), the second is one line naming it, and the run ends with [0, 1, 2]."""
    import signal

    from tests.pipelines.test_kill_resume import ROOT, finish, launch, make_model_dir, train_sets

    model, run = make_model_dir(tmp_path / "model"), tmp_path / "run"
    code, _, err = finish(launch(["--run-dir", str(run), *train_sets(model, "run.steps=1")]))
    assert code == 0, err
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "specrl.cli", "train", "--no-compare", "--no-progress",
           "--resume", str(run), "--set", "run.steps=3"]  # fmt: skip
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert first.stdout is not None
        while not (line := first.stdout.readline()).startswith("step   1"):
            assert line, "the first resume ended before its step 1"
        first.send_signal(signal.SIGSTOP)  # holding the lock, mid-run
        second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=300)  # fmt: skip
        first.send_signal(signal.SIGCONT)
        _, first_err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert second.returncode == 2, second.stderr
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"in use by another specrl process (pid {first.pid})" in lines[0]
    assert first.returncode == 0, first_err
    assert steps(RunDir(run)) == [0, 1, 2]
