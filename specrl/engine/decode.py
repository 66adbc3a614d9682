"""One decode step over a call's live rows: plain (one token per row) or speculative.

``Decoder.step(call, rows, start)`` advances every live row and returns the indices of the rows
that finished. k is ``spec.k_for_batch`` or, for an adaptive spec, the controller's choice; a
speculative step drafts k tokens (plus first-token siblings with ``SpecConfig.siblings``),
verifies them in one target forward and advances each row by its own count. Drafts,
acceptances and times go to the call's stats (a ``StepRecord`` per forward with ``record_steps``).
Details: docs/internals.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specrl.engine.call import Call
from specrl.engine.rows import Kept, Seq, sample_rows
from specrl.engine.static import StaticSteps
from specrl.models.device import device_mark, marked_seconds
from specrl.rollout_types import EngineStats
from specrl.sampling import STREAM_DRAFT, STREAM_SAMPLE
from specrl.spec.config import SpecConfig
from specrl.spec.controller import SpecController, StepOutcome
from specrl.spec.proposers.base import Draft, Proposer, ProposerBatch
from specrl.spec.siblings import SiblingDraft, resolve_siblings
from specrl.spec.verify import verify

# The controller of an adaptive spec for a call's (speculation, drafter), None when not adaptive.
ControllerFor = Callable[[SpecConfig, Proposer], SpecController | None]


@dataclass
class SpecDrafts:
    """One step's drafts as the controller sees them: the cap it puts on a deterministic
    draft (``capped``) and what the step verified and accepted (``record``)."""

    context: float  # mean tokens cached per row
    control: SpecController | None
    verified: int = 0  # draft positions in the verify forward
    drafted: list[int] = field(default_factory=list)  # [B] drafts verified per row
    accepted: list[int] = field(default_factory=list)  # [B]
    caught_up: int = 0  # feature positions the drafter read first (all rows)

    def capped(self, lengths: torch.Tensor, deterministic: bool) -> torch.Tensor:
        """``lengths`` [B] limited to the controller's cap (deterministic drafts only)."""
        if self.control is None or not deterministic:
            return lengths
        cap = self.control.cap(len(lengths), self.context, lengths.tolist())
        return lengths.clamp(max=cap)

    def record(self, verified: int, lengths: torch.Tensor, accepted: torch.Tensor) -> None:
        self.verified = verified
        self.drafted = lengths.tolist()
        self.accepted = accepted.tolist()


