"""Async results are steady state: staleness 0 is sync, the warm-up does not matter once
converged, high staleness stays under the perfect-overlap bound, seeds give a spread, and a run
too short to converge says so."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from specrl.costmodel.errors import SimInputError
from specrl.sim import runner as sim_runner
from specrl.sim.cli import build_app
from specrl.sim.continuous import simulate_continuous
from specrl.sim.pipeline import Interval, Schedule
from specrl.sim.report import text_summary
from specrl.sim.runner import (
    CONVERGENCE_TOL,
    engine_config,
    generation_floor_s,
    replica_count,
    rl_phases,
    run_scenario,
    simulate_generation,
    workload_lengths,
)
from specrl.sim.scenario import load_scenario

ONE_SEED = "workload.seeds=1"
# a cheap trainer (MFU 1, no fixed per-step costs): the generators, not the trainer, set the pace
CHEAP_TRAINER = [
    "training.mfu=1.0",
    "training.logprob_mfu=1.0",
    "pipeline.framework_overhead_s=0",
    "pipeline.refit_fixed_s=0",
    "workload.samples_per_step=256",
]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(a, b)


def test_staleness_zero_equals_sync_on_the_same_gpus():
    asyn = run_scenario(load_scenario("paper-235b-async", [ONE_SEED, "pipeline.staleness=0"]))
    sync = run_scenario(
        load_scenario("paper-235b-async", [ONE_SEED, "pipeline.mode=sync", "training.gpus=0"])
    )
    for kind in ("speculative", "no_spec"):
        a, s = asyn.runs[0].run(kind), sync.runs[0].run(kind)
        assert a.schedule.step_time == pytest.approx(s.schedule.step_time, rel=1e-9)
        assert a.schedule.step_time == pytest.approx(a.phases.total, rel=1e-9)
    assert asyn.rollout_speedup == pytest.approx(sync.rollout_speedup, rel=1e-12)
    assert asyn.end_to_end_speedup == pytest.approx(sync.end_to_end_speedup, rel=1e-9)
    assert asyn.warnings == () and asyn.convergence()["speculative"]["max_half_spread"] < 1e-9


def _step(warmup: int) -> tuple[float, tuple[str, ...]]:
    res = run_scenario(
        load_scenario(
            "nemo-rl-qwen3-30b-a3b-32xh100-async", [ONE_SEED, f"pipeline.warmup_periods={warmup}"]
        )
    )
    return res.speculative.schedule.step_time, res.warnings


def test_result_is_independent_of_the_warmup_once_converged():
    # this scenario's first period is ~6% slower than the steady state (the pipeline fills)
    one, warn_one = _step(1)
    two, warn_two = _step(2)
    assert warn_one == () and warn_two == ()
    assert _rel(one, two) <= CONVERGENCE_TOL


def _schedule(gaps: list[float], warmup: int, measured: int) -> Schedule:
    ends = np.cumsum([1.0, *gaps])
    intervals = tuple(Interval("training", "train", s, e - 0.5, e) for s, e in enumerate(ends))
    return Schedule(intervals, len(ends), warmup, measured)


def test_half_spread_sees_a_filling_pipeline_and_a_cycle_longer_than_the_period():
    steady = [22.0, 190.0] * 8
    filling = [60.0, 250.0, *steady]
    assert _schedule(steady, 2, 4).half_spread(2) == pytest.approx(0.0)
    assert _schedule(filling, 0, 4).half_spread(2) > CONVERGENCE_TOL
    assert _schedule(filling, 2, 4).half_spread(2) == pytest.approx(0.0)
    cycle3 = [59.0, 64.0, 82.0] * 12  # period 3 measured in periods of 2 steps
    assert _schedule(cycle3, 0, 4).half_spread(2) > CONVERGENCE_TOL
    assert _schedule(cycle3, 0, 24).half_spread(2) <= CONVERGENCE_TOL
    assert _schedule(cycle3, 0, 24).step_time == pytest.approx(np.mean(cycle3[:24]))


def test_an_unconverged_run_is_lengthened_then_warns(monkeypatch):
    monkeypatch.setattr(sim_runner, "CONVERGENCE_TOL", -1.0)  # nothing counts as converged
    overrides = [ONE_SEED, "workload.samples_per_step=64", "speculation.enabled=false"]
    res = run_scenario(load_scenario("paper-235b-async", overrides))
    conv = res.convergence()["speculative"]
    assert conv["measured_steps"] == sim_runner.MAX_WINDOW_SCALE * 2 * 2  # 2 periods of 2, x8
    assert any(w.startswith("not converged") for w in res.warnings)
    assert res.to_json()["convergence"]["converged"] is False


def _staleness(s: int):
    overrides = [ONE_SEED, f"pipeline.staleness={s}", *CHEAP_TRAINER]
    return run_scenario(load_scenario("paper-235b-async", overrides))


def test_staleness_8_is_bounded_by_perfect_overlap():
    res = _staleness(8)
    run = res.speculative
    floor = run.floor_s
    # the bound is the generators' work at perfect packing here, not the trainer's phases
    assert floor > 1.5 * run.phases.trainer
    assert run.schedule.step_time >= floor
    assert res.no_spec.schedule.step_time >= res.no_spec.floor_s
    sync = res.sync_no_spec.schedule.step_time
    assert res.end_to_end_speedup_vs_sync_no_spec <= sync / floor
    assert res.warnings == ()
    # the window covers whole periods of staleness + 1 steps, after a warm-up, before a cool-down
    conv = res.convergence()["speculative"]
    assert conv["period_steps"] == 9 and conv["measured_steps"] == 18
    assert conv["steps_simulated"] == conv["warmup_steps"] + 18 + 9 + 1
    # more staleness never hurts, and 8 gains over 1
    assert res.end_to_end_speedup_vs_sync_no_spec > _staleness(1).end_to_end_speedup_vs_sync_no_spec


def test_the_old_six_step_window_broke_the_overlap_bound():
    """What printed 8.75x: 6 steps, all admissible at t = 0 at staleness 8, measured on the last
    spacing, which is the trainer's alone."""
    sc = load_scenario("paper-235b-async", [ONE_SEED, "pipeline.staleness=8", *CHEAP_TRAINER])
    rollout = simulate_generation(sc, True)
    phases = rl_phases(sc, rollout.time_s, True, sc.training.gpus)
    prompts, responses = workload_lengths(sc)
    cfg, replicas = engine_config(sc, True), replica_count(sc)
    old = simulate_continuous(prompts, responses, cfg, replicas, phases, 6, 8).schedule.step_time
    assert old < generation_floor_s(sc, True)


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("paper-8b-sync", []),
        ("paper-8b-sync", ["speculation.policy=cost_optimal", "speculation.k=5"]),
        ("nemo-rl-qwen3-30b-a3b-32xh100", []),
        ("paper-235b-async", ["speculation.draft_coverage=[0.9, 0.5]"]),
    ],
)
def test_generation_floor_is_below_a_drained_rollout(name, overrides):
    sc = load_scenario(name, [ONE_SEED, *overrides])
    for spec in (True, False):
        floor = generation_floor_s(sc, spec)
        assert 0 < floor <= simulate_generation(sc, spec).time_s


