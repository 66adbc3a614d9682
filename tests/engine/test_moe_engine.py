"""The engine on a mixture-of-experts target: speculation stays lossless (greedy and
sample-exact token for token, whole-sequence distributions by chi-square), static steps equal
unpadded ones, and the cost model sees the experts."""

from __future__ import annotations

import pytest
import torch

from specrl.engine import Engine
from specrl.models.moe import Routing
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig
from specrl.spec.controller import model_spec
from tests.conftest import make_tiny
from tests.engine.test_inflight import SwitchEngine
from tests.engine.test_spec_engine import NEW, PROMPT, VOCAB, assert_matches_exact

MOE = dict(model_type="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=16, mlp_only_layers=(0,), num_layers=3)  # fmt: skip
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8], [9, 9, 9, 9, 9]]
DRAFTERS = ["ngram", "suffix", "draft", "eagle3", "mtp"]


def moe_target(seed: int = 3, vocab: int = 32):
    return make_tiny(seed=seed, vocab_size=vocab, **MOE)


def generate(target, method: str, params: SamplingParams, exact: str = "distribution",
             step_graphs: str = "off") -> tuple[list, Engine]:  # fmt: skip
    vocab = target.config.vocab_size
    draft = make_tiny(seed=5, vocab_size=vocab) if method == "draft" else None  # a dense drafter
    spec = None if method == "none" else SpecConfig(method, 3, exact=exact)
    engine = Engine(target, max_batch=4, spec=spec, draft_model=draft, step_graphs=step_graphs)
    return engine.generate([Request(p, params) for p in PROMPTS]), engine


@pytest.mark.parametrize("method", DRAFTERS)
def test_greedy_speculation_equals_plain(method):
    target = moe_target()
    params = SamplingParams(temperature=0, max_new_tokens=12, n=2)
    plain, _ = generate(target, "none", params)
    spec, engine = generate(target, method, params)
    assert engine.stats.drafted > 0
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.token_raw_logprobs, b.token_raw_logprobs)


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle3"])
def test_sampled_speculation_is_sample_exact(method):
    target = moe_target(vocab=16)
    params = SamplingParams(temperature=0.8, top_k=5, max_new_tokens=16, n=3, seed=7)
    plain, _ = generate(target, "none", params)
    spec, engine = generate(target, method, params, exact="sample")
    assert engine.stats.drafted > 0
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sequence_distribution_matches_exact(method):
    target = moe_target(seed=11, vocab=VOCAB)
    draft = make_tiny(seed=5, vocab_size=VOCAB) if method == "draft" else None
    engine = Engine(target, max_batch=512, spec=SpecConfig(method, 3), draft_model=draft)
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW, n=3000, seed=1)
    out = engine.generate([Request(PROMPT, params)])
    assert_matches_exact(out, target, params)
    assert engine.stats.drafted > 0


@pytest.mark.parametrize("method", ["none", "ngram", "eagle3"])
def test_static_steps_equal_unpadded_steps(method):
    target = moe_target()
    params = SamplingParams(temperature=0, max_new_tokens=10, n=2)
    plain, _ = generate(target, method, params)
    static, engine = generate(target, method, params, step_graphs="static")
    assert engine.stats.steps > 0 and engine.static.host_copies == engine.stats.steps
    assert [c.token_ids for c in static] == [c.token_ids for c in plain]


def test_the_cost_model_sees_the_experts():
    target = moe_target()
    spec = model_spec(target)
    c = target.config
    assert spec.is_moe and spec.experts == 8 and spec.experts_per_token == 2
    assert spec.moe_layers == 2 and spec.moe_intermediate == 16
    assert spec.params_active == c.num_parameters(active=True) < spec.params_total


def teacher_forced_routing(target, ids: list[int]) -> torch.Tensor:
    """Experts [len(ids), moe_layers, top_k] of one full forward over ``ids``."""
    rec = Routing(record=True)
    with torch.no_grad():
        target(torch.tensor([ids]), torch.arange(len(ids))[None], routing=rec)
    return rec.experts()


@pytest.mark.parametrize(("method", "graphs"),
                         [("none", "off"), ("ngram", "off"), ("eagle3", "off"), ("none", "static"),
                          ("ngram", "static")])  # fmt: skip
def test_completions_carry_the_experts_of_every_input_position(method, graphs):
    """Each completion's routing is what a full forward over prompt + completion routes at
    every position but the last (float32: the same experts), through prefill, shared prompts,
    speculation and static steps."""
    target = moe_target()
    params = SamplingParams(temperature=1.0, max_new_tokens=9, n=2, seed=3)
    comps, _ = generate(target, method, params, step_graphs=graphs)
    for c in comps:
        ids = c.prompt_ids + c.token_ids
        assert c.routing.shape == (len(ids) - 1, 2, 2) and c.routing.dtype == torch.int16
        assert torch.equal(c.routing, teacher_forced_routing(target, ids)[:-1])


def test_a_dense_target_records_no_routing():
    comps, _ = generate(make_tiny(seed=3), "ngram", SamplingParams(temperature=0, max_new_tokens=4))
    assert all(c.routing is None for c in comps)


@pytest.mark.parametrize("mode", ["reverify", "discard"])
def test_an_in_flight_update_records_the_new_weights_routing(mode):
    """Rows rewritten under new weights (re-prefilled, reverified or restarted) carry the
    experts the new weights route at every input position."""
    old, new = moe_target(seed=3), moe_target(seed=4)
    update = ({k: v.clone() for k, v in new.named_parameters()}, 1, mode)
    engine = SwitchEngine(old, [update], 1, max_batch=4, spec=SpecConfig("ngram", 3))
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=5)
    comps = engine.generate([Request(p, params) for p in PROMPTS])
    assert engine.stats.weight_updates == 1
    for c in comps:
        assert set(c.token_versions) == {1}
        ids = c.prompt_ids + c.token_ids
        assert torch.equal(c.routing, teacher_forced_routing(new, ids)[:-1])
