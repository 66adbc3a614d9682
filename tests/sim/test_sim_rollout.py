"""Event-driven rollout: token conservation, batching limits, KV preemption, speculation effects."""

import numpy as np
import pytest

from specrl.costmodel.cost import StepCostModel
from specrl.costmodel.specs import load_drafter, load_hardware, load_model
from specrl.sim.acceptance import AcceptanceModel, AcceptanceParams
from specrl.sim.rollout import EngineConfig, sample_lengths, simulate_replica, simulate_rollout

ACC = AcceptanceModel("constant", AcceptanceParams(alpha=0.6))


def _cfg(drafter=None, policy="off", k=0, max_num_seqs=64, hw="h100", model="llama-3.1-8b"):
    costs = StepCostModel(load_model(model), load_hardware(hw), 1, drafter)
    return EngineConfig(costs, ACC, policy, k, max_num_seqs)


def test_single_sequence_plain_decode_is_length_times_step():
    cfg = _cfg()
    res = simulate_replica(np.array([100]), np.array([300]), cfg)
    prefill = cfg.costs.prefill(1, 100)
    # each step advances one token; cost linear in context so the mid-point pricing is exact
    want = prefill + sum(cfg.costs.decode(1, 100 + i) for i in range(300))
    assert res.time_s == pytest.approx(want, rel=1e-9)
    assert res.steps == 300


def test_speculative_single_sequence_takes_fewer_steps():
    cfg = _cfg(load_drafter("eagle3"), "fixed", 3)
    res = simulate_replica(np.array([100]), np.array([3000]), cfg)
    per_step = ACC.expected_tokens(3, np.zeros(1))[0]
    assert res.steps == pytest.approx(3000 / per_step, rel=0.01)
    assert res.spec_fraction == 1.0


def test_batch_never_exceeds_max_num_seqs_and_all_tokens_generated():
    lengths = sample_lengths(500, 0.8, 4000, 200, seed=1)
    res = simulate_replica(np.full(200, 64), lengths, _cfg(max_num_seqs=32))
    assert max(s.n_seqs for s in res.segments) <= 32
    assert res.tokens == lengths.sum()


def test_kv_capacity_forces_preemption_on_small_memory():
    # the 2-core CPU profile keeps ~10 GB for KV: 500k tokens of SmolLM2 context;
    # 64 x 16k-token sequences cannot all stay resident
    cfg = _cfg(max_num_seqs=64, hw="cpu-2core", model="smollm2-135m")
    cap = cfg.costs.kv_capacity_tokens()
    lengths = np.full(64, 16000)
    res = simulate_replica(np.full(64, 100), lengths, cfg)
    assert cap < 64 * 16100
    assert res.preemptions > 0
    assert res.tokens == lengths.sum()


def test_rollout_time_is_slowest_replica_and_more_replicas_help():
    lengths = sample_lengths(800, 0.6, 4000, 256, seed=0)
    prompts = np.full(256, 128)
    one = simulate_rollout(prompts, lengths, _cfg(max_num_seqs=256), replicas=1)
    four = simulate_rollout(prompts, lengths, _cfg(max_num_seqs=256), replicas=4)
    assert four.time_s == max(r.time_s for r in four.replicas)
    assert four.time_s < one.time_s


def test_cost_optimal_policy_never_slower_than_fixed_or_off():
    lengths = sample_lengths(1500, 0.9, 8000, 128, seed=3)
    prompts = np.full(128, 128)
    drafter = load_drafter("eagle3")
    times = {
        p: simulate_rollout(prompts, lengths, _cfg(drafter, p, 5, 128), 1).time_s
        for p in ("off", "fixed", "cost_optimal")
    }
    assert times["cost_optimal"] <= min(times["off"], times["fixed"]) * 1.001


def test_lognormal_lengths_have_requested_mean_and_cap():
    x = sample_lengths(1000, 0.5, 100_000, 200_000, seed=0)
    assert x.mean() == pytest.approx(1000, rel=0.02)
    assert sample_lengths(1000, 1.5, 2000, 1000, seed=0).max() == 2000


def test_capped_mean_sampler_hits_the_published_average_under_the_cap():
    from specrl.sim.rollout import sample_lengths_capped_mean

    got = sample_lengths_capped_mean(5400, 0.7, 7892, 512, seed=0)
    assert got.max() <= 7892 and abs(got.mean() - 5400) < 1.0
    # the plain sampler's mean is before truncation, so under a tight cap it falls short
    assert sample_lengths(5400, 0.7, 7892, 512, seed=0).mean() < 5000
    with pytest.raises(ValueError):
        sample_lengths_capped_mean(8000, 0.7, 7892, 16, seed=0)
