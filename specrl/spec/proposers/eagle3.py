"""EAGLE-3 drafting: a ``DraftHead`` reading the target features the engine hands over.

``Eagle3Proposer(target_model, drafter_path=None, drafter=None)`` drafts with a loaded, given or
untrained head; its ``hidden_layers`` tell the engine which target layers to capture. Each
``propose`` feeds the new features through the head (its own KV cache), drafts k tokens from its
processed distribution with ``draft_stream`` uniforms and returns that q (scattered into the
target vocabulary for a reduced draft vocabulary). ``check`` refuses a head of another target.
Details: docs/internals.md.
"""

from __future__ import annotations

import torch

from specrl.models.device import model_device, on
from specrl.models.heads import DraftHead, cast_floats, check_compatible, head_config, load_head
from specrl.models.transformer import Transformer
from specrl.sampling import draw, uniforms
from specrl.spec.proposers import register_proposer
from specrl.spec.proposers.base import Draft, ProposerBatch


@register_proposer("eagle3")
class Eagle3Proposer:
    """A learned head over the target's hidden states, batched, with its own KV cache."""

    deterministic = False
    kind = "eagle3"

    def __init__(
        self,
        target_model: Transformer | None = None,
        drafter_path: str | None = None,
        drafter: DraftHead | None = None,
    ) -> None:
        if target_model is None:
            raise ValueError(f"the {self.kind!r} drafter needs the target model")
        if drafter is None and drafter_path is not None:
            drafter = load_head(drafter_path, target_model, kind=self.kind)
        if drafter is None:
            drafter = DraftHead(target_model, self.kind).eval()
        check_compatible(head_config(drafter), target_model.config)
        if drafter.kind != self.kind:
            raise ValueError(f"a {drafter.kind!r} head cannot serve the {self.kind!r} drafter")
        drafter._target = (target_model,)  # always share the live target's embedding/LM head
        self.device = model_device(target_model)
        self.head = drafter.to(self.device).requires_grad_(False)
        self.hidden_layers = drafter.feature_layers
        self.cache = None
        self.slots: dict[int, int] = {}
        self.free: list[int] = []

    # ------------------------------------------------------------------ engine hooks

    def check(self, max_len: int, vocab_size: int) -> None:
        """Refuse (ValueError) a head the engine cannot use; called when the engine is built."""
        if self.head.target_config.vocab_size != vocab_size:
            raise ValueError(
                f"drafter vocabulary ({self.head.target_config.vocab_size}) differs from the "
                f"target's ({vocab_size})"
            )

    def bind(self, max_batch: int, max_len: int, vocab_size: int) -> None:
        """Check, then allocate the head cache (max_batch slots + 1 scratch) for a generate."""
        self.check(max_len, vocab_size)
        c = self.cache
        if c is None or c.slots < max_batch + 1 or c.max_len < max_len:
            self.cache = self.head.new_cache(max_batch + 1, max_len)
        self.slots, self.free = {}, list(range(self.cache.slots - 1))[::-1]

    def observe(self, row_ids: list[int], accepted: torch.Tensor) -> None:
        """Nothing to do: the next propose brings the true features of the accepted tokens."""

    def finish(self, row_id: int, group_key: int, tokens: list[int]) -> None:
        slot = self.slots.pop(row_id, None)
        if slot is not None:
            self.free.append(slot)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load a head state dict; one that carries another draft vocabulary (``d2t``: a head
        trained from scratch during RL picks it after its first rollouts) switches to it."""
        vocab = state.get("d2t")
        current = self.head.d2t
        if vocab is not None and (current is None or not torch.equal(current, vocab)):
            self.head.set_draft_vocab(vocab.to(self.device, copy=True))
        self.head.load_state_dict(cast_floats(state, self.head.dtype))

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(self, batch: ProposerBatch, k: int) -> Draft:
        if self.cache is None:
            raise RuntimeError(f"{type(self).__name__}.bind() must be called before propose()")
        if batch.hidden is None:
            raise RuntimeError("the engine handed no target features (hidden_layers ignored?)")
        b = len(batch)
        if k == 0:
            return Draft.empty(b, 0)
        slot_ids = [self._slot(r) for r in batch.row_ids]
        ends = [len(h) - 1 for h in batch.histories]  # next head position per row
        slots, first = on(self.device, torch.tensor(slot_ids), torch.tensor(ends)[:, None])
        g, logits = self._catch_up(batch, slot_ids, slots, ends)
        tokens, probs = [], []
        steps = batch.counters[:, None] + torch.arange(k, device=self.device)[None, :]  # [B, k]
        u = uniforms(batch.seeds, steps, batch.draft_stream)  # [B, k]
        settings = (batch.temperature, batch.top_k, batch.top_p)  # first: [B, 1] head position
        for i in range(k):
            idx, q = draw(logits, *settings, u[:, i])  # [B], [B, Vd]
            tok = self.head.to_target(idx)  # [B] target ids
            tokens.append(tok)
            probs.append(q)
            if i + 1 < k:
                kv_len = max(ends) + i + 1
                g = self.head.step(g, tok[:, None], first + i, self.cache, slots[:, None], slots,
                                   kv_len)  # fmt: skip
                logits = self.head.logits(g[:, 0]).float()
        q = torch.stack(probs, 1)  # [B, k, Vd]
        return Draft(
            tokens=torch.stack(tokens, 1),
            lengths=torch.full((b,), k, dtype=torch.int64, device=self.device),
            probs=self.head.to_full(q.flatten(0, 1)).view(b, k, -1),  # [B, k, V]
        )

    def _slot(self, row_id: int) -> int:
        slot = self.slots.get(row_id)
        if slot is None:
            if not self.free:
                raise RuntimeError("drafter cache is full (more live rows than bound)")
            slot = self.slots[row_id] = self.free.pop()
        return slot

    def _catch_up(
        self, batch: ProposerBatch, slot_ids: list[int], slots: torch.Tensor, ends: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each row's new features; return g [B, 1, H] and logits [B, V] at its last one."""
        feats = batch.hidden
        counts = [int(f.shape[0]) for f in feats]
        if min(counts) < 1:
            raise RuntimeError("a row brought no new target features since its last propose")
        b, width = len(feats), max(counts)
        scratch = self.cache.slots - 1
        f = feats[0].new_zeros(b, width, feats[0].shape[-1])  # where the features are
        ids = torch.zeros(b, width, dtype=torch.int64)
        positions = torch.zeros(b, width, dtype=torch.int64)  # padding: position 0, scratch slot
        rows = torch.full((b, width), scratch, dtype=torch.int64)
        for i, (m, end, hist) in enumerate(zip(counts, ends, batch.histories, strict=True)):
            start = end - m  # features cover positions start .. end-1
            f[i, :m] = feats[i]
            ids[i, :m] = torch.tensor(hist[start + 1 : end + 1])
            positions[i, :m] = torch.arange(start, end)
            rows[i, :m] = slot_ids[i]
        ids, positions, rows, last = on(self.device, ids, positions, rows,
                                        torch.tensor(counts)[:, None, None] - 1)  # fmt: skip
        h = self.head.features_in(f.to(self.head.dtype))
        g = self.head.step(h, ids, positions, self.cache, rows, slots, max(ends))
        g = g.gather(1, last.expand(b, 1, g.shape[-1]))  # [B, 1, H]
        return g, self.head.logits(g[:, 0]).float()
