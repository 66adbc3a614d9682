"""Property tests of the ``suffix`` (SRT / suffix decoding) proposer against a brute force."""

from __future__ import annotations

from collections import Counter, OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import specrl.spec.proposers.suffix as suffix_module
from specrl.spec.proposers import Proposer, get_proposer_class
from specrl.spec.proposers.base import make_batch
from specrl.spec.proposers.suffix import SuffixProposer

tokens = st.lists(st.integers(0, 3), min_size=0, max_size=25)  # small alphabet: many matches


def reference(
    sequences: list[list[int]],
    history: list[int],
    k: int,
    min_match: int,
    max_match: int,
    min_confidence: float,
) -> list[int]:
    """Brute force of the documented rule over explicit sequences."""
    occurrences, matched = [], 0
    for m in range(1, min(max_match, len(history)) + 1):
        found = [
            (s, p)
            for s, seq in enumerate(sequences)
            for p in range(m - 1, len(seq) - 1)
            if seq[p - m + 1 : p + 1] == history[-m:]
        ]
        if not found:
            break
        occurrences, matched = found, m
    if matched < min_match or not occurrences:
        return []
    draft = []
    for step in range(1, k + 1):
        following = [sequences[s][p + step] for s, p in occurrences if p + step < len(sequences[s])]
        if not following:
            break
        counts = Counter(following)
        best = min(counts, key=lambda t: (-counts[t], t))
        if counts[best] < min_confidence * len(occurrences):
            break
        draft.append(best)
        occurrences = [
            (s, p)
            for s, p in occurrences
            if p + step < len(sequences[s]) and sequences[s][p + step] == best
        ]
    return draft


@st.composite
def scenarios(draw):
    """Stored completions per group, a batch of live rows in groups 0/1, proposer settings."""
    stored = draw(st.lists(st.tuples(st.integers(0, 1), tokens), max_size=5))
    rows = draw(st.lists(st.tuples(st.integers(0, 1), tokens), min_size=1, max_size=5))
    min_match = draw(st.integers(1, 3))
    params = dict(
        min_match=min_match,
        max_match=min_match + draw(st.integers(0, 6)),
        min_confidence=draw(st.sampled_from([0.0, 0.3, 0.5, 0.75, 1.0])),
        use_own_history=draw(st.booleans()),
    )
    return stored, rows, params, draw(st.integers(1, 5))


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_matches_brute_force(scenario) -> None:
    """Every row's draft == the documented rule over stored + live sibling sequences.

    This also proves the key property: a draft always equals a continuation that occurred after
    the matched suffix in some indexed or live sequence, and its length is <= k.
    """
    stored, rows, params, k = scenario
    proposer = SuffixProposer(**params)
    for group, completion in stored:
        proposer.add_completion(group, completion)
    batch = make_batch([h for _, h in rows], group_keys=[g for g, _ in rows])
    draft = proposer.propose(batch, k)
    saved = suffix_module._ONE_SHOT
    try:  # the same drafts when candidates are narrowed one token at a time throughout
        suffix_module._ONE_SHOT = 0
        assert proposer.propose(batch, k).rows() == draft.rows()
    finally:
        suffix_module._ONE_SHOT = saved
    assert draft.probs is None and draft.tokens.shape == (len(rows), k)
    assert (draft.lengths <= k).all()
    args = (params["min_match"], params["max_match"], params["min_confidence"])
    for b, (group, history) in enumerate(rows):
        sequences = [c for g, c in stored if g == group and c]
        own = params["use_own_history"]
        sequences += [h for i, (g, h) in enumerate(rows) if g == group and (i != b or own)]
        assert draft.rows()[b] == reference(sequences, history, k, *args)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 10**6), min_size=3, max_size=40, unique=True),
    st.lists(st.integers(0, 10**6), min_size=1, max_size=10),
    st.integers(1, 6),
)
def test_added_completion_is_reproduced_from_its_prefix(completion, prompt, k) -> None:
    """After add_completion, any prefix (>= min_match tokens, or the prompt) drafts its rest."""
    proposer = SuffixProposer(min_match=2)
    proposer.add_completion(5, completion, prompt=prompt)
    for cut in range(0, len(completion)):
        history = prompt + completion[:cut]
        draft = proposer.propose(make_batch([history], group_keys=[5]), k).rows()[0]
        if cut >= 2 or len(history) >= 2:
            assert draft == completion[cut : cut + k], cut
        else:
            assert draft == []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 30)), max_size=40))
