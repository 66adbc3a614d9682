"""Weight-sync guardrails: fingerprints agree across the learner/engine cast and processes and
change when a tensor is damaged; a backend that skips, stales or corrupts a policy or drafter
update fails the run (or the push) with one ``WeightSyncError`` line; correct backends (inline
and worker process, sync and async) pass the check step after step."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import replace

import pytest
import torch

from specrl.backends import Served, plan_rollout
from specrl.backends.native import NativeBackend, build_native
from specrl.backends.process import build_process
from specrl.engine.engine import Engine
from specrl.models.fingerprint import SAMPLES, fingerprint, fingerprint_dtype, positions
from specrl.models.weights import engine_copy
from specrl.pipelines.guard import WeightGuard, WeightSyncError
from specrl.pipelines.rundir import RunDir
from specrl.pipelines.train import train
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig
from tests.backends.sabotage import Sabotaged
from tests.conftest import make_tiny
from tests.pipelines.pipeline_fakes import tiny_config, tiny_parts

PROCESS = ("rollout.placement=process", "rollout.threads=1")
ASYNC = ("pipeline.mode=async", "pipeline.max_staleness=1")
BIG = "big.weight"  # a synthetic matrix larger than SAMPLES: only a sample is hashed


def big_named(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        BIG: torch.randn(2048, 64, generator=gen),  # [2048, 64]: 131072 > SAMPLES elements
        "bias": torch.randn(64, generator=gen),  # [64]
        "index": torch.arange(10),  # an index buffer: hashed as is
    }


# --------------------------------------------------------------------------- fingerprints


def test_fingerprint_agrees_across_the_engine_cast():
    """A learner's fp32 weights cast to the engine's dtype fingerprint as the engine's copy."""
    model = make_tiny()
    named = dict(model.named_parameters())
    for dtype in (torch.float32, torch.bfloat16):
        engine = dict(engine_copy(model, dtype).named_parameters())
        fp = fingerprint(named, dtype)
        assert fp == fingerprint(engine) == fingerprint(engine, dtype)
        assert fingerprint_dtype(fp) == dtype
    assert fingerprint(named, torch.bfloat16) != fingerprint(named, torch.float32)


def test_fingerprint_is_the_same_in_another_process():
    """Sampled positions come from the names, not from the process (no ``hash()`` salt)."""
    code = (
        "import torch; from specrl.models.fingerprint import fingerprint;"
        "g = torch.Generator().manual_seed(0);"
        "t = {'big.weight': torch.randn(2048, 64, generator=g)};"
        "print(fingerprint(t, torch.bfloat16))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    gen = torch.Generator().manual_seed(0)
    here = fingerprint({BIG: torch.randn(2048, 64, generator=gen)}, torch.bfloat16)
    assert out.stdout.strip() == here


def damaged(named: Mapping[str, torch.Tensor], how: str) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in named.items()}
    with torch.no_grad():
        if how == "scale":
            out[BIG].mul_(1.01)
        elif how == "offset":
            out[BIG].add_(1e-2)
        elif how == "zero_row":
            out[BIG][1234].zero_()
        elif how == "bias":
            out["bias"][5] += 0.5  # a small tensor is hashed whole
        elif how == "index":
            out["index"][0] = 7
    return out


