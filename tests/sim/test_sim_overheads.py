"""Speculative overhead from what it is: per-kind draft forwards (catch-up over the verified
positions), the verify pass at k+1 tokens, the sampler, per-kind acceptance profiles, the n-gram
matcher's context cost, and the acceptance a rollout reports."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specrl.costmodel.cost import StepCostModel
from specrl.costmodel.drafters import catches_up
from specrl.costmodel.specs import load_drafter, load_hardware, load_model, with_overrides
from specrl.sim.acceptance import (
    AcceptanceModel,
    AcceptanceParams,
    alpha_for_length,
    alpha_for_rollout_length,
    expected_tokens_iid,
    expected_tokens_profile,
    rollout_acceptance,
)
from specrl.sim.rollout import EngineConfig, simulate_rollout

QWEN8B, H100 = load_model("qwen3-8b"), load_hardware("h100")


def costs(drafter: str = "eagle3", **kw) -> StepCostModel:
    return StepCostModel(QWEN8B, H100, 1, load_drafter(drafter), **kw)


def test_eagle_draft_is_a_catch_up_forward_then_one_token_forwards():
    c = costs()
    assert catches_up(c.drafter) and not catches_up(load_drafter("ngram"))
    for k in (1, 3, 7):
        want = c.draft_forward(16, k + 1, 900) + (k - 1) * c.draft_forward(16, 1, 900)
        assert c.draft(16, k, 900) == pytest.approx(want)
    # every forward pays the per-forward overhead: k of them
    slower = replace(c, hw=with_overrides(H100, forward_overhead_s=H100.forward_overhead_s + 1e-3))
    assert slower.draft(16, 5, 900) - c.draft(16, 5, 900) == pytest.approx(5e-3)


@pytest.mark.parametrize("drafter", ["eagle3", "mtp", "draft-qwen3-0.6b"])
def test_draft_and_verify_costs_grow_with_k_batch_and_context(drafter):
    c = costs(drafter)
    for n, ctx in [(1, 500), (64, 4000)]:
        drafts = [c.draft(n, k, ctx) for k in range(1, 8)]
        verifies = [c.verify(n, k, ctx) for k in range(1, 8)]
        assert all(b > a for a, b in zip(drafts, drafts[1:], strict=False))
        assert all(b > a for a, b in zip(verifies, verifies[1:], strict=False))
    assert c.step(64, 3, 1000) > c.step(8, 3, 1000) > c.step(1, 3, 1000)
    assert c.step(8, 3, 8000) > c.step(8, 3, 1000)


def test_draft_model_costs_more_than_an_eagle_head():
    assert costs("draft-qwen3-0.6b").draft(32, 3, 2000) > 3 * costs().draft(32, 3, 2000)


def test_verify_is_a_k_plus_one_token_forward_plus_the_sampler():
    c = costs()
    for n, k in [(1, 3), (32, 5)]:
        forward = c.target_forward(n, k + 1, 1500)
        sampler = n * (k + 1) * QWEN8B.vocab * H100.verify_s_per_logit
        assert c.verify(n, k, 1500) == pytest.approx(forward + sampler)
        assert c.sampler(n, k + 1) == pytest.approx(sampler) and sampler > 0
    assert c.step(32, 3, 1500) == pytest.approx(
        H100.step_overhead_s + c.draft(32, 3, 1500) + c.verify(32, 3, 1500)
    )


def test_speculation_pays_least_at_large_batch():
    """Tokens per second gained at acceptance 0.8, k = 3, falls as the batch grows (the verify
    pass's extra tokens stop being free)."""
    c = costs()
    tokens = expected_tokens_iid(0.8, 3)
    gains = [tokens * c.decode(n, 2000) / c.step(n, 3, 2000) for n in (1, 16, 64, 256)]
    assert all(b < a for a, b in zip(gains, gains[1:], strict=False))
    # 2.95 tokens per step at batch 1: near vLLM #20780's EAGLE-3 (1.75x at 3.08 tokens, k = 4)
    assert gains[0] > 1.5


def test_model_free_drafter_pays_per_sequence_and_per_context_token():
    ngram = load_drafter("ngram-vllm")
    c = StepCostModel(QWEN8B, H100, 1, ngram)
    assert c.draft(10, 3, 1000) == pytest.approx(
        10 * (ngram.cpu_s_per_seq + 1000 * ngram.cpu_s_per_ctx_token)
    )
    assert c.draft(10, 3, 4000) > c.draft(10, 3, 1000) > c.draft(5, 3, 1000)


@pytest.mark.parametrize("ratio", [0.8, 0.95, 1.0, 1.1])
def test_position_ratio_profile_inverts_and_shapes_the_draft_positions(ratio):
    for k, length in [(3, 2.5), (5, 3.2)]:
        alpha = alpha_for_length(length, k, ratio)
        assert expected_tokens_profile(alpha, k, ratio) == pytest.approx(length, abs=1e-9)
        model = AcceptanceModel("constant", AcceptanceParams(alpha, position_ratio=ratio))
        rates = model.rates(k, np.zeros(2))
        assert rates[0, 0] == pytest.approx(alpha)
        assert rates[0, -1] == pytest.approx(min(1.0, alpha * ratio ** (k - 1)))


def test_a_falling_profile_gains_less_from_more_drafts():
    flat, falling = 1.0, 0.9
    a_flat, a_fall = alpha_for_length(3.0, 3, flat), alpha_for_length(3.0, 3, falling)
    assert expected_tokens_profile(a_fall, 7, falling) < expected_tokens_profile(a_flat, 7, flat)


def test_rollout_acceptance_is_token_weighted_and_solvable():
    lengths = np.array([300, 1200, 5000, 16000])
    constant = AcceptanceModel("constant", AcceptanceParams(0.7))
    assert rollout_acceptance(constant, 3, lengths) == pytest.approx(expected_tokens_iid(0.7, 3))
    drift = AcceptanceModel("drift", AcceptanceParams(0.9, decay_per_1k_tokens=0.05, floor=0.1))
    reported = rollout_acceptance(drift, 3, lengths)
    assert 1.0 < reported < expected_tokens_iid(0.9, 3)  # long sequences accept less
    alpha = alpha_for_rollout_length(drift, 3, lengths, 2.0)
    solved = AcceptanceModel("drift", replace(drift.params, alpha=alpha))
    assert rollout_acceptance(solved, 3, lengths) == pytest.approx(2.0, rel=1e-6)
    with pytest.raises(ValueError, match="outside the reachable"):
        alpha_for_rollout_length(drift, 3, lengths, 3.99)


def test_the_event_simulation_reports_the_acceptance_rollout_acceptance_predicts():
    lengths = np.array([400, 900, 2500, 6000, 300, 7000, 1500, 3300])
    drift = AcceptanceModel("drift", AcceptanceParams(0.85, decay_per_1k_tokens=0.04, floor=0.2))
    cfg = EngineConfig(costs(), drift, "fixed", 3, 8, replan_tokens=64)
    res = simulate_rollout(np.full(len(lengths), 100), lengths, cfg, replicas=2)
    assert res.acceptance_length == pytest.approx(rollout_acceptance(drift, 3, lengths), rel=0.02)
