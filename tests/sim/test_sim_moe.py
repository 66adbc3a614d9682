"""MoE and collectives: experts touched by verify tokens, expert parallelism (busiest rank,
all-to-all fitted on DeepEP), routing skew, TP all-reduce, FP8 weights, and their checks."""

from __future__ import annotations

import pytest

from specrl.costmodel.cost import (
    ForwardShape,
    Layout,
    StepCostModel,
    all_reduce_time,
    all_to_all_time,
    busiest_rank_experts,
    busiest_rank_pairs,
    comm_time,
    expected_experts,
    expected_max_normal,
    forward_cost,
    weight_bytes_read,
)
from specrl.costmodel.errors import SimInputError
from specrl.costmodel.specs import (
    list_specs,
    load_drafter,
    load_hardware,
    load_model,
    with_overrides,
)
from specrl.sim.published import DEEPEP_LOW_LATENCY, fit_all_to_all, h800
from specrl.sim.runner import run_scenario
from specrl.sim.scenario import load_scenario

Q235, Q30 = load_model("qwen3-235b-a22b"), load_model("qwen3-30b-a3b")
H100, H200 = load_hardware("h100"), load_hardware("h200")


def test_experts_touched_grow_with_tokens_and_verify_tokens_cost_more_at_small_batch():
    counts = [expected_experts(128, 8, t) for t in (1, 2, 4, 16, 64, 512)]
    assert all(b > a for a, b in zip(counts, counts[1:], strict=False))
    one = forward_cost(Q235, H200, 8, ForwardShape(1, 1, 2000))
    verify = forward_cost(Q235, H200, 8, ForwardShape(1, 4, 2000))
    assert verify.memory_s > 1.5 * one.memory_s  # 4 tokens touch ~29 experts instead of 8
    # at a large batch nearly every expert is read anyway: the verify's extra tokens are cheap
    big1 = forward_cost(Q235, H200, 8, ForwardShape(256, 1, 2000))
    big4 = forward_cost(Q235, H200, 8, ForwardShape(256, 4, 2000))
    assert big4.memory_s < 1.05 * big1.memory_s
    # routing locality: extra verify tokens reusing the sequence's experts read fewer weights
    local = forward_cost(Q235, H200, 8, ForwardShape(1, 4, 2000), locality=0.8)
    assert one.memory_s < local.memory_s < verify.memory_s


def test_busiest_rank_bounds_and_growth():
    assert expected_max_normal(1) == 0.0
    assert 1.3 < expected_max_normal(8) < expected_max_normal(64) < 2.6
    for tokens in (1, 8, 64, 4096):
        mean = expected_experts(128, 8, tokens) / 8
        busiest = busiest_rank_experts(128, 8, tokens, 8)
        assert mean <= busiest <= 16 + 1e-9
    assert busiest_rank_experts(128, 8, 10, 1) == pytest.approx(expected_experts(128, 8, 10))
    pairs = 4096 * 8
    assert pairs / 8 < busiest_rank_pairs(pairs, 8) < 1.05 * pairs / 8  # many tokens: balanced
    assert busiest_rank_pairs(8, 8) > 2 * 8 / 8  # one token's 8 picks: far from balanced
    assert busiest_rank_pairs(pairs, 8, skew=1.5) == pytest.approx(
        1.5 * busiest_rank_pairs(pairs, 8)
    )


def test_expert_parallel_replica_waits_for_its_busiest_rank_and_pays_all_to_alls():
    shape = ForwardShape(8, 4, 1500)
    tp = forward_cost(Q235, H200, 8, shape, layout=Layout())
    ep = forward_cost(Q235, H200, 8, shape, layout=Layout(ep=8))
    assert ep.memory_s > tp.memory_s  # the busiest rank holds more touched experts than 1/8
    assert ep.comm_s > 0 and tp.comm_s > 0
    skewed = forward_cost(Q235, H200, 8, ForwardShape(256, 4, 1500), layout=Layout(ep=8, skew=2))
    even = forward_cost(Q235, H200, 8, ForwardShape(256, 4, 1500), layout=Layout(ep=8))
    assert skewed.compute_s > even.compute_s
    bytes_tp = weight_bytes_read(Q235, 32.0)
    assert weight_bytes_read(Q235, 32.0, Layout(gpus=8, ep=8)) > bytes_tp


