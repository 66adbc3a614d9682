"""One ``generate`` call's live rows on the target model: what every part of a call shares.

Contract: live rows occupy cache slots 0..B-1 in list order (row == slot). ``forward`` runs the
target over the KV cache, also returning the features the drafter reads; ``prefill`` prefills
each distinct prompt once and copies its cache to the other slots given; ``tensors`` are the
rows' sampling tensors (rebuilt after ``rows_changed``); ``emit`` appends a step's tokens to
rows' completions, cut at a stop token or the row's limit and tagged with ``version``, and
returns the finished rows' indices; ``retire`` removes those, moving the last live rows into the
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
from specrl.engine.rows import ActiveSpec, RowTensors, Sampled, Seq
from specrl.models.device import on
from specrl.models.transformer import Transformer
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

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, **kw):
        """Target forward on the engine cache; also the drafter's features [B, T, F] if any."""
        capture = self.active.capture
        out = self.model(ids, positions, self.kv.cache, capture=capture, **kw)
        if self.record_steps:  # positions [B, T]: the first query position = tokens cached
            self._shape = (ids.shape[0], ids.shape[1], float(positions[:, 0].float().mean()))
        feats = torch.cat(out.captured, dim=-1) if capture else None
        return out, feats

    def prefill(
        self, prompts: list[list[int]], slots: list[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Prefill each distinct prompt once, into the first of its slots, and copy its cache to
        the others: per entry the last-position logits [N, V] (float32) and the drafter's prompt
        features [len, F] (None without a learned drafter). Bit for bit what prefilling every
        entry would give (the same forward's rows, copied)."""
        first: dict[tuple[int, ...], int] = {}  # prompt -> index of its forward row
        heads: list[int] = []  # index into prompts of each distinct prompt
        for i, p in enumerate(prompts):
            if first.setdefault(tuple(p), len(heads)) == len(heads):
                heads.append(i)
        logits, feats = self._prefill_forward(
            [prompts[i] for i in heads], [slots[i] for i in heads]
        )
        row = [first[tuple(p)] for p in prompts]
        for i, (p, r) in enumerate(zip(prompts, row, strict=True)):
            if heads[r] != i:
                self.kv.cache.copy_slot(slots[heads[r]], slots[i], len(p))
        if feats is not None:
            feats = [feats[r, : len(p)] for p, r in zip(prompts, row, strict=True)]
        return logits[row], feats

    def _prefill_forward(
        self, prompts: list[list[int]], slots: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One prefill forward of the prompts into ``slots``: last-position logits [G, V]
        (float32) and the drafter's features [G, width, F] (or None)."""
        lens = [len(p) for p in prompts]
        width = max(lens)
        ids = torch.zeros(len(prompts), width, dtype=torch.int64)
        for g, p in enumerate(prompts):
            ids[g, : lens[g]] = torch.tensor(p)
        positions = torch.arange(width).expand(len(prompts), width)
        last = torch.tensor(lens)[:, None] - 1
        ids, positions, last, at = self.on(ids, positions, last, torch.tensor(slots))
        out, feats = self.forward(ids, positions, logits_at=last, slots=at, prefill=True)
        return out.logits[:, 0].float(), feats

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
        emitted = [
            row[:n] for row, n in zip(v.tokens.tolist(), v.num_emitted.tolist(), strict=True)
        ]
        s = Sampled(v.tokens, v.logprobs_processed, v.logprobs_raw)
        return self.emit(rows, emitted, s, start, first=first)

    def emit(
        self,
        rows: list[Seq],
        tokens: list[list[int]],
        s: Sampled,
        start: float,
        first: bool = False,
    ) -> list[int]:
        """Append emitted tokens (cut at stop/length); return indices of finished rows."""
        lp, raw = (
            s.logprobs.reshape(len(rows), -1).tolist(),
            s.raw_logprobs.reshape(len(rows), -1).tolist(),
        )
        now = time.perf_counter() - start
        finished = []
        for i, (seq, toks) in enumerate(zip(rows, tokens, strict=True)):
            c = seq.comp
            if not first:  # acceptance counts decode/verify steps; the prefill's token is apart
                c.verify_steps += 1
                self.stats.row_steps += 1
            for j, tok in enumerate(toks):
                seq.history.append(tok)
                c.token_ids.append(tok)
                c.logprobs.append(lp[i][j])
                c.raw_logprobs.append(raw[i][j])
                c.token_versions.append(self.version)
                self.stats.tokens += 1
                self.stats.emitted_per_row_step += not first
                if first and j == 0:
                    c.first_token_s = now
                if tok in seq.stop:
                    c.finish_reason = "stop"
                    break
                if len(seq.history) >= seq.max_total:
                    c.finish_reason = "length"
                    break
            else:
                continue
            c.latency_s = now
            c.policy_version = self.version
            finished.append(i)
            proposer = self.active.proposer
            if proposer is not None:
                proposer.finish(seq.row_id, seq.group_key, c.token_ids)
        return finished

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
