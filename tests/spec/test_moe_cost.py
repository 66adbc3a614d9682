"""The cost model's unique-expert term: expected distinct experts under measured routing, its
own fitted rate, the controller's popularity measurement of an MoE target."""

from __future__ import annotations

import numpy as np
import pytest

from specrl.costmodel.cost import StepCostModel, expected_experts
from specrl.costmodel.fit import Record, design, fit_design, relative_nnls
from specrl.costmodel.specs import load_hardware, with_overrides
from specrl.spec.controller import measure_popularity, model_spec
from tests.conftest import make_tiny
from tests.engine.test_moe_engine import MOE


def test_expected_experts_under_measured_routing():
    uniform = (0.25,) * 8  # 2 of 8 per token
    for n in (1, 3, 10):
        assert expected_experts(8, 2, n, uniform) == pytest.approx(expected_experts(8, 2, n))
    skewed = (0.9, 0.9) + (0.2 / 6,) * 6  # two hot experts take most tokens
    assert expected_experts(8, 2, 1, skewed) == pytest.approx(2.0)
    assert expected_experts(8, 2, 8, skewed) < 0.6 * expected_experts(8, 2, 8)
    assert expected_experts(8, 2, 10_000, skewed) == pytest.approx(8.0)


def test_a_fit_recovers_the_rate_of_the_experts_a_verify_touches():
    """Records priced by a profile whose routed experts stream at a third of the dense rate:
    the fit finds that rate and prices unseen verify widths from it (the uniform-rate model,
    one byte rate for both, cannot)."""
    spec = model_spec(make_tiny(seed=1, **MOE))
    base = load_hardware("cpu-2core")
    profile = with_overrides(base, name="truth", eta_mem=0.5, eta_expert_mem=0.15,
                             step_overhead_s=1e-4)  # fmt: skip
    truth = StepCostModel(spec, profile)
    shapes = [(b, t) for b in (1, 2, 4, 8, 16, 32) for t in (1, 2, 3, 4)]
    records = [Record(b, t, 64.0, truth.target_forward(b, t, 64.0), "decode" if t == 1
                      else "verify") for b, t in shapes]  # fmt: skip
    x, y = design(spec, records)
    fitted = fit_design(x, y, base, "fitted")
    assert fitted.eta_expert_mem == pytest.approx(0.15, rel=1e-3)
    model = StepCostModel(spec, fitted)
    for b, t in ((3, 6), (24, 8)):
        want = truth.target_forward(b, t, 64.0)
        assert model.target_forward(b, t, 64.0) == pytest.approx(want, rel=1e-3)
    one_rate = np.delete(x, 6, axis=1)  # every weight byte at one rate (the model before)
    one_rate[:, 1] += x[:, 6]
    coef = relative_nnls(one_rate, y)
    assert np.abs(one_rate @ coef / y - 1).max() > 0.02  # a misfit the term removes


def test_the_controller_measures_an_moe_targets_routing():
    moe = make_tiny(seed=1, **MOE)
    popularity = measure_popularity(moe)
    assert len(popularity) == 8 and sum(popularity) == pytest.approx(2.0)
    assert model_spec(moe, popularity).expert_popularity == popularity
    assert measure_popularity(make_tiny(seed=1)) == ()
