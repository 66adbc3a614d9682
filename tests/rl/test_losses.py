"""Policy losses: hand-computed values, gradients, clipping and normalisation differences."""

import math

import pytest
import torch

from specrl.rl.losses import LOSSES, LossNorm, get_loss, k3_kl


def _inputs():
    # two sequences: lengths 2 and 3 (T = 3)
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -1.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -2.0])
    return logprobs, mask, adv


def test_registry():
    assert {"grpo", "dr_grpo", "dapo"} <= set(LOSSES)
    with pytest.raises(ValueError, match="did you mean dapo"):
        get_loss("dapoo")


def test_on_policy_values_by_normalisation():
    lp, mask, adv = _inputs()
    old = lp.detach()
    # ratio = 1 everywhere: per-token term = -A
    grpo = get_loss("grpo")(lp, old, adv, mask).loss
    assert math.isclose(float(grpo.detach()), ((-1.0) + 2.0) / 2, abs_tol=1e-6)  # mean of seq means
    dapo = get_loss("dapo")(lp, old, adv, mask).loss
    assert math.isclose(float(dapo.detach()), (-1.0 * 2 + 2.0 * 3) / 5, abs_tol=1e-6)  # token mean
    dr = get_loss("dr_grpo")(lp, old, adv, mask, max_len=10).loss
    assert math.isclose(float(dr.detach()), (-2.0 + 6.0) / (2 * 10), abs_tol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo"])
def test_ratio_one_gradient_is_advantage_weighted_logprob_gradient(name):
    lp, mask, adv = _inputs()
    out = get_loss(name)(lp, lp.detach(), adv, mask, max_len=3)
    out.loss.backward()
    lengths = mask.sum(1, keepdim=True)
    weight = {"grpo": 1 / (lengths * 2), "dr_grpo": torch.full_like(lengths, 1 / 6),
              "dapo": torch.full_like(lengths, 1 / 5)}[name]  # fmt: skip
    expected = -adv[:, None] * mask * weight  # d loss / d logprob_t
    assert torch.allclose(lp.grad, expected, atol=1e-6)
    assert out.metrics["clip_frac"] == 0.0 and out.metrics["ratio_mean"] == pytest.approx(1.0)


def test_clipping_zeroes_gradient_outside_trust_region_only():
    lp = torch.zeros(4, 1, requires_grad=True)
    # ratios 1.5, 1.5, 0.5, 0.5 with advantages +, -, -, +
    old = torch.log(torch.tensor([[1 / 1.5], [1 / 1.5], [2.0], [2.0]]))
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    out = get_loss("grpo")(lp, old, adv, torch.ones(4, 1), eps_low=0.2)
    out.loss.backward()
    g = lp.grad[:, 0]
    assert g[0] == 0 and g[2] == 0  # A>0 above 1+eps and A<0 below 1-eps: clipped
    # inside the region: d/dlp of -ratio*A = -A*ratio, over 4 sequences
    assert torch.allclose(g[[1, 3]], torch.tensor([1.5, -0.5]) / 4)
    assert out.metrics["clip_frac"] == pytest.approx(0.5)
    assert out.metrics["ratio_mean"] == pytest.approx(1.0)
    # value: -min(rA, clip(r)A) per token, mean over the 4 sequences
    expected = -(1.2 * 1 + 1.5 * -1 + 0.8 * -1 + 0.5 * 1) / 4
    assert float(out.loss.detach()) == pytest.approx(expected)


def test_dapo_clip_higher_is_asymmetric():
    lp = torch.zeros(1, 1, requires_grad=True)
    old = torch.log(torch.tensor([[1 / 1.25]]))  # ratio 1.25, A>0
    adv = torch.ones(1)
    get_loss("dapo")(lp, old, adv, torch.ones(1, 1)).loss.backward()  # eps_high 0.28: unclipped
    assert lp.grad.item() == pytest.approx(-1.25)
    lp.grad = None
    get_loss("grpo")(lp, old, adv, torch.ones(1, 1)).loss.backward()  # symmetric 0.2: clipped
    assert lp.grad.item() == 0.0


def test_token_vs_sequence_normalisation_differ_for_unequal_lengths():
    # a long correct completion and a short wrong one: per-token weight differs
    lp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]])
    adv = torch.tensor([1.0, -1.0])
    g = {}
    for name in ("grpo", "dapo"):
        lp.grad = None
        get_loss(name)(lp, lp.detach(), adv, mask).loss.backward()
        g[name] = lp.grad.clone()
    # grpo: every sequence weighs 1/N in total -> long sequence tokens get 1/(2*4)
    assert g["grpo"][0, 0] == pytest.approx(-1 / 8) and g["grpo"][1, 0] == pytest.approx(1 / 2)
    # dapo: every token weighs 1/5
    assert g["dapo"][0, 0] == pytest.approx(-1 / 5) and g["dapo"][1, 0] == pytest.approx(1 / 5)


def test_kl_k3_values_and_gradient():
    lp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    kl = k3_kl(lp, ref)
    d = math.log(0.5)
    assert kl[0, 0].item() == pytest.approx(math.exp(d) - d - 1) and kl[0, 1].item() == 0.0
    out = get_loss("dapo")(lp, lp.detach(), torch.zeros(1), torch.ones(1, 2), ref_logprobs=ref,
                           kl_coef=0.1)  # fmt: skip
    assert float(out.loss.detach()) == pytest.approx(0.1 * kl.sum().item() / 2)
    assert out.metrics["kl"] == pytest.approx(kl.mean().item())
    out.loss.backward()  # d/dlp [exp(ref-lp) - (ref-lp)] = 1 - exp(ref-lp)
    assert lp.grad[0, 0].item() == pytest.approx(0.1 * (1 - 0.5) / 2)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo"])
def test_micro_batch_losses_add_up_with_batch_norm(name):
    torch.manual_seed(0)
    lp = torch.randn(6, 5)
    old = lp + 0.1 * torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    adv = torch.randn(6)
    full = get_loss(name)(lp, old, adv, mask, max_len=5).loss
    norm = LossNorm.of(mask)
    parts = sum(
        get_loss(name)(lp[s], old[s], adv[s], mask[s], max_len=5, norm=norm).loss
        for s in (slice(0, 2), slice(2, 6))
    )
    assert torch.allclose(full, parts, atol=1e-6)


def test_shape_errors():
    with pytest.raises(ValueError, match="same"):
        get_loss("grpo")(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        get_loss("grpo")(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
