"""A learned drafter's k draws as one static step (``specrl.models.graphs``), and the draw chain.

``chain(logits, k, sampling, u, advance)`` draws k tokens, each from the logits the previous
draw led to (``advance``): the drafting loop of uncaptured and static steps alike.
``StaticDrafts(graphs, sizes)`` is a drafter's share of the engine's static steps: ``width``
the batch bucket of a step (None: too many rows), ``run`` a drafting step keyed by its
``DraftKey`` (rows, draws, stream, hints from host settings; every step is dropped when the
storage it reads is replaced: a cache, a draft vocabulary; ``free_cache`` drops them before a
drafter makes a new cache, so their references do not keep the old one alive). A static step
reads row b's cache in slot b: ``bind_rows`` puts each batch row there (carrying cached rows
that move); ``step_inputs`` pads rows to the bucket: padding rows sample with ``PAD_SETTINGS``
from zeros and write only the cache's last position, which no row reaches. ``host_reads``
counts the drafter's reads of device data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from specrl.models.cache import KVCache
from specrl.models.device import on
from specrl.models.graphs import StepGraphs, bucket_for, pad_rows
from specrl.sampling import PAD_SETTINGS, SamplingHints, draw, uniforms
from specrl.spec.proposers.base import ProposerBatch

Sampling = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # temperature, top_k, top_p [W]
Inputs = dict[str, torch.Tensor]  # a static drafting step's inputs (``step_inputs``)
Drafted = tuple[torch.Tensor, torch.Tensor]  # tokens [W, k] int64, q [W, k, V]


@dataclass(frozen=True)
class DraftKey:
    """What a static drafting step is built for: its rows (a bucket), draws, stream, hints."""

    width: int
    k: int
    stream: int
    hints: SamplingHints


DraftStep = Callable[[DraftKey, Inputs], Drafted]  # the drafter's step (reads no device data)


class StaticDrafts:
    """A drafter's static drafting steps over ``graphs`` with batch buckets ``sizes``."""

    def __init__(self, graphs: StepGraphs, sizes: tuple[int, ...]) -> None:
        self.graphs = graphs
        self.sizes = sizes
        self.host_reads = 0  # reads of device data by the drafter (counted where it makes them)
        self._reads: tuple | None = None  # identity of the storage the steps were built on

    def drop(self) -> None:
        """Drop every step (and with them their references to the storage they read)."""
        self.graphs.clear()
        self._reads = None

    def width(self, rows: int) -> int | None:
        """The bucket a step over ``rows`` rows is padded to; None when none holds them."""
        return bucket_for(rows, self.sizes)

    def run(
        self, step: DraftStep, batch: ProposerBatch, k: int, x: Inputs, vocab: int, reads: tuple
    ) -> Drafted:
        """``step``'s outputs over ``x`` (the batch's rows padded) drawing from ``vocab``
        tokens; ``reads`` names the storage the steps read besides parameters updated in place
        (a change drops every step)."""
        if reads != self._reads:
            self.drop()
            self._reads = reads
        width = x["positions"].shape[0]
        key = DraftKey(width, k, batch.draft_stream, self.hints(batch, width, vocab))
        return self.graphs.run(key, partial(step, key), x)

    def hints(self, batch: ProposerBatch, width: int, vocab: int) -> SamplingHints:
        """The sampling hints of the batch's rows and ``width - len(batch)`` padding rows over a
        ``vocab``-token distribution, from host settings (read from the device when the batch
        carries none: counted)."""
        settings = batch.settings
        if settings is None:
            self.host_reads += 1
            columns = (batch.temperature.tolist(), batch.top_k.tolist(), batch.top_p.tolist())
            settings = list(zip(*columns, strict=True))
        rows = [*settings, *[PAD_SETTINGS] * (width - len(settings))]
        temps, top_ks, top_ps = zip(*rows, strict=True)
        return SamplingHints.of(temps, top_ks, top_ps, vocab)


class CachedDrafter(Protocol):
    """A drafter with its own KV cache and (maybe) static steps reading it."""

    cache: KVCache | None
    static: StaticDrafts | None


def free_cache(drafter: CachedDrafter) -> None:
    """Let go of ``drafter``'s cache before it makes a new one: its static steps (which hold
    the old one) are dropped and its reference cleared, so the old cache is freed first."""
    if drafter.static is not None:
        drafter.static.drop()
    drafter.cache = None


