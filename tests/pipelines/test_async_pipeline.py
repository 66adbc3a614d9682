"""The asynchronous pipeline: equal to sync at staleness 0, bounded staleness, a fake backend
drives both loops, bad pipeline options are refused with one line."""

from __future__ import annotations

import json

import pytest
import torch

from specrl.config import ConfigError
from specrl.pipelines.async_ import admit
from specrl.pipelines.loop import METRIC_KEYS, TIMING_KEYS
from specrl.pipelines.step import Batch
from specrl.pipelines.train import train
from tests.pipelines.pipeline_fakes import (
    FakeBackend,
    draw_prompts,
    fake_parts,
    tiny_config,
    tiny_parts,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


@pytest.mark.parametrize(
    ("spec", "placement"), [("none", "inline"), ("suffix", "inline"), ("suffix", "process")]
)
def test_async_at_staleness_zero_equals_sync(tmp_path, spec, placement):
    """Same seeds, same metrics (timings aside), same final weights; also with the engine in a
    worker process (weights through shared memory, drafter state across the pipe)."""
    common = (f"rollout.spec={spec}", "run.steps=5", "rollout.temperature=0.8",
              "rollout.max_new_tokens=10")  # fmt: skip
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    train(tiny_parts(tiny_config(*common), num_train=3), str(sync_dir), progress=False)
    threads = ["rollout.threads=1"] if placement == "process" else []
    cfg = tiny_config(*common, "pipeline.mode=async", "pipeline.max_staleness=0",
                      f"rollout.placement={placement}", *threads)  # fmt: skip
    parts = tiny_parts(cfg, num_train=3)
    try:
        train(parts, str(async_dir), progress=False)
    finally:
        parts.backend.close()
    a, b = _rows(sync_dir / "metrics.jsonl"), _rows(async_dir / "metrics.jsonl")
    assert len(a) == 5 and _untimed(a) == _untimed(b)
    assert all(r["staleness_max"] == 0 for r in b)
    assert _untimed(_rows(sync_dir / "eval.jsonl")) == _untimed(_rows(async_dir / "eval.jsonl"))
    last = "checkpoints/step_000005/policy.safetensors"
    assert (sync_dir / last).read_bytes() == (async_dir / last).read_bytes()


@pytest.mark.parametrize("bound", [1, 2])
def test_staleness_bound_holds_and_is_used(tmp_path, bound):
    """The producer runs ahead (the fake backend is instant), never past the bound."""
    backend = FakeBackend()
    cfg = tiny_config("pipeline.mode=async", f"pipeline.max_staleness={bound}", "run.steps=8",
                      "run.eval_every=0")  # fmt: skip
    rows = train(fake_parts(cfg, backend), str(tmp_path), progress=False)
    assert [r["step"] for r in rows] == list(range(8))
    for r in rows:
        assert r["staleness_max"] <= bound and r["step"] - r["behaviour_version"] <= bound
        assert sum(r["staleness_hist"].values()) == r["gen_tokens"]
    assert max(r["staleness_max"] for r in rows) == bound  # it did run ahead
    gens = [v for what, v in backend.calls if what == "generate"]
    assert all(step - v <= bound for step, v in enumerate(gens))


def test_a_batch_past_the_bound_is_refused():
    parts = fake_parts(tiny_config("pipeline.mode=async", "pipeline.max_staleness=1"))
    version, bound = 5, parts.cfg.pipeline.max_staleness
    stale = Batch(5, [], [], torch.zeros(1, 2), torch.zeros(1, 2), behaviour_version=3)
    with pytest.raises(RuntimeError, match="staleness bound broken"):
        admit(version, bound, stale)
    fresh = Batch(5, [], [], torch.zeros(1, 2), torch.zeros(1, 2), behaviour_version=4)
    admit(version, bound, fresh)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fake_backend_drives_the_pipeline(tmp_path, mode):
    """No engine anywhere: the pipeline knows only the backend seam. Every learner update is
    pushed once, in order, with the learner's weights."""
    backend = FakeBackend()
    cfg = tiny_config(f"pipeline.mode={mode}", "run.steps=4")
    parts = fake_parts(cfg, backend)
    rows = train(parts, str(tmp_path), progress=False)
    for row in rows:
        assert set(METRIC_KEYS) <= set(row)
        assert all(isinstance(row[k], int | float) for k in METRIC_KEYS)
    assert [v for v, _ in backend.checksums] == [1, 2, 3, 4]
    final = float(sum(p.double().sum() for p in parts.learner.model.parameters()))
    assert backend.checksums[-1][1] == pytest.approx(final, rel=1e-12)
    assert len({c for _, c in backend.checksums}) == 4  # the weights moved every step
    asked = [ids for kind, ids in backend.prompts if kind == "train"]
    expected = [[parts.codec.prompt_ids(p) for p in draw_prompts(parts, s)] for s in range(4)]
    assert asked == expected  # each step's prompts, once, in order


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["pipeline.mode=fast"], "pipeline.mode"),
        (["pipeline.max_staleness=-1"], "pipeline.max_staleness"),
        (["pipeline.update=sometimes"], "pipeline.update"),
        (["pipeline.in_flight_tokens=maybe"], "pipeline.in_flight_tokens"),
        (["pipeline.update=in_flight"], "needs pipeline.mode='async'"),
        (["pipeline.mode=async", "pipeline.update=in_flight", "pipeline.max_staleness=0"],
         "max_staleness >= 1"),
        (["pipeline.mode=async", "rollout.top_k=5"], "learner.correction='tis'"),
        (["learner.correction=tiss"], "did you mean tis"),
        (["learner.is_cap=0"], "learner.is_cap"),
        (["rollout.placement=gpu"], "rollout.placement"),
        (["pipeline.max_staleness=3"], "max_staleness=3 needs pipeline.mode='async'"),
        (["pipeline.in_flight_tokens=keep"], "in_flight_tokens='keep' needs pipeline.update"),
        (["rollout.threads=1"], "rollout.threads=1 needs the engine in a worker process"),
    ],
)  # fmt: skip
def test_bad_pipeline_options_fail_with_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        fake_parts(tiny_config(*overrides))
    assert "\n" not in str(err.value)


