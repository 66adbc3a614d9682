"""Continuous async generation: identities with sync, the staleness bound, and the tail effect."""

import numpy as np
import pytest

from specrl.costmodel.cost import StepCostModel
from specrl.costmodel.errors import SimInputError
from specrl.costmodel.specs import load_hardware, load_model
from specrl.sim.acceptance import AcceptanceModel, AcceptanceParams
from specrl.sim.continuous import simulate_continuous
from specrl.sim.pipeline import StepPhases, simulate_async, simulate_sync
from specrl.sim.rollout import EngineConfig, sample_lengths, simulate_rollout
from specrl.sim.runner import run_scenario
from specrl.sim.scenario import load_scenario

ACC = AcceptanceModel("constant", AcceptanceParams(alpha=0.6))
CFG = EngineConfig(StepCostModel(load_model("llama-3.1-8b"), load_hardware("h100")), ACC)


def _workload(sigma: float, n: int = 64, mean: float = 1500.0):
    responses = sample_lengths(mean, sigma, 16384, n, seed=3)
    return np.full(n, 200), responses


def _phases(generation: float, train: float) -> StepPhases:
    return StepPhases(generation, 0.3 * train, 0.7 * train, 0.0, 1.0, overhead=0.5)


def _both(sigma: float, staleness: int, train_frac: float = 0.3, steps: int = 8, replicas=2):
    prompts, responses = _workload(sigma)
    gen = simulate_rollout(prompts, responses, CFG, replicas).time_s
    phases = _phases(gen, train_frac * gen)
    cont = simulate_continuous(prompts, responses, CFG, replicas, phases, steps, staleness)
    drain = simulate_async(phases, steps, staleness)
    return phases, cont, drain


def test_staleness_zero_continuous_equals_sync():
    phases, cont, _ = _both(sigma=1.0, staleness=0)
    sync = simulate_sync(phases, 8)
    assert cont.schedule.step_time == pytest.approx(sync.step_time, rel=1e-9)
    assert cont.schedule.makespan == pytest.approx(sync.makespan, rel=1e-9)


def test_long_tail_continuous_beats_per_step_draining():
    _, cont, drain = _both(sigma=1.2, staleness=1)
    assert cont.schedule.step_time < 0.8 * drain.step_time
    # without a tail (all lengths equal) there is little idle tail to fill
    _, flat_c, flat_d = _both(sigma=0.0, staleness=1)
    gain_tail = drain.step_time / cont.schedule.step_time
    gain_flat = flat_d.step_time / flat_c.schedule.step_time
    assert gain_tail > gain_flat


def test_more_staleness_never_slower():
    times = [_both(sigma=1.2, staleness=s, steps=10)[1].schedule.step_time for s in (0, 1, 2, 4)]
    assert all(b <= a * 1.01 for a, b in zip(times, times[1:], strict=False)), times


def test_staleness_bound_and_trainer_order_hold():
    for staleness in (1, 2):
        _, cont, _ = _both(sigma=1.0, staleness=staleness)
        versions = cont.versions
        assert all(b > a for a, b in zip(versions, versions[1:], strict=False))
        for s, (start, end) in enumerate(cont.generation_spans):
            v = s - staleness
            assert start >= (versions[v] if v > 0 else 0.0) - 1e-9
            # step s is trained only after its last sequence finished
            assert versions[s + 1] >= end


def test_trainer_bound_pipeline_runs_at_trainer_speed():
    phases, cont, _ = _both(sigma=1.0, staleness=2, train_frac=3.0, steps=10)
    assert cont.schedule.step_time == pytest.approx(phases.trainer, rel=1e-6)


def test_tokens_conserved_across_steps():
    prompts, responses = _workload(1.0)
    phases = _phases(1.0, 1.0)
    cont = simulate_continuous(prompts, responses, CFG, 3, phases, 5, 1)
    assert sum(r.tokens for r in cont.replicas) == pytest.approx(5 * responses.sum())
    assert 0.0 < cont.generation_busy_fraction <= 1.0


def test_scenario_async_modes_and_staleness_zero_matches_sync_on_same_split():
    one = ["workload.seeds=1"]
    cont = run_scenario(load_scenario("paper-235b-async", one))
    drain = run_scenario(
        load_scenario("paper-235b-async", [*one, "pipeline.async_generation=drain"])
    )
    assert cont.speculative.schedule.step_time < drain.speculative.schedule.step_time
    zero = run_scenario(load_scenario("paper-235b-async", [*one, "pipeline.staleness=0"]))
    p = zero.speculative.phases
    assert zero.speculative.schedule.step_time == pytest.approx(p.total, rel=1e-9)
    with pytest.raises(SimInputError, match="continuous, drain"):
        run_scenario(load_scenario("paper-235b-async", ["pipeline.async_generation=bogus"]))