class Decoder:
    """Decode steps over a call's live rows (module docstring); ``controller_for`` gives the
    controller of an adaptive spec (the engine keeps it across calls)."""

    def __init__(self, controller_for: ControllerFor, static: StaticSteps | None = None) -> None:
        self._controller_for = controller_for
        self.static = static  # static (captured) steps where rows fit a bucket; None: never

    def step(self, call: Call, rows: list[Seq], start: float) -> list[int]:
        """One decode step for all live rows; returns indices of rows that finished."""
        if not rows:
            return []
        st = call.stats
        t0, draft0 = time.perf_counter(), st.draft_s
        spec, proposer = call.active.spec, call.active.proposer
        control = self._controller_for(spec, proposer) if proposer is not None else None
        context = sum(s.pos for s in rows) / len(rows)
        if control is not None:
            k = control.choose(len(rows), context)
        else:
            k = spec.k_for_batch(len(rows)) if proposer is not None else 0
        drafts = SpecDrafts(context, control)
        if k == 0:
            finished = self._plain_step(call, rows, start)
        else:
            finished = self._spec_step(call, rows, start, k, drafts)
        elapsed = time.perf_counter() - t0
        draft_s = st.draft_s - draft0
        st.decode_s += elapsed
        st.steps += 1
        st.spec_steps += drafts.verified > 0
        if control is not None:
            control.observe(StepOutcome(len(rows), k, drafts.verified, context, elapsed,
                                        draft_s, drafts.drafted, drafts.accepted,
                                        drafts.caught_up))  # fmt: skip
        if call.record_steps:
            _record_step(call, k, elapsed, draft_s)
        return finished

    def _plain_step(self, call: Call, rows: list[Seq], start: float) -> list[int]:
        if self.static is not None and self.static.fits(len(rows)):
            s, kept = self.static.decode(call, rows)
            _keep(rows, kept, [1] * len(rows))
            return call.emit_sampled(rows, s, start)
        pos = [s.pos for s in rows]
        ids, positions = call.on(torch.tensor([[s.history[-1]] for s in rows]),
                                 torch.tensor(pos)[:, None])  # fmt: skip
        out, kept = call.forward(ids, positions, kv_len=max(pos) + 1)
        _keep(rows, kept, [1] * len(rows))
        s = sample_rows(out.logits[:, 0], call.tensors(rows), _counters(call, rows))
        return call.emit_sampled(rows, s, start)

    def _spec_step(
        self, call: Call, rows: list[Seq], start: float, k: int, drafts: SpecDrafts
    ) -> list[int]:
        """Draft, verify k+1 positions in one target forward, advance each row by its count
        (``drafts`` caps a deterministic draft through its controller and records the step)."""
        t0 = time.perf_counter()
        mark = None if self.static is None else device_mark(call.device)  # drafting's start
        spec, proposer = call.active.spec, call.active.proposer
        t = call.tensors(rows)
        counters = _counters(call, rows)
        batch = ProposerBatch(
            histories=[s.history for s in rows],
            group_keys=[s.group_key for s in rows],
            row_ids=[s.row_id for s in rows],
            temperature=t.temperature,
            top_k=t.top_k,
            top_p=t.top_p,
            seeds=t.seeds,
            counters=counters,
            prompt_lengths=[len(s.comp.prompt_ids) for s in rows],
            hidden=_take_hidden(rows),
            draft_stream=STREAM_SAMPLE if spec.exact == "sample" else STREAM_DRAFT,
            settings=[(s.params.temperature, s.params.top_k, s.params.top_p) for s in rows],
        )
        draft = proposer.propose(batch, k)
        drafts.caught_up = sum(len(h) for h in batch.hidden) if batch.hidden else 0
        room_left = [s.max_total - len(s.history) - 1 for s in rows]
        if self.static is not None and spec.siblings == 0 and self.static.fits(len(rows)):
            lengths, kk = _static_lengths(call, draft, room_left, drafts)
            host_s = time.perf_counter() - t0
            drafted = device_mark(call.device)
            call.stats.draft_s += host_s
            finished = self._static_verify(call, rows, start, batch, draft, lengths, kk, drafts)
            if mark is not None:  # the verify step's copy waited for the drafting too
                _retime_draft(call.stats, host_s, marked_seconds(mark, drafted))
            return finished
        draft = draft.to(call.device)  # host drafts: one copy per step
        (room,) = call.on(torch.tensor(room_left))
        lengths = torch.minimum(draft.lengths, room.clamp(min=0))  # [B]
        lengths = drafts.capped(lengths, draft.probs is None)
        kk = int(lengths.max())
        count = spec.siblings_for_batch(len(rows), kk)
        tree = SiblingDraft.draw(draft, lengths, kk, count, t.seeds, counters)
        t1 = time.perf_counter()
        call.stats.draft_s += t1 - t0
        pos = [s.pos for s in rows]
        last, positions = call.on(
            torch.tensor([[s.history[-1]] for s in rows]),
            torch.tensor(pos)[:, None] + torch.arange(kk + 1)[None, :],
        )
        ids = torch.cat([last, draft.tokens[:, :kk]], 1)  # [B, kk+1]; positions the same
        if tree is not None:  # siblings: leaves under the root, stored after the chain
            ids, positions = tree.extend(ids, positions)
        width = ids.shape[1]
        out, kept = call.forward(
            ids.clamp(min=0),
            positions,
            kv_len=max(pos) + width,
            tree=None if tree is None else tree.mask,
        )
        logits = out.logits.float()  # [B, width, V]
        probs = None if draft.probs is None else draft.probs[:, :kk]
        sampling = (t.temperature, t.top_k, t.top_p, t.seeds, counters)
        v = verify(ids[:, 1 : kk + 1], lengths, probs, logits[:, : kk + 1], *sampling,
                   rule=spec.exact)  # fmt: skip
        if tree is not None:
            v, chosen = resolve_siblings(v, lengths, draft.tokens[:, 0], draft.probs[:, 0],
                                         tree.tokens, tree.valid, logits[:, 0],
                                         logits[:, kk + 1 :], *sampling)  # fmt: skip
            call.stats.sibling_accepted += tree.adopt(
                call.kv.cache, pos, chosen, kept.feats, kept.routes
            )
        call.stats.verify_s += time.perf_counter() - t1
        _count(call.stats, rows, lengths, v.num_accepted)
        drafts.record(kk, lengths, v.num_accepted)
        proposer.observe(batch.row_ids, v.num_emitted)
        _keep(rows, kept, v.num_emitted.tolist())
        return call.emit_verified(rows, v, start)

    def _static_verify(
        self,
        call: Call,
        rows: list[Seq],
        start: float,
        batch: ProposerBatch,
        draft: Draft,
        lengths: torch.Tensor,  # [B] drafts to verify per row (host or device)
        kk: int,  # their most (a bound for device lengths)
        drafts: SpecDrafts,
    ) -> list[int]:
        """``_spec_step``'s verification as one static step (no draft tree)."""
        t1 = time.perf_counter()
        probs = None if draft.probs is None else draft.probs[:, :kk]
        v, lengths, kept = self.static.verify(call, rows, draft.tokens[:, :kk], lengths, probs,
                                              call.active.spec.exact)  # fmt: skip
        call.stats.verify_s += time.perf_counter() - t1
        _count(call.stats, rows, lengths, v.num_accepted)
        drafts.record(kk, lengths, v.num_accepted)
        call.active.proposer.observe(batch.row_ids, v.num_emitted)
        _keep(rows, kept, v.num_emitted.tolist())
        return call.emit_verified(rows, v, start)


