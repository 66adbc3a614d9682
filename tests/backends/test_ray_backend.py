"""The Ray backend: N rollout workers as Ray actors behind the ``RolloutBackend`` protocol.

One local Ray for the module (``RaySession``: bound to 127.0.0.1), shut down at its end, after
which no Ray process of this test process may be left. The workers serve what a single backend
serves (same tokens for the same seeds), a weight update is one ``ray.put`` fetched by every
worker, the weight-sync guard names a worker that skipped an update, and a worker killed in
the middle of a call is replaced (with the newest weights) without changing the result.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest
import torch

ray = pytest.importorskip("ray")

from specrl.backends import GROUP_DONE, build_backend, plan_rollout  # noqa: E402
from specrl.backends.base import Served, Versions  # noqa: E402
from specrl.backends.native import build_native  # noqa: E402
from specrl.backends.ray_ import CONTROL, RayBackend, agreed  # noqa: E402
from specrl.backends.ray_session import import_ray  # noqa: E402
from specrl.config import ConfigError  # noqa: E402
from specrl.models.fingerprint import fingerprint  # noqa: E402
from specrl.pipelines.guard import WeightGuard, WeightSyncError  # noqa: E402
from specrl.rollout_types import Request  # noqa: E402
from specrl.sampling import SamplingParams  # noqa: E402
from tests.backends.ray_helpers import host, listeners, local_ray, ray_processes, wait_gone  # noqa: E402
from tests.backends.test_process_backend import call_within, perturbed  # noqa: E402
from tests.conftest import ON_SERVER_WORKER, make_tiny  # noqa: E402
from tests.pipelines.pipeline_fakes import tiny_config  # noqa: E402

pytestmark = ON_SERVER_WORKER  # one local Ray cluster at a time (tests/conftest.py)

RAY = ("cluster.rollout_workers=2", "cluster.threads=1", "rollout.spec=ngram")
REQUESTS = [
    Request([5, 6, 7, 8], SamplingParams(max_new_tokens=10, seed=3, n=3)),
    Request(
        [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_new_tokens=12, n=2, seed=2)
    ),
    Request([9, 4, 9, 4, 9], SamplingParams(temperature=0.7, top_k=8, max_new_tokens=10, seed=8)),
    Request([], SamplingParams(seed=1)),  # an error completion; the others still run
    Request([7, 3, 7, 3], SamplingParams(temperature=0.9, max_new_tokens=14, seed=5, n=4)),
]
EXACT = ("request_index", "sample_index", "token_ids", "finish_reason", "error", "seed",
         "policy_version", "token_versions", "drafted", "accepted")  # fmt: skip


@pytest.fixture(scope="module")
def session(one_thread):
    """A local Ray for the module; at its end nothing of it may be left running."""
    yield from local_ray()


@pytest.fixture(scope="module")
def pair(session) -> tuple[RayBackend, object]:
    """Two Ray workers and an inline native backend over the same tiny model and config."""
    cfg = tiny_config(*RAY)
    backend = build_backend(plan_rollout(cfg), make_tiny())
    assert isinstance(backend, RayBackend)
    yield backend, build_native(plan_rollout(cfg), make_tiny())
    backend.close()


def assert_same(a, b, exact_logprobs: bool) -> None:
    assert len(a.completions) == len(b.completions)
    for x, y in zip(a.completions, b.completions, strict=True):
        for name in EXACT:
            assert getattr(x, name) == getattr(y, name), name
        for name in ("logprobs", "raw_logprobs"):
            if exact_logprobs:
                assert getattr(x, name) == getattr(y, name), name
            else:  # another batch composition: fp32 rounding differs, not the tokens
                torch.testing.assert_close(getattr(x, name), getattr(y, name), rtol=0, atol=1e-4)
    assert (a.stats.drafted, a.stats.accepted) == (b.stats.drafted, b.stats.accepted)


def push(backend, version: int, seed: int) -> dict[str, torch.Tensor]:
    named = perturbed(make_tiny(seed), scale=0.3)
    backend.update_weights(named, version)
    return named


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_workers_match_a_single_backend(pair, method):
    backend, inline = pair
    # the same features but GROUP_DONE (its completions come back when a call ends)
    assert backend.spec == inline.spec and backend.features == inline.features - {GROUP_DONE}
    spec = backend.spec if method == "ngram" else type(backend.spec)("none", 0)
    out, ref = backend.generate(REQUESTS, spec), inline.generate(REQUESTS, spec)
    assert_same(out, ref, exact_logprobs=False)
    errors = [c.request_index for c in out.completions if c.finish_reason == "error"]
    assert errors == [3]  # the bad request keeps its place
    assert (out.stats.drafted > 0) == (method == "ngram")
    assert out.faults == 0 and len(set(backend.pids())) == 2


def test_no_port_outside_loopback(pair):
    pids = ray_processes()
    try:
        found = listeners(pids)
    except FileNotFoundError:
        pytest.skip("no `ss` here")
    assert found, "no listening socket of a Ray process found: the check would be void"
    outside = [(a, p) for a, p in found if host(a) not in {"127.0.0.1", "[::ffff:127.0.0.1]"}]
    assert not outside, f"Ray listens outside 127.0.0.1: {outside}"


# --------------------------------------------------------------------------- weight updates


def test_one_put_then_every_worker_gets_it(pair, monkeypatch):
    backend, inline = pair
    version = backend.versions().policy + 1
    puts = []
    real_put = ray.put

    def counting_put(value, *args, **kwargs):
        ref = real_put(value, *args, **kwargs)
        puts.append(ref.hex())
        return ref

    monkeypatch.setattr(ray, "put", counting_put)
    named = push(backend, version, seed=1)
    monkeypatch.undo()
    assert len(puts) == 1  # one put for N workers
    fetched = ray.get([a.fetched_ids.options(concurrency_group=CONTROL).remote()
                       for a in backend.actors])  # fmt: skip
    assert [ids[-1] for ids in fetched] == puts * 2  # each worker fetched that object
    served = backend.served()
    assert served.policy_version == version
    assert served.policy == fingerprint(named, torch.float32)
    inline.update_weights(named, version)
    for t in named.values():
        t.zero_()  # the caller may reuse its tensors at once
    out, ref = backend.generate(REQUESTS), inline.generate(REQUESTS)
    assert_same(out, ref, exact_logprobs=False)
    assert {v for c in out.completions for v in c.token_versions} == {version}


def test_bad_update_is_refused_before_the_put(pair, monkeypatch):
    backend, _ = pair
    before = backend.served()
    named = dict(make_tiny().named_parameters())
    named.pop(next(iter(named)))
    monkeypatch.setattr(ray, "put", lambda *a, **k: pytest.fail("put before the check"))
    with pytest.raises(ValueError, match="no tensor for parameter"):
        backend.update_weights(named, before.policy_version + 1)
    monkeypatch.undo()
    assert backend.served() == before


class SkipsWorker:
    """The backend, except that policy updates reach every worker but ``skip``."""

    def __init__(self, backend: RayBackend, skip: int) -> None:
        self.backend, self.skip = backend, skip

    def update_weights(self, named, version):
        ref = ray.put((version, {k: t.detach().clone() for k, t in named.items()}))
        ray.get([a.update_weights.options(concurrency_group=CONTROL).remote([ref])
                 for i, a in enumerate(self.backend.actors) if i != self.skip])  # fmt: skip
        return 0.0

    def __getattr__(self, name):
        return getattr(self.backend, name)


def test_guard_names_the_worker_that_skipped_an_update(pair):
    backend, _ = pair
    guard = WeightGuard(torch.float32)
    version = backend.versions().policy + 1
    guard.push(backend, perturbed(make_tiny(2), scale=0.3), version)  # all agree: passes
    with pytest.raises(WeightSyncError, match=r"worker 1 serves policy version") as e:
        guard.push(SkipsWorker(backend, skip=1), perturbed(make_tiny(3)), version + 1)
    assert "worker 0" in str(e.value) and "\n" not in str(e.value)
    guard.push(backend, perturbed(make_tiny(4), scale=0.3), version + 2)  # in step again


def test_a_pending_update_is_fine_a_missed_one_is_not():
    old, new = Served(3, "float32:aa"), Served(4, "float32:bb")
    # worker 1 received version 4 but holds it pending (busy, or staged in flight)
    assert agreed([(new, Versions(4)), (old, Versions(4))]) == old
    # worker 1 never received version 4 (skipped): named, under version 4
    missed = agreed([(new, Versions(4)), (old, Versions(3))])
    assert missed.policy_version == 4
    assert "worker 1 serves policy version 3 (float32:aa; newest received 3)" in missed.policy
    assert "worker 0 serves version 4" in missed.policy and missed.policy.startswith("float32:")
    # the same version with other contents is never fine
    clash = agreed([(new, Versions(4)), (Served(4, "float32:cc"), Versions(4))])
    assert "rollout workers disagree" in clash.policy and clash.drafter is None


# --------------------------------------------------------------------------- faults


def generate_while_killed(backend: RayBackend, index: int) -> tuple[object, int]:
    """Freeze worker ``index`` (it cannot finish anything), start a generate call, then
    SIGKILL the worker: it dies with its chunk unfinished. The call's result and the pid."""
    pid = backend.pids()[index]
    os.kill(pid, signal.SIGSTOP)
    box: dict[str, object] = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", backend.generate(REQUESTS)))
    thread.start()
    os.kill(pid, signal.SIGKILL)
    thread.join(120)
    assert not thread.is_alive(), "generate hung after a worker died"
    return box["out"], pid


