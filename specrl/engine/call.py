"""One ``generate`` call's live rows on the target model: what every part of a call shares.

Contract: live rows occupy cache slots 0..B-1 in list order (row == slot). ``forward`` runs the
target over the KV cache, also returning the features the drafter reads; ``prefill`` prefills
each distinct prompt once and copies its cache to the other slots given; ``tensors`` are the
rows' sampling tensors (rebuilt after ``rows_changed``); ``emit`` appends a step's tokens
[B, T] and logprobs to each row's record (one host copy per field and step, one ``extend`` per
row: no Python per token), cut at a stop token or the row's limit and tagged with ``version``,
hands a finished row's record to its completion as tensors and returns the finished rows'
indices; ``retire`` removes those, moving the last live rows into the
holes, and first announces (``GroupsDone``: ``Engine.generate``'s ``on_done``) each request whose
rows have all finished; ``record`` appends the last forward's shape and time to
``stats.step_records`` (callers check ``record_steps``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import torch

from specrl.engine.kv import KVSpace
from specrl.engine.rows import ActiveSpec, Kept, RowTensors, Sampled, Seq
from specrl.models.device import on
from specrl.models.moe import Routing
from specrl.models.transformer import ForwardOutput, Transformer
from specrl.rollout_types import Completion, EngineStats, StepRecord
from specrl.spec.verify import Verified


class GroupsDone:
    """Announces a request once all of its completions have finished (``Engine.generate``'s
    ``on_done``)."""

    def __init__(
        self, valid: list[Completion], on_done: Callable[[int, list[Completion]], None] | None
    ) -> None:
        self.on_done = on_done
        self.groups: dict[int, list[Completion]] = {}  # request -> its completions
        for c in valid:
            self.groups.setdefault(c.request_index, []).append(c)
        self.left = Counter(c.request_index for c in valid)  # request -> unfinished completions

    def finished(self, rows: list[Seq], finished: list[int]) -> None:
        """Count the rows at ``finished`` (indices into ``rows``) as done."""
        if self.on_done is not None:
            for i in finished:
                request = rows[i].comp.request_index
                self.left[request] -= 1
                if self.left[request] == 0:
                    self.on_done(request, self.groups[request])


class Call:
    """The running call's services over its live rows (module docstring)."""

    def __init__(
        self,
        model: Transformer,
        kv: KVSpace,
        active: ActiveSpec,
        stats: EngineStats,
        version: int,
        record_steps: bool,
        groups_done: GroupsDone | None = None,
    ) -> None:
        self.model = model
        self.groups_done = groups_done  # announces requests whose rows have all finished
        self.kv = kv
        self.device = kv.device
        self.active = active
        self.stats = stats  # the call's counters (``Engine.stats``)
        self.version = version  # the weights version emitted tokens are tagged with
        self.record_steps = record_steps  # time each forward into stats.step_records
        self._tensors: RowTensors | None = None
        self._shape: tuple[int, int, float] = (0, 0, 0.0)  # last forward: rows, T, mean context

    def on(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Host-built tensors on the engine's device (the same tensors on the CPU)."""
        return on(self.device, *tensors)

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, **kw
    ) -> tuple[ForwardOutput, Kept]:
        """Target forward on the engine cache; also what follows its positions into history
        (``Kept``: the drafter's features [B, T, F], an MoE target's experts)."""
        capture = self.active.capture
        routing = Routing.experts_of(self.model.config)
        out = self.model(ids, positions, self.kv.cache, capture=capture, routing=routing, **kw)
        if self.record_steps:  # positions [B, T]: the first query position = tokens cached
            self._shape = (ids.shape[0], ids.shape[1], float(positions[:, 0].float().mean()))
        return out, kept_of(out.captured, routing, ids.shape)

    def prefill(
        self, prompts: list[list[int]], slots: list[int]
    ) -> tuple[torch.Tensor, list[Kept]]:
        """Prefill each distinct prompt once, into the first of its slots, and copy its cache to
        the others: per entry the last-position logits [N, V] (float32) and what its prompt
        positions keep (``Kept`` [len, ...]). Bit for bit what prefilling every entry would give
        (the same forward's rows, copied)."""
        first: dict[tuple[int, ...], int] = {}  # prompt -> index of its forward row
        heads: list[int] = []  # index into prompts of each distinct prompt
        for i, p in enumerate(prompts):
            if first.setdefault(tuple(p), len(heads)) == len(heads):
                heads.append(i)
        logits, kept = self._prefill_forward([prompts[i] for i in heads], [slots[i] for i in heads])
        row = [first[tuple(p)] for p in prompts]
        for i, (p, r) in enumerate(zip(prompts, row, strict=True)):
            if heads[r] != i:
                self.kv.cache.copy_slot(slots[heads[r]], slots[i], len(p))
        return logits[row], [
            kept.at(r, slice(0, len(p))) for p, r in zip(prompts, row, strict=True)
        ]

    def _prefill_forward(
        self, prompts: list[list[int]], slots: list[int]
    ) -> tuple[torch.Tensor, Kept]:
        """One prefill forward of the prompts into ``slots``: last-position logits [G, V]
        (float32) and what the positions keep (``Kept`` [G, width, ...])."""
        lens = [len(p) for p in prompts]
        width = max(lens)
        ids = torch.zeros(len(prompts), width, dtype=torch.int64)
        for g, p in enumerate(prompts):
            ids[g, : lens[g]] = torch.tensor(p)
        positions = torch.arange(width).expand(len(prompts), width)
        last = torch.tensor(lens)[:, None] - 1
        ids, positions, last, at = self.on(ids, positions, last, torch.tensor(slots))
        out, kept = self.forward(ids, positions, logits_at=last, slots=at, prefill=True)
        return out.logits[:, 0].float(), kept

    def tensors(self, rows: list[Seq]) -> RowTensors:
        """The live rows' sampling tensors [B] (built once per batch composition)."""
        if self._tensors is None:
            self._tensors = RowTensors.of(rows, self.device)
        return self._tensors

    def rows_changed(self) -> None:
        """The live rows or their seeds changed: ``tensors`` are built again."""
        self._tensors = None

    def shaped(self, rows: int, tokens: int, context: float) -> None:
        """Note the shape of a forward run elsewhere (a static step) for ``record``."""
        self._shape = (rows, tokens, context)

    def record(self, kind: str, seconds: float, tokens_per_seq: int | None = None) -> None:
        """Append a record of the last target forward's shape and its time."""
        rows, tokens, context = self._shape
        rec = StepRecord(kind, rows, tokens_per_seq or tokens, context, seconds)
        self.stats.step_records.append(rec)

    def emit_verified(
        self, rows: list[Seq], v: Verified, start: float, first: bool = False
    ) -> list[int]:
        """``emit`` the tokens ``verify`` emitted per row (``first``: no decode step counted)."""
        return self.emit(rows, v.tokens, v.logprobs_processed, v.logprobs_raw, v.num_emitted,
                         start, first)  # fmt: skip

    def emit_sampled(
        self, rows: list[Seq], s: Sampled, start: float, first: bool = False
    ) -> list[int]:
        """``emit`` one sampled token per row (``s``: [B] each)."""
        return self.emit(rows, s.tokens[:, None], s.logprobs[:, None], s.raw_logprobs[:, None],
                         None, start, first)  # fmt: skip

    def emit(
        self,
        rows: list[Seq],
        tokens: torch.Tensor,  # [B, T] on the device
        logprobs: torch.Tensor,  # [B, T] processed
        raw: torch.Tensor,  # [B, T] temperature 1, untruncated
        emitted: torch.Tensor | None,  # [B] tokens each row emitted (None: all T)
        start: float,
        first: bool = False,
    ) -> list[int]:
        """Append each row's emitted tokens, cut after a stop token or at the row's length
        limit (``first``: a row's first tokens, no decode step counted); finish the rows that
        stopped or reached their limit (their completions get their tokens as tensors); return
        their indices. One host copy per field per step and one ``extend`` per row and field:
        no Python per token."""
        toks, lps, raws = (x.reshape(len(rows), -1).tolist() for x in (tokens, logprobs, raw))
        width = tokens.shape[1] if tokens.dim() == 2 else 1
        counts = emitted.tolist() if emitted is not None else [width] * len(rows)
        now = time.perf_counter() - start
        finished, stopped, total, v = [], [], 0, self.version
        for i, (seq, row, n) in enumerate(zip(rows, toks, counts, strict=True)):
            lp, rw, stop = lps[i], raws[i], False
            if n < width or len(seq.history) + n >= seq.max_total or not seq.stop.isdisjoint(row):
                n, stop = _cut(seq, row, n)  # else all kept, the row goes on (the common case)
                row, lp, rw = row[:n], lp[:n], rw[:n]
            if first:  # a new row's (or a restarted row's) first tokens
                seq.comp.first_token_s = now
            else:  # acceptance counts decode/verify steps; the prefill's token is apart
                seq.comp.verify_steps += 1
            seq.history.extend(row)  # the row's record: one extend per field, inline (hot loop)
            seq.logprobs.extend(lp)
            seq.raw.extend(rw)
            seq.versions.extend([v] * n)
            seq.emitted += n
            total += n
            if stop or len(seq.history) >= seq.max_total:
                finished.append(i)
                stopped.append(stop)
        self._count_emitted(len(rows), total, first)
        for i, stop in zip(finished, stopped, strict=True):
            self._finish(rows[i], stop, now)
        return finished

    def _count_emitted(self, rows: int, tokens: int, first: bool) -> None:
        st = self.stats
        st.tokens += tokens
        if not first:
            st.row_steps += rows
            st.emitted_per_row_step += tokens

    def _finish(self, seq: Seq, stopped: bool, now: float) -> None:
        """A finished row's completion takes its tokens (tensors) and its end."""
        c = seq.comp
        c.set_tokens(*seq.tensors())
        c.routing = seq.routing()
        c.finish_reason = "stop" if stopped else "length"
        c.latency_s = now
        c.policy_version = self.version
        if self.active.proposer is not None:
            self.active.proposer.finish(seq.row_id, seq.group_key, seq.history[len(c.prompt_ids) :])

    def retire(self, rows: list[Seq], finished: list[int]) -> None:
        """Remove finished rows, moving the last live rows into the holes (announcing first,
        through ``groups_done``, every request whose rows have now all finished: at a stop in
        the first token, in a decode step or in a rewrite after an in-flight update alike)."""
        if not finished:
            return
        if self.groups_done is not None:
            self.groups_done.finished(rows, finished)
        for i in sorted(finished, reverse=True):
            last = len(rows) - 1
            if i != last:
                self.kv.cache.move(last, i, rows[last].pos)
                rows[i] = rows[last]
            rows.pop()
        self.rows_changed()


def kept_of(captured: list[torch.Tensor], routing: Routing | None, shape: torch.Size) -> Kept:
    """A forward's ``Kept``: its captured layers concatenated [B, T, F] and the experts its
    ``routing`` recorded as [B, T, moe_layers, top_k] (``shape``: its ids' [B, T])."""
    feats = torch.cat(captured, dim=-1) if captured else None
    if routing is None or not routing.recorded:
        return Kept(feats)
    experts = routing.experts()  # [B * T, moe_layers, top_k]
    return Kept(feats, experts.reshape(*shape, *experts.shape[1:]))


def _cut(seq: Seq, tokens: list[int], n: int) -> tuple[int, bool]:
    """How many of a row's ``n`` emitted ``tokens`` it keeps (up to and including the first
    stop token, at most its room to the length limit) and whether a stop token ended it (set
    operations per row; the scan for the stop's position runs once in a row's life)."""
    kept = tokens[: min(n, seq.max_total - len(seq.history))]
    if seq.stop.isdisjoint(kept):
        return len(kept), False
    return next(j for j, t in enumerate(kept) if t in seq.stop) + 1, True
