"""The ``Proposer`` protocol: what every drafter offers the engine, and what it is given.

Each decode step the engine calls ``propose(ProposerBatch, k) -> Draft`` (``tokens[B, k]``,
``lengths[B]``, ``probs[B, k, V]`` = the distribution each draft was drawn from, ``None`` for a
deterministic drafter), then ``observe(row_ids, accepted)``, and ``finish`` when a sequence
ends; ``load_weights`` refreshes a learned drafter. Only data types and the protocol live here;
drafters live in sibling modules. Details: docs/internals.md.
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
    # Per row (temperature, top_k, top_p) as host values, what a static drafting step's
    # ``SamplingHints`` are built from without reading the device; None: not given.
    settings: list[tuple[float, int, float]] | None = None

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
