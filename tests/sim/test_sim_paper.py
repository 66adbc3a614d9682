"""The paper's table (arXiv 2604.26779) as regression tests.

Which numbers are fitted (specrl.sim.paper.PAPER_ROWS, role "fit"): the RL-Zero and RL-Think
no-speculation generation times (-> mean response lengths), the RL-Zero k = 3 speculative
generation (-> the draft forward overhead of the paper's stack), the RL-Zero n-gram speedup (->
the n-gram proposer's CPU cost) and the async no-speculation step (-> its batch). The measured
acceptance lengths are inputs. Every other row is a check: those within 15% are asserted; those
outside it are strict expected failures that name the gap docs/simulator.md explains (if the
model ever reproduces one, the test fails and the docs must change). The RL-Zero and RL-Think
scenarios run their three length draws, as recorded in benchmarks/results/sim_validate.json (a
sync rollout's time is set by its longest sequence, so one draw's seconds move by +-20%); the
speedup-only variants run one draw (speedups move by ~2% between draws).
"""

from __future__ import annotations

import numpy as np
import pytest

from specrl.sim.acceptance import rollout_acceptance
from specrl.sim.paper import (
    PAPER_ACCEPTANCE,
    PAPER_ROWS,
    QUANTITIES,
    RLZERO,
    linear_k_costs,
    seed_lengths,
    verify_roof,
)
from specrl.sim.runner import ScenarioResult, acceptance_model, run_scenario
from specrl.sim.scenario import load_scenario

ONE_SEED = ["workload.seeds=1"]
ALL_SEEDS = ("paper-8b-rlzero-sync", "paper-8b-rlthink-sync")  # absolute seconds are checked
ROWS = {r.key: r for r in PAPER_ROWS}
# checks the model misses by more than 15% (docs/simulator.md, "The paper's table")
K_SWEEP_GAP = (
    "RL-Zero's sweep implies a step of 0.14 + 0.58 k decode steps (paper.linear_k_costs): a"
    " verify forward alone costs 1, and the model's compute roof and graph cap add too little"
)
KNOWN_GAPS = {
    "rlzero-k5": K_SWEEP_GAP,
    "rlzero-k7": K_SWEEP_GAP,
    "rlthink-k5": K_SWEEP_GAP,
    "rlthink-k7": K_SWEEP_GAP,
}
FAST_CHECKS = ["rlzero-step", "rlthink-gen-spec", "rlthink-rollout", "rlthink-step",
               "rlthink-ngram", *KNOWN_GAPS]  # fmt: skip
FAST_FITS = ["rlzero-gen-plain", "rlzero-gen-spec", "rlthink-gen-plain", "rlzero-ngram"]


@pytest.fixture(scope="module")
def results():
    """One run per scenario for the whole module (a cache local to these tests)."""
    cache: dict[str, ScenarioResult] = {}

    def get(scenario: str) -> ScenarioResult:
        if scenario not in cache:
            overrides = [] if scenario in ALL_SEEDS else ONE_SEED
            cache[scenario] = run_scenario(load_scenario(scenario, overrides))
        return cache[scenario]

    return get


def _value(results, key: str) -> float:
    row = ROWS[key]
    return float(QUANTITIES[row.quantity](results(row.scenario)))


def test_every_row_names_a_scenario_a_quantity_and_a_role():
    for row in PAPER_ROWS:
        assert row.quantity in QUANTITIES and row.role in ("fit", "check")
        assert row.role == "check" or row.sets, row.key
        load_scenario(row.scenario)
    assert sum(r.role == "check" for r in PAPER_ROWS) >= 2 * sum(
        r.role == "fit" for r in PAPER_ROWS
    )


@pytest.mark.parametrize("key", FAST_FITS)
def test_scenarios_carry_the_fitted_inputs(results, key):
    """A fit row is reproduced by the value its scenario carries (the n-gram row on one length
    draw: within 12%; the others on the fitted three: within 1%)."""
    tolerance = 0.01 if ROWS[key].scenario in ALL_SEEDS else 0.12
    assert _value(results, key) == pytest.approx(ROWS[key].published, rel=tolerance)


