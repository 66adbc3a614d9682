"""The ``Proposer`` base class: what every drafter offers the engine, and what it is given.

Each decode step the engine calls ``propose(ProposerBatch, k) -> Draft`` (``tokens[B, k]``,
``lengths[B]``, ``probs[B, k, V]`` = the distribution each draft was drawn from, ``None`` for a
deterministic drafter), then ``observe(row_ids, accepted)``, and ``finish`` when a sequence
ends. Every drafter subclasses ``Proposer`` (``register_proposer`` refuses one that does not);
only ``propose`` must be implemented, every other hook has a documented no-op default and is called
unconditionally: ``check`` and ``use_static`` when the engine is built, ``bind`` before each
generate call, ``load_weights`` / ``tensors`` for a learned drafter's weights (backend updates
and fingerprints), ``state_dict`` / ``load_state_dict`` for what a resume restores
(``keeps_state``), ``hidden_layers`` for the target features it reads. Only data types and the
base class live here; drafters live in sibling modules. Details: docs/internals.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from specrl.sampling import STREAM_DRAFT

if TYPE_CHECKING:
    from specrl.models.graphs import StepGraphs


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


class Proposer:
    """A drafter: proposes up to k tokens per row; told what was accepted and what finished.

    Subclasses set ``deterministic`` (True: drafts are one-hot, ``Draft.probs`` is None) and
    implement ``propose``; every other hook below is optional, its default a no-op for a
    model-free drafter that keeps no state across calls."""

    name: str  # the registered name (``register_proposer`` sets it)
    deterministic: bool
    hidden_layers: tuple[int, ...] = ()  # target layers whose outputs it reads (learned heads)
    keeps_state: bool = False  # ``state_dict`` carries state a resume must restore

    def propose(self, batch: ProposerBatch, k: int) -> Draft:
        """Up to k draft tokens per row of ``batch`` (every drafter implements it)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement propose")

    def observe(self, row_ids: list[int], accepted: torch.Tensor) -> None:
        """Row ``row_ids[b]`` emitted ``accepted[b]`` tokens this step (its accepted drafts plus
        one); by default nothing to do."""

    def finish(self, row_id: int, group_key: int, tokens: list[int]) -> None:
        """Row ``row_id`` (of prompt ``group_key``) ended with completion ``tokens``; by default
        nothing to do."""

    def check(self, max_len: int, vocab_size: int) -> None:
        """Refuse (``ValueError``) an engine this drafter cannot serve: contexts up to
        ``max_len``, a ``vocab_size`` vocabulary; called when the engine is built. By default
        any engine."""

    def use_static(self, graphs: StepGraphs, sizes: tuple[int, ...]) -> None:
        """The engine runs static steps (batch buckets ``sizes``, over ``graphs``): a drafter
        with steps of its own may run them the same way. By default it drafts as before."""

    def bind(self, max_batch: int, max_len: int, vocab_size: int) -> None:
        """Get ready for a generate call of up to ``max_batch`` rows of up to ``max_len``
        positions (e.g. allocate a cache); by default nothing to do."""

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """New weights for a learned drafter (the names ``tensors`` gives); model-free by
        default: nothing to load."""

    def tensors(self) -> tuple[dict[str, torch.Tensor], torch.dtype] | None:
        """A learned drafter's tensors as it holds them (the names ``load_weights`` takes) and
        its parameters' dtype, what a backend fingerprints; None (the default) for a
        model-free drafter."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """What a resume restores (JSON-able, ``keeps_state``); by default nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict``; a drafter that keeps none (the default) refuses any
        (``ValueError``)."""
        raise ValueError(
            f"saved drafter state of {state.get('name')!r}, but this run's drafter keeps none"
        )


def module_tensors(
    module: torch.nn.Module, named: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], torch.dtype]:
    """``named`` (tensors of ``module``) and the dtype of its first floating-point parameter
    (float32 when it has none): a learned drafter's ``tensors``."""
    floats = (p.dtype for p in module.parameters() if p.is_floating_point())
    return named, next(floats, torch.float32)


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
