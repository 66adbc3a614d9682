"""The fixed per-layer cost terms, their engine overrides, and the free-constant fit with its
leave-one-source-out split (specrl.sim.fidelity)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specrl.costmodel.cost import ForwardShape, Layout, forward_cost, layer_floor, touched_experts
from specrl.costmodel.specs import load_hardware, load_model, with_overrides
from specrl.sim import fidelity
from specrl.sim.accuracy import section_lines
from specrl.sim.runner import hardware
from specrl.sim.scenario import load_scenario
from specrl.sim.serving import SERVING

H100 = load_hardware("h100")
BARE = with_overrides(H100, layer_s=0.0, moe_layer_s=0.0, expert_s=0.0)
DENSE, MOE = load_model("llama-3.1-8b"), load_model("qwen3-30b-a3b")


def _floor(model, hw, gpus, n_seqs, ep=1):
    shape = ForwardShape(n_seqs, 1, 500)
    layout = Layout(gpus, ep)
    return (forward_cost(model, hw, gpus, shape, layout=layout).total
            - forward_cost(model, BARE, gpus, shape, layout=layout).total)  # fmt: skip


def test_a_dense_forward_pays_layer_s_per_layer_whatever_the_tp_degree():
    for gpus in (1, 2, 8):
        assert _floor(DENSE, H100, gpus, 4) == pytest.approx(DENSE.layers * H100.layer_s)


def test_a_moe_forward_pays_per_moe_layer_and_per_touched_expert():
    for n in (1, 8, 64):
        touched = touched_experts(MOE, n)  # tokens of one query token each
        want = (MOE.layers * H100.layer_s + MOE.moe_layers * H100.moe_layer_s
                + MOE.moe_layers * touched * H100.expert_s)  # fmt: skip
        assert _floor(MOE, H100, 2, n) == pytest.approx(want)
    assert touched_experts(MOE, 1) == pytest.approx(MOE.experts_per_token)
    assert touched_experts(MOE, 8) < touched_experts(MOE, 64) <= MOE.experts
    assert touched_experts(DENSE, 8) == 0.0


def test_expert_parallel_ranks_pay_their_own_experts_only():
    assert touched_experts(MOE, 64, Layout(8, 8)) < touched_experts(MOE, 64, Layout(8, 1))
    assert _floor(MOE, H100, 8, 64, ep=8) < _floor(MOE, H100, 8, 64, ep=1)


def test_layer_floor_is_zero_on_a_profile_without_it():
    assert layer_floor(MOE, load_hardware("gb200"), 64.0) == 0.0


def test_engine_overrides_reach_the_profile_and_moe_terms_refuse_dense_models():
    sc = load_scenario("paper-235b-async", ["engine.layer_s=1e-5", "engine.expert_s=2e-6",
                                            "engine.moe_layer_s=3e-5",
                                            "engine.eta_expert_mem=0.5"])  # fmt: skip
    hw = hardware(sc)
    assert (hw.layer_s, hw.expert_s, hw.moe_layer_s, hw.eta_expert_mem) == (1e-5, 2e-6, 3e-5, 0.5)
    point = next(p for p in SERVING if p.model == "llama-3.1-8b" and p.role == "heldout")
    overrides = fidelity.overrides_for(point, fidelity.current_values())
    assert not any("moe" in o or "expert" in o for o in overrides)
    moe_point = next(p for p in SERVING if p.model == "qwen3-30b-a3b" and not p.scenario)
    assert len(fidelity.overrides_for(moe_point, fidelity.current_values())) == len(fidelity.FREE)


def _synthetic(points, values):
    """``points`` with their published values replaced by the simulation's under ``values``."""
    sims = fidelity.simulated(points, values)
    return [replace(p, published=v) for p, v in zip(points, sims, strict=True)]