def test_measured_acceptance_lengths_are_reproduced_by_the_fitted_profile(results):
    sc = load_scenario(RLZERO, ["speculation.acceptance.measured_over=start"])
    lengths = seed_lengths(RLZERO)
    model = acceptance_model(load_scenario(RLZERO), lengths)
    assert model.params.position_ratio == sc.speculation.acceptance.position_ratio < 1
    for m in PAPER_ACCEPTANCE["rlzero-eagle3"]:
        assert rollout_acceptance(model, m.k, lengths) == pytest.approx(m.length, rel=0.005)
    # and the event simulation reports what it was given
    assert results(RLZERO).speculative.rollout.acceptance_length == pytest.approx(3.32, rel=0.02)


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(k, marks=pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[k]))
        if k in KNOWN_GAPS
        else k
        for k in FAST_CHECKS
    ],
)
def test_paper_check_within_15_percent(results, key):
    assert _value(results, key) == pytest.approx(ROWS[key].published, rel=0.15)


def test_ngram_is_slower_than_no_speculation_on_both_workloads(results):
    assert _value(results, "rlzero-ngram") < 1.0
    assert _value(results, "rlthink-ngram") < 1.0
    assert _value(results, "rlthink-ngram") < _value(results, "rlzero-ngram")


def test_rl_think_gains_less_than_rl_zero_and_steps_less_than_rollouts(results):
    assert _value(results, "rlthink-rollout") < _value(results, "rlzero-rollout")
    for workload in ("rlzero", "rlthink"):
        assert 1.0 < _value(results, f"{workload}-step") < _value(results, f"{workload}-rollout")


@pytest.mark.xfail(strict=True, reason=K_SWEEP_GAP)
def test_k_sweep_shape(results):
    """k = 3 is best on RL-Zero and k >= 5 is slower than none on RL-Think (the paper)."""
    zero = [_value(results, k) for k in ("rlzero-rollout", "rlzero-k5", "rlzero-k7")]
    think = [_value(results, k) for k in ("rlthink-k5", "rlthink-k7")]
    assert zero[0] > max(zero[1:]) and max(think) < 1.0


def test_more_drafts_never_lose_their_acceptance_gain_in_the_model(results):
    """What the model does say about the k sweep: at a fixed measured acceptance profile the
    speedup falls by less than the acceptance rises, and k = 7 is below k = 5."""
    zero = [_value(results, k) for k in ("rlzero-rollout", "rlzero-k5", "rlzero-k7")]
    assert zero[2] < zero[1]
    assert zero[2] / zero[0] > (3.32 / 5.06)
    assert np.all(np.isfinite(zero))


def test_a_graph_cap_of_1024_tokens_leaves_k3_and_slows_the_wider_verifies():
    """specrl.sim.paper.graph_alternative's premise: at the paper's 256 sequences per replica,
    k = 3's verify (1024 tokens) stays graphed, so only k >= 5 pays the eager launches (the
    prefills, wider than any graph, pay them with and without speculation: 0.03% of k = 3's
    speedup)."""
    over = [*ONE_SEED, "engine.graph_capture_tokens=1024", "engine.eager_s_per_layer=1e-3"]
    for key in ("rlzero-rollout", "rlzero-k7"):
        row = ROWS[key]
        capped = run_scenario(load_scenario(row.scenario, over))
        base = run_scenario(load_scenario(row.scenario, ONE_SEED))
        got, want = (float(QUANTITIES[row.quantity](r)) for r in (capped, base))
        if key == "rlzero-rollout":
            assert got == pytest.approx(want, rel=1e-3)
        else:
            assert got < 0.9 * want


def test_the_paper_sweep_needs_a_step_cheaper_than_one_verify_forward():
    """The measured reason the k-sweep rows stay xfail: the speedups 1.77 / 1.44 / 1.21 at
    acceptance 3.32 / 4.35 / 5.06 fit a straight line in k almost exactly, with a base under one
    decode step, while every speculative step of the model holds a verify forward (>= one
    decode step) besides its k draft forwards."""
    lin = linear_k_costs()
    assert lin["worst_residual"] < 0.01
    assert 0.0 < lin["base"] < 0.2 and 0.5 < lin["per_draft"] < 0.65
    row = ROWS["rlzero-k5"]
    costs_k5 = 4.35 / row.published
    assert lin["base"] + 5 * lin["per_draft"] == pytest.approx(costs_k5, rel=0.01)


def test_verify_roof_counts_compute_bound_time_and_rises_with_k():
    """The rows per replica over the rollout against the compute roof: k = 3's verify of 4
    tokens per row never crosses it on a GB200 at these batches, k = 7's does for part of the
    time (the batch shrinks as rows finish, so never all of it)."""
    k3, k7 = verify_roof("paper-8b-rlzero-sync"), verify_roof("paper-8b-rlzero-k7-sync")
    assert k3["compute_bound_share"] == 0.0 < k7["compute_bound_share"] < 1.0
    assert 1.0 < k3["mean_rows"] <= 256 and 1.0 < k7["mean_rows"] <= 256
