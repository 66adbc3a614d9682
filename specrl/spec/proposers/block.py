"""Block drafting (DFlash): a ``BlockHead`` drafts k tokens in one forward.

``BlockProposer(target_model, drafter_path=None, drafter=None)`` is the EAGLE-3 proposer's
machinery (features handed over by the engine, a KV cache of its own, a slot per row, static
steps) with a ``models.block_head.BlockHead``: each ``propose`` writes the new features into the
head's cache (each layer's context keys and values), then ONE forward of the block after them
(the row's last token and k mask slots) gives k distributions q_j; draft j is drawn from q_j
with ``draft_stream`` uniforms (the chain's draws, each from its own slot's logits: drafts do not
feed back), so drafting costs nearly the same at any k. ``check`` refuses a head of another
target. With ``use_static`` the block runs as one static step per bucket and k (the catch-up
stays uncaptured, as EAGLE-3's).
"""

from __future__ import annotations

from functools import partial

import torch

from specrl.models.block_head import BlockHead
from specrl.models.cache import KVCache
from specrl.models.device import on
from specrl.models.graphs import pad_rows
from specrl.models.transformer import STATIC
from specrl.sampling import SamplingHints
from specrl.spec.proposers import register_proposer, static_draft
from specrl.spec.proposers.base import ProposerBatch
from specrl.spec.proposers.eagle3 import Eagle3Proposer
from specrl.spec.proposers.static_draft import Drafted, DraftKey, Inputs, Sampling


@register_proposer("block")
class BlockProposer(Eagle3Proposer):
    """A block head over the target's hidden states: k drafts per row in one forward."""

    kind = "block"

    def _draft(self, batch: ProposerBatch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Uncaptured drafting: tokens [B, k] and q [B, k, V], each row in its own slot."""
        slot_ids = [self._slot(r) for r in batch.row_ids]
        ends = [len(h) - 1 for h in batch.histories]  # the last token's position per row
        last = torch.tensor([h[-1] for h in batch.histories])[:, None]
        slots, first, last = on(self.device, torch.tensor(slot_ids), torch.tensor(ends)[:, None],
                                last)  # fmt: skip
        self._catch_up(batch, slot_ids, slots, ends)
        positions = first + torch.arange(k + 1, device=self.device)  # [B, k+1]
        g = self.head.block(last, positions, self.cache, slots, max(ends) + k + 1)
        return block_draws(self.head, g[:, 1:], *static_draft.batch_sampling(batch, k))

    def _draft_static(
        self, batch: ProposerBatch, k: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafting with row b in slot b: the catch-up uncaptured (its width varies), then the
        block as one static step over ``width`` rows: tokens [W, k] and q [W, k, V]. Padding
        rows write the cache's last k + 1 positions only, past any context."""
        capacity = self.cache.slots - 1  # the last slot is scratch
        self.slots, self.free = static_draft.bind_rows(self.cache, self.slots, batch.row_ids,
                                                       capacity)  # fmt: skip
        ends = [len(h) - 1 for h in batch.histories]
        g = self._catch_up(batch, list(range(len(batch))), None, ends, static=True)
        # positions [W, k+1]: ends + 0..k (step_inputs' k+2 draft steps less the first);
        # padding rows' blocks stored from max_len - (k+1), past every context, to the end
        pad = self.cache.max_len - (k + 1)
        x = static_draft.step_inputs(batch, g, ends, k + 2, width, pad)
        last = torch.tensor([h[-1] for h in batch.histories])[:, None]  # [B, 1]
        x["last"] = pad_rows(last.to(self.device), width)
        lm, d2t = self.head.lm_head().weight, self.head.d2t  # refreshed outside any capture
        reads = (self.cache.k.data_ptr(), self.cache.max_len, lm.data_ptr(),
                 None if d2t is None else d2t.data_ptr())  # fmt: skip
        step = partial(block_draft_step, self.head, self.cache)
        return self.static.run(step, batch, k, x, self.head.draft_vocab_size, reads)


def block_draws(
    head: BlockHead,
    g: torch.Tensor,  # [W, k, H] the block's outputs
    sampling: Sampling,
    u: torch.Tensor,  # [W, k] uniforms
    hints: SamplingHints | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft j drawn from slot j's processed distribution: target ids [W, k] and q [W, k, V]
    (the target's vocabulary)."""
    logits = head.logits(g).float()  # [W, k, Vd]
    k = logits.shape[1]
    idx, q = static_draft.chain(logits[:, 0], k, sampling, u, lambda i, _: logits[:, i + 1], hints)
    return head.to_target(idx), head.to_full(q.flatten(0, 1)).view(*idx.shape, -1)


def block_draft_step(head: BlockHead, cache: KVCache, key: DraftKey, x: Inputs) -> Drafted:
    """The static drafting step: the block of ``key.k`` + 1 slots over W rows (``x``:
    ``step_inputs`` with k + 2 steps, its positions [W, k+1] the slots', and ``last`` [W, 1]
    the rows' last tokens), row b's cache in slot b; tokens [W, k] and q [W, k, V]. Reads no
    device data on the host (capturable)."""
    g = head.block(x["last"], x["positions"], cache, kv_len=STATIC)
    sampling, u = static_draft.unpack_sampling(x, key)
    return block_draws(head, g[:, 1:], sampling, u, key.hints)
