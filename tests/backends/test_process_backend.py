"""The process backend serves exactly what the inline one serves, survives a concurrent update,
and fails loudly (never hangs) when its worker dies or is closed."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
import torch

from specrl.backends import GROUP_DONE, build_backend, plan_rollout
from specrl.backends.base import Rollout
from specrl.backends.native import NativeBackend, build_native
from specrl.backends.process import ProcessBackend, build_process
from specrl.config import ConfigError
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from tests.conftest import make_tiny
from tests.pipelines.pipeline_fakes import tiny_config

PROCESS = ("rollout.placement=process", "rollout.threads=1")
REQUESTS = [
    Request([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_new_tokens=12, n=2)),
    Request([5, 6, 7, 8], SamplingParams(max_new_tokens=10, seed=3, n=3)),
    Request([9, 4, 9, 4, 9], SamplingParams(temperature=0.7, top_k=8, max_new_tokens=10, seed=8)),
    Request([], SamplingParams(seed=1)),  # an error completion; the others still run
]
FIELDS = ("token_ids", "logprobs", "raw_logprobs", "finish_reason", "error", "seed",
          "policy_version", "token_versions", "drafted", "accepted")  # fmt: skip


def call_within(seconds: float, fn: Callable[[], object]) -> object:
    """``fn()``'s result or exception, failing the test if it takes longer than ``seconds``."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (handed back to the test)
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"no answer within {seconds} s (a hang)"
    return box.get("error", box.get("value"))


def assert_same(a: Rollout, b: Rollout) -> None:
    assert len(a.completions) == len(b.completions)
    for x, y in zip(a.completions, b.completions, strict=True):
        for name in FIELDS:
            assert getattr(x, name) == getattr(y, name), name
    assert (a.stats.drafted, a.stats.accepted) == (b.stats.drafted, b.stats.accepted)


