"""The async pipeline on one shared machine (specrl.sim.shared) and the machine fit's pieces."""

from __future__ import annotations

import numpy as np
import pytest

from specrl.costmodel.specs import load_hardware, load_model
from specrl.sim.machine import (
    LearnerFit,
    LearnerShape,
    MeasuredRollout,
    MeasuredStep,
    fit_learner,
    fit_overlap,
    learner_features,
    predict_run,
)
from specrl.sim.pipeline import StepPhases, simulate_async
from specrl.sim.shared import Overlap, simulate_shared

GEN = [3.0, 5.0, 2.0, 4.0, 6.0]
LEARN = [4.0, 1.0, 3.0, 2.0, 2.5]


def test_staleness_zero_is_the_synchronous_running_sum():
    done = simulate_shared(GEN, LEARN, 0, Overlap(2.7, 1.3))
    assert done == pytest.approx(np.cumsum(np.add(GEN, LEARN)))


def test_no_slowdown_is_the_disaggregated_async_pipeline():
    phases = StepPhases(generation=3.0, logprobs=0.0, train=4.0, drafter_train=0.0, refit=0.0)
    for staleness in (1, 2):
        sched = simulate_async(phases, 6, staleness)
        done = simulate_shared([3.0] * 6, [4.0] * 6, staleness, Overlap(1.0, 1.0))
        assert done == pytest.approx([sched.step_end(s) for s in range(6)])


def test_overlap_work_is_conserved_under_processor_sharing():
    """Two steps at staleness 1: generation of step 1 (4 s) overlaps learning of step 0 (6 s).
    With slowdowns 2/2 the first 8 s of overlap finish generation (4 s of work at half speed)
    while learning did 4 of its 6 s; it then runs alone: done at 2 + 8 + 2 = 12 s; learning of
    step 1 (1 s) alone after that."""
    done = simulate_shared([2.0, 4.0], [6.0, 1.0], 1, Overlap(2.0, 2.0))
    assert done == pytest.approx([12.0, 13.0])


def test_slower_overlap_never_finishes_sooner():
    times = [simulate_shared(GEN, LEARN, 1, Overlap(g, g))[-1] for g in (1.0, 1.5, 2.0, 3.0)]
    assert np.all(np.diff(times) > 0)
    # and the run can never beat the busier side alone, nor lose to sync at an even split
    assert times[0] >= max(sum(GEN), sum(LEARN))
    assert simulate_shared(GEN, LEARN, 1, Overlap(2.0, 2.0))[-1] <= sum(GEN) + sum(LEARN) + 1e-9


@pytest.mark.parametrize("bad", [(0.5, 2.0), (2.0, 0.9)])
def test_a_speedup_from_overlap_is_refused(bad):
    with pytest.raises(ValueError, match="overlap slowdowns must be >= 1"):
        Overlap(*bad)


def test_mismatched_step_lists_are_refused():
    with pytest.raises(ValueError, match="3 generation times for 2 learning times"):
        simulate_shared([1.0, 2.0, 3.0], [1.0, 2.0], 1, Overlap())


def test_fit_overlap_recovers_the_slowdowns_that_made_the_runs():
    truth = Overlap(1.6, 2.2)
    runs = []
    for scale in (0.5, 1.0, 2.0):
        gen, learn = [g * scale for g in GEN], LEARN
        runs.append((gen, learn, 1, predict_run(gen, learn, 1, truth)))
    got = fit_overlap(runs, grid=np.arange(1.0, 3.0001, 0.1))
    assert got.generation == pytest.approx(1.6) and got.learning == pytest.approx(2.2)


def _step(shape: LearnerShape, learn_s: float) -> MeasuredStep:
    rollout = MeasuredRollout((20,), (10,), 0, (), (), 0, 4, 64)
    return MeasuredStep(rollout, shape, gen_s=1.0, learn_s=learn_s, step_s=1.0 + learn_s)


def test_fit_learner_recovers_its_two_rates_and_fixed_time():
    model, hw = load_model("smollm2-135m"), load_hardware("cpu-2core")
    truth = LearnerFit(trunk_mfu=0.2, head_mfu=0.05, fixed_s=0.7)
    shapes = [LearnerShape(256 * r, 256**2 * r, t) for r, t in ((1, 200), (4, 300), (8, 1900))]
    shapes.append(LearnerShape(512 * 3, 512**2 * 3, 1400))
    steps = [_step(s, truth.seconds(model, hw, s)) for s in shapes]
    got = fit_learner(model, hw, steps)
    assert (got.trunk_mfu, got.head_mfu, got.fixed_s) == pytest.approx((0.2, 0.05, 0.7), rel=1e-6)


def test_learner_features_count_the_head_at_completions_only():
    model = load_model("smollm2-135m")
    a = learner_features(model, LearnerShape(1024, 1024 * 256, 100))
    b = learner_features(model, LearnerShape(1024, 1024 * 256, 300))
    assert a[0] == b[0] and b[1] == pytest.approx(3 * a[1]) and a[2] == b[2] == 1.0
    assert b[1] - a[1] == pytest.approx(3 * 2 * model.vocab * model.hidden * 200)


def test_measured_rollout_acceptance_is_conditional_per_position():
    r = MeasuredRollout((5,), (9,), 3, (40, 20, 5), (100, 80, 50), 100, 1, 1)
    assert r.acceptance() == pytest.approx((0.4, 0.5, 0.25))
    assert r.coverage() == pytest.approx((1.0, 0.8, 0.5))
    assert r.acceptance_length == pytest.approx(1.65)


def test_error_summary_and_table_separate_fitted_from_held_out_rows():
    from specrl.sim.machine import error_summary, error_table

    rows = [
        {"config": "a", "fitted": True, "acceptance_length": 1.0, "measured_s": 2.0,
         "predicted_s": 2.2, "error": 0.1},
        {"config": "b", "fitted": False, "acceptance_length": 1.5, "measured_s": 4.0,
         "predicted_s": 3.0, "error": -0.25},
        {"config": "c", "fitted": False, "acceptance_length": 1.2, "measured_s": 1.0,
         "predicted_s": 1.05, "error": 0.05},
    ]  # fmt: skip
    got = error_summary(rows)
    assert got["heldout_mean_abs_error"] == pytest.approx(0.15)
    assert got["heldout_max_abs_error"] == pytest.approx(0.25)
    assert got["fitted_mean_abs_error"] == pytest.approx(0.1)
    lines = error_table(rows, 6).splitlines()
    assert len(lines) == 4
    assert lines[2].split() == ["b", "held-out", "1.50", "4.00", "3.00", "-25.0%"]
