"""The ``Proposer`` protocol: what every drafter offers the engine, and what it is given.

Contract:
- Each decode step the engine builds a ``ProposerBatch`` (one entry per live sequence, in batch
  order) and calls ``propose(batch, k)``. The returned ``Draft`` has ``tokens[B, k]`` and
  ``lengths[B]`` (0 <= lengths <= k; a row may draft nothing) and ``probs[B, k, V]``: the
  distribution each draft token was actually drawn from, or ``None`` for a deterministic drafter
  (one-hot q). ``verify`` needs exactly that q; never pass a distribution the tokens were not
  drawn from.
- ``histories[b]`` is the full token history of row b: prompt followed by every emitted token;
  its last token is the one the target reads first this step. ``prompt_lengths[b]`` (optional)
  says where the prompt ends. ``group_keys[b]`` identifies the prompt (GRPO siblings share it; the
  same prompt token ids give the same key across calls); ``row_ids[b]`` identifies the sequence
  while it lives.
- After verification the engine calls ``observe(row_ids, accepted)`` with the number of tokens
  each row emitted (lets a stateful drafter advance or roll back its own state), and
  ``finish(row_id, group_key, completion_tokens)`` once a sequence ends.
- ``load_weights(state)`` refreshes a learned drafter after a policy update (no-op for model-free
  drafters); a drafter that is never refreshed stays correct but its acceptance collapses.
- ``deterministic`` is True iff ``propose`` always returns ``probs=None``.
- Devices: the batch's tensors (and ``hidden``) are on the engine's device; a learned drafter
  drafts there, a model-free one may return its ``Draft`` on the host (the engine moves it with
  one copy per step, ``Draft.to``), never syncing per row.

This module holds only data types and the protocol; drafters live in sibling modules and are
registered by name in ``specrl.spec.proposers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specrl.sampling import STREAM_DRAFT


@dataclass(frozen=True)
class Draft:
    """Draft tokens for a batch of B rows and k slots."""

    tokens: torch.Tensor  # [B, k] int64; slots >= lengths[b] are padding (any value)
    lengths: torch.Tensor  # [B] int64 in [0, k]; valid draft tokens per row
    probs: torch.Tensor | None = None  # [B, k, V] float32 q of each slot; None = one-hot

    @property
    def k(self) -> int:
        return int(self.tokens.shape[1])

    @staticmethod
    def empty(batch: int, k: int) -> Draft:
        """A draft with no tokens for any row (plain decoding)."""
        return Draft(
            tokens=torch.zeros(batch, k, dtype=torch.int64),
            lengths=torch.zeros(batch, dtype=torch.int64),
        )

    @staticmethod
    def from_lists(rows: list[list[int]], k: int) -> Draft:
        """A deterministic draft from per-row token lists (each truncated to k)."""
        tokens = torch.zeros(len(rows), k, dtype=torch.int64)
        lengths = torch.zeros(len(rows), dtype=torch.int64)
        for b, row in enumerate(rows):
            row = row[:k]
            if row:
                tokens[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
            lengths[b] = len(row)
        return Draft(tokens=tokens, lengths=lengths)

    def to(self, device: torch.device) -> Draft:
        """This draft on ``device`` (itself when it is there already: no copy on the CPU)."""
        if self.tokens.device == device:
            return self
        probs = None if self.probs is None else self.probs.to(device, non_blocking=True)
        return Draft(self.tokens.to(device, non_blocking=True),
                     self.lengths.to(device, non_blocking=True), probs)  # fmt: skip

    def rows(self) -> list[list[int]]:
        """Valid draft tokens of every row, as Python lists."""
        lengths = self.lengths.tolist()
        return [row[:n] for row, n in zip(self.tokens.tolist(), lengths, strict=True)]


@dataclass
class ProposerBatch:
    """What the engine hands a proposer each step (B rows, batch order)."""

    histories: list[list[int]]  # per row: prompt + emitted tokens (last = next target input)
    group_keys: list[int]  # per row: prompt id, shared by GRPO siblings, stable across calls
    row_ids: list[int]  # per row: unique sequence id, stable while the sequence lives
    temperature: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float; 1 = off
    seeds: torch.Tensor  # [B] int64
    counters: torch.Tensor  # [B] int64; counter of the first token emitted this step
    # Learned drafters (a proposer with ``hidden_layers``): per row, the target's features
    # [n, F] (outputs of those layers, concatenated) for history positions len-1-n .. len-2,
    # i.e. the positions that became history since the last propose; feature i predicted
    # token history[i + 1]. None when the proposer asks for no layers.
    hidden: list[torch.Tensor] | None = None
    prompt_lengths: list[int] | None = None  # per row: prompt tokens at the start of histories
    # The random stream a stochastic drafter draws slot i's token with (uniforms(seeds,
    # counters + i, draft_stream)): its own STREAM_DRAFT, or plain sampling's STREAM_SAMPLE
    # under sample-exact verification (the coupling that lets drafts equal plain tokens).
    draft_stream: int = STREAM_DRAFT

    def __len__(self) -> int:
        return len(self.histories)


@runtime_checkable
class Proposer(Protocol):
    """A drafter: proposes up to k tokens per row; told what was accepted and what finished."""

    name: str
    deterministic: bool

    def propose(self, batch: ProposerBatch, k: int) -> Draft: ...

    def observe(self, row_ids: list[int], accepted: torch.Tensor) -> None: ...

    def finish(self, row_id: int, group_key: int, tokens: list[int]) -> None: ...

    def load_weights(self, state: dict[str, torch.Tensor]) -> None: ...


def make_batch(
    histories: list[list[int]],
    group_keys: list[int] | None = None,
    row_ids: list[int] | None = None,
    prompt_lengths: list[int] | None = None,
) -> ProposerBatch:
    """A ProposerBatch with default sampling settings (T=1, no truncation); for tests/tools."""
    rows = len(histories)
    return ProposerBatch(
        histories=histories,
        group_keys=group_keys if group_keys is not None else list(range(rows)),
        row_ids=row_ids if row_ids is not None else list(range(rows)),
        temperature=torch.ones(rows),
        top_k=torch.zeros(rows, dtype=torch.int64),
        top_p=torch.ones(rows),
        seeds=torch.zeros(rows, dtype=torch.int64),
        counters=torch.zeros(rows, dtype=torch.int64),
        prompt_lengths=prompt_lengths,
    )
