"""``ngram``: prompt-lookup drafting over each row's own history (model-free, deterministic).

For n from ``max_n`` down to ``min_n``, the most recent earlier occurrence of the row's last n
tokens gives the draft: the (at most k) tokens that followed it; no match -> an empty draft.
Drafts are deterministic (``probs=None``). A per-row incremental index keeps a step's cost in
the new tokens; ``finish`` drops a row, and at most ``max_rows`` rows are kept (LRU).
Details: docs/internals.md.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from specrl.spec.proposers import register_proposer
from specrl.spec.proposers.base import Draft, Proposer, ProposerBatch


class _RowIndex:
    """Most recent start of every n-gram (min_n..max_n) of one history that has a successor."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.starts: dict[tuple[int, ...], int] = {}
        self.length = 0  # tokens of the history indexed so far
        self.first = self.last = -1  # its first and last token (cheap consistency check)

    def update(self, history: list[int]) -> None:
        """Index the n-grams of ``history`` whose continuation is now known."""
        consistent = self.length <= len(history) and (
            self.length == 0 or (history[0] == self.first and history[self.length - 1] == self.last)
        )
        if not consistent:
            self.starts.clear()
            self.length = 0
        # n-grams starting at s with s + n <= len - 1 (a successor exists); new ones end at
        # positions length-1 .. len-2, i.e. successors at length .. len-1.
        for end in range(max(self.length - 1, 0), len(history) - 1):
            for n in range(self.min_n, self.max_n + 1):
                start = end - n + 1
                if start >= 0:
                    self.starts[tuple(history[start : end + 1])] = start
        self.length = len(history)
        if history:
            self.first, self.last = history[0], history[-1]

    def lookup(self, history: list[int], k: int) -> list[int]:
        """Continuation (<= k tokens) of the longest, most recent match of the history's suffix."""
        for n in range(min(self.max_n, len(history) - 1), self.min_n - 1, -1):
            start = self.starts.get(tuple(history[-n:]))
            if start is not None:
                return history[start + n : start + n + k]
        return []


@register_proposer("ngram")
class NgramProposer(Proposer):
    """Prompt lookup: draft what followed the latest earlier occurrence of the last n tokens."""

    name = "ngram"
    deterministic = True

    def __init__(self, max_n: int = 4, min_n: int = 2, max_rows: int = 4096) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_n, self.min_n, self.max_rows = max_n, min_n, max_rows
        self._rows: OrderedDict[int, _RowIndex] = OrderedDict()

    def propose(self, batch: ProposerBatch, k: int) -> Draft:
        """Per row, the continuation of its own history's matching suffix (<= k tokens)."""
        if k <= 0:
            return Draft.empty(len(batch), max(k, 0))
        drafts = []
        for row_id, history in zip(batch.row_ids, batch.histories, strict=True):
            index = self._row(row_id)
            index.update(history)
            drafts.append(index.lookup(history, k))
        return Draft.from_lists(drafts, k)

    def observe(self, row_ids: list[int], accepted: torch.Tensor) -> None:
        """Nothing to do: the index follows the histories."""

    def finish(self, row_id: int, group_key: int, tokens: list[int]) -> None:
        """Drop the row's index."""
        self._rows.pop(row_id, None)

    def _row(self, row_id: int) -> _RowIndex:
        index = self._rows.get(row_id)
        if index is None:
            index = self._rows[row_id] = _RowIndex(self.min_n, self.max_n)
            while len(self._rows) > self.max_rows:
                self._rows.popitem(last=False)
        else:
            self._rows.move_to_end(row_id)
        return index
