"""Engine step records (``record_steps=True``) describe the forwards the engine really ran."""

from __future__ import annotations

import pytest
import torch

from specrl.engine import Engine
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig
from tests.conftest import make_tiny

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15], [3, 3, 3, 3, 3, 3]]


def kinds(engine: Engine, kind: str) -> list:
    return [r for r in engine.stats.step_records if r.kind == kind]


def test_off_by_default_records_nothing():
    engine = Engine(make_tiny(), max_batch=2)
    engine.generate([Request(p, SamplingParams(max_new_tokens=4, seed=1)) for p in PROMPTS])
    assert engine.stats.step_records == [] and engine.stats.steps > 0


def test_plain_decoding_one_decode_record_per_step_and_prefills_per_admission():
    engine = Engine(make_tiny(), max_batch=2, record_steps=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    engine.generate([Request(p, params) for p in PROMPTS])  # refills: several prefills
    st = engine.stats
    decodes, prefills = kinds(engine, "decode"), kinds(engine, "prefill")
    assert len(decodes) == st.steps and len(prefills) + len(decodes) == len(st.step_records)
    assert all(r.tokens_per_seq == 1 and 1 <= r.batch_size <= 2 for r in decodes)
    assert sum(r.batch_size for r in decodes) == st.row_steps  # prefills are not row steps
    assert sum(r.batch_size for r in prefills) == len(PROMPTS)
    assert all(r.context_len == 0 and r.step_time_s > 0 for r in prefills)
    assert max(r.tokens_per_seq for r in prefills) == max(len(p) for p in PROMPTS)


def test_decode_context_is_the_tokens_already_cached():
    engine = Engine(make_tiny(), max_batch=1, record_steps=True)
    prompt, new = [1, 2, 3, 4], 5
    engine.generate([Request(prompt, SamplingParams(max_new_tokens=new, seed=2))])
    contexts = [r.context_len for r in kinds(engine, "decode")]
    assert contexts == [len(prompt) + i for i in range(new - 1)]


def test_speculative_steps_record_a_draft_and_a_k_plus_1_verify():
    k, prompt = 3, [1, 2, 3]
    engine = Engine(make_tiny(seed=2, vocab_size=16), spec=SpecConfig("self", k), record_steps=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=1 + 4 * (k + 1), n=4, seed=4)
    engine.generate([Request(prompt, params)])  # self-drafting accepts all: k+1 per step
    drafts, verifies = kinds(engine, "draft"), kinds(engine, "verify")
    assert len(drafts) == len(verifies) == engine.stats.steps == 4
    assert kinds(engine, "decode") == [] and len(kinds(engine, "prefill")) == 1
    assert all(r.tokens_per_seq == k for r in drafts)
    assert all(r.tokens_per_seq == k + 1 and r.batch_size == 4 for r in verifies)
    assert [r.context_len for r in verifies] == [len(prompt) + i * (k + 1) for i in range(4)]


def test_cumulative_stats_concatenate_records_and_sum_counters():
    engine = Engine(make_tiny(), max_batch=4, spec=SpecConfig("ngram", 2), record_steps=True)
    params = SamplingParams(max_new_tokens=5, seed=5)
    lengths, drafted = [], []
    for _ in range(2):
        engine.generate([Request(p, params) for p in PROMPTS])
        lengths.append(len(engine.stats.step_records))
        drafted.append(engine.stats.per_position_drafted)
    total = engine.total_stats
    assert len(total.step_records) == sum(lengths)
    assert len(total.per_position_drafted) == max(len(d) for d in drafted)
    assert sum(total.per_position_drafted) == sum(sum(d) for d in drafted)


@pytest.mark.parametrize(
    "max_batch, sizes, lengths",
    [
        (1, [1, 3, 2, 4, 1], [9, 3, 6, 4, 7]),
        (2, [1, 3, 2, 4, 1], [9, 3, 6, 4, 7]),
        (3, [1, 3, 2, 4, 1], [9, 3, 6, 4, 7]),
        (3, [2, 2, 2, 2, 2], [5, 5, 5, 5, 5]),  # all rows end together: slots of other prompts
    ],
)
def test_a_group_larger_than_the_batch_is_prefilled_once_per_call(max_batch, sizes, lengths):
    """Samples of a request admitted after its first (batch < group) reuse its prefill: one
    prefill per request per call, the same completions as a batch that forks them all at once
    (groups of several sizes and lengths, so rows finish and compact in many orders, and a
    later sample may land in a slot another prompt used last)."""
    model = make_tiny()
    reqs = [
        Request(p, SamplingParams(temperature=1.0, max_new_tokens=m, n=n, seed=i))
        for i, (p, n, m) in enumerate(zip(PROMPTS, sizes, lengths, strict=True))
    ]
    engine = Engine(model, max_batch=max_batch, record_steps=True)
    out = engine.generate(reqs)
    assert sum(r.batch_size for r in kinds(engine, "prefill")) == len(reqs)
    forked = Engine(model, max_batch=64).generate(reqs)
    assert [c.token_ids for c in out] == [c.token_ids for c in forked]
    for a, b in zip(out, forked, strict=True):  # batch shapes round differently: close
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
    engine.generate(reqs)  # a new call prefills again (the weights may have changed)
    assert sum(r.batch_size for r in kinds(engine, "prefill")) == len(reqs)


@pytest.mark.parametrize("max_batch", [2, 3, 64])
def test_requests_with_the_same_prompt_share_one_prefill_row(max_batch):
    """Separate requests with equal prompts (and a group among them) run one prefill row per
    distinct prompt in each admission, and complete exactly as each request does alone."""
    model = make_tiny()
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[0]]
    reqs = [
        Request(p, SamplingParams(temperature=1.0, max_new_tokens=5, n=1 + (i == 2), seed=i))
        for i, p in enumerate(prompts)
    ]
    engine = Engine(model, max_batch=max_batch, record_steps=True)
    out = engine.generate(reqs)
    if max_batch == 64:  # smaller batches: admissions split requests and groups (stash)
        assert [r.batch_size for r in kinds(engine, "prefill")] == [3]  # 3 distinct prompts
    alone = [c for r in reqs for c in Engine(model, max_batch=1).generate([r])]
    assert [c.token_ids for c in out] == [c.token_ids for c in alone]
    for a, b in zip(out, alone, strict=True):  # batch shapes round differently: close
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
