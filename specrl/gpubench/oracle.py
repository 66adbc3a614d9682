"""The drafters the GPU check and ``specrl bench grpo`` time, and their oracle rollouts.

Contract: two drafters, registered on first use (``oracle_spec``, ``fixed_spec``), so that
importing this module leaves the proposer registry as it was. ``ORACLE`` (``OracleProposer``) drafts
the tokens of a known rollout (its ``book``: sample seed -> prompt + completion) with a set
per-token acceptance; ``FIXED`` (``FixedProposer``) drafts k tokens that verification all but
always rejects, so every step is a verify step of exactly k drafts. ``oracle_spec`` is the
``SpecConfig`` of an oracle (sample-exact verification); ``solve_alpha`` the per-token
acceptance of a target acceptance length. ``plain_rollout`` / ``oracle_rollout`` roll a run's
prompts out plain and with the oracle over the run's weights (the GPU check's grpo section,
``specrl bench grpo --mode interleaved --ceiling``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from specrl.backends.native import NativeBackend
from specrl.engine import Engine
from specrl.pipelines.step import rollout
from specrl.spec.config import SpecConfig
from specrl.spec.proposers import PROPOSERS, Draft, Proposer, register_proposer

if TYPE_CHECKING:
    from specrl.backends.base import Rollout
    from specrl.pipelines.build import RunParts
    from specrl.rollout_types import Completion

ORACLE = "oracle"  # proposer names, registered on first use
FIXED = "fixed-draft"
ALPHA_BISECTIONS = 60  # solve_alpha: to below 1e-15


class OracleProposer(Proposer):
    """Drafts the tokens plain sampling will draw: ``book`` maps a sample seed to the plain
    rollout's prompt + completion; a row whose history has left it drafts nothing, or with
    ``off_book`` k copies of token 0 (rejected unless sampling draws it: the row's steps keep
    the shape of drafted ones). With ``accept`` < 1 each drafted token is kept with that
    probability (one uniform per sample seed and position, drawn once) and the first one not
    kept is replaced by a neighbouring token id, which verification rejects; the draft keeps
    its length."""

    deterministic = True

    def __init__(
        self, book: dict[int, list[int]] | None = None, accept: float = 1.0, off_book: bool = False
    ) -> None:
        self.book = {} if book is None else book
        self.accept = accept
        self.off_book = off_book
        self.uniforms = {s: np.random.default_rng(s).random(len(f)) for s, f in self.book.items()}

    def propose(self, batch, k: int) -> Draft:
        rows = []
        for seed, history in zip(batch.seeds.tolist(), batch.histories, strict=True):
            full = self.book.get(seed, [])
            n = len(history)
            if full[:n] == history:
                rows.append(self.spoil(full[n : n + k], seed, n))
            else:
                rows.append([0] * k if self.off_book else [])
        return Draft.from_lists(rows, k)

    def spoil(self, draft: list[int], seed: int, position: int) -> list[int]:
        """``draft`` with its first token not kept replaced by a wrong id."""
        if self.accept >= 1.0 or not draft:
            return draft
        kept = self.uniforms[seed][position : position + len(draft)] < self.accept
        if kept.all():
            return draft
        j = int(np.argmin(kept))  # the first position not kept
        wrong = draft[j] - 1 if draft[j] > 0 else draft[j] + 1
        return [*draft[:j], wrong, *draft[j + 1 :]]


class FixedProposer(Proposer):
    """Drafts k tokens per row that verification all but always rejects (the ids after the
    row's last token): a verify step of exactly k drafts, whatever the model."""

    deterministic = True

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def propose(self, batch, k: int) -> Draft:
        rows = [[(h[-1] + 1 + i) % self.vocab for i in range(k)] for h in batch.histories]
        return Draft.from_lists(rows, k)


def oracle_spec(
    book: dict[int, list[int]],
    k: int,
    accept: float = 1.0,
    *,
    off_book: bool = False,
    adaptive: bool = True,
) -> SpecConfig:
    """The oracle drafting ``book`` at per-token acceptance ``accept``, sample-exact
    verification; k fixed, or chosen per step by the cost-model controller (``adaptive``)."""
    _registered(ORACLE, OracleProposer)
    options: dict[str, Any] = {"book": book, "accept": accept}
    if off_book:
        options["off_book"] = True
    return SpecConfig(ORACLE, k, options=options, exact="sample", adaptive=adaptive)


def fixed_spec(k: int, vocab: int) -> SpecConfig:
    """Verify steps of exactly k rejected drafts (``FixedProposer``)."""
    _registered(FIXED, FixedProposer)
    return SpecConfig(FIXED, k, options={"vocab": vocab}, exact="sample", adaptive=False)


def _registered(name: str, cls: type[Proposer]) -> None:
    """Register ``cls`` as proposer ``name`` unless it is (the registry is append-only)."""
    if name not in PROPOSERS:
        register_proposer(name)(cls)


def book_of(out: Sequence[Completion]) -> dict[int, list[int]]:
    """Each sample seed's prompt + completion in ``out`` (completions: an oracle's book)."""
    return {c.seed: list(c.prompt_ids) + list(c.token_ids) for c in out}


def solve_alpha(acceptance_length: float, k: int) -> float:
    """The per-token acceptance a whose expected acceptance length at k drafts, bonus token
    included, 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a), is ``acceptance_length``."""
    if not 1.0 < acceptance_length < k + 1:
        raise ValueError(f"acceptance length {acceptance_length} is outside (1, {k + 1}) at k={k}")
    lo, hi = 0.0, 1.0
    for _ in range(ALPHA_BISECTIONS):  # the sum rises with a
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(k + 1)) < acceptance_length else (lo, mid)
    return (lo + hi) / 2


def plain_rollout(
    parts: RunParts, prompts: list, step: int, record: bool = False
) -> tuple[float, Rollout]:
    """Seconds and rollout of the step's prompts with no speculation (``record``: with the
    engine's step records)."""
    engine = parts.backend.engine
    engine.record_steps, before = record, engine.record_steps
    try:
        t0 = time.perf_counter()
        out = rollout(parts, prompts, step, spec=SpecConfig("none", 0))
        return time.perf_counter() - t0, out
    finally:
        engine.record_steps = before


def oracle_rollout(
    parts: RunParts,
    engine: Engine,
    prompts: list,
    step: int,
    plain: list[Completion],
    k: int,
    accept: float = 1.0,
) -> tuple[float, float, bool]:
    """Seconds, acceptance length and same-tokens check of the step's prompts rolled out by
    ``engine`` (over the run's shared, current weights) drafting ``plain``'s tokens with the
    oracle at per-token acceptance ``accept`` (k up to ``k``, the controller's choice)."""
    spec = oracle_spec(book_of(plain), k, accept, off_book=False, adaptive=True)
    engine.spec, engine.proposer = spec, engine.make_proposer(spec)
    oracle = replace(parts, backend=NativeBackend(engine))
    t0 = time.perf_counter()
    out = rollout(oracle, prompts, step)
    seconds = time.perf_counter() - t0
    same = [c.token_ids for c in out.completions] == [c.token_ids for c in plain]
    return seconds, out.stats.acceptance_length, same
