"""``suffix``: SRT / suffix-decoding style drafts from a per-prompt history (model-free).

Per prompt (``group_key``) it indexes earlier completions (``finish``, ``add_completion``) and
reads live siblings' histories from the batch. A row's draft follows the longest matched suffix
of its history along the most frequent continuation while its share stays ``>= min_confidence``
(deterministic, ``probs=None``); ``last_support`` holds each drafted token's count (how many
occurrences continued that way). Memory is bounded by ``max_groups * max_tokens_per_group``
(FIFO completions per prompt, LRU prompts). Details: docs/internals.md.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict, deque

import numpy as np
import torch

from specrl.spec.proposers import register_proposer
from specrl.spec.proposers.base import Draft, Proposer, ProposerBatch

SEP = -1  # separator between indexed sequences (token ids are >= 0)
_ONE_SHOT = 32  # candidate count below which a suffix is compared in one vectorised shot


class _Group:
    """Stored completions of one prompt, FIFO-capped at ``max_tokens`` tokens."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.docs: deque[np.ndarray] = deque()  # int32 token arrays, oldest first
        self.tokens = 0
        self.prompt_tail: list[int] | None = None
        self._corpus: np.ndarray | None = None  # cached [SEP, doc0, SEP, doc1, SEP, ...]

    def add(self, tokens: list[int]) -> None:
        doc = np.asarray((self.prompt_tail or []) + list(tokens), dtype=np.int32)
        doc = doc[: self.max_tokens]
        self.docs.append(doc)
        self.tokens += doc.size
        while self.tokens > self.max_tokens:
            self.tokens -= self.docs.popleft().size
        self._corpus = None

    def corpus(self) -> np.ndarray:
        """All stored tokens [n] int32, every sequence preceded and followed by SEP."""
        if self._corpus is None:
            parts = [np.full(1, SEP, dtype=np.int32)]
            for doc in self.docs:
                parts += [doc, parts[0]]
            self._corpus = np.concatenate(parts)
        return self._corpus


