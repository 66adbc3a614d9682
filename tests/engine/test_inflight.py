"""In-flight weight updates: reverify is exact for the new policy, keep is not; versions, logprobs,
statistics, staging while idle, replacement of an unapplied update, refused drafters."""

from __future__ import annotations

import itertools
import threading
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from specrl.engine import Engine
from specrl.engine.inflight import fresh_seed
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams, processed_logprobs_for
from specrl.spec.config import SpecConfig
from tests.conftest import make_tiny

VOCAB = 4
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive, so ngram/suffix drafters do propose
NEW = 3
OLD, NEW_VERSION = 0, 7

pytestmark = pytest.mark.usefixtures("one_thread")


def policy_a(vocab: int = VOCAB):
    return make_tiny(seed=11, vocab_size=vocab)


def policy_b(vocab: int = VOCAB, scale: float = 0.05):
    """Policy A after a small step: acceptance of A's tokens is neither ~0 nor ~1."""
    model = policy_a(vocab)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


class SwitchEngine(Engine):
    """Stages ``updates`` (each (named, version, mode)) right after the ``at``-th admission of
    the first generate call, so they apply before decode step ``at`` (``at=0``: the rows hold
    only their first token)."""

    def __init__(self, model, updates: list[tuple], at: int, **kw) -> None:
        super().__init__(model, **kw)
        self.updates, self.at, self.admissions = updates, at, 0

    def _admit(self, rows, pending, start) -> None:
        super()._admit(rows, pending, start)
        if self.admissions == self.at:
            for update in self.updates:
                self.stage_weights(*update)
        self.admissions += 1


def switched(mode: str, at: int, spec: SpecConfig | None = None, vocab: int = VOCAB, **kw):
    """An engine starting with A's weights that switches to B's in flight."""
    update = (weights(policy_b(vocab)), NEW_VERSION, mode)
    return SwitchEngine(policy_a(vocab), [update], at, spec=spec, **kw)


def exact_distribution(model, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(completion) under ``model`` by enumeration: every NEW-token continuation's probability
    (product of processed probabilities), cut at its first stop token."""
    seqs = list(itertools.product(range(VOCAB), repeat=NEW))
    ids = torch.tensor([PROMPT + list(s) for s in seqs])  # [S, P+NEW]
    logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids)).logits[:, len(PROMPT) - 1 : -1]
    lp = processed_logprobs_for(logits.reshape(-1, VOCAB), params).view(len(seqs), NEW, VOCAB)
    chosen = lp.gather(-1, torch.tensor(seqs)[..., None])[..., 0].sum(-1).exp()  # [S]
    probs: Counter = Counter()
    for s, p in zip(seqs, chosen.tolist(), strict=True):
        cut = next((i + 1 for i, t in enumerate(s) if t in params.stop_token_ids), NEW)
        probs[s[:cut]] += p
    return probs


def fit_pvalue(completions, model, params: SamplingParams) -> float:
    """Chi-square p-value of the completions against ``model``'s exact distribution (0.0 when
    one of them is impossible under it)."""
    counts = Counter(tuple(c.token_ids) for c in completions)
    exact = exact_distribution(model, params)
    if any(exact.get(s, 0.0) == 0.0 for s in counts):
        return 0.0
    support = [s for s, p in exact.items() if p > 0]
    observed = np.array([counts[s] for s in support], dtype=float)
    expected = np.array([exact[s] for s in support])
    expected *= observed.sum() / expected.sum()
    return float(stats.chisquare(observed, expected).pvalue)


def live_at_switch(out):
    """Completions that hold a token of the new version (live at the switch, or admitted later)."""
    return [c for c in out if NEW_VERSION in c.token_versions]


PARAMS = {
    "T1": SamplingParams(temperature=1.0, max_new_tokens=NEW, n=3000, seed=1),
    "T0.8-topk3-topp0.9": SamplingParams(
        temperature=0.8, top_k=3, top_p=0.9, max_new_tokens=NEW, n=3000, seed=2
    ),
    "T1-stop": SamplingParams(
        temperature=1.0, max_new_tokens=NEW, n=3000, seed=3, stop_token_ids=(0,)
    ),
}


@pytest.mark.parametrize("at", [0, 1], ids=["first-token", "mid"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_reverify_is_exact_for_the_new_policy_and_keep_is_not(name, at):
    """The key test: rows switched from A to B with reverify follow B's exact sequence
    distribution; the same switch with keep (a mixture of A and B) fails the same test."""
    params = PARAMS[name]
    target = policy_b()
    results = {}
    for mode in ("reverify", "keep"):
        engine = switched(mode, at, max_batch=params.n)
        out = live_at_switch(engine.generate([Request(PROMPT, params)]))
        assert len(out) > params.n // 2 and engine.stats.weight_updates == 1
        results[mode] = fit_pvalue(out, target, params)
    assert results["reverify"] > 1e-3
    assert results["keep"] < 1e-6  # the test has power: a stale mixture is caught


@pytest.mark.parametrize("method", ["ngram", "suffix", "eagle3", "block"])
def test_reverify_and_discard_are_exact_with_drafters(method):
    """With a drafter, rewritten rows still follow B's exact distribution (discard as well)."""
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=NEW, n=3000, seed=4)
    target = policy_b()
    for mode in ("reverify", "discard"):
        engine = switched(mode, 0, spec=SpecConfig(method, 2), max_batch=params.n)
        out = live_at_switch(engine.generate([Request(PROMPT, params)]))
        assert len(out) > params.n // 2
        assert engine.stats.drafted > 0
        assert fit_pvalue(out, target, params) > 1e-3


