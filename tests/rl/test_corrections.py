"""Off-policy corrections: the registered rules, their effect on a learner step, and what 'tis'
does with top-k/top-p truncated behaviour logprobs (on-policy weight = the kept mass)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from specrl.config_training import LearnerCfg
from specrl.engine.engine import Engine
from specrl.rl.corrections import CORRECTIONS, get_correction
from specrl.rl.learner import Learner, TrainSample, token_logprobs
from specrl.rl.losses import get_loss
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from tests.conftest import make_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def test_registry_and_rules():
    assert {"ppo", "tis"} <= set(CORRECTIONS)
    with pytest.raises(ValueError, match="did you mean tis"):
        get_correction("tiss")
    cur = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]])
    beh = torch.tensor([[-1.5, -1.0], [9.0, 9.0]])
    has = torch.tensor([True, False])
    ppo = get_correction("ppo")(cur, beh, has, 2.0)
    assert torch.equal(ppo.old, torch.tensor([[-1.5, -1.0], [-0.5, -0.7]])) and ppo.weight is None
    tis = get_correction("tis")(cur, beh, has, 1.5)
    assert torch.equal(tis.old, cur)
    want = torch.tensor([[min(math.exp(0.5), 1.5), math.exp(-1.0)], [1.0, 1.0]])
    torch.testing.assert_close(tis.weight, want)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo"])
def test_is_weight_scales_each_tokens_policy_gradient(name):
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], requires_grad=True)
    mask, adv = torch.ones(2, 2), torch.tensor([1.0, -2.0])
    w = torch.tensor([[2.0, 0.5], [1.0, 3.0]])
    get_loss(name)(lp, lp.detach(), adv, mask, max_len=2).loss.backward()
    plain = lp.grad.clone()
    lp.grad = None
    out = get_loss(name)(lp, lp.detach(), adv, mask, max_len=2, is_weight=w)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, plain * w)
    assert out.metrics["is_weight_mean"] == pytest.approx(float(w.mean()))


def _samples(model, shift: float = 0.0) -> list[TrainSample]:
    seqs = [([3, 4, 5], [6, 7, 8, 9]), ([3, 4, 5], [10, 11]), ([12, 13], [14, 15, 16])]
    with torch.no_grad():
        own = token_logprobs(model, seqs)
    return [
        TrainSample(p, c, a, (lp - (shift if i == 0 else 0.0)).tolist())
        for i, ((p, c), a, lp) in enumerate(zip(seqs, [1.0, -0.5, 0.7], own, strict=True))
    ]


def _step(correction: str, samples, cap: float = 4.0):
    model = make_tiny(0).float()
    cfg = LearnerCfg(correction=correction, is_cap=cap, dtype="fp32", lr=1e-2)
    learner = Learner(copy.deepcopy(model), cfg)
    learner.train_step(samples)
    return torch.cat([p.detach().flatten() for p in learner.model.parameters()])


def test_tis_on_policy_equals_ppo_and_weights_stale_tokens():
    model = make_tiny(0).float()
    on_policy = _samples(model)
    torch.testing.assert_close(_step("tis", on_policy), _step("ppo", on_policy))
    # the first sample's behaviour was log 2 less likely: its tokens weigh 2x (cap 4), which
    # moves the update; capping at 1 takes the weight back to 1 (= the on-policy step)
    stale = _samples(model, shift=math.log(2.0))
    assert not torch.allclose(_step("tis", stale), _step("tis", on_policy))
    torch.testing.assert_close(_step("tis", stale, cap=1.0), _step("tis", on_policy))


@pytest.mark.parametrize("truncation", [{"top_k": 4}, {"top_p": 0.6}])
def test_tis_weight_with_truncation_is_the_kept_mass(truncation):
    """On-policy with top-k/top-p, exp(learner - behaviour) at each token = the probability mass
    the truncation kept at that position (the exact IS ratio to the untruncated policy)."""
    model = make_tiny(0, vocab_size=32).float()
    engine = Engine(copy.deepcopy(model), max_batch=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=3, seed=5, **truncation)
    comps = engine.generate([Request([3, 4, 5], params)])
    seqs = [(c.prompt_ids, c.token_ids) for c in comps]
    with torch.no_grad():
        untrunc = token_logprobs(model, seqs)
    for c, lp in zip(comps, untrunc, strict=True):
        weight = get_correction("tis")(lp[None], torch.tensor([c.logprobs]), torch.tensor([True]),
                                       100.0).weight[0]  # fmt: skip
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            probs = model(ids, torch.arange(ids.shape[1])[None]).logits[0].float().softmax(-1)
        for t in range(len(c.token_ids)):
            p = probs[len(c.prompt_ids) - 1 + t]  # [V]
            kept = _kept_mass(p, **truncation)
            assert float(weight[t]) == pytest.approx(kept, rel=1e-4)
            assert kept < 1.0


def _kept_mass(p: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> float:
    sorted_p = p.sort(descending=True).values
    if top_k:
        return float(sorted_p[:top_k].sum())
    before = sorted_p.cumsum(0) - sorted_p  # mass strictly before each token
    return float(sorted_p[before < top_p].sum())
