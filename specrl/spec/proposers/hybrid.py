"""``hybrid``: per row, a suffix draft where earlier rollouts predict it, else the EAGLE-3 head.

``HybridProposer(target_model, drafter_path=None, drafter=None)`` holds an EAGLE-3 head (trained
online as for ``eagle3``) and a ``SuffixProposer`` over the prompt groups' completions. Each
``propose`` scores a row's suffix draft and the head's by expected accepted tokens from running
per-position acceptance rates (measured for both sources), gives each row the better (the suffix
on ties) and runs the head only for its rows; the returned ``Draft`` is exact for every row.
Rewritten histories (in-flight reverify/discard) are not supported. Details: docs/internals.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrl.models.device import on
from specrl.models.heads import DraftHead
from specrl.models.transformer import Transformer
from specrl.spec.proposers import register_proposer
from specrl.spec.proposers.base import Draft, ProposerBatch
from specrl.spec.proposers.eagle3 import Eagle3Proposer
from specrl.spec.proposers.suffix import SuffixProposer

PRIOR = 0.6  # acceptance rate assumed for a draft position never verified yet
RATE = 0.05  # EMA weight of one verdict
FEED_EVERY = 64  # kept features of a row past which the head reads them without drafting
SUPPORT_KEYS = ((4, "suffix:4+"), (2, "suffix:2-3"), (1, "suffix:1"))  # (least count, key)


def support_key(count: int) -> str:
    """The rate key of a suffix draft token continued by ``count`` earlier occurrences."""
    return next(key for least, key in SUPPORT_KEYS if count >= least)


@dataclass
class _Verdict:
    """What a row drafted at its last propose, to be scored at its next one."""

    keys: list[str]  # the rate key of each draft token the verifier saw
    accepted: int | None = None  # set by ``observe``
    start: int = 0  # history length when drafted (the shadow suffix draft's reference)
    shadow: list[int] | None = None  # the suffix draft a head row did not take
    shadow_keys: list[str] | None = None


@register_proposer("hybrid")
class HybridProposer(Eagle3Proposer):
    """Suffix drafts where siblings and earlier rollouts predict the row, the head elsewhere."""

    deterministic = False
    kind = "eagle3"  # the head it trains and loads is an EAGLE-3 head
    keeps_state = True  # its suffix index

    def __init__(
        self,
        target_model: Transformer | None = None,
        drafter_path: str | None = None,
        drafter: DraftHead | None = None,
    ) -> None:
        super().__init__(target_model, drafter_path, drafter)
        self.suffix = SuffixProposer()
        self.rates: dict[str, list[float]] = {}  # rate key -> per draft position
        self.pending: dict[int, list[torch.Tensor]] = {}  # row id -> features not yet fed
        self.verdicts: dict[int, _Verdict] = {}  # row id -> its last draft
        self.last_sources: list[str] = []

    # ------------------------------------------------------------------ engine hooks

    def bind(self, max_batch: int, max_len: int, vocab_size: int) -> None:
        super().bind(max_batch, max_len, vocab_size)
        self.pending, self.verdicts = {}, {}  # rows of an interrupted call never come back

    def observe(self, row_ids: list[int], accepted: torch.Tensor) -> None:
        """Record each drafting row's verdict (``accepted[b]``: tokens row b emitted, its
        accepted drafts plus one), folded in at its next propose."""
        for row_id, emitted in zip(row_ids, accepted.tolist(), strict=True):
            verdict = self.verdicts.get(row_id)
            if verdict is not None and verdict.accepted is None:
                verdict.accepted = min(int(emitted) - 1, len(verdict.keys))

    def finish(self, row_id: int, group_key: int, tokens: list[int]) -> None:
        super().finish(row_id, group_key, tokens)
        self.suffix.finish(row_id, group_key, tokens)
        self.pending.pop(row_id, None)
        self.verdicts.pop(row_id, None)

    def state_dict(self) -> dict:
        return self.suffix.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.suffix.load_state_dict(state)

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(self, batch: ProposerBatch, k: int) -> Draft:
        if batch.hidden is None:
            raise RuntimeError("the engine handed no target features (hidden_layers ignored?)")
        b = len(batch)
        for row_id, feats, history in zip(batch.row_ids, batch.hidden, batch.histories,
                                          strict=True):  # fmt: skip
            self.pending.setdefault(row_id, []).append(feats)
            self._score(row_id, history)
        if k == 0:
            return Draft.empty(b, 0)
        sfx = self.suffix.propose(batch, k)
        suffix_rows = sfx.rows()
        suffix_keys = [[support_key(c) for c in counts] for counts in self.suffix.last_support]
        head_gain = self.expected(["head"] * k)
        heads = [i for i, keys in enumerate(suffix_keys) if self.expected(keys) < head_gain]
        draft = self._assemble(batch, sfx, heads, k)
        self._feed_long(batch, heads)
        chosen = set(heads)
        self.last_sources = ["head" if i in chosen else "suffix" for i in range(b)]
        for i, (row_id, n) in enumerate(zip(batch.row_ids, draft.lengths.tolist(), strict=True)):
            took_head = i in chosen
            verdict = _Verdict(["head"] * n if took_head else suffix_keys[i], None,
                               len(batch.histories[i]))  # fmt: skip
            if took_head and suffix_rows[i]:
                verdict.shadow, verdict.shadow_keys = suffix_rows[i], suffix_keys[i]
            self.verdicts[row_id] = verdict
        return draft

    def _assemble(self, batch: ProposerBatch, sfx: Draft, heads: list[int], k: int) -> Draft:
        """The suffix draft with one-hot q, the head's draft and q on rows ``heads``."""
        b, vocab = len(batch), self.head.target_config.vocab_size
        sfx = sfx.to(self.device)  # the suffix tree drafts on the host
        tokens, lengths = sfx.tokens.clone(), sfx.lengths.clone()
        probs = torch.zeros(b, k, vocab, device=self.device)  # [B, k, V]
        hot = torch.arange(k, device=self.device)[None, :] < sfx.lengths[:, None]  # [B, k]
        probs[hot] = torch.nn.functional.one_hot(sfx.tokens[hot], vocab).float()
        if heads:
            drafted = super().propose(self._head_batch(batch, heads), k)
            tokens[heads], lengths[heads], probs[heads] = (
                drafted.tokens,
                drafted.lengths,
                drafted.probs,
            )
        return Draft(tokens=tokens, lengths=lengths, probs=probs)

    def _feed_long(self, batch: ProposerBatch, heads: list[int]) -> None:
        """Feed the head the kept features of rows that did not draft with it and have kept
        ``FEED_EVERY`` or more (no drafting: the head's cache just catches up)."""
        chosen = set(heads)
        rows = [
            i for i, row_id in enumerate(batch.row_ids)
            if i not in chosen and sum(int(f.shape[0]) for f in self.pending[row_id]) >= FEED_EVERY
        ]  # fmt: skip
        if rows:
            sub = self._head_batch(batch, rows)
            slot_ids = [self._slot(r) for r in sub.row_ids]
            (slots,) = on(self.device, torch.tensor(slot_ids))
            self._catch_up(sub, slot_ids, slots, [len(h) - 1 for h in sub.histories])

    def _head_batch(self, batch: ProposerBatch, rows: list[int]) -> ProposerBatch:
        """The rows ``rows`` of ``batch``, each with every feature the head has not read yet."""
        hidden = [torch.cat(self.pending.pop(batch.row_ids[i])) for i in rows]
        pick = torch.tensor(rows, device=batch.seeds.device)
        return ProposerBatch(
            histories=[batch.histories[i] for i in rows],
            group_keys=[batch.group_keys[i] for i in rows],
            row_ids=[batch.row_ids[i] for i in rows],
            temperature=batch.temperature[pick],
            top_k=batch.top_k[pick],
            top_p=batch.top_p[pick],
            seeds=batch.seeds[pick],
            counters=batch.counters[pick],
            hidden=hidden,
            prompt_lengths=None
            if batch.prompt_lengths is None
            else [batch.prompt_lengths[i] for i in rows],
            draft_stream=batch.draft_stream,
        )

    # ------------------------------------------------------------------ acceptance estimates

    def _score(self, row_id: int, history: list[int]) -> None:
        """Fold the row's last verdict (and its shadow suffix draft's match) into the rates."""
        verdict = self.verdicts.pop(row_id, None)
        if verdict is None:
            return
        if verdict.accepted is not None and verdict.keys:
            self.learn(verdict.keys, verdict.accepted)
        if verdict.shadow:
            emitted = history[verdict.start :]
            seen = min(len(verdict.shadow), len(emitted))
            match = 0
            while match < seen and verdict.shadow[match] == emitted[match]:
                match += 1
            self.learn(verdict.shadow_keys[:seen], match)

    def rate(self, key: str, position: int) -> float:
        """The running acceptance rate of draft ``position`` under ``key`` (``PRIOR`` unseen)."""
        rates = self.rates.get(key, [])
        return rates[position] if position < len(rates) else PRIOR

    def expected(self, keys: list[str]) -> float:
        """Expected accepted tokens of a draft whose token i has rate key ``keys[i]``:
        sum_j prod_{i<=j} a(i, keys[i])."""
        total, alive = 0.0, 1.0
        for i, key in enumerate(keys):
            alive *= self.rate(key, i)
            total += alive
        return total

    def learn(self, keys: list[str], accepted: int) -> None:
        """One row's verdicts on a draft with rate keys ``keys``: positions 1..accepted
        accepted, position accepted+1 rejected (when there was one); later ones not tested."""
        for i in range(min(accepted + 1, len(keys))):
            rates = self.rates.setdefault(keys[i], [])
            rates.extend([PRIOR] * (i + 1 - len(rates)))
            hit = 1.0 if i < accepted else 0.0
            rates[i] += RATE * (hit - rates[i])
