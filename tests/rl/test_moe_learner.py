"""The learner on a mixture-of-experts policy: routing replay places the engine's experts at the
right tokens and removes an expert-choice mismatch, router statistics and the load-balancing
loss, and MoE settings refused on a dense policy."""

from __future__ import annotations

import copy

import pytest
import torch

from specrl.config_training import LearnerCfg
from specrl.engine import Engine
from specrl.rl.learner import Learner, TrainSample
from specrl.rl.packing import pack_sequences, packed_routing
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from tests.conftest import make_tiny
from tests.engine.test_moe_engine import MOE, PROMPTS


def moe_policy(seed: int = 3):
    return make_tiny(seed=seed, vocab_size=32, **MOE)


def rollout(model, n: int = 2):
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=n, seed=9)
    return Engine(model, max_batch=8).generate([Request(p, params) for p in PROMPTS])


def test_packed_routing_places_each_sequence_at_its_tokens():
    seqs = [([1, 2, 3], [4, 5]), ([1, 2, 3], [6]), ([7, 8], [9, 9, 9])]
    routings = [torch.arange(4).view(4, 1, 1), torch.arange(3).view(3, 1, 1) + 10,
                torch.arange(4).view(4, 1, 1) + 20]  # fmt: skip
    batch = pack_sequences(seqs, row_len=16, share_prompts=True)
    got = packed_routing(batch, routings).view(*batch.ids.shape)
    row = got[0].tolist()  # prompt [1 2 3] shared, then [4 5], [6], then [7 8] [9 9 9]
    assert row[:3] == [10, 11, 12]  # the shared prompt: its sequences' (a group's are alike)
    assert row[3:5] == [3, -1] and row[5] == -1  # a completion's last token: none recorded
    assert row[6:11] == [20, 21, 22, 23, -1] and set(row[11:]) == {-1}  # padding: none
    assert packed_routing(batch, [None, None, None]) is None
    with pytest.raises(ValueError, match="sequence 2: routing of shape"):
        packed_routing(batch, [None, None, torch.zeros(9, 1, 1, dtype=torch.int64)])


@pytest.mark.parametrize("setting", [dict(routing_replay=True), dict(moe_aux_loss_coef=0.1)])
def test_a_dense_policy_refuses_moe_settings(setting):
    with pytest.raises(ValueError, match="needs a mixture-of-experts policy; the model is a dense"):
        Learner(make_tiny(), LearnerCfg(dtype="fp32", **setting))


def test_replaying_the_engine_routing_gives_its_logprobs_and_a_shifted_one_does_not():
    policy = moe_policy()
    comps = rollout(policy)
    learner = Learner(copy.deepcopy(policy), LearnerCfg(dtype="fp32", routing_replay=True))
    seqs = [(c.prompt_ids, c.tokens) for c in comps]
    engine = torch.cat([c.token_raw_logprobs for c in comps])
    replayed = torch.cat(learner.raw_logprobs(seqs, [c.routing for c in comps]))
    free = torch.cat(learner.raw_logprobs(seqs))
    torch.testing.assert_close(replayed, engine, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(free, engine, atol=1e-5, rtol=1e-5)
    shifted = [torch.roll(c.routing, 1, dims=0) for c in comps]
    assert (torch.cat(learner.raw_logprobs(seqs, shifted)) - engine).abs().max() > 1e-2


def test_replay_removes_an_expert_choice_mismatch():
    """A learner whose router differs a little from the engine's (as precision or kernels make
    it) routes some tokens elsewhere: those tokens' logprobs jump. Replaying the engine's
    experts leaves only the router weights' smooth difference (measured at this seed: max
    |delta| 0.025 free, 0.008 replayed; means 1.0e-3 and 0.8e-3)."""
    policy = moe_policy()
    comps = rollout(policy, n=4)
    learner_model = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in learner_model.layers:
            if layer.moe:
                w = layer.mlp.gate.weight
                w.add_(torch.randn(w.shape, generator=g) * 0.01 * w.abs().mean())
    learner = Learner(learner_model, LearnerCfg(dtype="fp32", routing_replay=True))
    seqs = [(c.prompt_ids, c.tokens) for c in comps]
    engine = torch.cat([c.token_raw_logprobs for c in comps])
    free = (torch.cat(learner.raw_logprobs(seqs)) - engine).abs()
    replayed = (torch.cat(learner.raw_logprobs(seqs, [c.routing for c in comps])) - engine).abs()
    assert replayed.max() < 0.5 * free.max()  # the jumps are gone
    assert replayed.mean() < free.mean()


def test_a_step_reports_router_statistics_and_the_balancing_loss_moves_the_gradient():
    policy = moe_policy()
    comps = rollout(policy)
    advantages = torch.linspace(-1, 1, len(comps)).tolist()
    samples = [TrainSample(c.prompt_ids, c.tokens, a, None, c.routing)
               for c, a in zip(comps, advantages, strict=True)]  # fmt: skip
    grads = []
    for coef in (0.0, 1.0):
        cfg = LearnerCfg(dtype="fp32", routing_replay=True, moe_aux_loss_coef=coef)
        learner = Learner(copy.deepcopy(policy).train().requires_grad_(True), cfg)
        metrics = learner.accumulate_gradients(samples).metrics
        assert metrics["moe_load_max"] >= 1.0 and metrics["moe_aux_loss"] > 0
        grads.append(learner.model.layers[1].mlp.gate.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])
