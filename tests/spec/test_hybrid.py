"""The ``hybrid`` drafter: suffix drafts where earlier rollouts predict a row, the EAGLE-3 head
elsewhere, chosen per row by expected accepted tokens; exactness is in test_spec_engine.py."""

from __future__ import annotations

import torch

from specrl.engine import Engine
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig
from specrl.spec.proposers import get_proposer_class, head_kind, proposer_takes
from specrl.spec.proposers.base import make_batch
from specrl.spec.proposers.eagle3 import Eagle3Proposer
from specrl.spec.proposers.hybrid import (
    FEED_EVERY,
    PRIOR,
    SUPPORT_KEYS,
    HybridProposer,
    support_key,
)
from tests.conftest import assert_teacher_forced, make_tiny

VOCAB = 32


def hybrid(max_batch: int = 8) -> HybridProposer:
    torch.manual_seed(0)
    p = HybridProposer(make_tiny(3, vocab_size=VOCAB))
    p.bind(max_batch, 64, VOCAB)
    return p


def features(p: HybridProposer, histories: list[list[int]]) -> list[torch.Tensor]:
    """Target features of every position but the last of each history (a row's first propose)."""
    return [torch.randn(len(h) - 1, width(p)) for h in histories]


def width(p: HybridProposer) -> int:
    return p.head.target_config.hidden_size * len(p.hidden_layers)


def batch_for(p, histories, keys, row_ids=None):
    b = make_batch(histories, group_keys=keys, row_ids=row_ids)
    b.hidden = features(p, histories)
    return b


def test_it_is_a_learned_eagle3_drafter():
    assert get_proposer_class("hybrid") is HybridProposer
    assert head_kind("hybrid") == "eagle3" and head_kind("suffix") == "suffix"
    assert proposer_takes("hybrid", "drafter_path")  # a head directory, trained like eagle3's


def test_rows_whose_siblings_predict_them_take_the_suffix_draft_with_one_hot_q(monkeypatch):
    p = hybrid()
    p.suffix.add_completion(7, [4, 5, 6, 8, 9, 10, 11])  # an earlier rollout of prompt 7
    calls = []
    propose = Eagle3Proposer.propose

    def counting(self, batch, k):
        calls.append(list(batch.row_ids))
        return propose(self, batch, k)

    monkeypatch.setattr(Eagle3Proposer, "propose", counting)
    histories = [[1, 2, 4, 5, 6], [1, 2, 30, 31]]  # row 0 continues the earlier rollout
    draft = p.propose(batch_for(p, histories, keys=[7, 7]), 3)
    assert p.last_sources == ["suffix", "head"] and calls == [[1]]  # only row 1 ran the head
    assert draft.tokens[0].tolist() == [8, 9, 10] and draft.lengths.tolist() == [3, 3]
    assert torch.equal(draft.probs[0], torch.nn.functional.one_hot(draft.tokens[0], VOCAB).float())
    torch.testing.assert_close(draft.probs[1].sum(-1), torch.ones(3))  # the head's q
    assert draft.probs[1].gather(1, draft.tokens[1][:, None]).min() > 0


def test_a_step_where_every_row_drafts_from_siblings_runs_no_head(monkeypatch):
    p = hybrid()
    p.suffix.add_completion(7, [4, 5, 6, 8, 9, 10, 11])
    monkeypatch.setattr(Eagle3Proposer, "propose", lambda *a: (_ for _ in ()).throw(AssertionError))
    draft = p.propose(batch_for(p, [[1, 4, 5, 6], [2, 4, 5, 6]], keys=[7, 7]), 3)
    assert p.last_sources == ["suffix", "suffix"] and draft.tokens.tolist() == [[8, 9, 10]] * 2


def test_the_head_catches_up_on_every_feature_of_the_steps_it_skipped(monkeypatch):
    """A row drafted by the suffix drafter keeps its target features; when the head next drafts
    for it, it reads all of them at once (its cache covers every position)."""
    p = hybrid()
    p.suffix.add_completion(7, [4, 5, 6, 8, 9, 10, 11])
    seen = []
    propose = Eagle3Proposer.propose

    def recording(self, batch, k):
        seen.append([int(h.shape[0]) for h in batch.hidden])
        return propose(self, batch, k)

    monkeypatch.setattr(Eagle3Proposer, "propose", recording)
    history = [1, 4, 5, 6]
    p.propose(batch_for(p, [history], keys=[7]), 3)  # suffix: 3 features kept
    assert p.last_sources == ["suffix"] and seen == []
    p.observe([0], torch.tensor([4]))
    history = history + [8, 9, 10, 20]  # all three drafts accepted, then a token off-script
    more = make_batch([history], group_keys=[7])
    more.hidden = [torch.randn(4, width(p))]
    p.propose(more, 3)
    assert p.last_sources == ["head"] and seen == [[3 + 4]] == [[len(history) - 1]]


