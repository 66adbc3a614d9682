"""Advantage estimators: hand-computed values and group properties."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrl.rl.advantages import ADVANTAGES, compute_advantages, get_advantage


def test_registry_has_the_three_estimators():
    assert {"grpo", "dr_grpo", "rloo"} <= set(ADVANTAGES)


def test_grpo_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    adv = compute_advantages("grpo", r, eps=0.0)
    std0 = (4 * 0.25 / 3) ** 0.5  # unbiased std of [1,0,0,1]
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std0)
    std1 = (3 * 0.0625 + 0.5625) / 3
    assert torch.allclose(adv[1], torch.tensor([0.25, 0.25, 0.25, -0.75]) / std1**0.5)


def test_grpo_without_std_is_mean_centred():
    r = torch.tensor([[3.0, 1.0, 2.0]])
    adv = compute_advantages("grpo", r, normalize_std=False)
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0, 0.0]]))


def test_identical_rewards_give_zero_advantage():
    r = torch.ones(2, 5)
    for name in ("grpo", "dr_grpo", "rloo"):
        assert torch.equal(compute_advantages(name, r), torch.zeros(2, 5)), name


def test_dr_grpo_and_rloo_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(
        compute_advantages("dr_grpo", r), torch.tensor([[0.75, -0.25] + [-0.25] * 2])
    )
    # leave-one-out: 1 - 0 = 1; 0 - 1/3
    expect = torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]])
    assert torch.allclose(compute_advantages("rloo", r), expect)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=8))
def test_rloo_equals_explicit_leave_one_out(values):
    r = torch.tensor([values], dtype=torch.float64).float()
    adv = compute_advantages("rloo", r)[0]
    for i in range(len(values)):
        others = torch.cat([r[0, :i], r[0, i + 1 :]])
        assert torch.isclose(adv[i], r[0, i] - others.mean(), atol=1e-4)
    assert abs(float(adv.sum())) < 1e-3


def test_unknown_name_and_bad_shape():
    with pytest.raises(ValueError, match="did you mean grpo"):
        get_advantage("grp")
    with pytest.raises(ValueError, match="num_groups, G"):
        compute_advantages("grpo", torch.ones(4))
    with pytest.raises(ValueError, match="G=1"):
        compute_advantages("rloo", torch.ones(3, 1))