def test_discard_is_exact_for_the_new_policy():
    params = PARAMS["T0.8-topk3-topp0.9"]
    engine = switched("discard", 1, max_batch=params.n)
    out = engine.generate([Request(PROMPT, params)])
    assert fit_pvalue(out, policy_b(), params) > 1e-3


def full_forward_logprobs(model, prompt, tokens, params):
    """Processed and raw logprobs [n] of ``tokens`` after ``prompt`` in one full forward."""
    ids = torch.tensor([prompt + tokens])
    logits = model(ids, torch.arange(ids.shape[1])[None]).logits[0, len(prompt) - 1 : -1]
    idx = torch.tensor(tokens)[:, None]
    processed = processed_logprobs_for(logits.float(), params).gather(1, idx)[:, 0]
    raw = torch.log_softmax(logits.float(), -1).gather(1, idx)[:, 0]
    return processed, raw


LONG = SamplingParams(temperature=0.5, top_k=8, max_new_tokens=24, n=6, seed=9)
PROMPT2 = [1, 2, 3, 4, 5, 1, 2, 3]


@pytest.mark.parametrize("spec", [None, SpecConfig("ngram", 3)], ids=["plain", "ngram"])
@pytest.mark.parametrize("mode", ["reverify", "discard"])
def test_rewritten_rows_carry_new_versions_and_new_logprobs(mode, spec):
    """After reverify/discard every token of a live row is tagged with the new version and its
    processed and raw logprobs equal a full forward of B on the finished sequence. The batch
    (4) is smaller than the group (6): the 2 samples admitted after the switch would reuse a
    prompt prefill stashed under A if the stash survived."""
    engine = switched(mode, 3, spec=spec, vocab=32, max_batch=4)
    out = engine.generate([Request(PROMPT2, LONG)])
    target = policy_b(32)
    assert engine.policy_version == NEW_VERSION and engine.stats.weight_updates == 1
    for c in out:
        assert len(c.token_ids) == LONG.max_new_tokens
        assert c.token_versions == [NEW_VERSION] * len(c.token_ids)
        assert c.policy_version == NEW_VERSION
        processed, raw = full_forward_logprobs(target, PROMPT2, c.token_ids, LONG)
        torch.testing.assert_close(torch.tensor(c.logprobs), processed, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(c.raw_logprobs), raw, atol=1e-4, rtol=0)
    st = engine.stats
    assert st.tokens == sum(len(c.token_ids) for c in out) + st.discarded_tokens
    if mode == "reverify":
        assert st.reverified_tokens == st.reused_tokens + st.discarded_tokens > 0
        assert st.reused_tokens > 0 and st.reverify_s > 0
    else:
        assert st.reverified_tokens == st.reused_tokens == 0 and st.discarded_tokens > 0