@pytest.mark.parametrize("how", ["scale", "offset", "zero_row", "bias", "index"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fingerprint_changes_with_a_damaged_tensor(how, dtype):
    named = big_named()
    assert fingerprint(damaged(named, how), dtype) != fingerprint(named, dtype)


def test_fingerprint_samples_big_tensors_and_probes_every_row():
    idx = positions(BIG, torch.Size([2048, 64]))
    assert idx is not None and idx.shape == (SAMPLES + 2048,)
    assert torch.equal(torch.unique(idx[SAMPLES:] // 64), torch.arange(2048))  # each row once
    assert positions("bias", torch.Size([64])) is None  # hashed whole
    assert fingerprint(big_named(0)) != fingerprint(big_named(1))  # other weights
    with pytest.raises(ValueError, match="not a weight fingerprint"):
        fingerprint_dtype("deadbeef")


# --------------------------------------------------------------------------- sabotage


def _rows(run: str) -> list[dict]:
    return RunDir(run).rows(RunDir(run).metrics)


def _fails(parts, run: str, version: int, *words: str) -> None:
    with pytest.raises(WeightSyncError) as info:
        train(parts, run, progress=False)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"weight sync check failed at version {version}:"), message
    for word in words:
        assert word in message
    assert len(_rows(run)) < parts.cfg.run.steps  # the run ended there


@pytest.mark.parametrize(
    "how, words",
    [
        ("skip", ["still serves policy version 1", "(update skipped)"]),
        ("stale", ["serves policy fingerprint", "the learner pushed", "skipped or corrupted"]),
        ("scale", ["serves policy fingerprint", "the learner pushed", "skipped or corrupted"]),
        ("zero_row", ["serves policy fingerprint", "skipped or corrupted"]),
    ],
)
def test_a_sabotaged_policy_update_fails_the_sync_run(tmp_path, how, words):
    parts = tiny_parts(tiny_config("rollout.spec=ngram", "run.steps=4", "run.eval_every=0"))
    parts = replace(parts, backend=Sabotaged(parts.backend, how, version=2))
    _fails(parts, str(tmp_path), 2, *words)
    rows = _rows(str(tmp_path))
    # a skip is seen after the next rollout (step 2 does not learn); a bad update at its push
    assert [r["step"] for r in rows] == ([0, 1] if how == "skip" else [0])


def test_a_backend_serving_other_initial_weights_fails_at_the_first_step(tmp_path):
    parts = tiny_parts(tiny_config("run.steps=2", "run.eval_every=0"))
    backend = build_native(plan_rollout(parts.cfg), make_tiny(1))  # not the learner's weights
    parts = replace(parts, backend=backend)
    _fails(parts, str(tmp_path), 0, "serves policy fingerprint")
    assert _rows(str(tmp_path)) == []


def test_a_sabotaged_update_fails_the_async_run_with_a_worker(tmp_path, one_thread):
    cfg = tiny_config(*PROCESS, "pipeline.mode=async", "pipeline.max_staleness=1",
                      "run.steps=4", "run.eval_every=0")  # fmt: skip
    parts = tiny_parts(cfg)
    inner = parts.backend
    parts = replace(parts, backend=Sabotaged(inner, "stale", version=2))
    try:
        _fails(parts, str(tmp_path), 2, "the learner pushed")
    finally:
        inner.close()


# --------------------------------------------------------------------------- correct backends


@pytest.mark.parametrize(
    "overrides",
    [
        ("rollout.spec=ngram",),
        ("rollout.spec=suffix", "model.dtype=bf16"),
        (*ASYNC, "rollout.spec=suffix"),
        (
            *ASYNC,
            "pipeline.update=in_flight",
            "pipeline.in_flight_tokens=keep",
            "rollout.spec=self",
            "rollout.max_new_tokens=16",
        ),  # fmt: skip
        (*PROCESS, *ASYNC, "model.dtype=bf16"),
    ],
    ids=["sync", "sync-bf16", "async", "async-in-flight", "async-worker-bf16"],
)
def test_correct_backends_pass_the_check_every_step(tmp_path, overrides, one_thread):
    parts = tiny_parts(tiny_config(*overrides, "run.steps=5", "run.eval_every=0"))
    seen: list[Served] = []
    verify = parts.guard.verify

    def spy(served, floor=None):
        seen.append(served)
        verify(served, floor)

    parts.guard.verify = spy
    try:
        rows = train(parts, str(tmp_path), progress=False)
        served = parts.backend.served()
    finally:
        parts.backend.close()
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert served.policy_version == 5
    assert served.policy == fingerprint(
        dict(parts.learner.model.named_parameters()), parts.guard.dtype
    )
    checked = {s.policy_version for s in seen if s.policy is not None}
    assert checked >= {0, 5}  # the initial weights and the last push were compared
    assert len({s.policy for s in seen}) >= 3  # the weights did change between versions


# --------------------------------------------------------------------------- drafter updates


def head_state(seed: int = 1) -> dict[str, torch.Tensor]:
    """A learned head's tensors, perturbed (float32, as a drafter trainer would push them)."""
    from specrl.models.heads import DraftHead

    torch.manual_seed(0)
    head = DraftHead(make_tiny(0), "eagle3")
    gen = torch.Generator().manual_seed(seed)
    return {
        n: t + 0.1 * torch.randn(t.shape, generator=gen) if t.is_floating_point() else t
        for n, t in head.state_dict().items()
    }


def eagle_native() -> NativeBackend:
    torch.manual_seed(0)
    return NativeBackend(Engine(make_tiny(0), spec=SpecConfig("eagle3", 3)))


def eagle_worker(tmp_path):
    from specrl.models.heads import DraftHead, save_head

    torch.manual_seed(0)
    head = save_head(DraftHead(make_tiny(0), "eagle3"), tmp_path / "head")
    cfg = tiny_config(*PROCESS, "rollout.spec=eagle3", f"rollout.drafter_path={head}",
                      "model.dtype=bf16")  # fmt: skip
    return build_process(plan_rollout(cfg), make_tiny(0))


@pytest.mark.parametrize("where", ["inline", "worker"])
def test_drafter_updates_are_checked(tmp_path, where, one_thread):
    backend = eagle_native() if where == "inline" else eagle_worker(tmp_path)
    try:
        guard = WeightGuard()
        for version in (1, 2):
            state = head_state(seed=version)
            guard.push_drafter(backend, state, version)
            served = backend.served()
            assert served.drafter_version == version
            assert served.drafter == fingerprint(state, fingerprint_dtype(served.drafter))
        assert (fingerprint_dtype(served.drafter) == torch.bfloat16) == (where == "worker")
        for how, words in (
            ("skip", "still serves drafter version 2 (update skipped)"),
            ("stale", "skipped or corrupted"),
            ("scale", "skipped or corrupted"),
        ):
            sabotaged = Sabotaged(backend, how, version=3, drafter=True)
            sabotaged.last["drafter"] = head_state(seed=2)  # what version 2 pushed
            with pytest.raises(WeightSyncError, match="at drafter version 3") as info:
                WeightGuard().push_drafter(sabotaged, head_state(seed=3), 3)
            assert words in str(info.value) and "\n" not in str(info.value)
            backend.update_drafter(head_state(seed=2), 2)  # back to version 2 for the next case
    finally:
        backend.close()


def test_model_free_drafters_report_no_drafter_fingerprint():
    backend = build_native(plan_rollout(tiny_config("rollout.spec=suffix")), make_tiny())
    WeightGuard().push_drafter(backend, {"unused": torch.ones(3)}, 4)  # nothing to compare
    assert backend.served() == Served(0, backend.served().policy, 4, None)


# --------------------------------------------------------------------------- served()


def test_served_reads_the_engine_itself(one_thread):
    """A tensor damaged inside the engine after a correct update is seen at the next check."""
    model = make_tiny()
    backend = build_native(plan_rollout(tiny_config()), model)
    guard = WeightGuard()
    guard.remember(0, dict(model.named_parameters()))
    guard.push(backend, dict(make_tiny(1).named_parameters()), 1)
    backend.engine.model.embed.weight.data[3].zero_()  # no update, no version counter moved
    with pytest.raises(WeightSyncError, match="at version 1: the rollout backend serves policy"):
        guard.verify(backend.served())


def test_served_during_a_generate_call_answers_at_once(monkeypatch, one_thread):
    """While a call runs, ``served`` gives the last idle record (an update received meanwhile is
    pending); after the call it is applied and fingerprinted."""
    backend = build_native(plan_rollout(tiny_config()), make_tiny())
    before = backend.served()
    entered, release = threading.Event(), threading.Event()
    generate = backend.engine.generate

    def blocking(requests, spec=None, on_done=None):
        entered.set()
        release.wait()
        return generate(requests, spec=spec, on_done=on_done)

    monkeypatch.setattr(backend.engine, "generate", blocking)
    caller = threading.Thread(
        target=backend.generate, args=([Request([2, 3], SamplingParams(max_new_tokens=2))],)
    )
    caller.start()
    try:
        assert entered.wait(60)
        new = dict(make_tiny(1).named_parameters())
        backend.update_weights(new, 1)  # pending: the call is running
        assert backend.served() == before  # answered without waiting for the call
    finally:
        release.set()
        caller.join(60)
    after = backend.served()
    assert after.policy_version == 1 and after.policy == fingerprint(new, torch.float32)


def test_a_sabotaged_drafter_push_fails_the_async_run(tmp_path, monkeypatch, one_thread):
    """The async learner trains the head while the producer generates; a damaged drafter update
    is found after the next rollout and ends the run with one line naming the version."""
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))  # no head: trained from scratch
    cfg = tiny_config(*ASYNC, "rollout.spec=eagle3", "rollout.max_new_tokens=12",
                      "drafter.vocab=0", "drafter.mode=online", "run.steps=6",
                      "run.eval_every=0")  # fmt: skip
    parts = tiny_parts(cfg)
    monkeypatch.setattr(parts.drafter.trainer, "_affordable", lambda: 1)  # a push every step
    parts = replace(parts, backend=Sabotaged(parts.backend, "scale", version=2, drafter=True))
    with pytest.raises(WeightSyncError, match="at drafter version 2") as info:
        train(parts, str(tmp_path / "run"), progress=False)
    assert "skipped or corrupted" in str(info.value) and "\n" not in str(info.value)
    assert len(_rows(str(tmp_path / "run"))) < 6  # the run ended there
