"""Synchronous GRPO pipeline on a tiny model and a synthetic task: metrics, mismatch, errors."""

from __future__ import annotations

import json

import pytest
import torch

from specrl.config import ConfigError
from specrl.models.weights import copy_weights
from specrl.pipelines.build import build_run
from specrl.pipelines.loop import METRIC_KEYS
from specrl.pipelines.train import run_training, train
from tests.conftest import make_tiny
from tests.pipelines.pipeline_fakes import (
    IdCodec,
    ModFourEnv,
    draw_prompts,
    tiny_config,
    tiny_parts,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("spec", ["none", "suffix", "self"])
def test_run_writes_every_metric_key(tmp_path, spec):
    parts = tiny_parts(tiny_config(f"rollout.spec={spec}"))
    summary = run_training(parts, str(tmp_path), progress=False)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        assert set(METRIC_KEYS) <= set(row)
        assert all(isinstance(row[k], int | float) for k in METRIC_KEYS)
        assert row["gen_tokens"] > 0 and row["step_time_s"] >= row["train_time_s"]
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    evals = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert {"greedy_accuracy", "sampled_accuracy"} <= set(evals[0])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000002", "step_000004",
    ]  # fmt: skip
    assert (tmp_path / "config.toml").exists() and (tmp_path / "summary.json").exists()
    if spec == "none":
        assert all(r["acceptance_length"] == 1.0 for r in rows)
        assert "speed_rollout_speedup" not in summary
    else:
        assert summary["speed_rollout_speedup"] > 0
        assert summary["speed_free_draft_speedup"] >= summary["speed_rollout_speedup"]
    if spec == "self":  # q == p: every draft accepted
        assert all(r["acceptance_length"] > 1.5 for r in rows)


@pytest.mark.parametrize("spec", ["none", "ngram", "self"])
def test_engine_learner_logprob_mismatch_fp32(tmp_path, spec):
    rows = train(tiny_parts(tiny_config(f"rollout.spec={spec}")), str(tmp_path), progress=False)
    assert max(r["logprob_delta_mean"] for r in rows) <= 1e-3
    assert max(r["logprob_delta_max"] for r in rows) <= 1e-2


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_learned_head_drafter_serves_rl(tmp_path, monkeypatch, kind):
    """A trained-head drafter from ``rollout.drafter_path`` (or the cached default) drafts the
    rollouts of a GRPO run with engine/learner logprobs in agreement; no head and a frozen
    drafter -> clear error (the default trains one from scratch: test_online_drafter.py)."""
    from specrl.models.heads import DraftHead, save_head
    from specrl.paths import drafter_cache_dir as default_out

    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=f"specrl train-drafter --drafter {kind}"):
        tiny_parts(tiny_config(f"rollout.spec={kind}", "drafter.mode=frozen"))
    assert tiny_parts(tiny_config(f"rollout.spec={kind}")).drafter.trainer.fresh
    torch.manual_seed(0)
    head = save_head(DraftHead(make_tiny(0), kind), tmp_path / "head")
    parts = tiny_parts(tiny_config(f"rollout.spec={kind}", f"rollout.drafter_path={head}"))
    rows = train(parts, str(tmp_path / "run"), progress=False)
    assert all(r["acceptance_length"] >= 1.0 for r in rows)
    assert max(r["logprob_delta_mean"] for r in rows) <= 1e-3
    assert parts.backend.engine.stats.drafted > 0  # the head drafted in the last rollout
    save_head(DraftHead(make_tiny(0), kind), default_out(parts.cfg.model.name, kind))
    cached = tiny_parts(tiny_config(f"rollout.spec={kind}", "drafter.mode=frozen"))
    assert cached.drafter.trainer is None  # the cached default head is found


def test_draft_model_drafter_defaults_to_the_cached_one(tmp_path, monkeypatch):
    """``rollout.spec=draft`` without a path: frozen, a clear error naming the command that
    makes one (by default the run trains one from the policy's first layers); then the model
    ``specrl train-drafter --drafter draft`` caches is found and drafts."""
    from specrl.drafters.distill import init_draft, save_draft_model
    from specrl.paths import drafter_cache_dir as default_out

    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="specrl train-drafter --drafter draft"):
        tiny_parts(tiny_config("rollout.spec=draft", "drafter.mode=frozen"))
    assert tiny_parts(tiny_config("rollout.spec=draft")).drafter.trainer.fresh
    cfg = tiny_config("rollout.spec=draft", "drafter.mode=frozen")
    target = make_tiny(0)
    save_draft_model(init_draft(target, 1), default_out(cfg.model.name, "draft"), target.config)
    parts = tiny_parts(cfg)
    assert parts.backend.engine.draft_model.config.num_layers == 1
    train(parts, str(tmp_path / "run"), progress=False)
    assert parts.backend.engine.stats.drafted > 0