def test_keep_rows_show_both_versions_and_keep_their_seed():
    at = 3  # plain decoding: the first token + 3 decode steps under A
    engine = switched("keep", at, vocab=32, max_batch=6)
    out = engine.generate([Request(PROMPT2, LONG)])
    reference = Engine(policy_a(32), max_batch=6).generate([Request(PROMPT2, LONG)])
    old = at + 1
    for c, ref in zip(out, reference, strict=True):
        assert c.token_versions == [OLD] * old + [NEW_VERSION] * (LONG.max_new_tokens - old)
        assert c.token_ids[:old] == ref.token_ids[:old] and c.seed == ref.seed
        assert c.logprobs[:old] == ref.logprobs[:old]  # old tokens untouched
    assert engine.stats.reused_tokens == old * LONG.n and engine.stats.discarded_tokens == 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def test_reverify_keeps_the_accepted_prefix_and_switches_seed():
    """A rewritten completion starts with the accepted prefix of its old tokens (then a new
    token: a recovered one differs from the rejected draft); its seed is the fresh one."""
    at = 5  # plain decoding: 6 old tokens per row, the same as A alone samples with that seed
    engine = switched("reverify", at, vocab=32, max_batch=6)
    out = engine.generate([Request(PROMPT2, LONG)])
    old = Engine(policy_a(32), max_batch=6).generate([Request(PROMPT2, LONG)])
    kept = 0
    for c, o in zip(out, old, strict=True):
        assert c.seed == fresh_seed(o.seed, NEW_VERSION)
        kept += min(common_prefix(c.token_ids, o.token_ids), at + 1)
    assert 0 < kept == engine.stats.reused_tokens
    assert engine.stats.reverified_tokens == (at + 1) * LONG.n


def test_update_staged_while_idle_applies_at_the_next_generate():
    """Staged with no generate running: nothing changes until the next call, which then runs
    entirely under the new weights (same seeds: the same tokens as an engine built with B)."""
    engine = Engine(policy_a(32), max_batch=6)
    engine.stage_weights(weights(policy_b(32)), NEW_VERSION, "reverify")
    assert engine.policy_version == OLD
    assert torch.equal(engine.model.embed.weight, policy_a(32).embed.weight)
    out = engine.generate([Request(PROMPT2, LONG)])
    ref = Engine(policy_b(32), max_batch=6).generate([Request(PROMPT2, LONG)])
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]
    assert all(c.token_versions == [NEW_VERSION] * len(c.token_ids) for c in out)
    assert engine.stats.weight_updates == 0  # not an in-flight update


def test_newer_staged_update_replaces_an_older_one():
    other = weights(make_tiny(seed=99, vocab_size=32))
    b = weights(policy_b(32))
    engine = Engine(policy_a(32))
    engine.stage_weights(other, 3, "discard")
    engine.stage_weights(b, NEW_VERSION, "reverify")
    engine.generate([Request(PROMPT2, LONG.replace(n=1))])
    assert engine.policy_version == NEW_VERSION
    assert torch.equal(engine.model.embed.weight, b["embed.weight"])
    # in flight: two updates staged before one safe point apply once, the newer one
    engine = SwitchEngine(policy_a(32), [(other, 3, "discard"), (b, NEW_VERSION, "reverify")], 2)
    out = engine.generate([Request(PROMPT2, LONG)])
    assert engine.stats.weight_updates == 1 and engine.stats.reverified_tokens == 3 * LONG.n
    assert {v for c in out for v in c.token_versions} == {NEW_VERSION}


def test_staged_update_older_than_the_served_weights_is_dropped():
    """Newer weights written directly (a backend's idle refit) win over an older staged update
    that never found a safe point."""
    engine = Engine(policy_a(32))
    engine.stage_weights(weights(policy_b(32)), 3, "reverify")
    engine.policy_version = 4  # e.g. NativeBackend.update_weights while idle
    engine.generate([Request(PROMPT2, LONG.replace(n=1))])
    assert engine.policy_version == 4
    assert torch.equal(engine.model.embed.weight, policy_a(32).embed.weight)


def test_update_from_another_thread_between_decode_steps():
    """A learner thread stages while the generating thread waits at a decode step; the update
    lands before the next step and the running call finishes under it."""
    engine = Engine(policy_a(32), max_batch=6)
    b = weights(policy_b(32))
    reached, staged = threading.Event(), threading.Event()
    step = engine._step

    def pausing_step(rows, start):
        if engine.stats.steps == 4:
            reached.set()
            assert staged.wait(30)
        return step(rows, start)

    def learner():
        assert reached.wait(30)
        engine.stage_weights(b, NEW_VERSION, "keep")
        staged.set()

    engine._step = pausing_step
    thread = threading.Thread(target=learner)
    thread.start()
    out = engine.generate([Request(PROMPT2, LONG)])
    thread.join()
    for c in out:  # the first token + 5 decode steps (0..4) under A
        assert c.token_versions == [OLD] * 6 + [NEW_VERSION] * (LONG.max_new_tokens - 6)


@pytest.mark.parametrize("method", ["draft", "self"])
def test_rewrite_modes_are_refused_for_draft_model_drafters(method):
    draft = make_tiny(seed=5, vocab_size=32) if method == "draft" else None
    engine = Engine(policy_a(32), spec=SpecConfig(method, 2), draft_model=draft)
    b = weights(policy_b(32))
    for mode in ("reverify", "discard"):
        with pytest.raises(ValueError, match=f"mode='{mode}' are not supported with the "):
            engine.stage_weights(b, NEW_VERSION, mode)
    engine.stage_weights(b, NEW_VERSION, "keep")  # keep touches no history


