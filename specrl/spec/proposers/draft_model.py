"""Drafting with a (smaller) language model that shares the target's tokenizer.

``DraftModelProposer(model)`` keeps its own KV cache (a slot per live row), feeds each row the
history it has not seen, then samples k tokens from the row's processed distribution with
``draft_stream`` uniforms and returns q. ``bind`` checks vocabulary and context;
``load_weights`` takes new weights. ``self`` is the same class with the target (q == p).
Details: docs/internals.md.
"""

from __future__ import annotations

import torch

from specrl.models.device import model_device, on
from specrl.models.transformer import Transformer
from specrl.models.weights import copy_weights
from specrl.sampling import draw, uniforms
from specrl.spec.proposers import register_proposer
from specrl.spec.proposers.base import Draft, ProposerBatch


class _Row:
    __slots__ = ("slot", "fed", "safe")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.fed: list[int] = []  # tokens whose keys/values sit at positions 0.. of the slot
        self.safe = 0  # leading tokens of ``fed`` known to equal the row's history

    def valid(self, history: list[int]) -> int:
        """Cache positions still valid for ``history`` (histories only grow)."""
        return self.safe + _common_prefix(self.fed[self.safe :], history[self.safe :])


@register_proposer("draft")
class DraftModelProposer:
    """A small causal LM as drafter, batched, with its own KV cache."""

    deterministic = False

    def __init__(self, draft_model: Transformer | None = None) -> None:
        if draft_model is None:
            raise ValueError(
                "the 'draft' drafter needs a draft model: --drafter DIR (make one with `specrl "
                "train-drafter --drafter draft`) or --drafter prefix:N (the target's first N "
                "layers)"
            )
        self.model = draft_model
        self.device = model_device(draft_model)  # drafts where the draft model's weights are
        self.rows: dict[int, _Row] = {}
        self.cache = None
        self.free: list[int] = []

    # ------------------------------------------------------------------ engine hooks

    def check(self, max_len: int, vocab_size: int) -> None:
        """Refuse (ValueError) a drafter the engine cannot use; called when the engine is built."""
        c = self.model.config
        if c.vocab_size != vocab_size:
            raise ValueError(
                f"drafter vocabulary ({c.vocab_size}) differs from the target's ({vocab_size})"
            )
        if c.max_position_embeddings < max_len:
            raise ValueError(
                f"drafter context ({c.max_position_embeddings}) is shorter than needed ({max_len})"
            )

    def bind(self, max_batch: int, max_len: int, vocab_size: int) -> None:
        """Check, then allocate the cache for a generate call."""
        self.check(max_len, vocab_size)
        if self.cache is None or self.cache.slots < max_batch or self.cache.max_len < max_len:
            self.cache = self.model.new_cache(max_batch, max_len)
            self.rows, self.free = {}, list(range(max_batch))[::-1]

    def observe(self, row_ids: list[int], accepted: torch.Tensor) -> None:
        """Nothing to do: the next propose compares what was fed with the history."""

    def finish(self, row_id: int, group_key: int, tokens: list[int]) -> None:
        row = self.rows.pop(row_id, None)
        if row is not None:
            self.free.append(row.slot)

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """New draft weights under the model's own parameter names (what the backend serves
        and fingerprints); the cached keys/values of live rows are recomputed on their next
        propose."""
        copy_weights(self.model, state)
        for row in self.rows.values():
            row.fed, row.safe = [], 0

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(self, batch: ProposerBatch, k: int) -> Draft:
        if self.cache is None:
            raise RuntimeError("DraftModelProposer.bind() must be called before propose()")
        rows = [self._row(rid) for rid in batch.row_ids]
        self._prefill_new(rows, batch.histories)
        logits = self._catch_up(rows, batch.histories)  # [B, V]
        (slots,) = on(self.device, torch.tensor([r.slot for r in rows]))
        tokens, probs = [], []
        steps = batch.counters[:, None] + torch.arange(k, device=self.device)[None, :]  # [B, k]
        u = uniforms(batch.seeds, steps, batch.draft_stream)  # [B, k]
        for i in range(k):
            tok, q = draw(logits, batch.temperature, batch.top_k, batch.top_p, u[:, i])
            tokens.append(tok)
            probs.append(q)
            if i + 1 < k:
                logits = self._step(tok, [len(h) + i for h in batch.histories], slots)
        for row, hist, drafted in zip(
            rows, batch.histories, torch.stack(tokens, 1).tolist(), strict=True
        ):
            row.fed, row.safe = hist + drafted[: k - 1], len(hist)
        b = len(rows)
        return Draft(
            tokens=torch.stack(tokens, 1)
            if k
            else torch.zeros(b, 0, dtype=torch.int64, device=self.device),
            lengths=torch.full((b,), k, dtype=torch.int64, device=self.device),
            probs=torch.stack(probs, 1) if k else None,
        )

    def _row(self, row_id: int) -> _Row:
        row = self.rows.get(row_id)
        if row is None:
            if not self.free:
                raise RuntimeError("draft model cache is full (more live rows than bound)")
            row = self.rows[row_id] = _Row(self.free.pop())
        return row

    def _prefill_new(self, rows: list[_Row], histories: list[list[int]]) -> None:
        """Prefill the prompt (all but the last history token) of rows never seen."""
        new = [
            (r, h[:-1]) for r, h in zip(rows, histories, strict=True) if not r.fed and len(h) > 1
        ]
        if not new:
            return
        width = max(len(t) for _, t in new)
        ids = torch.zeros(len(new), width, dtype=torch.int64)
        for i, (_, t) in enumerate(new):
            ids[i, : len(t)] = torch.tensor(t)
        slots = torch.tensor([r.slot for r, _ in new])
        positions = torch.arange(width).expand(len(new), width)
        ids, positions, slots = on(self.device, ids, positions, slots)
        self.model.hidden_states(ids, positions, self.cache, slots=slots, prefill=True)
        for r, t in new:
            r.fed, r.safe = list(t), len(t)

    def _catch_up(self, rows: list[_Row], histories: list[list[int]]) -> torch.Tensor:
        """Feed each row's unseen history tokens; return logits [B, V] after its last token."""
        starts = [r.valid(h) for r, h in zip(rows, histories, strict=True)]
        starts = [min(s, len(h) - 1) for s, h in zip(starts, histories, strict=True)]
        width = max(len(h) - s for s, h in zip(starts, histories, strict=True))
        b = len(rows)
        ids = torch.zeros(b, width, dtype=torch.int64)
        positions = torch.zeros(b, width, dtype=torch.int64)
        last = torch.zeros(b, 1, dtype=torch.int64)
        for i, (s, h) in enumerate(zip(starts, histories, strict=True)):
            n = len(h) - s
            ids[i, :n] = torch.tensor(h[s:])
            positions[i] = torch.arange(s, s + width)
            last[i, 0] = n - 1
        slots = torch.tensor([r.slot for r in rows])
        kv_len = max(s + width for s in starts)
        ids, positions, last, slots = on(self.device, ids, positions, last, slots)
        out = self.model(ids, positions, self.cache, kv_len=kv_len, logits_at=last, slots=slots)
        return out.logits[:, 0].float()

    def _step(
        self, tokens: torch.Tensor, positions: list[int], slots: torch.Tensor
    ) -> torch.Tensor:
        (pos,) = on(self.device, torch.tensor(positions)[:, None])
        out = self.model(tokens[:, None], pos, self.cache, kv_len=max(positions) + 1, slots=slots)
        return out.logits[:, 0].float()


@register_proposer("self")
class SelfProposer(DraftModelProposer):
    """The target drafting for itself (a test device: q == p, so every draft is accepted)."""

    def __init__(self, target_model: Transformer | None = None) -> None:
        if target_model is None:
            raise ValueError("the 'self' drafter needs the target model")
        super().__init__(target_model)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