def test_prompt_order_is_deterministic_and_cycles():
    cfg = tiny_config("rollout.prompts_per_step=5")
    a, b = tiny_parts(cfg), tiny_parts(cfg)
    steps = range(12)  # 60 prompts over a 24-prompt split: cycles into epochs 1 and 2
    ids = [[p.id for p in draw_prompts(a, s)] for s in steps]
    assert ids == [[p.id for p in draw_prompts(b, s)] for s in steps]
    flat = [i for step in ids for i in step]
    assert sorted(flat[:24]) == sorted(p.id for p in ModFourEnv().prompts("train"))
    assert flat[:24] != flat[24:48]  # each epoch reshuffled
    other = tiny_parts(tiny_config("rollout.prompts_per_step=5", "run.seed=1"))
    assert [p.id for p in draw_prompts(other, 0)] != ids[0]


def test_refit_updates_engine_and_packed_cache():
    parts = tiny_parts(tiny_config("model.dtype=bf16"))
    engine = parts.backend.engine
    x = torch.tensor([[3, 4, 5]])
    pos = torch.arange(3)[None]
    with torch.no_grad():
        before = engine.model(x, pos).logits.clone()  # builds the packed bf16 weights
        for p in parts.learner.model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    seconds = parts.push_weights(1)
    assert seconds >= 0 and engine.policy_version == 1 and parts.backend.versions().policy == 1
    with torch.no_grad():
        after = engine.model(x, pos).logits
        fresh = make_tiny().to(torch.bfloat16)
        copy_weights(fresh, dict(parts.learner.model.named_parameters()))
        expected = fresh(x, pos).logits
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, expected)
    with pytest.raises(ValueError, match="shape"):
        copy_weights(
            engine.model,
            {"embed.weight": torch.zeros(2, 2)}
            | {n: p for n, p in parts.learner.model.named_parameters() if n != "embed.weight"},
        )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["rollout.temperature=0"], "temperature"),
        (["rollout.group_size=1"], "group_size"),
        (["rollout.spec=draft", "drafter.mode=frozen"], "drafter_path"),
    ],
)
def test_bad_run_settings_fail_before_work(tmp_path, monkeypatch, overrides, match):
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))  # no cached drafters
    with pytest.raises(ConfigError, match=match):
        build_run(tiny_config(*overrides), model=make_tiny(), codec=IdCodec(), env=ModFourEnv())


def test_used_run_dir_is_not_overwritten(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="not empty"):
        train(tiny_parts(tiny_config()), str(tmp_path), progress=False)


def test_auto_tokens_per_forward_is_the_controller_and_an_integer_a_fixed_cap():
    """'auto' (the default) hands k to the engine's cost-model controller; an integer is the
    fixed cap, kept."""
    cfg = tiny_config("rollout.max_tokens_per_forward=auto", "rollout.spec=ngram")
    spec = tiny_parts(cfg).backend.spec
    assert spec.adaptive and spec.max_tokens_per_forward is None
    cfg = tiny_config("rollout.max_tokens_per_forward=8", "rollout.spec=ngram")
    spec = tiny_parts(cfg).backend.spec
    assert not spec.adaptive and spec.max_tokens_per_forward == 8


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_auto_without_the_controller_follows_the_engine_dtype(dtype):
    """Where the controller does not run (vLLM), 'auto' caps a step at the native kernel's rows
    for bf16 where the kernel runs (the GEMV path: one pass over the weights) and at 16 tokens
    otherwise."""
    from specrl.backends import REGISTRY
    from specrl.kernels.gemv import MAX_ROWS, gemv_kernel
    from specrl.rollout_plan import spec_config

    cfg = tiny_config(f"model.dtype={dtype}", "rollout.max_tokens_per_forward=auto",
                      "rollout.spec=ngram")  # fmt: skip
    spec = spec_config(cfg, REGISTRY["vllm"].traits)
    native = dtype == "bf16" and gemv_kernel() is not None
    assert not spec.adaptive
    assert spec.max_tokens_per_forward == (MAX_ROWS if native else 16)
    assert spec.k_for_batch(1) == 3
    assert spec.k_for_batch(2) == (1 if native else 3)  # 2 rows x (1 + 1) tokens = 4
