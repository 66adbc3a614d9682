"""The engine: batching changes nothing; logprobs are right; bad requests are isolated."""

from __future__ import annotations

import pytest
import torch

from specrl.engine import Engine
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from tests.conftest import make_tiny

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15], [3, 3, 3, 3, 3, 3]]


def run(model, prompts, params, max_batch=8):
    return Engine(model, max_batch=max_batch).generate([Request(p, params) for p in prompts])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batching_changes_nothing(tiny, temperature):
    params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=7)
    together = run(tiny, PROMPTS, params, max_batch=2)  # forces refills and compaction
    for i, prompt in enumerate(PROMPTS):
        alone = Engine(tiny, max_batch=1).generate([Request(prompt, params)])[0]
        assert together[i].token_ids == alone.token_ids
        torch.testing.assert_close(
            torch.tensor(together[i].raw_logprobs), torch.tensor(alone.raw_logprobs)
        )


def recompute(model, prompt, tokens, params):
    """Processed and raw logprobs of tokens by one full forward (the learner's view)."""
    from specrl.sampling import processed_logprobs_for, raw_logprobs

    ids = torch.tensor([prompt + tokens])
    logits = model(ids, torch.arange(ids.shape[1])[None]).logits[0, len(prompt) - 1 : -1]
    lp = processed_logprobs_for(logits, params)
    idx = torch.tensor(tokens)[:, None]
    return lp.gather(1, idx)[:, 0], raw_logprobs(logits).gather(1, idx)[:, 0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=10, seed=1),
        SamplingParams(temperature=0.6, top_k=5, top_p=0.9, max_new_tokens=10, seed=2),
    ],
)
def test_logprobs_match_full_forward(tiny, params):
    for c in run(tiny, PROMPTS[:3], params):
        proc, raw = recompute(tiny, c.prompt_ids, c.token_ids, params)
        torch.testing.assert_close(torch.tensor(c.logprobs), proc, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.tensor(c.raw_logprobs), raw, atol=1e-5, rtol=1e-5)


def test_group_samples_fork_the_prompt_cache(tiny):
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=4, seed=3)
    forked = Engine(tiny, max_batch=8).generate([Request(PROMPTS[1], params)])
    serial = Engine(tiny, max_batch=1).generate([Request(PROMPTS[1], params)])
    assert [c.token_ids for c in forked] == [c.token_ids for c in serial]
    assert len({tuple(c.token_ids) for c in forked}) > 1  # siblings differ
    assert [c.sample_index for c in forked] == [0, 1, 2, 3]


def test_stop_tokens_end_the_completion():
    model = make_tiny(seed=3)
    free = run(model, [PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=10))[0]
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    params = SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(stop,))
    c = run(model, [PROMPTS[0]], params)[0]
    assert c.finish_reason == "stop"
    assert c.token_ids == free.token_ids[: first + 1]
    assert len(c.logprobs) == len(c.token_ids)


def test_max_new_tokens_and_context_limit(tiny):
    c = run(tiny, [PROMPTS[0]], SamplingParams(max_new_tokens=5, seed=0))[0]
    assert len(c.token_ids) == 5 and c.finish_reason == "length"
    engine = Engine(tiny, max_batch=2, max_context=6)
    c = engine.generate([Request(PROMPTS[0], SamplingParams(max_new_tokens=50, seed=0))])[0]
    assert len(c.prompt_ids) + len(c.token_ids) == 6 and c.finish_reason == "length"


def test_bad_requests_are_rejected_alone(tiny):
    good = SamplingParams(max_new_tokens=4, seed=0)
    requests = [
        Request([1, 2], good),
        Request([], good),
        Request(list(range(1, 20)) * 20, good),  # longer than the context
        Request([1, 2], SamplingParams(temperature=-1.0)),
        Request([1, 999], good),
        Request([3, 4], SamplingParams(top_p=0.0)),
        Request([5], good),
    ]
    out = Engine(tiny, max_batch=4).generate(requests)
    errors = {c.request_index: c.error for c in out if c.error}
    assert set(errors) == {1, 2, 3, 4, 5}
    assert errors[1] == "empty prompt"
    assert "context holds" in errors[2]
    assert "temperature must be >= 0" in errors[3]
    assert "token id 999 outside the vocabulary" in errors[4]
    assert "top_p" in errors[5]
    assert all(len(c.token_ids) == 4 for c in out if c.request_index in (0, 6))


def test_timing_and_version_recorded(tiny):
    engine = Engine(tiny, policy_version=3)
    c = engine.generate([Request([1, 2, 3], SamplingParams(max_new_tokens=4, seed=0))])[0]
    assert c.policy_version == 3
    assert 0 < c.first_token_s <= c.latency_s
    assert c.acceptance_length == 1.0
    assert engine.stats.tokens == 4


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_on_done_announces_each_group_as_it_finishes(tiny, spec):
    """A request is announced once, with its n completions all finished, while a longer
    request still decodes; the announced completions are the ones returned."""
    from specrl.spec.config import SpecConfig

    short = SamplingParams(temperature=1.0, max_new_tokens=2, n=3, seed=1, stop_token_ids=())
    long = SamplingParams(temperature=1.0, max_new_tokens=20, n=2, seed=2, stop_token_ids=())
    first = SamplingParams(temperature=1.0, max_new_tokens=1, n=2, seed=3, stop_token_ids=())
    reqs = [Request(PROMPTS[0], long), Request(PROMPTS[1], short), Request([], short),
            Request(PROMPTS[2], first)]  # fmt: skip
    seen: list[tuple[int, list, list[int]]] = []

    def on_done(index, comps):  # the other requests' token counts right now
        live = [len(c.token_ids) for c in out_ref[0]] if out_ref else []
        seen.append((index, list(comps), live))
        assert all(c.latency_s > 0 and c.request_index == index for c in comps)

    engine = Engine(tiny, max_batch=8, spec=SpecConfig(method=spec, k=2) if spec else None)
    out_ref: list = []
    engine._admission.plan = _capturing(engine._admission.plan, out_ref)
    out = engine.generate(reqs, on_done=on_done)
    # done at its first token (in admission), then the short one, then the long one; the
    # refused request (an empty prompt) never
    assert [i for i, _, _ in seen] == [3, 1, 0]
    assert seen[0][1] == out[8:10] and all(len(c.token_ids) == 1 for c in seen[0][1])
    short_done = seen[1]
    assert short_done[1] == out[2:5] and all(len(c.token_ids) == 2 for c in short_done[1])
    assert max(short_done[2][:2]) < 20  # the long request was still decoding then
    assert seen[2][1] == out[0:2] and all(len(c.token_ids) == 20 for c in out[0:2])


def _capturing(plan, into: list):
    """``Admission.plan`` that also hands its completions list to the test."""

    def wrapped(*args, **kwargs):
        completions, pending = plan(*args, **kwargs)
        into.append(completions)
        return completions, pending

    return wrapped