def test_seeds_are_averaged_and_their_spread_reported():
    overrides = ["workload.seeds=3", "workload.samples_per_step=256"]
    res = run_scenario(load_scenario("paper-235b-async", overrides))
    j = json.loads(json.dumps(res.to_json()))
    assert j["seeds"] == [0, 1, 2]
    for name in ("rollout_speedup", "end_to_end_speedup", "end_to_end_speedup_vs_sync_no_spec"):
        s = j["spread"][name]
        assert len(s["per_seed"]) == 3 and len(set(s["per_seed"])) == 3
        assert s["min"] <= s["mean"] <= s["max"] and s["std"] > 0
        assert s["mean"] == pytest.approx(float(np.mean(s["per_seed"])))
        assert s["min"] * 0.98 <= j[name] <= s["max"] * 1.02  # ratio of means sits in the range
    times = [r.speculative.schedule.step_time for r in res.runs]
    assert j["step_time_s"]["speculative"] == pytest.approx(float(np.mean(times)))
    assert j["end_to_end_speedup"] == pytest.approx(
        j["step_time_s"]["no_spec"] / j["step_time_s"]["speculative"]
    )
    assert "seeds" in text_summary(res)
    assert [r.seed for r in run_scenario(load_scenario("paper-8b-sync", ["workload.seed=7",
            "workload.seeds=2"])).runs] == [7, 8]  # fmt: skip


def test_one_draw_when_nothing_is_random():
    res = run_scenario(
        load_scenario("paper-8b-sync", ["workload.seeds=4", "workload.length_trace=[900, 4000]"])
    )
    assert [r.seed for r in res.runs] == [0]


def test_too_short_to_converge_warns_in_the_result_and_on_the_console():
    args = ["paper-235b-async", "--set", ONE_SEED, "--set", "pipeline.measure_periods=1",
            "--set", "pipeline.warmup_periods=0", "--json"]  # fmt: skip
    res = CliRunner().invoke(build_app(), args)
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout)
    assert len(result["warnings"]) == 2 and result["convergence"]["converged"] is False
    warned = [line for line in res.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 2 and "measure_periods=1" in res.stderr
    summary = CliRunner().invoke(build_app(), args[:-1])
    assert summary.stdout.count("warning: ") == 2


def test_a_model_that_does_not_fit_raises_the_one_line_error():
    sc = load_scenario("paper-235b-async", ["generation.gpus_per_replica=2"])
    with pytest.raises(SimInputError, match=r"^model qwen3-235b-a22b does not fit [^\n]*FP8"):
        run_scenario(sc)
