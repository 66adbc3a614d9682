"""EAGLE-3 drafting: a ``DraftHead`` reading the target features the engine hands over.

``Eagle3Proposer(target_model, drafter_path=None, drafter=None)`` drafts with a loaded, given or
untrained head; its ``hidden_layers`` tell the engine which target layers to capture. Each
``propose`` feeds the new features through the head (its own KV cache), drafts k tokens from its
processed distribution with ``draft_stream`` uniforms and returns that q (scattered into the
target vocabulary for a reduced draft vocabulary). ``check`` refuses a head of another target.
With ``use_static`` (an engine with static steps) row b's head cache sits in slot b and the k
draws run as one static step (``static_draft``); the catch-up (variable width) stays uncaptured.
Details: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from specrl.models.cache import KVCache
from specrl.models.device import model_device, on
from specrl.models.graphs import StepGraphs
from specrl.models.head_kinds import load_head, new_head
from specrl.models.heads import DraftHead, cast_floats, check_compatible, head_config
from specrl.models.transformer import STATIC, Transformer
from specrl.sampling import SamplingHints
from specrl.spec.proposers import register_proposer, static_draft
from specrl.spec.proposers.base import Draft, Proposer, ProposerBatch, module_tensors
from specrl.spec.proposers.static_draft import Drafted, DraftKey, Inputs


@register_proposer("eagle3")
class Eagle3Proposer(Proposer):
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
            drafter = new_head(target_model, self.kind).eval()
        check_compatible(head_config(drafter), target_model.config)
        if drafter.kind != self.kind:
            raise ValueError(f"a {drafter.kind!r} head cannot serve the {self.kind!r} drafter")
        drafter.use_target(target_model)  # always share the live target's embedding/LM head
        self.device = model_device(target_model)
        self.head = drafter.to(self.device).requires_grad_(False)
        self.hidden_layers = drafter.feature_layers
        self.cache = None
        self.slots: dict[int, int] = {}
        self.free: list[int] = []
        self.static: static_draft.StaticDrafts | None = None  # ``use_static``

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
        if self.cache is None or self.cache.slots <= max_batch or self.cache.max_len < max_len:
            static_draft.free_cache(self)
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

    def tensors(self) -> tuple[dict[str, torch.Tensor], torch.dtype]:
        """The head's state dict (the names ``load_weights`` takes) and its dtype."""
        return module_tensors(self.head, dict(self.head.state_dict()))

    def use_static(self, graphs: StepGraphs, sizes: tuple[int, ...]) -> None:
        """Draft k tokens as one static step over ``graphs`` (batch buckets ``sizes``) from
        now on. A subclass with a ``propose`` of its own (hybrid: the head drafts sub-batches)
        keeps the uncaptured drafting."""
        if type(self).propose is Eagle3Proposer.propose:
            self.static = static_draft.StaticDrafts(graphs, sizes)

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
        width = None if self.static is None else self.static.width(b)
        if width is not None:
            tokens, q = self._draft_static(batch, k, width)
        else:
            tokens, q = self._draft(batch, k)
        lengths = torch.full((b,), k, dtype=torch.int64, device=self.device)
        return Draft(tokens=tokens[:b], lengths=lengths, probs=q[:b])

    def _draft(self, batch: ProposerBatch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Uncaptured drafting: tokens [B, k] and q [B, k, V], each row in its own slot."""
        slot_ids = [self._slot(r) for r in batch.row_ids]
        ends = [len(h) - 1 for h in batch.histories]  # next head position per row
        slots, first = on(self.device, torch.tensor(slot_ids), torch.tensor(ends)[:, None])
        g = self._catch_up(batch, slot_ids, slots, ends)

        def step(g: torch.Tensor, tokens: torch.Tensor, i: int) -> torch.Tensor:
            kv_len = max(ends) + i + 1
            return self.head.step(g, tokens, first + i, self.cache, slots[:, None], slots, kv_len)

        return head_chain(self.head, g, k, *static_draft.batch_sampling(batch, k), step)

    def _draft_static(
        self, batch: ProposerBatch, k: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafting with row b in slot b: the catch-up uncaptured (its width varies), then the
        k draws as one static step over ``width`` rows: tokens [W, k] and q [W, k, V]."""
        capacity = self.cache.slots - 1  # the last slot is scratch
        self.slots, self.free = static_draft.bind_rows(self.cache, self.slots, batch.row_ids,
                                                       capacity)  # fmt: skip
        ends = [len(h) - 1 for h in batch.histories]
        g = self._catch_up(batch, list(range(len(batch))), None, ends, static=True)
        x = static_draft.step_inputs(batch, g, ends, k, width, self.cache.max_len - 1)
        lm, d2t = self.head.lm_head().weight, self.head.d2t  # refreshed outside any capture
        reads = (self.cache.k.data_ptr(), self.cache.max_len, lm.data_ptr(),
                 None if d2t is None else d2t.data_ptr())  # fmt: skip
        step = partial(head_draft_step, self.head, self.cache)
        return self.static.run(step, batch, k, x, self.head.draft_vocab_size, reads)

    def _slot(self, row_id: int) -> int:
        slot = self.slots.get(row_id)
        if slot is None:
            if not self.free:
                raise RuntimeError("drafter cache is full (more live rows than bound)")
            slot = self.slots[row_id] = self.free.pop()
        return slot

    def _catch_up(
        self,
        batch: ProposerBatch,
        slot_ids: list[int],
        slots: torch.Tensor | None,
        ends: list[int],
        static: bool = False,
    ) -> torch.Tensor:
        """Feed each row's new features; return g [B, 1, H] at its last one. ``static``: row b
        in slot b over the whole cache (no host read), padding at the cache's last position."""
        feats = batch.hidden
        counts = [int(f.shape[0]) for f in feats]
        if min(counts) < 1:
            raise RuntimeError("a row brought no new target features since its last propose")
        b, width = len(feats), max(counts)
        pad = self.cache.max_len - 1 if static else 0  # padding: this position, scratch slot
        f = feats[0].new_zeros(b, width, feats[0].shape[-1])  # where the features are
        ids = torch.zeros(b, width, dtype=torch.int64)
        positions = torch.full((b, width), pad, dtype=torch.int64)
        rows = torch.full((b, width), self.cache.slots - 1, dtype=torch.int64)
        for i, (m, end, hist) in enumerate(zip(counts, ends, batch.histories, strict=True)):
            start = end - m  # features cover positions start .. end-1
            f[i, :m] = feats[i]
            ids[i, :m] = torch.tensor(hist[start + 1 : end + 1])
            positions[i, :m] = torch.arange(start, end)
            rows[i, :m] = slot_ids[i]
        ids, positions, rows, last = on(self.device, ids, positions, rows,
                                        torch.tensor(counts)[:, None, None] - 1)  # fmt: skip
        h = self.head.features_in(f.to(self.head.dtype))
        kv_len = STATIC if static else max(ends)
        g = self.head.step(h, ids, positions, self.cache, rows, slots, kv_len)
        return g.gather(1, last.expand(b, 1, g.shape[-1]))  # [B, 1, H]


def head_chain(
    head: DraftHead,
    g: torch.Tensor,  # [W, 1, H] the head's output at each row's last fed position
    k: int,
    sampling: static_draft.Sampling,
    u: torch.Tensor,  # [W, k] uniforms
    step: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    hints: SamplingHints | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k drafts from the head: target ids [W, k] and q [W, k, V] (the target's vocabulary);
    ``step(g, tokens [W, 1], i)`` runs the head at draft i's position and gives the next g."""

    def advance(i: int, idx: torch.Tensor) -> torch.Tensor:
        nonlocal g
        g = step(g, head.to_target(idx)[:, None], i)
        return head.logits(g[:, 0]).float()

    idx, q = static_draft.chain(head.logits(g[:, 0]).float(), k, sampling, u, advance, hints)
    return head.to_target(idx), head.to_full(q.flatten(0, 1)).view(*idx.shape, -1)


def head_draft_step(head: DraftHead, cache: KVCache, key: DraftKey, x: Inputs) -> Drafted:
    """The static drafting step: ``key.k`` draws over W rows (``x``: ``step_inputs``, start is
    g [W, 1, H]), row b's head cache in slot b; tokens [W, k] and q [W, k, V]. Reads no device
    data on the host (capturable)."""

    def step(g: torch.Tensor, tokens: torch.Tensor, i: int) -> torch.Tensor:
        return head.step(g, tokens, x["positions"][:, i : i + 1], cache, kv_len=STATIC)

    sampling, u = static_draft.unpack_sampling(x, key)
    return head_chain(head, x["start"], key.k, sampling, u, step, key.hints)