def test_killed_worker_is_replaced_and_nothing_changes(pair):
    backend, _ = pair
    version = backend.versions().policy + 1
    named = push(backend, version, seed=5)
    expected = backend.generate(REQUESTS)  # fault-free, at this version
    out, dead = generate_while_killed(backend, 1)
    assert out.faults == 1
    assert_same(out, expected, exact_logprobs=True)  # same chunks, same seeds: identical
    keys = [(c.request_index, c.sample_index) for c in out.completions]
    assert len(keys) == len(set(keys)) == sum(r.sampling.n for r in REQUESTS)
    assert dead not in backend.pids()
    served = backend.served()  # the replacement loaded the newest weights first
    assert (served.policy_version, served.policy) == (version, fingerprint(named, torch.float32))
    assert backend.generate(REQUESTS).faults == 0  # reported once


def test_worker_that_keeps_dying_ends_the_call(session):
    cfg = tiny_config("cluster.rollout_workers=2", "cluster.threads=1", "rollout.spec=suffix",
                      "cluster.max_restarts=1")  # fmt: skip
    with RayBackend(plan_rollout(cfg), make_tiny()) as backend:
        backend.generate(REQUESTS)
        state = backend.state_dict()  # one suffix-drafter history per worker
        assert len(state["workers"]) == 2
        assert all(w["drafter"]["name"] == "suffix" for w in state["workers"])
        backend.load_state_dict(state)
        out, _ = generate_while_killed(backend, 0)
        assert out.faults == 1  # replaced once: allowed
        pid = backend.pids()[0]
        os.kill(pid, signal.SIGKILL)
        error = call_within(120, lambda: backend.generate(REQUESTS))
        assert isinstance(error, RuntimeError)
        assert "rollout worker 0 died 2 times (cluster.max_restarts=1)" in str(error)
        assert "\n" not in str(error)


