"""Sample-exact speculation (``SpecConfig.exact = "sample"``): with the same seeds, speculative
output is plain sampling's output token for token, for every drafter, at any temperature and
top-k/top-p; the standard rule is exact only in distribution (tested in test_spec_engine.py)."""

from __future__ import annotations

import pytest
import torch

from specrl.engine import Engine
from specrl.rollout_types import Request
from specrl.sampling import STREAM_SAMPLE, SamplingParams, sample_logits, uniforms
from specrl.spec.config import SpecConfig
from specrl.spec.verify import verify
from tests.conftest import make_tiny

DRAFTERS = ["ngram", "suffix", "self", "draft", "eagle3", "mtp", "block"]
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8], [9, 9, 9, 9, 9]]
SETTINGS = {
    "T1": dict(temperature=1.0),
    "T0.8-topk5-topp0.9": dict(temperature=0.8, top_k=5, top_p=0.9),
}


def run(target, spec: SpecConfig, settings: dict, max_batch: int = 8) -> list:
    draft = (
        make_tiny(seed=5, vocab_size=target.config.vocab_size) if spec.method == "draft" else None
    )
    engine = Engine(target, max_batch=max_batch, spec=spec, draft_model=draft)
    params = SamplingParams(max_new_tokens=20, n=3, seed=7, **settings)
    return engine.generate([Request(p, params) for p in PROMPTS]), engine.stats


@pytest.mark.parametrize("settings", list(SETTINGS.values()), ids=list(SETTINGS))
@pytest.mark.parametrize("method", DRAFTERS)
def test_sampled_speculation_equals_sampled_plain(method, settings):
    target = make_tiny(seed=3, vocab_size=16)
    plain, _ = run(target, SpecConfig("none", 0), settings)
    spec, stats = run(target, SpecConfig(method, 3, exact="sample"), settings)
    assert stats.drafted > 0  # the drafter really drafted
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
    if method == "self":  # the others draft random-model tokens: few or none match
        assert stats.accepted > 0


def test_the_standard_rule_is_not_sample_exact():
    """The property belongs to the rule: the same drafter under rejection sampling samples
    other (equally distributed) sequences."""
    target = make_tiny(seed=3, vocab_size=16)
    plain, _ = run(target, SpecConfig("none", 0), SETTINGS["T1"])
    spec, stats = run(target, SpecConfig("self", 3), SETTINGS["T1"])
    assert stats.accepted > 0
    assert [c.token_ids for c in spec] != [c.token_ids for c in plain]


def test_the_coupled_self_drafter_is_always_accepted():
    """q == p drawn with plain sampling's uniforms: every draft is plain's token."""
    target = make_tiny(seed=3, vocab_size=16)
    _, stats = run(target, SpecConfig("self", 3, exact="sample"), SETTINGS["T1"])
    assert stats.accepted == stats.drafted > 0


def test_verify_sample_rule_emits_plain_tokens_up_to_the_first_mismatch():
    gen = torch.Generator().manual_seed(0)
    batch, k, vocab = 256, 4, 6
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    temperature = torch.rand(batch, generator=gen) + 0.3
    top_k = torch.randint(0, 4, (batch,), generator=gen)
    top_p = torch.full((batch,), 0.95)
    seeds = torch.randint(0, 2**62, (batch,), generator=gen)
    counters = torch.randint(0, 100, (batch,), generator=gen)
    lengths = torch.randint(0, k + 1, (batch,), generator=gen)
    plain = torch.stack([
        sample_logits(logits[:, i], temperature, top_k, top_p,
                      uniforms(seeds, counters + i, STREAM_SAMPLE))[0]
        for i in range(k + 1)], dim=1)  # fmt: skip
    # drafts: plain's tokens with some positions changed, so every prefix length occurs
    drafts = torch.where(torch.rand(batch, k, generator=gen) < 0.3, (plain[:, :k] + 1) % vocab,
                         plain[:, :k])  # fmt: skip
    v = verify(drafts, lengths, None, logits, temperature, top_k, top_p, seeds, counters,
               rule="sample")  # fmt: skip
    for b in range(batch):
        n = 0
        while n < lengths[b] and drafts[b, n] == plain[b, n]:
            n += 1
        assert v.num_accepted[b] == n
        assert v.tokens[b, : n + 1].tolist() == plain[b, : n + 1].tolist()
    assert len(set(v.num_accepted.tolist())) == k + 1


def test_bad_exact_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="spec_exact must be one of distribution, sample"):
        SpecConfig("ngram", 3, exact="bitwise").validate()
    with pytest.raises(ValueError, match="takes no siblings"):
        SpecConfig("eagle3", 3, siblings=2, exact="sample").validate()
