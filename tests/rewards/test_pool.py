"""The reward pool: calls run in worker processes, and nothing a reward does (hang, raise, kill
its worker) reaches the caller as anything but a one-line error; the pool keeps serving."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from specrl.rewards.pool import RewardCall, RewardPool
from tests.rewards import faulty


def call(fn, n: int = 3) -> RewardCall:
    return RewardCall(fn, ["p"] * n, ["a", "bb", "ccc"][:n], {"answer": [1] * n})


@pytest.fixture
def pool():
    p = RewardPool(workers=2, timeout_s=2.0)
    yield p
    p.close()


def test_values_come_back_from_a_worker(pool):
    out = pool.submit(call(faulty.length_reward)).outcome()
    assert out.error is None and out.value == [1.0, 2.0, 3.0]
    assert 0 < out.start <= out.end <= time.monotonic()


def test_every_fault_is_one_line_and_the_pool_keeps_serving(pool):
    t0 = time.monotonic()
    pending = [pool.submit(call(f)) for f in (faulty.sleeps_forever, faulty.raises,
                                                faulty.kills_worker)]  # fmt: skip
    hang, raised, killed = (p.outcome() for p in pending)
    assert time.monotonic() - t0 < 60  # the hang was cut by the timeout, not waited out
    assert hang.error == "timed out after 2s (worker killed)"
    assert raised.error == "raised ZeroDivisionError: the user's bug"
    assert killed.error is not None and killed.error.startswith("killed its worker (exit code")
    for out in (hang, raised, killed):
        assert "\n" not in out.error and out.value is None
    assert pool.submit(call(faulty.length_reward)).outcome().value == [1.0, 2.0, 3.0]


def test_no_workers_runs_in_the_calling_thread_on_outcome():
    p = RewardPool(workers=0, timeout_s=1.0)
    pending = p.submit(call(faulty.raises))
    assert pending.done()
    assert pending.outcome().error == "raised ZeroDivisionError: the user's bug"
    assert p.submit(call(faulty.length_reward)).outcome().value == [1.0, 2.0, 3.0]
    p.close()


def test_a_closed_pool_refuses_calls():
    p = RewardPool(workers=1, timeout_s=1.0)
    p.close()
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(call(faulty.length_reward))


def test_rewards_are_called_by_keyword_as_trl_calls_them(pool):
    assert pool.submit(call(faulty.reward_len)).outcome().value == [-19.0, -18.0, -17.0]
    c = RewardCall(faulty.accuracy_like, ["p"] * 2, ["3", "4"], {"solution": [3, 3]})
    assert pool.submit(c).outcome().value == [1.0, 0.0]


@pytest.mark.parametrize("workers", [0, 2])
def test_what_a_reward_raises_never_crosses_and_never_breaks_the_pool(workers):
    p = RewardPool(workers=workers, timeout_s=30.0)
    try:
        quit_, judge, own = (p.submit(call(f)).outcome() for f in (
            faulty.quits, faulty.raises_unpicklable, faulty.own_timeout))  # fmt: skip
        assert quit_.error == "raised SystemExit: 3"
        assert judge.error == "raised _NeedsKeywords: judge unavailable"
        assert own.error == "raised TimeoutError: database call timed out"  # not the pool's
        assert p.submit(call(faulty.length_reward)).outcome().value == [1.0, 2.0, 3.0]
    finally:
        p.close()


TRAINER = """
from specrl.rewards.pool import RewardCall, RewardPool
from tests.rewards import faulty

if __name__ == "__main__":
    pool = RewardPool(workers=1, timeout_s=3600)
    call = RewardCall(faulty.notes_pid_then_hangs, ["p"], ["c"], {"note": [NOTE]})
    pool.submit(call).outcome()  # never returns: the trainer is killed meanwhile
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_hanging_reward_does_not_outlive_a_killed_trainer(tmp_path):
    note = tmp_path / "worker.pid"
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.replace("NOTE", repr(str(note))))
    env = os.environ | {"PYTHONPATH": os.getcwd()}  # ``tests.rewards.faulty`` importable
    trainer = subprocess.Popen([sys.executable, str(script)], cwd=os.getcwd(), env=env)
    try:
        deadline = time.monotonic() + 120
        while not note.exists() or not note.read_text():
            assert time.monotonic() < deadline and trainer.poll() is None
            time.sleep(0.1)
        worker = int(note.read_text())
        assert _alive(worker)
    finally:
        trainer.kill()  # SIGKILL: no cleanup of its own runs
        trainer.wait()
    deadline = time.monotonic() + 60  # a liveness bound, not a timing claim
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(worker), f"reward worker {worker} outlived its killed trainer"