@register_proposer("suffix")
class SuffixProposer(Proposer):
    """Drafts the most frequent continuation of the longest matching suffix in a prompt group."""

    name = "suffix"
    deterministic = True
    keeps_state = True  # the index of earlier completions

    def __init__(
        self,
        max_match: int = 24,
        min_match: int = 2,
        min_confidence: float = 0.5,
        max_tokens_per_group: int = 16384,
        max_groups: int = 256,
        use_own_history: bool = False,
    ) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        if not 0 <= min_confidence <= 1:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        if max_tokens_per_group < 1 or max_groups < 1:
            raise ValueError("max_tokens_per_group and max_groups must be >= 1")
        self.max_match, self.min_match = max_match, min_match
        self.min_confidence = min_confidence
        self.max_tokens_per_group, self.max_groups = max_tokens_per_group, max_groups
        self.use_own_history = use_own_history
        self._groups: OrderedDict[int, _Group] = OrderedDict()
        self.last_support: list[list[int]] = []  # per row of the last propose (see docstring)

    # -- Proposer hooks ------------------------------------------------------------------------

    def propose(self, batch: ProposerBatch, k: int) -> Draft:
        """Per row, a continuation seen after its history's longest matching suffix (<= k)."""
        drafts: list[list[int]] = [[] for _ in range(len(batch))]
        support: list[list[int]] = [[] for _ in range(len(batch))]
        self.last_support = support
        if k <= 0:
            return Draft.empty(len(batch), max(k, 0))
        rows_of: dict[int, list[int]] = defaultdict(list)
        for b, key in enumerate(batch.group_keys):
            rows_of[key].append(b)
        for key, rows in rows_of.items():
            group = self._touch(key)
            if group.prompt_tail is None and batch.prompt_lengths is not None:
                prompt = batch.histories[rows[0]][: batch.prompt_lengths[rows[0]]]
                group.prompt_tail = prompt[-self.max_match :]
            for b, (draft, counts) in zip(rows, self._propose_group(group, batch, rows, k),
                                          strict=True):  # fmt: skip
                drafts[b], support[b] = draft, counts
        return Draft.from_lists(drafts, k)

    def observe(self, row_ids: list[int], accepted: torch.Tensor) -> None:
        """Nothing to do: live histories are read from each batch."""

    def finish(self, row_id: int, group_key: int, tokens: list[int]) -> None:
        """Index a finished completion of prompt ``group_key``."""
        self.add_completion(group_key, tokens)

    def state_dict(self) -> dict:
        """The index as JSON-able data (least recently used prompt first), for resumes."""
        groups = [
            {"key": key, "prompt_tail": g.prompt_tail, "docs": [d.tolist() for d in g.docs]}
            for key, g in self._groups.items()
        ]
        return {"name": self.name, "groups": groups}

    def load_state_dict(self, state: dict) -> None:
        """Replace the index with one from ``state_dict``."""
        if state.get("name") != self.name:
            raise ValueError(f"drafter state of {state.get('name')!r}, this drafter is 'suffix'")
        groups: OrderedDict[int, _Group] = OrderedDict()
        for item in state["groups"]:
            g = _Group(self.max_tokens_per_group)
            g.prompt_tail = item["prompt_tail"]
            g.docs = deque(np.asarray(d, dtype=np.int32) for d in item["docs"])
            g.tokens = sum(len(d) for d in item["docs"])
            groups[int(item["key"])] = g
        self._groups = groups

    # -- index management ----------------------------------------------------------------------

    def add_completion(
        self, group_key: int, tokens: list[int], prompt: list[int] | None = None
    ) -> None:
        """Index a completion of prompt ``group_key`` (e.g. from an earlier call or RL step).

        ``prompt`` (optional) sets the group's prompt tail if it is not known yet.
        """
        group = self._touch(group_key)
        if group.prompt_tail is None and prompt is not None:
            group.prompt_tail = list(prompt[-self.max_match :])
        if tokens:
            group.add(tokens)

    def stored_tokens(self) -> int:
        """Tokens held by the index (all prompts)."""
        return sum(group.tokens for group in self._groups.values())

    def group_keys(self) -> list[int]:
        """Prompts in the index, least recently used first."""
        return list(self._groups)

    def _touch(self, key: int) -> _Group:
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(self.max_tokens_per_group)
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(key)
        return group

    # -- drafting ------------------------------------------------------------------------------

    def _propose_group(
        self, group: _Group, batch: ProposerBatch, rows: list[int], k: int
    ) -> list[tuple[list[int], list[int]]]:
        """(draft, support) for the rows of one prompt group, searching stored + live sibling
        tokens."""
        sep = np.full(1, SEP, dtype=np.int32)
        histories = [np.asarray(batch.histories[b], dtype=np.int32) for b in rows]
        corpus = group.corpus()
        search = np.concatenate([corpus] + [part for h in histories for part in (h, sep)])
        starts = corpus.size + np.cumsum([0] + [h.size + 1 for h in histories[:-1]])
        drafts = []
        for history, start in zip(histories, starts.tolist(), strict=True):
            span = (start, start + history.size)  # the row's own live history in ``search``
            exclude = None if self.use_own_history else span
            drafts.append(self._draft(search, history, k, exclude))
        return drafts

    def _draft(
        self,
        search: np.ndarray,  # [n] int32, sequences separated by SEP, starts and ends with SEP
        history: np.ndarray,  # [h] int32
        k: int,
        exclude: tuple[int, int] | None,  # [start, end) of positions not to match
    ) -> tuple[list[int], list[int]]:
        if history.size < self.min_match:
            return [], []
        ends = self._match(search, history, exclude)
        return ([], []) if ends is None else self._continue(search, ends, k)

    def _match(
        self, search: np.ndarray, history: np.ndarray, exclude: tuple[int, int] | None
    ) -> np.ndarray | None:
        """End positions [c] of the occurrences of the longest matching suffix, or None."""
        ends = np.flatnonzero(search[:-1] == history[-1])  # candidate end positions
        ends = ends[search[ends + 1] != SEP]  # a continuation must exist
        if exclude is not None:
            ends = ends[(ends < exclude[0]) | (ends >= exclude[1])]
        matched, limit = 1, min(self.max_match, history.size)
        # Narrow a large candidate set one token at a time (SEP at index 0 stops underflow) ...
        while ends.size > _ONE_SHOT and matched < limit:
            keep = search[ends - matched] == history[-1 - matched]
            if not keep.any():
                limit = matched
                break
            ends, matched = ends[keep], matched + 1
        # ... then compare the remaining suffix tokens of all candidates at once.
        if ends.size and matched < limit:
            offsets = np.arange(matched, limit)  # [w]
            equal = search[np.maximum(ends[:, None] - offsets, 0)] == history[-1 - offsets]
            extra = np.logical_and.accumulate(equal, axis=1).sum(axis=1)  # [c]
            best = int(extra.max())
            ends, matched = ends[extra == best], matched + best
        return ends if ends.size and matched >= self.min_match else None

    def _continue(
        self, search: np.ndarray, ends: np.ndarray, k: int
    ) -> tuple[list[int], list[int]]:
        """Greedy most-frequent continuation after ``ends`` while the count ratio is confident,
        and each drafted token's count."""
        steps = np.arange(1, k + 1)
        # [c, k] tokens after each occurrence; the clip lands on the final SEP
        following = search[np.minimum(ends[:, None] + steps, search.size - 1)].tolist()
        draft: list[int] = []
        support: list[int] = []
        for step in range(k):
            counts = Counter(row[step] for row in following)
            counts.pop(SEP, None)
            if not counts:
                break
            token, count = max(counts.items(), key=lambda item: (item[1], -item[0]))
            if count < self.min_confidence * len(following):
                break
            draft.append(token)
            support.append(count)
            following = [row for row in following if row[step] == token]
        return draft, support
