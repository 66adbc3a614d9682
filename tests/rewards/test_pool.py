"""The reward pool: calls run in worker processes, and nothing a reward does (hang, raise, kill
its worker) reaches the caller as anything but a one-line error; the pool keeps serving."""

from __future__ import annotations

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
