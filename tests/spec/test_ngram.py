"""Property tests of the ``ngram`` (prompt lookup) proposer against a brute-force reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrl.spec.proposers import Proposer, get_proposer_class, proposer_takes
from specrl.spec.proposers.base import make_batch
from specrl.spec.proposers.ngram import NgramProposer

histories = st.lists(st.integers(0, 4), min_size=0, max_size=60)  # small alphabet: many matches


def reference(history: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force: longest n first, then the latest earlier occurrence with a successor."""
    for n in range(max_n, min_n - 1, -1):
        if len(history) < n + 1:
            continue
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + k]
    return []


def propose_one(proposer: NgramProposer, history: list[int], k: int, row_id: int = 0) -> list:
    draft = proposer.propose(make_batch([history], row_ids=[row_id]), k)
    assert draft.probs is None
    return draft.rows()[0]


@settings(max_examples=300, deadline=None)
@given(histories, st.integers(1, 6), st.integers(1, 3), st.integers(0, 3))
def test_matches_brute_force(history: list[int], k: int, min_n: int, extra: int) -> None:
    max_n = min_n + extra
    proposer = NgramProposer(max_n=max_n, min_n=min_n)
    assert propose_one(proposer, history, k) == reference(history, k, min_n, max_n)


@settings(max_examples=100, deadline=None)
@given(histories, st.lists(st.integers(1, 5), min_size=1, max_size=8), st.integers(1, 5))
def test_incremental_index_matches_brute_force(history, steps, k) -> None:
    """A row growing by a few tokens per step (as in decoding) sees the same drafts."""
    proposer = NgramProposer(max_n=4, min_n=1)
    length = 0
    for step in steps:
        length = min(len(history), length + step)
        prefix = history[:length]
        assert propose_one(proposer, prefix, k, row_id=7) == reference(prefix, k, 1, 4)


@settings(max_examples=200, deadline=None)
@given(histories, st.integers(1, 6))
def test_draft_is_a_continuation_that_exists(history: list[int], k: int) -> None:
    """Lengths <= k; a non-empty draft followed an earlier occurrence of the history's suffix;
    an empty draft means no suffix of length >= min_n occurs earlier with a successor."""
    min_n, max_n = 2, 4
    draft = propose_one(NgramProposer(max_n=max_n, min_n=min_n), history, k)
    assert len(draft) <= k
    occurs = [
        (n, s)
        for n in range(min_n, max_n + 1)
        if len(history) > n
        for s in range(len(history) - n)
        if history[s : s + n] == history[-n:]
    ]
    if not draft:
        assert not occurs
        return
    assert any(history[s + n : s + n + len(draft)] == draft for n, s in occurs)
    n_best = max(n for n, _ in occurs)
    assert any(history[s + n_best : s + n_best + len(draft)] == draft for n, s in occurs)


def test_examples() -> None:
    proposer = NgramProposer(max_n=3, min_n=2)
    # "1 2 3 9 ... 1 2" -> proposes "3 9 ..."; the latest occurrence wins
    assert propose_one(proposer, [1, 2, 3, 9, 5, 1, 2], 3, row_id=1) == [3, 9, 5]
    assert propose_one(proposer, [1, 2, 3, 1, 2, 4, 1, 2], 3, row_id=2) == [4, 1, 2]
    assert propose_one(proposer, [1, 2, 3, 4], 3, row_id=3) == []  # no match
    assert propose_one(proposer, [5, 5, 5], 4, row_id=4) == [5]  # only one token follows


def test_batch_rows_and_row_reuse() -> None:
    proposer = NgramProposer(max_n=2, min_n=1)
    batch = make_batch([[1, 2, 1], [3, 4, 5], [7, 7]], row_ids=[10, 11, 12])
    draft = proposer.propose(batch, 2)
    assert draft.tokens.shape == (3, 2) and draft.lengths.tolist() == [2, 0, 1]
    assert draft.rows() == [[2, 1], [], [7]]
    # row id 10 reused for an unrelated history (without finish): re-indexed, still correct
    assert propose_one(proposer, [9, 8, 9], 2, row_id=10) == [8, 9]
    proposer.finish(10, 0, [])
    assert propose_one(proposer, [4, 4], 2, row_id=10) == [4]


def test_row_memory_is_bounded() -> None:
    proposer = NgramProposer(max_rows=3)
    for row_id in range(10):
        propose_one(proposer, [1, 2, 1, 2], 2, row_id=row_id)
    assert len(proposer._rows) == 3


def test_protocol_registry_and_bad_settings() -> None:
    assert get_proposer_class("ngram") is NgramProposer
    proposer = NgramProposer()
    assert isinstance(proposer, Proposer) and proposer.deterministic
    assert proposer.name == "ngram"
    assert proposer.propose(make_batch([[1, 1, 1]]), 0).tokens.shape == (1, 0)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(max_n=2, min_n=3)
    with pytest.raises(KeyError, match="ngram"):
        get_proposer_class("no-such-drafter")


def test_proposer_takes_tells_what_a_drafter_needs() -> None:
    assert proposer_takes("eagle3", "drafter_path") and proposer_takes("mtp", "drafter_path")
    assert proposer_takes("draft", "draft_model") and not proposer_takes("draft", "drafter_path")
    assert not proposer_takes("ngram", "drafter_path")
    assert not proposer_takes("none", "drafter_path")
    assert not proposer_takes("no-such-drafter", "draft_model")