def test_in_flight_needs_a_backend_that_can(tmp_path):
    cfg = tiny_config("pipeline.mode=async", "pipeline.update=in_flight")
    with pytest.raises(ConfigError, match="FakeBackend backend cannot update weights between"):
        fake_parts(cfg)


def test_in_flight_refuses_a_drafter_that_cannot_follow_before_work(tmp_path):
    cfg = tiny_config("pipeline.mode=async", "pipeline.update=in_flight", "rollout.spec=self")
    with pytest.raises(ConfigError, match="not supported with the 'self' drafter"):
        tiny_parts(cfg)
    tiny_parts(tiny_config("pipeline.mode=async", "pipeline.update=in_flight",
                           "pipeline.in_flight_tokens=keep", "rollout.spec=self"))  # fmt: skip


@pytest.mark.parametrize("tokens", ["reverify", "keep"])
def test_async_in_flight_run_keeps_the_bound(tmp_path, tokens):
    """In-flight updates on the inline native backend: every token's staleness stays within the
    bound, and each step's histogram counts every generated token."""
    cfg = tiny_config("pipeline.mode=async", "pipeline.update=in_flight", "run.steps=6",
                      f"pipeline.in_flight_tokens={tokens}", "pipeline.max_staleness=1",
                      "rollout.max_new_tokens=24", "rollout.spec=suffix")  # fmt: skip
    rows = train(tiny_parts(cfg), str(tmp_path), progress=False)
    assert [r["policy_version"] for r in rows] == list(range(1, 7))
    for r in rows:
        assert r["staleness_max"] <= 1 and sum(r["staleness_hist"].values()) == r["gen_tokens"]
        if tokens == "keep":  # nothing is re-verified or thrown away
            assert r["reverified_tokens"] == 0 and r["discarded_tokens"] == 0
        else:  # what re-verification does not keep, it discards
            assert r["reused_tokens"] + r["discarded_tokens"] == r["reverified_tokens"]