def step_inputs(
    batch: ProposerBatch,
    start: torch.Tensor,  # [B, 1, H] the drafter's state after each row's last fed token
    bases: list[int],  # per row: the cache position of its first draft step
    k: int,
    width: int,
    last: int,  # the cache's last position (padding rows write there)
) -> Inputs:
    """A static drafting step's inputs over ``width`` rows, padding rows after the batch's
    (no host read): start [W, 1, H] (zeros), positions [W, k-1] of the draft steps (host;
    ``last``), floats [W, 2] (temperature, top_p; 1) and ints [W, 3] (top_k, seed, counter; 0)
    as ``unpack_sampling`` reads them."""
    positions = torch.full((width, k - 1), last, dtype=torch.int64)
    positions[: len(bases)] = torch.tensor(bases)[:, None] + torch.arange(k - 1)[None, :]
    floats = torch.stack([batch.temperature.float(), batch.top_p.float()], 1)
    ints = torch.stack([batch.top_k, batch.seeds, batch.counters], 1).to(torch.int64)
    return {"start": pad_rows(start, width), "positions": positions,
            "floats": pad_rows(floats, width, 1.0), "ints": pad_rows(ints, width)}  # fmt: skip


def unpack_sampling(x: Inputs, key: DraftKey) -> tuple[Sampling, torch.Tensor]:
    """(temperature, top_k, top_p) [W] each and the draws' uniforms [W, k] of a step's inputs."""
    temperature, top_p = x["floats"].unbind(1)
    top_k, seeds, counters = x["ints"].unbind(1)
    return (temperature, top_k, top_p), _uniforms(seeds, counters, key.k, key.stream)


def batch_sampling(batch: ProposerBatch, k: int) -> tuple[Sampling, torch.Tensor]:
    """The batch's (temperature, top_k, top_p) [B] each and its draws' uniforms [B, k]."""
    u = _uniforms(batch.seeds, batch.counters, k, batch.draft_stream)
    return (batch.temperature, batch.top_k, batch.top_p), u


def chain(
    logits: torch.Tensor,  # [W, V] the first draw's logits
    k: int,
    sampling: Sampling,
    u: torch.Tensor,  # [W, k] uniforms
    advance: Callable[[int, torch.Tensor], torch.Tensor],
    hints: SamplingHints | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k draws from the processed distributions: indices [W, k] int64 and their q [W, k, V];
    ``advance(i, idx)`` gives the logits [W, V] that draw i's indices [W] lead to."""
    drawn, probs = [], []
    for i in range(k):
        idx, q = draw(logits, *sampling, u[:, i], hints=hints)  # [W], [W, V]
        drawn.append(idx)
        probs.append(q)
        if i + 1 < k:
            logits = advance(i, idx)
    return torch.stack(drawn, 1), torch.stack(probs, 1)


def bind_rows(
    cache: KVCache, slot_of: dict[int, int], row_ids: list[int], capacity: int
) -> tuple[dict[int, int], list[int]]:
    """Put row ``row_ids[b]`` in slot b of ``cache`` (its first ``capacity`` slots), carrying
    the cached rows that move: the new row -> slot map and the free slots as a stack (``pop``
    gives the lowest)."""
    slot_of, src, dst = place(slot_of, row_ids, capacity)
    if src:
        s, d = on(cache.k.device, torch.tensor(src), torch.tensor(dst))
        cache.k[:, d] = cache.k[:, s]  # the sources are read whole first: any permutation
        cache.v[:, d] = cache.v[:, s]
    held = set(slot_of.values())
    return slot_of, [s for s in range(capacity) if s not in held][::-1]


def place(
    slot_of: dict[int, int], row_ids: list[int], capacity: int
) -> tuple[dict[int, int], list[int], list[int]]:
    """Row ``row_ids[b]`` to slot b: the new row -> slot map (a row not in ``row_ids`` keeps its
    slot, or takes a free one past the batch when its own is wanted) and the slot moves
    (src, dst) that carry cached rows there; ``capacity`` slots in all."""
    b = len(row_ids)
    new = {r: i for i, r in enumerate(row_ids)}
    others = {r: s for r, s in slot_of.items() if r not in new}
    taken = {s for s in others.values() if s >= b}
    spare = iter([s for s in range(b, capacity) if s not in taken])
    for r, s in others.items():
        s = s if s >= b else next(spare, None)
        if s is None:
            raise RuntimeError("drafter cache is full (more live rows than bound)")
        new[r] = s
    moves = [(slot_of[r], s) for r, s in new.items() if slot_of.get(r, s) != s]
    return new, [m[0] for m in moves], [m[1] for m in moves]


def _uniforms(seeds: torch.Tensor, counters: torch.Tensor, k: int, stream: int) -> torch.Tensor:
    """Uniforms [W, k] of draft slots 0..k-1 of rows with ``seeds`` and ``counters`` [W]."""
    steps = counters[:, None] + torch.arange(k, device=counters.device)[None, :]  # [W, k]
    return uniforms(seeds, steps, stream)
