"""Packing sequences into rows for the learner's forward.

Contract: ``pack_sequences(sequences, row_len, share_prompts)`` places each ``(prompt_ids,
completion_ids)`` into rows of ``max(row_len, longest sequence)`` tokens (first fit, in order):
a prompt segment, then a completion segment that also sees that prompt (``parents``), positions
from 0, padding as segment -1. With ``share_prompts`` consecutive sequences with the same prompt
(a GRPO group) share one copy of it. The result (``PackedBatch``) is built on the host;
``PackedBatch.to(device)`` moves its tensors with one copy each. ``Span`` says where one
sequence's tokens sit. ``packed_routing`` places the sequences' recorded MoE experts at their
tokens (routing replay). Pure data: no model, no autograd.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specrl.models.device import on

TENSORS = ("ids", "positions", "segments", "parents", "rows", "cols", "targets")


@dataclass(frozen=True)
class Span:
    """One packed sequence's place: its row, the column and length of its (possibly shared)
    prompt segment, and the column where its completion starts."""

    row: int
    prompt_col: int
    prompt_len: int
    completion_col: int

    def columns(self, completion_len: int) -> torch.Tensor:  # [prompt_len + completion_len]
        """The columns of the sequence's tokens in order: prompt, then completion."""
        p = torch.arange(self.prompt_col, self.prompt_col + self.prompt_len)
        c = torch.arange(self.completion_col, self.completion_col + completion_len)
        return torch.cat([p, c])


@dataclass(frozen=True)
class PackedBatch:
    """Sequences packed into rows; completion-token coordinates listed in sequence order."""

    ids: torch.Tensor  # [R, L] token ids (padding: 0)
    positions: torch.Tensor  # [R, L] position within the own sequence
    segments: torch.Tensor  # [R, L] segment id (a prompt or a completion); -1 = padding
    parents: torch.Tensor  # [R, L] a completion's prompt segment; -2 = none
    rows: torch.Tensor  # [M] row of each completion token's *predicting* position
    cols: torch.Tensor  # [M] column of the predicting position
    targets: torch.Tensor  # [M] the completion token ids
    lengths: list[int]  # completion length per sequence (sum = M)
    spans: list[Span] = field(default_factory=list)  # where each sequence's tokens sit

    @property
    def tokens(self) -> int:
        """Non-padding tokens in the rows (what a forward computes)."""
        return int((self.segments >= 0).sum())

    def to(self, device: torch.device) -> PackedBatch:
        """The same batch with its tensors on ``device`` (itself when they are there)."""
        if self.ids.device == device:
            return self
        moved = on(device, *(getattr(self, k) for k in TENSORS))
        return dataclasses.replace(self, **dict(zip(TENSORS, moved, strict=True)))


@dataclass
class _Block:
    """A prompt and the (consecutive) sequences whose completions follow it in one row."""

    prompt: list[int]
    members: list[int]
    size: int  # tokens: the prompt once + every member's completion


def _blocks(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]], width: int, share: bool
) -> list[_Block]:
    """One block per sequence, or with ``share`` consecutive sequences of the same prompt in
    one block while it fits ``width`` tokens."""
    blocks: list[_Block] = []
    for i, (p, c) in enumerate(sequences):
        if len(p) == 0:
            raise ValueError(f"sequence {i} has an empty prompt: nothing predicts its first token")
        last = blocks[-1] if blocks else None
        if share and last and last.size + len(c) <= width and last.prompt == list(p):
            last.members.append(i)
            last.size += len(c)
        else:
            blocks.append(_Block(list(p), [i], len(p) + len(c)))
    return blocks


def _place(blocks: list[_Block], width: int) -> tuple[list[tuple[int, int]], int]:
    """First fit: (row, start column) per block, and the number of rows."""
    fill: list[int] = []
    place: list[tuple[int, int]] = []
    for b in blocks:
        r = next((i for i, used in enumerate(fill) if used + b.size <= width), len(fill))
        if r == len(fill):
            fill.append(0)
        place.append((r, fill[r]))
        fill[r] += b.size
    return place, len(fill)


def pack_sequences(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    row_len: int = 256,
    share_prompts: bool = False,
) -> PackedBatch:
    """First-fit packing (in order) into rows of ``max(row_len, longest sequence)`` tokens.

    Each sequence is a prompt segment followed by a completion segment that also sees that
    prompt (``parents``), positions continuing after it. With ``share_prompts`` consecutive
    sequences with the same prompt share one copy of it (a GRPO group: the prompt's tokens run
    once, not G times); each completion still sees exactly the prompt and itself.
    """
    width = max([row_len] + [len(p) + len(c) for p, c in sequences])
    blocks = _blocks(sequences, width, share_prompts)
    place, num_rows = _place(blocks, width)
    shape = (num_rows, width)
    ids = torch.zeros(shape, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    segments = torch.full(shape, -1, dtype=torch.long)
    parents = torch.full(shape, -2, dtype=torch.long)
    rows, cols, targets, lengths, spans = [], [], [], [], []
    seg = 0
    for b, (r, start) in zip(blocks, place, strict=True):
        n = len(b.prompt)
        ids[r, start : start + n] = torch.tensor(b.prompt, dtype=torch.long)
        positions[r, start : start + n] = torch.arange(n)
        segments[r, start : start + n] = prompt_seg = seg
        col = start + n
        for i in b.members:
            c = torch.as_tensor(sequences[i][1], dtype=torch.long).reshape(-1)  # [m]
            m = len(c)
            seg += 1
            ids[r, col : col + m] = c
            positions[r, col : col + m] = torch.arange(n, n + m)
            segments[r, col : col + m] = seg
            parents[r, col : col + m] = prompt_seg
            rows.append(torch.full((m,), r, dtype=torch.long))
            at = torch.arange(col - 1, col + m - 1)  # token j is predicted at the column before
            at[:1] = start + n - 1  # it; the first at the prompt's last (shared or not)
            cols.append(at)
            targets.append(c)
            lengths.append(m)
            spans.append(Span(r, start, n, col))
            col += m
        seg += 1
    flat = lambda x: torch.cat(x) if x else torch.zeros(0, dtype=torch.long)  # noqa: E731
    return PackedBatch(ids, positions, segments, parents, flat(rows), flat(cols), flat(targets),
                       lengths, spans)  # fmt: skip


def packed_routing(
    batch: PackedBatch, routings: Sequence[torch.Tensor | None]
) -> torch.Tensor | None:
    """Experts [R * L, moe_layers, top_k] int64 for every packed token in row order from each
    sequence's recorded routing ([P + n - 1, moe_layers, top_k]: its prompt, then its
    completion's tokens but the last), -1 where none was recorded (padding, a completion's last
    token, a sequence without routing); None when no sequence has any. ``ValueError`` naming a
    sequence whose routing does not fit its tokens."""
    given = [r for r in routings if r is not None]
    if not given:
        return None
    rows, width = batch.ids.shape
    shape = tuple(given[0].shape[1:])  # (moe_layers, top_k)
    out = torch.full((rows, width, *shape), -1, dtype=torch.int64)
    for i, (span, n, routing) in enumerate(zip(batch.spans, batch.lengths, routings, strict=True)):
        if routing is None:
            continue
        if tuple(routing.shape[1:]) != shape or len(routing) > span.prompt_len + n:
            raise ValueError(f"sequence {i}: routing of shape {tuple(routing.shape)} does not fit "
                             f"{span.prompt_len} + {n} tokens of {shape} experts")  # fmt: skip
        cols = span.columns(n)[: len(routing)]
        out[span.row, cols] = routing.to(torch.int64)
    return out.reshape(rows * width, *shape)
