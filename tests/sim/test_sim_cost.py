"""Cost model: roofline terms, KV capacity, drafter kinds, and the published vLLM step fit."""

import pytest

from specrl.costmodel.cost import ForwardShape, StepCostModel, forward_cost, weight_bytes_read
from specrl.costmodel.drafters import draft_forward
from specrl.costmodel.specs import list_specs, load_drafter, load_hardware, load_model


def test_kv_bytes_per_token_match_reference():
    assert load_model("llama-3.1-8b").kv_bytes == 131_072
    assert load_model("qwen3-8b").kv_bytes == 147_456
    assert load_model("qwen3-235b-a22b").kv_bytes == 192_512
    assert load_model("deepseek-v3").kv_bytes == 70_272


@pytest.mark.parametrize(
    "name,active", [("qwen3-235b-a22b", 22e9), ("qwen3-30b-a3b", 3.3e9), ("deepseek-v3", 37e9)]
)
def test_moe_active_params_consistent_with_expert_shapes(name, active):
    m = load_model(name)
    derived = m.dense_params + m.moe_layers * m.experts_per_token * m.expert_params
    assert derived == pytest.approx(active, rel=0.08)
    assert weight_bytes_read(m, 1) == pytest.approx(derived * 2)


def test_decode_matches_published_vllm_fit_on_h100():
    # t = 3.93e-8 * N_kv + 2.10e-5 * N_batched + 5.89e-3 (+1.21e-3 per step): Llama-3.1-8B, H100
    costs = StepCostModel(load_model("llama-3.1-8b"), load_hardware("h100"))
    for batch, ctx in [(1, 512), (16, 1024), (64, 2048)]:
        fit = 3.93e-8 * batch * ctx + 2.10e-5 * batch + 5.89e-3 + 1.21e-3
        assert costs.decode(batch, ctx) == pytest.approx(fit, rel=0.15)


def test_memory_term_scales_with_bandwidth_and_compute_with_tokens():
    m, hw = load_model("llama-3.1-8b"), load_hardware("h100")
    small = forward_cost(m, hw, 1, ForwardShape(1, 1, 0))
    big = forward_cost(m, hw, 1, ForwardShape(256, 4, 0))
    assert big.compute_s == pytest.approx(small.compute_s * 1024, rel=1e-3)  # + attention
    assert big.memory_s == pytest.approx(small.memory_s, rel=1e-6)
    tp2 = forward_cost(m, hw, 2, ForwardShape(1, 1, 0))
    assert tp2.memory_s == pytest.approx(small.memory_s / 2) and tp2.comm_s > 0


def test_kv_capacity_leaves_room_after_weights():
    costs = StepCostModel(load_model("llama-3.1-8b"), load_hardware("h100"))
    want = (80e9 * 0.9 - 8.03e9 * 2) / 131_072
    assert costs.kv_capacity_tokens() == pytest.approx(want)
    with_draft = StepCostModel(costs.target, costs.hw, 1, load_drafter("draft-qwen3-0.6b"))
    assert with_draft.kv_capacity_tokens() < costs.kv_capacity_tokens()


@pytest.mark.parametrize("drafter", list_specs("drafters"))
def test_every_drafter_kind_prices_a_draft(drafter):
    costs = StepCostModel(load_model("qwen3-8b"), load_hardware("h100"), 1, load_drafter(drafter))
    assert costs.draft(8, 3, 1000) > 0
    assert costs.draft(8, 0, 1000) == 0
    assert costs.step(8, 3, 1000) > costs.decode(8, 1000)


def test_drafters_are_much_cheaper_than_target():
    target = load_model("qwen3-8b")
    eagle = draft_forward(load_drafter("eagle3"), target)
    assert eagle.params_active < 0.1 * target.params_active
    mtp = draft_forward(load_drafter("mtp"), load_model("deepseek-v3"))
    assert mtp.is_moe and mtp.params_active < 0.1 * 37e9
    assert draft_forward(load_drafter("ngram"), target) is None


def test_a_block_drafter_drafts_k_tokens_in_one_forward():
    """DFlash prices one forward of k + 1 tokens per sequence: at batch 1 (memory-bound) 15
    drafts cost under 1.5x of 1 draft, while EAGLE-3's k forwards grow with k; at a large batch
    (compute-bound) the block's cost grows with its tokens too."""
    target, hw = load_model("qwen3-8b"), load_hardware("h100")
    block = StepCostModel(target, hw, 1, load_drafter("dflash"))
    eagle = StepCostModel(target, hw, 1, load_drafter("eagle3"))
    assert block.draft(1, 15, 1000) < 1.5 * block.draft(1, 1, 1000)
    assert block.draft(1, 15, 1000) == block.draft_forward(1, 16, 1000)
    assert eagle.draft(1, 15, 1000) > 5 * eagle.draft(1, 1, 1000)
    assert block.draft(512, 15, 1000) > 3 * block.draft(512, 1, 1000)