def test_eviction_keeps_memory_bounded(operations) -> None:
    """Per-prompt FIFO cap and LRU over prompts, checked against a model of the policy."""
    cap, max_groups = 40, 3
    proposer = SuffixProposer(max_tokens_per_group=cap, max_groups=max_groups)
    model: OrderedDict[int, list[list[int]]] = OrderedDict()
    for n, (group, length) in enumerate(operations):
        completion = [n] * length
        proposer.add_completion(group, completion)
        docs = model.pop(group, [])
        model[group] = docs
        if length:
            docs.append(completion[:cap])
            while sum(map(len, docs)) > cap:
                docs.pop(0)
        while len(model) > max_groups:
            model.popitem(last=False)
        assert proposer.group_keys() == list(model)
        assert proposer.stored_tokens() == sum(len(d) for ds in model.values() for d in ds)
        assert proposer.stored_tokens() <= cap * max_groups
        for key, docs in model.items():
            assert [d.tolist() for d in proposer._groups[key].docs] == docs


def test_live_siblings_are_drafted_from() -> None:
    proposer = SuffixProposer(min_match=2)
    prompt = [100, 101, 102]
    histories = [prompt + [1, 2, 3, 4, 5], prompt + [1, 2], prompt + [9, 9, 9]]
    batch = make_batch(histories, group_keys=[0, 0, 1], row_ids=[1, 2, 3])
    assert proposer.propose(batch, 3).rows() == [[], [3, 4, 5], []]


def test_own_history_only_with_option() -> None:
    history = [[1, 2, 3, 4, 1, 2]]
    assert SuffixProposer().propose(make_batch(history), 3).rows() == [[]]
    own = SuffixProposer(use_own_history=True)
    assert own.propose(make_batch(history), 3).rows() == [[3, 4, 1]]


def test_confidence_sets_the_draft_length() -> None:
    """Continuations after [1, 2]: [3, 4, 5] twice, [3, 4, 6] once, [7] once."""
    proposer = SuffixProposer(min_match=2, min_confidence=0.5)
    for completion in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 7]):
        proposer.add_completion(0, completion)
    draft = lambda p: p.propose(make_batch([[0, 1, 2]], group_keys=[0]), 4).rows()[0]  # noqa: E731
    assert draft(proposer) == [3, 4, 5]  # 3/4, 3/3, 2/3
    proposer.min_confidence = 0.7
    assert draft(proposer) == [3, 4]  # 5 has 2/3 < 0.7
    proposer.min_confidence = 0.8
    assert draft(proposer) == []  # 3 has 3/4 < 0.8


def test_prompt_tail_from_batch_prompt_lengths() -> None:
    """With prompt_lengths, a finished completion is stored behind the prompt's tail."""
    proposer = SuffixProposer()
    prompt = [50, 51, 52]
    batch = make_batch([prompt + [7]], group_keys=[3], prompt_lengths=[3])
    proposer.propose(batch, 2)
    proposer.finish(row_id=0, group_key=3, tokens=[7, 8, 9])
    fresh = make_batch([prompt], group_keys=[3], prompt_lengths=[3])
    assert proposer.propose(fresh, 2).rows() == [[7, 8]]


def test_groups_do_not_leak() -> None:
    proposer = SuffixProposer()
    proposer.add_completion(1, [1, 2, 3, 4])
    assert proposer.propose(make_batch([[1, 2]], group_keys=[2]), 2).rows() == [[]]
    assert proposer.propose(make_batch([[1, 2]], group_keys=[1]), 2).rows() == [[3, 4]]


def test_protocol_registry_and_bad_settings() -> None:
    assert get_proposer_class("suffix") is SuffixProposer
    proposer = SuffixProposer()
    assert isinstance(proposer, Proposer) and proposer.deterministic
    assert proposer.propose(make_batch([[1, 2]]), 0).tokens.shape == (1, 0)
    with pytest.raises(ValueError, match="min_match"):
        SuffixProposer(min_match=0)
    with pytest.raises(ValueError, match="min_confidence"):
        SuffixProposer(min_confidence=1.5)