# --------------------------------------------------------------------------- set-up, close


def test_close_kills_the_workers(session):
    backend = RayBackend(plan_rollout(tiny_config(*RAY)), make_tiny())
    pids = set(backend.pids())
    backend.close()
    backend.close()  # idempotent
    assert not wait_gone(pids)
    assert ray.is_initialized()  # the module's session is not this backend's to end


def test_start_up_errors_are_one_line(session, tmp_path):
    with pytest.raises(ConfigError, match="rollout.placement='process'"):
        RayBackend(plan_rollout(tiny_config(*RAY, "rollout.placement=process")), make_tiny())
    with pytest.raises(ConfigError, match="cluster.worker_cpus"):
        RayBackend(plan_rollout(tiny_config(*RAY, "cluster.worker_cpus=1000")), make_tiny())
    damaged = tmp_path / "head"  # the plan finds a head; only the workers' loading fails
    damaged.mkdir()
    (damaged / "head.json").write_text("[]")
    cfg = tiny_config(*RAY[:2], "rollout.spec=eagle3", f"rollout.drafter_path={damaged}",
                      "drafter.mode=frozen")  # fmt: skip
    with pytest.raises(ConfigError, match="bad value for rollout.spec"):  # a worker's error
        RayBackend(plan_rollout(cfg), make_tiny())


def test_missing_ray_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[ray\]'"):
        import_ray()