def _static_lengths(
    call: Call, draft: Draft, room: list[int], drafts: SpecDrafts
) -> tuple[torch.Tensor, int]:
    """Drafts to verify per row [B] (the draft's, at most each row's ``room``, capped by the
    controller) and their most, kk, without a device-to-host copy: a host draft's are limited
    on the host; a device draft's stay on the device and kk is their host-known bound."""
    room = [max(0, r) for r in room]
    if draft.lengths.device.type == "cpu":
        lengths = drafts.capped(
            torch.minimum(draft.lengths, torch.tensor(room)), draft.probs is None
        )
        return lengths, int(lengths.max())
    (bound,) = call.on(torch.tensor(room))
    lengths = drafts.capped(torch.minimum(draft.lengths, bound), draft.probs is None)
    return lengths, min(draft.k, max(room))


def _retime_draft(stats: EngineStats, host_s: float, device_s: float) -> None:
    """A static step's drafting took ``device_s`` on the device, of which the host saw
    ``host_s`` (it does not wait for a device drafter's step): the rest, which the verify
    step's wait counted, moves from ``verify_s`` to ``draft_s``."""
    moved = max(0.0, device_s - host_s)
    stats.draft_s += moved
    stats.verify_s -= moved


def _record_step(call: Call, k: int, elapsed: float, draft_s: float) -> None:
    """A plain step is one decode record; a speculative one a draft and a verify record."""
    if k == 0:
        call.record("decode", elapsed)
        return
    call.record("draft", draft_s, tokens_per_seq=k)
    call.record("verify", elapsed - draft_s)


def _counters(call: Call, rows: list[Seq]) -> torch.Tensor:  # [B] tokens emitted per row
    return call.on(torch.tensor([s.emitted for s in rows]))[0]


def _keep(rows: list[Seq], kept: Kept, counts: list[int]) -> None:
    """Store what the positions that became history keep (``counts`` per row)."""
    if kept.feats is None and kept.routes is None:
        return
    for b, (seq, n) in enumerate(zip(rows, counts, strict=True)):
        seq.keep(kept.at(b, slice(0, n)))


def _take_hidden(rows: list[Seq]) -> list[torch.Tensor] | None:
    """Per row, features [n, F] of history positions len-1-n .. len-2 (then cleared)."""
    if not rows or not rows[0].hidden:
        return None
    out = [torch.cat(s.hidden) for s in rows]
    for s in rows:
        s.hidden = []
    return out


def _count(st: EngineStats, rows: list[Seq], lengths: torch.Tensor, accepted: torch.Tensor) -> None:
    """Drafted and accepted tokens per row, per draft position and in all (lengths and
    accepted [B]: per position by a comparison over the batch, no Python per token)."""
    lengths, accepted = lengths.cpu(), accepted.cpu()
    for seq, n, a in zip(rows, lengths.tolist(), accepted.tolist(), strict=True):
        seq.comp.drafted += n
        seq.comp.accepted += a
    st.drafted += int(lengths.sum())
    st.accepted += int(accepted.sum())
    k = int(lengths.max()) if len(lengths) else 0
    if k:
        at = torch.arange(k)  # [k] draft positions
        _add(st.per_position_drafted, (lengths[:, None] > at).sum(0).tolist())
        hits = (accepted[:, None] > at).sum(0)  # [k]
        _add(st.per_position_accepted, hits[: int(accepted.max())].tolist())  # up to the last hit


def _add(counts: list[int], more: list[int]) -> None:
    """counts[i] += more[i], growing ``counts`` as needed."""
    counts.extend([0] * (len(more) - len(counts)))
    for i, m in enumerate(more):
        counts[i] += m
