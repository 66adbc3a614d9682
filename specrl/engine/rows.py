"""A live row of a running ``generate`` call, what is sampled for it and the call's speculation.

Contract: ``Seq`` is one live sequence (its completion record, history, stop set, the logprobs
and versions of its emitted tokens, the target features not yet handed to the drafter and, on
a mixture-of-experts target, the experts of every history position fed so far); ``Kept`` is
what a forward computed per position that follows the position into history;
``RowTensors`` are the rows' sampling settings as device tensors [B]; ``sample_rows`` samples
one token per row with counter-based randomness (``specrl.sampling.uniforms``), so a row samples
the same tokens alone or batched; ``ActiveSpec`` is the running call's speculation, by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from specrl.models.device import on
from specrl.rollout_types import Completion
from specrl.sampling import STREAM_SAMPLE, SamplingParams, sample_logits, uniforms
from specrl.spec.config import SpecConfig
from specrl.spec.proposers.base import Proposer


@dataclass(frozen=True)
class Kept:
    """Per-position outputs of a forward that follow their positions into history: the
    drafter's features [..., F] and an MoE target's experts [..., moe_layers, top_k] (int16),
    each None where not recorded; ``at`` indexes both alike."""

    feats: torch.Tensor | None = None
    routes: torch.Tensor | None = None

    def at(self, *index: int | slice) -> Kept:
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return Kept(pick(self.feats), pick(self.routes))


@dataclass
class Seq:
    """One live sequence: its completion record and decoding position."""

    comp: Completion
    params: SamplingParams
    history: list[int]  # prompt + emitted tokens
    max_total: int  # history length at which the sequence must stop
    group_key: int
    row_id: int
    stop: frozenset[int] = frozenset()
    # target features [n, F] of history positions not yet handed to the drafter (learned drafters)
    hidden: list[torch.Tensor] = field(default_factory=list)
    # MoE targets: experts [n, moe_layers, top_k] of the history positions fed (prompt first)
    routes: list[torch.Tensor] = field(default_factory=list)
    # per emitted token: processed and raw logprobs, the weights version that sampled it
    logprobs: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    emitted: int = 0  # tokens of its completion so far

    def restart_record(self) -> None:
        """No token emitted yet (a new row; a row an in-flight update restarts)."""
        del self.history[len(self.comp.prompt_ids) :]
        self.logprobs, self.raw, self.versions, self.emitted = [], [], [], 0
        self.hidden, self.routes = [], []

    def keep(self, *parts: Kept) -> None:
        """Append ``parts`` (each [n, ...]) to the features and experts kept."""
        for part in parts:
            if part.feats is not None:
                self.hidden.append(part.feats)
            if part.routes is not None:
                self.routes.append(part.routes)

    def routing(self) -> torch.Tensor | None:
        """Experts [len(history) - 1, moe_layers, top_k] of every position but the last (the
        inputs of the logprobs of its tokens), or None where none were recorded."""
        if not self.routes:
            return None
        return torch.cat(self.routes)[: len(self.history) - 1].cpu()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Its completion's tokens, logprobs, raw logprobs and versions as tensors [n] each."""
        return (torch.tensor(self.history[len(self.comp.prompt_ids) :], dtype=torch.int64),
                torch.tensor(self.logprobs, dtype=torch.float32),
                torch.tensor(self.raw, dtype=torch.float32),
                torch.tensor(self.versions, dtype=torch.int64))  # fmt: skip

    @property
    def pos(self) -> int:
        """Cache position of the last emitted token (not yet in the cache)."""
        return len(self.history) - 1


@dataclass
class RowTensors:
    """Per-row sampling tensors for the current batch composition, all [B]."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor

    @classmethod
    def of(cls, rows: list[Seq], device: torch.device) -> RowTensors:
        return cls(*on(device,  # built on the host, one copy each
            torch.tensor([s.params.temperature for s in rows], dtype=torch.float32),
            torch.tensor([s.params.top_k for s in rows], dtype=torch.int64),
            torch.tensor([s.params.top_p for s in rows], dtype=torch.float32),
            torch.tensor([s.comp.seed for s in rows], dtype=torch.int64),
        ))  # fmt: skip


@dataclass
class Sampled:
    tokens: torch.Tensor  # [N]
    logprobs: torch.Tensor  # [N] processed
    raw_logprobs: torch.Tensor  # [N]


def sample_rows(logits: torch.Tensor, t: RowTensors, counters: torch.Tensor) -> Sampled:
    """Sample one token per row from logits [N, V] with per-row settings at counters [N]."""
    u = uniforms(t.seeds, counters, STREAM_SAMPLE)
    return Sampled(*sample_logits(logits, t.temperature, t.top_k, t.top_p, u))


class ActiveSpec(NamedTuple):
    """The speculation of the running call (the engine's own between calls)."""

    spec: SpecConfig
    proposer: Proposer | None = None  # None: plain decoding
    capture: tuple[int, ...] = ()  # target layers whose features the drafter reads

    @classmethod
    def of(cls, spec: SpecConfig, proposer: Proposer | None) -> ActiveSpec:
        """``spec`` with its ``proposer`` when speculation is on."""
        proposer = proposer if spec.enabled else None
        return cls(spec, proposer, () if proposer is None else tuple(proposer.hidden_layers))