def perturbed(model: torch.nn.Module, scale: float = 0.5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {n: p + scale * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def pair(one_thread) -> tuple[ProcessBackend, NativeBackend]:
    """A worker (suffix drafter) and an inline backend over the same tiny model and config;
    every test leaves the two in step (same weights, same suffix history)."""
    cfg = tiny_config(*PROCESS, "rollout.spec=suffix")
    model = make_tiny()
    process = build_backend(plan_rollout(cfg), model)
    assert isinstance(process, ProcessBackend)
    yield process, build_native(plan_rollout(cfg), model)
    process.close()


@pytest.fixture
def worker(one_thread) -> ProcessBackend:
    """A worker of its own (for tests that kill or close it)."""
    backend = build_process(plan_rollout(tiny_config(*PROCESS)), make_tiny())
    yield backend
    backend.close()


@pytest.mark.parametrize("method", ["none", "ngram", "suffix"])
def test_process_matches_inline(pair, method):
    process, inline = pair
    # the same features but GROUP_DONE (its completions come back when a call ends)
    assert process.spec == inline.spec and process.features == inline.features - {GROUP_DONE}
    spec = None if method == "suffix" else dataclasses.replace(inline.spec, method=method)
    for _ in range(2):  # the second call drafts from the suffix drafter's history
        a, b = process.generate(REQUESTS, spec), inline.generate(REQUESTS, spec)
        assert_same(a, b)
    assert (a.stats.drafted > 0) == (method != "none")
    assert a.completions[-1].finish_reason == "error"


def test_update_weights_then_still_identical(pair):
    process, inline = pair
    before = process.generate(REQUESTS)
    inline.generate(REQUESTS)  # keep the suffix histories in step
    new = perturbed(make_tiny())
    process.update_weights(new, version=1)
    inline.update_weights(new, version=1)
    for t in new.values():
        t.zero_()  # the caller may reuse its tensors at once
    assert process.versions().policy == 1
    a, b = process.generate(REQUESTS), inline.generate(REQUESTS)
    assert_same(a, b)
    assert {v for c in a.completions for v in c.token_versions} == {1}
    assert [c.token_ids for c in a.completions] != [c.token_ids for c in before.completions]


def test_bad_update_is_refused_before_anything_moves(pair):
    process, _ = pair
    version = process.versions().policy
    named = dict(make_tiny().named_parameters())
    named.pop(next(iter(named)))
    with pytest.raises(ValueError, match="no tensor for parameter"):
        process.update_weights(named, version=version + 7)
    assert process.versions().policy == version


def test_update_while_generating_does_not_wait_for_it(pair):
    process, inline = pair
    version = process.versions().policy
    # long enough (several batches of 200 tokens) to still run when the update arrives
    long = [Request([1, 2, 3], SamplingParams(max_new_tokens=200, seed=4, n=512))]
    done: dict[str, float] = {}

    def generate() -> None:
        done["rollout"] = process.generate(long, dataclasses.replace(process.spec, method="none"))
        done["generate"] = time.monotonic()

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    time.sleep(0.3)
    new = perturbed(make_tiny(), 0.1)
    process.update_weights(new, version=version + 1)
    done["update"] = time.monotonic()
    assert process.versions().policy == version + 1  # announced at once, applied after the call
    thread.join(60)
    assert done["update"] < done["generate"], "update_weights waited for the generate call"
    assert {c.policy_version for c in done["rollout"].completions} == {version}
    inline.update_weights(new, version=version + 1)
    after = process.generate(REQUESTS)
    assert after.completions[0].token_versions[0] == version + 1
    assert_same(after, inline.generate(REQUESTS))


def test_suffix_state_round_trip(pair):
    process, inline = pair
    inline_state = inline.state_dict()
    state = process.state_dict()
    assert state == inline_state and state["drafter"]["groups"]
    assert json.loads(json.dumps(state)) == state
    process.load_state_dict({"drafter": {"name": "suffix", "groups": []}})
    assert process.state_dict()["drafter"]["groups"] == []
    process.load_state_dict(state)
    assert process.state_dict() == state
    with pytest.raises(ValueError, match="drafter state of 'ngram'"):  # the worker's own type
        process.load_state_dict({"drafter": {"name": "ngram", "groups": []}})
    with pytest.raises(RuntimeError, match="KeyError in the rollout worker: 'groups'"):
        process.load_state_dict({"drafter": {"name": "suffix"}})
    assert process.state_dict() == state


def test_update_drafter_reaches_the_worker(pair):
    process, _ = pair
    process.update_drafter({"unused": torch.ones(3)}, version=5)  # suffix: model-free
    assert process.versions().drafter == 5


def test_killed_worker_raises_instead_of_hanging(worker):
    long = [Request([1, 2, 3], SamplingParams(max_new_tokens=250, seed=2, n=256))]
    waiting: list[object] = []
    thread = threading.Thread(
        target=lambda: waiting.append(call_within(20, lambda: worker.generate(long)))
    )
    thread.start()
    time.sleep(0.5)  # the generate call is under way
    os.kill(worker.pid, signal.SIGKILL)
    thread.join(25)
    for err in (waiting[0], call_within(5, lambda: worker.generate(REQUESTS[:1]))):
        assert isinstance(err, RuntimeError), err
        assert "rollout worker process died (exit code -9)" in str(err)
    assert isinstance(call_within(5, worker.versions), RuntimeError)
    call_within(20, worker.close)


def test_close_is_idempotent_and_final(worker):
    process = worker._worker.process
    assert worker.generate(REQUESTS[:1]).completions[0].token_ids
    call_within(20, worker.close)
    assert process.exitcode == 0  # it exited by itself, asked to
    worker.close()
    with pytest.raises(RuntimeError, match="rollout backend is closed"):
        worker.generate(REQUESTS[:1])


def test_startup_error_is_the_workers_message(tmp_path):
    damaged = tmp_path / "head"  # the plan finds a head; only the worker's loading fails
    damaged.mkdir()
    (damaged / "head.json").write_text("[]")
    cfg = tiny_config(*PROCESS, "rollout.spec=eagle3", f"rollout.drafter_path={damaged}",
                      "drafter.mode=frozen")  # fmt: skip
    err = call_within(60, lambda: build_process(plan_rollout(cfg), make_tiny()))
    assert isinstance(err, ConfigError), err
    assert str(err).startswith(f"bad value for rollout.spec: {damaged}")