def test_all_to_all_grows_with_bytes_and_with_ranks_across_nodes():
    assert all_to_all_time(H100, 1, 1e9) == 0.0
    small, large = all_to_all_time(H100, 8, 1e6), all_to_all_time(H100, 8, 1e8)
    assert H100.a2a_latency_s < small < large
    assert all_to_all_time(H100, 16, 1e8) > all_to_all_time(H100, 8, 1e8)  # crosses a node
    assert comm_time(Q235, H100, 8, 64, ep=8) > comm_time(Q235, H100, 8, 8, ep=8)


def test_all_to_all_constants_are_the_deepep_fit():
    latency, efficiency = fit_all_to_all()
    for name in list_specs("hardware"):
        hw = load_hardware(name)
        if not name.startswith("cpu"):
            assert hw.a2a_latency_s == pytest.approx(latency, rel=0.01), name
            assert hw.a2a_efficiency == pytest.approx(efficiency, rel=0.01), name
    fitted = with_overrides(h800(), a2a_latency_s=latency, a2a_efficiency=efficiency)
    errors = [
        abs(all_to_all_time(fitted, p.ep, p.bytes_per_gpu) / p.seconds - 1)
        for p in DEEPEP_LOW_LATENCY
    ]
    assert max(errors) < 0.35 and sum(errors) / len(errors) < 0.15


def test_tp_all_reduce_grows_with_tp_and_bytes_and_is_two_per_layer():
    assert all_reduce_time(H100, 1, 1e9) == 0.0
    assert all_reduce_time(H100, 8, 1e7) > all_reduce_time(H100, 2, 1e7)
    assert all_reduce_time(H100, 16, 1e7) > all_reduce_time(H100, 8, 1e7)  # scale-out link
    dense = load_model("llama-3.1-8b")
    one = all_reduce_time(H100, 8, 64 * dense.hidden * 2)
    assert comm_time(dense, H100, 8, 64) == pytest.approx(2 * dense.layers * one)


def test_fp8_weights_halve_bytes_and_use_the_fp8_peak():
    bf16 = StepCostModel(Q235, H200, 8)
    fp8 = StepCostModel(Q235, H200, 8, precision="fp8")
    assert fp8.weight_bytes() == pytest.approx(bf16.weight_bytes() / 2)
    assert fp8.kv_capacity_tokens() > bf16.kv_capacity_tokens()
    assert fp8.decode(1, 1000) < bf16.decode(1, 1000)
    assert H200.peak("fp8") == H200.peak_flops_fp8 > H200.peak("bf16")
    with pytest.raises(SimInputError, match="no FP8 peak"):
        load_hardware("cpu-2core").peak("fp8")


def test_mtp_drafter_on_a_moe_target_reads_experts():
    c = StepCostModel(load_model("deepseek-v3"), H200, 8, load_drafter("mtp"), precision="fp8")
    assert c.draft_model.is_moe
    assert c.draft(1, 1, 500) > H200.forward_overhead_s


@pytest.mark.parametrize(
    "override,expect",
    [
        ("generation.ep=3", "must divide"),
        ("generation.precision=fp16", "unknown generation.precision"),
    ],
)
def test_bad_moe_layouts_are_one_line_errors(override, expect):
    with pytest.raises(SimInputError, match=expect) as err:
        run_scenario(load_scenario("paper-235b-async-512", [override]))
    assert "\n" not in str(err.value)


def test_expert_parallelism_needs_a_moe_model_and_fp8_needs_an_fp8_peak():
    with pytest.raises(SimInputError, match="is dense"):
        run_scenario(load_scenario("paper-8b-rlzero-sync", ["generation.ep=2"]))
    with pytest.raises(SimInputError, match="no FP8 peak"):
        run_scenario(load_scenario("paper-8b-rlzero-sync", [
            "hardware=cpu-2core", "generation.precision=fp8", "model=smollm2-135m"]))  # fmt: skip