def test_the_fit_reproduces_values_made_by_known_constants():
    """Published values made by the simulator at known constants are matched again by the fit
    started elsewhere (each group's acceptance refitted at every trial as in the real fit)."""
    keys = (
        "vllm-20780-llama8b-b1",
        "vllm-20780-eagle3-k3",
        "vllm-20780-eagle3-k6",
        "specforge-qwen30b-tp2-b1",
        "specforge-qwen30b-tp2-b16",
        "specforge-qwen30b-tp4-b8",
        "sglang-4716-llama70b-tp8-b1",
        "eagle3-sglang-b16",
    )
    points = [p for p in SERVING if p.key in keys]
    known = (0.5, 0.8, 30.0, 40.0, 2.0, 0.7)
    synthetic = _synthetic(points, known)
    start = fidelity.current_values()
    assert np.max(np.abs(fidelity.log_errors(synthetic, start))) > 0.05  # the start is off
    fit = fidelity.fit_constants(synthetic, start=start)
    assert np.max(np.abs(fidelity.log_errors(synthetic, fit.values))) < 0.01


def test_leave_one_source_out_never_fits_on_the_source_it_predicts(monkeypatch):
    points = [p for p in fidelity.fitted_points() if not p.scenario][:12]
    origins = {p.origin for p in points}
    seen = []

    def fake_fit(train, start=None, max_evals=400):
        seen.append({p.origin for p in train})
        return fidelity.Fit(fidelity.current_values(), 0.0, 1)

    monkeypatch.setattr(fidelity, "fit_constants", fake_fit)
    result = fidelity.leave_one_source_out(points, log=lambda line: None)
    loso = result["leave_one_source_out"]
    assert set(loso["by_origin"]) == origins and len(origins) >= 2
    for origin, train in zip(loso["by_origin"], seen, strict=False):
        assert origin not in train and train == origins - {origin}
    assert seen[-1] == origins  # the last fit: every source
    assert loso["rows"] == len(points) == result["all_sources"]["rows"]
    pooled = [r["key"] for d in loso["by_origin"].values() for r in d["rows_detail"]]
    assert sorted(pooled) == sorted(p.key for p in points)


def test_the_physics_table_names_every_left_out_source():
    points = [p for p in fidelity.fitted_points() if not p.scenario]
    rows = fidelity.errors_under(fidelity.current_values(), points[:3])
    stats = fidelity.stats(rows)
    data = {
        "free": [c.field for c in fidelity.FREE], "loss": fidelity.LOSS,
        "leave_one_source_out": {**stats, "by_origin": {"A": {**stats, "constants": {
            "layer_s": 3e-5}}}},
        "all_sources": {**stats, "constants": {"layer_s": 3e-5}},
        "carried": {"layer_s": 3e-5}, "carried_errors": stats,
    }  # fmt: skip
    text = "\n".join(section_lines("physics", data))
    assert "leave-one-source-out (the headline)" in text and "layer_s 30us" in text
    assert f"{stats['median']:.1%}" in text


def test_a_profile_fitted_from_steps_prices_them_as_its_fit_without_the_base_floors():
    """``fit.profile_from_coefficients`` on a base carrying floors (H100): the fit's c0 holds
    every fixed cost of a step, so the profile prices a decode exactly as the fit does (the
    base's floors would count it twice)."""
    from specrl.costmodel.cost import StepCostModel
    from specrl.costmodel.fit import Record, features, profile_from_coefficients

    assert H100.layer_s > 0 and H100.moe_layer_s > 0
    coef = np.array([3e-4, 1 / 3.0e12, 1 / 7.0e14, 0.0, 0.0, 0.0, 1 / 2.0e12])
    for model in (DENSE, MOE):
        profile = profile_from_coefficients(H100, coef, "fitted")
        assert (profile.layer_s, profile.moe_layer_s, profile.expert_s) == (0.0, 0.0, 0.0)
        for n in (1, 16):
            fit = float(features(model, Record(n, 1, 600.0, 0.0, "decode", "c")) @ coef)
            assert StepCostModel(model, profile).decode(n, 600.0) == pytest.approx(fit, rel=1e-9)
