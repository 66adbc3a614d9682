"""Training phases from FLOPs and a measured MFU per model class, plus the layout's collectives."""

from __future__ import annotations

import pytest

from specrl.costmodel.specs import load_hardware, load_model
from specrl.sim.published import NEMO_RL_V03_PHASES, fit_training
from specrl.sim.runner import rl_phases, run_scenario
from specrl.sim.scenario import load_scenario
from specrl.sim.training import (
    forward_flops,
    gradient_sync_seconds,
    load_efficiency,
    logprob_seconds,
    model_parallel_shards,
    parallel_seconds,
    train_seconds,
)

H100 = load_hardware("h100")


def test_training_table_is_the_fit_on_the_nemo_rl_v03_phases():
    fitted = fit_training()
    for cls, model in (("dense", "llama-3.1-8b"), ("moe", "qwen3-30b-a3b")):
        eff = load_efficiency(load_model(model))
        assert eff.model_class == cls and eff.sources
        assert eff.train_mfu == pytest.approx(fitted[cls]["train_mfu"], rel=0.01)
        assert eff.logprob_mfu == pytest.approx(fitted[cls]["logprob_mfu"], rel=0.01)
    # ... so the fit rows reproduce their published phases
    for m in NEMO_RL_V03_PHASES:
        sc = load_scenario(m.scenario, ["workload.seeds=1"])
        phases = rl_phases(sc, 0.0, False, sc.generation.gpus)
        assert phases.train == pytest.approx(m.seconds["train"], rel=0.02)
        assert phases.logprobs == pytest.approx(m.seconds["logprobs"], rel=0.02)


def test_moe_rl_training_is_far_less_efficient_than_dense():
    dense, moe = (
        load_efficiency(load_model("qwen3-8b")),
        load_efficiency(load_model("qwen3-30b-a3b")),
    )
    assert moe.train_mfu < 0.25 * dense.train_mfu
    assert moe.expert_parallel > 1 == dense.expert_parallel


def test_train_time_scales_with_tokens_and_inverse_mfu_and_attention_with_length():
    model = load_model("qwen3-8b")
    eff = load_efficiency(model)
    base = train_seconds(model, H100, 8, 1e6, 2000, eff)
    assert train_seconds(model, H100, 8, 2e6, 2000, eff) == pytest.approx(2 * base, rel=0.02)
    assert train_seconds(model, H100, 8, 1e6, 2000, eff, mfu=eff.train_mfu / 2) > 1.9 * base
    assert forward_flops(model, 1e6, 16000) > forward_flops(model, 1e6, 2000)
    one = logprob_seconds(model, H100, 8, 1e6, 2000, 1, eff)
    assert logprob_seconds(model, H100, 8, 1e6, 2000, 2, eff) == pytest.approx(2 * one)
    assert one < base / 2.5  # a forward is a third of forward + backward


def test_parallelism_collectives_are_priced_by_layout():
    dense, moe = load_model("qwen3-8b"), load_model("qwen3-235b-a22b")
    assert parallel_seconds(dense, H100, 64, 1e6, 3, 8) == 0.0  # no experts: no all-to-all
    assert parallel_seconds(moe, H100, 64, 2e6, 3, 8) > parallel_seconds(moe, H100, 64, 1e6, 3, 8)
    assert model_parallel_shards(dense, H100, 8, 1) == 3  # 8.19B x 16 B over 64 GB per H100
    assert model_parallel_shards(moe, H100, 128, 8) >= 8 * 6  # 235B x 16 B over 64 GB
    one_node = gradient_sync_seconds(dense, H100, 8, 2)
    assert gradient_sync_seconds(dense, H100, 16, 2) > one_node > 0  # crosses nodes


def test_scenario_mfu_overrides_the_class_table():
    base = load_scenario("nemo-rl-v03-llama8b-8xh100", ["workload.seeds=1"])
    slow = load_scenario("nemo-rl-v03-llama8b-8xh100", ["workload.seeds=1", "training.mfu=0.1"])
    p0 = run_scenario(base).no_spec.phases
    p1 = run_scenario(slow).no_spec.phases
    assert p1.train > 4 * p0.train * 0.9 and p1.logprobs == pytest.approx(p0.logprobs)