def test_bad_mode_and_bad_weights_are_refused():
    engine = Engine(policy_a(32))
    b = weights(policy_b(32))
    with pytest.raises(ValueError, match="mode must be one of"):
        engine.stage_weights(b, 1, "merge")
    del b["norm.weight"]
    with pytest.raises(ValueError, match="no tensor for parameter 'norm.weight'"):
        engine.stage_weights(b, 1, "keep")


def test_learned_drafter_gets_the_new_features_after_a_rewrite():
    """EAGLE-3 after reverify: every feature handed to the head equals the capture of a full
    forward of the weights in force at that step (A before the switch, B after)."""
    a_ref, b_ref = policy_a(32), policy_b(32)
    engine = switched("reverify", 2, spec=SpecConfig("eagle3", 3), vocab=32, max_batch=6)
    proposer, seen = engine.proposer, []
    propose = proposer.propose

    def recording(batch, k):
        version = engine.policy_version
        for history, feats in zip(batch.histories, batch.hidden, strict=True):
            seen.append((list(history), feats, version))
        return propose(batch, k)

    proposer.propose = recording
    engine.generate([Request(PROMPT2, LONG)])
    assert {v for _, _, v in seen} == {OLD, NEW_VERSION}
    for history, feats, version in seen:
        model = b_ref if version == NEW_VERSION else a_ref
        n = feats.shape[0]
        full = model(torch.tensor([history]), torch.arange(len(history))[None],
                     capture=proposer.hidden_layers)  # fmt: skip
        want = torch.cat(full.captured, -1)[0, len(history) - 1 - n : len(history) - 1]
        torch.testing.assert_close(feats, want, atol=1e-4, rtol=1e-4)


def test_a_stop_at_the_first_token_ends_the_row():
    """A row whose prefill token is a stop token (or max_new_tokens == 1) is retired at once
    (it was decoded further before in-flight rewrites made first-token finishes common)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=3, n=200, seed=3, stop_token_ids=(0,))
    out = Engine(policy_a(), max_batch=200).generate([Request(PROMPT, params)])
    assert any(c.token_ids == [0] for c in out)
    assert all(0 not in c.token_ids[:-1] for c in out)
    one = Engine(policy_a(), max_batch=4).generate([Request(PROMPT, params.replace(n=4,
                                                    max_new_tokens=1))])  # fmt: skip
    assert all(len(c.token_ids) == 1 for c in one)


def test_reverify_with_a_token_cap_is_exact():
    """``reverify_max_tokens`` verifies only the first old tokens (the rest are discarded): a
    shorter fixed draft, still exact for the new policy."""
    params = PARAMS["T1"]
    engine = switched("reverify", 1, max_batch=params.n)
    engine.reverify_max_tokens = 1
    out = engine.generate([Request(PROMPT, params)])
    st = engine.stats
    assert st.reverified_tokens == params.n  # 2 old tokens per row, 1 checked
    assert st.discarded_tokens == 2 * params.n - st.reused_tokens
    assert fit_pvalue(out, policy_b(), params) > 1e-3


def test_reverify_rows_of_other_prompt_lengths_and_limits():
    """Rows with a long prompt and a short limit next to rows with a long completion (padding
    past the cache's end is clamped); every token's logprobs match the weights it was
    sampled under (A for a row finished before the switch, B for the others)."""
    params = SamplingParams(temperature=0.5, top_k=8, seed=3)
    prompts = [([1, 2, 3], 60), ([4, 5, 6], 10), ([7, 8, 9, 10, 11] * 6, 40)]
    requests = [Request(p, params.replace(max_new_tokens=n)) for p, n in prompts]
    update = (weights(policy_b(32)), NEW_VERSION, "reverify")
    engine = SwitchEngine(policy_a(32), [update], 45, max_batch=2)
    out = engine.generate(requests)
    models = {OLD: policy_a(32), NEW_VERSION: policy_b(32)}
    assert [len(c.token_ids) for c in out] == [n for _, n in prompts]
    assert [set(c.token_versions) for c in out] == [{NEW_VERSION}, {OLD}, {NEW_VERSION}]
    for c, req in zip(out, requests, strict=True):
        model = models[c.token_versions[0]]
        processed, raw = full_forward_logprobs(model, req.prompt_ids, c.token_ids, req.sampling)
        torch.testing.assert_close(torch.tensor(c.logprobs), processed, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(c.raw_logprobs), raw, atol=1e-4, rtol=0)