def test_acceptance_rates_move_the_choice():
    p = hybrid()
    assert p.expected(["head"] * 3) == PRIOR + PRIOR**2 + PRIOR**3
    for _ in range(200):  # single-occurrence suffix drafts rejected at their first token
        p.learn(["suffix:1"] * 3, 0)
    rates = p.rates["suffix:1"]
    assert rates[0] < 0.01 and len(rates) == 1  # later positions were never verified
    p.learn(["suffix:1", "suffix:1", "suffix:4+"], 3)  # keys differ per position
    assert len(p.rates["suffix:1"]) == 2
    assert p.rates["suffix:4+"] == [PRIOR, PRIOR, PRIOR + 0.05 * (1 - PRIOR)]
    p.suffix.add_completion(7, [4, 5, 6, 8, 9, 10, 11])  # one earlier occurrence: "suffix:1"
    p.propose(batch_for(p, [[1, 4, 5, 6]], keys=[7]), 3)
    assert p.last_sources == ["head"]  # the siblings' continuation no longer pays
    for _ in range(4):  # ... but four rollouts continuing the same way are other evidence
        p.suffix.add_completion(8, [4, 5, 6, 8, 9, 10, 11])
    p.propose(batch_for(p, [[1, 4, 5, 6]], keys=[8], row_ids=[1]), 3)
    assert p.suffix.last_support == [[4, 4, 4]] and p.last_sources == ["suffix"]


def test_support_keys():
    assert [support_key(c) for c in (1, 2, 3, 4, 9)] == [
        "suffix:1", "suffix:2-3", "suffix:2-3", "suffix:4+", "suffix:4+"
    ]  # fmt: skip


def test_engine_run_uses_both_sources_and_learns_their_rates():
    torch.manual_seed(0)
    target = make_tiny(3, vocab_size=VOCAB)
    engine = Engine(target, max_batch=16, spec=SpecConfig("hybrid", 3))
    params = SamplingParams(temperature=0.8, max_new_tokens=24, n=8, seed=2)
    sources = []
    proposer = engine.proposer
    propose = proposer.propose

    def recording(batch, k):
        draft = propose(batch, k)
        sources.extend(proposer.last_sources)
        return draft

    proposer.propose = recording
    engine.generate([Request([1, 2, 3, 1, 2, 3], params), Request([4, 5, 4, 5], params)])
    assert {"suffix", "head"} <= set(sources)
    assert proposer.rates["head"]  # verdicts of both sources were folded
    assert any(proposer.rates.get(key) for _, key in SUPPORT_KEYS)
    assert not proposer.pending and not proposer.verdicts  # finished rows leave nothing behind


def test_the_head_reads_the_true_features_of_every_position(monkeypatch):
    """Through the engine, with rows moving between the sources: whenever the head drafts for
    a row it reads exactly the target's features of the positions it has not read yet."""
    torch.manual_seed(0)
    target = make_tiny(3, vocab_size=VOCAB)
    engine = Engine(target, max_batch=16, spec=SpecConfig("hybrid", 3))
    proposer = engine.proposer
    proposer.rates["head"] = [0.3, 0.3, 0.3]  # suffix drafts win wherever there is one
    seen = []
    propose = Eagle3Proposer.propose

    def recording(self, batch, k):
        seen.extend(zip([list(h) for h in batch.histories], batch.hidden, strict=True))
        return propose(self, batch, k)

    monkeypatch.setattr(Eagle3Proposer, "propose", recording)
    params = SamplingParams(temperature=0.8, max_new_tokens=24, n=8, seed=2)
    engine.generate([Request([1, 2], params)])
    assert seen and max(f.shape[0] for _, f in seen) > 4  # some read > 1 step's (k + 1) tokens
    assert_teacher_forced(target, proposer.hidden_layers, seen)


def test_the_suffix_source_is_scored_while_the_head_drafts():
    """A row that took the head still scores the suffix draft it did not take against what it
    then emitted, so a suffix source that fell behind can come back."""
    p = hybrid()
    p.rates["suffix:1"] = [0.05, PRIOR, PRIOR]
    p.suffix.add_completion(7, [4, 5, 6, 8, 9, 10, 11])
    history = [1, 4, 5, 6]
    p.propose(batch_for(p, [history], keys=[7]), 3)
    assert p.last_sources == ["head"]
    p.observe([0], torch.tensor([3]))  # the head's first two drafts accepted
    more = make_batch([history + [8, 9, 10]], group_keys=[7])  # = the suffix draft
    more.hidden = [torch.randn(3, width(p))]
    p.propose(more, 3)
    assert p.rates["suffix:1"][0] > 0.05 and p.rates["suffix:1"][2] > PRIOR
    head = p.rates["head"]  # two accepted, the third rejected
    assert head[0] > PRIOR and head[1] > PRIOR and head[2] < PRIOR


def test_a_verdict_is_dropped_when_the_row_finishes():
    """A finishing row's last draft may have been cut by its token limit: not scored."""
    p = hybrid()
    p.propose(batch_for(p, [[1, 2, 3]], keys=[7]), 3)
    p.observe([0], torch.tensor([1]))
    p.finish(0, 7, [9])
    assert p.rates == {} and not p.verdicts and not p.pending


def test_long_kept_features_are_fed_without_drafting():
    p = hybrid()
    earlier = [2 + i % 29 for i in range(FEED_EVERY + 8)]  # an earlier rollout, periodic
    p.suffix.add_completion(7, earlier)
    history = [1, *earlier[:FEED_EVERY]]
    p.propose(batch_for(p, [history], keys=[7]), 3)
    assert p.last_sources == ["suffix"]
    assert not p.pending and 0 in p.slots  # fed into the head's cache, no draft from it
