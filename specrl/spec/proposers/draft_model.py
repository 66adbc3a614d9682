"""Drafting with a (smaller) language model that shares the target's tokenizer.

``DraftModelProposer(model)`` keeps its own KV cache (a slot per live row), feeds each row the
history it has not seen, then samples k tokens from the row's processed distribution with
``draft_stream`` uniforms and returns q. ``bind`` checks vocabulary and context;
``load_weights`` takes new weights. ``self`` is the same class with the target (q == p).
The drafted tokens are read back at the next propose (what the cache holds), not while the
device still drafts. With ``use_static`` (an engine with static steps) row b's cache sits in
slot b and the k draws run as one static step (``static_draft``); prefill and catch-up
(variable width) stay uncaptured. Details: docs/internals.md.
"""

from __future__ import annotations

from functools import partial

import torch

from specrl.models.cache import KVCache
from specrl.models.device import model_device, on
from specrl.models.graphs import StepGraphs
from specrl.models.transformer import STATIC, Transformer
from specrl.models.weights import copy_weights
from specrl.spec.proposers import register_proposer, static_draft
from specrl.spec.proposers.base import Draft, Proposer, ProposerBatch, module_tensors
from specrl.spec.proposers.static_draft import Drafted, DraftKey, Inputs


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
class DraftModelProposer(Proposer):
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
        self.static: static_draft.StaticDrafts | None = None  # ``use_static``
        self._unread: tuple[list[_Row], torch.Tensor] | None = None  # drafts fed, not yet read

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
            static_draft.free_cache(self)
            self.cache = self.model.new_cache(max_batch, max_len)
            self.rows, self.free, self._unread = {}, list(range(max_batch))[::-1], None

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
        self._unread = None
        for row in self.rows.values():
            row.fed, row.safe = [], 0

    def tensors(self) -> tuple[dict[str, torch.Tensor], torch.dtype]:
        """The draft model's parameters (our names, what ``load_weights`` takes) and dtype."""
        return module_tensors(self.model, dict(self.model.named_parameters()))

    def use_static(self, graphs: StepGraphs, sizes: tuple[int, ...]) -> None:
        """Draft k tokens as one static step over ``graphs`` (batch buckets ``sizes``)."""
        self.static = static_draft.StaticDrafts(graphs, sizes)

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(self, batch: ProposerBatch, k: int) -> Draft:
        if self.cache is None:
            raise RuntimeError("DraftModelProposer.bind() must be called before propose()")
        self._settle()
        b = len(batch)
        width = None if self.static is None or k == 0 else self.static.width(b)
        if width is not None:
            self._place(batch.row_ids)
        rows = [self._row(rid) for rid in batch.row_ids]
        self._prefill_new(rows, batch.histories)
        h = self._catch_up(rows, batch.histories, static=width is not None)  # [B, 1, H]
        if k == 0:
            tokens, q = torch.zeros(b, 0, dtype=torch.int64, device=self.device), None
        elif width is not None:
            tokens, q = self._draft_static(batch, h, k, width)
        else:
            tokens, q = self._draft(batch, rows, h, k)
        for row, hist in zip(rows, batch.histories, strict=True):
            row.fed, row.safe = list(hist), len(hist)
        self._unread = (rows, tokens[:b, : k - 1])  # fed too: read at the next propose
        lengths = torch.full((b,), k, dtype=torch.int64, device=self.device)
        return Draft(tokens=tokens[:b], lengths=lengths, probs=None if q is None else q[:b])

    def _draft(
        self, batch: ProposerBatch, rows: list[_Row], h: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Uncaptured drafting: tokens [B, k] and q [B, k, V], each row in its own slot."""
        (slots,) = on(self.device, torch.tensor([r.slot for r in rows]))
        lengths = [len(hist) for hist in batch.histories]

        def advance(i: int, idx: torch.Tensor) -> torch.Tensor:
            return self._step(idx, [n + i for n in lengths], slots)

        logits = self.model.lm_head(h)[:, 0].float()
        return static_draft.chain(logits, k, *static_draft.batch_sampling(batch, k), advance)

    def _draft_static(
        self, batch: ProposerBatch, h: torch.Tensor, k: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k draws as one static step over ``width`` rows (row b in slot b): tokens [W, k]
        and q [W, k, V]."""
        bases = [len(hist) for hist in batch.histories]
        x = static_draft.step_inputs(batch, h, bases, k, width, self.cache.max_len - 1)
        step = partial(model_draft_step, self.model, self.cache)
        reads = (self.cache.k.data_ptr(), self.cache.max_len)
        return self.static.run(step, batch, k, x, self.model.config.vocab_size, reads)

    def _settle(self) -> None:
        """Add the last propose's drafted tokens to what its rows were fed (read here, a step
        later, when the device has long made them: no wait on the drafting itself)."""
        if self._unread is None:
            return
        rows, tokens = self._unread
        self._unread = None
        if tokens.shape[1] == 0:
            return
        if self.static is not None:
            self.static.host_reads += 1
        for row, drafted in zip(rows, tokens.tolist(), strict=True):
            row.fed += drafted

    def _place(self, row_ids: list[int]) -> None:
        """Put row ``row_ids[b]`` in slot b (moving cached rows), ready for a static step."""
        slot_of = {rid: row.slot for rid, row in self.rows.items()}
        slot_of, self.free = static_draft.bind_rows(self.cache, slot_of, row_ids,
                                                    self.cache.slots)  # fmt: skip
        for rid, slot in slot_of.items():
            self.rows.setdefault(rid, _Row(slot)).slot = slot

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

    def _catch_up(
        self, rows: list[_Row], histories: list[list[int]], static: bool = False
    ) -> torch.Tensor:
        """Feed each row's unseen history tokens; return the hidden state [B, 1, H] after its
        last token. ``static``: row b in slot b over the whole cache (no host read), padding
        tokens at the cache's last position."""
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
            if static:
                positions[i, n:] = self.cache.max_len - 1
            last[i, 0] = n - 1
        slots = torch.tensor([r.slot for r in rows])
        kv_len = STATIC if static else max(s + width for s in starts)
        ids, positions, last, slots = on(self.device, ids, positions, last, slots)
        h, _ = self.model.hidden_states(ids, positions, self.cache, kv_len,
                                        slots=None if static else slots)  # fmt: skip
        return h.gather(1, last[:, :, None].expand(b, 1, h.shape[-1]))

    def _step(
        self, tokens: torch.Tensor, positions: list[int], slots: torch.Tensor
    ) -> torch.Tensor:
        (pos,) = on(self.device, torch.tensor(positions)[:, None])
        out = self.model(tokens[:, None], pos, self.cache, kv_len=max(positions) + 1, slots=slots)
        return out.logits[:, 0].float()


def model_draft_step(model: Transformer, cache: KVCache, key: DraftKey, x: Inputs) -> Drafted:
    """The static drafting step: ``key.k`` draws over W rows (``x``: ``step_inputs``, start is
    h [W, 1, H]), row b's cache in slot b; tokens [W, k] and q [W, k, V]. Reads no device data
    on the host (capturable)."""

    def advance(i: int, idx: torch.Tensor) -> torch.Tensor:
        out = model(idx[:, None], x["positions"][:, i : i + 1], cache, kv_len=STATIC)
        return out.logits[:, 0].float()

    sampling, u = static_draft.unpack_sampling(x, key)
    logits = model.lm_head(x["start"])[:, 0].float()
    return static_draft.chain(logits, key.k, sampling, u, advance, key.hints)


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
