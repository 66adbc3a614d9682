"""Sibling drafts: extra candidates for the first draft token, verified losslessly.

``draw_siblings(q0, x, s, seeds, counters)`` draws ``s`` more first-token candidates without
replacement from a stochastic drafter's ``q0``; the target verifies them in the chain's forward
(a draft tree), and ``resolve_siblings`` runs recursive rejection sampling on the rows whose
chain rejected its first draft, so the emitted token is still distributed as ``p``.
``SiblingDraft`` is the engine's side of one step (``draw``, ``extend``, ``adopt``). No input is
modified in place. Details: docs/internals.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specrl.models.cache import KVCache
from specrl.sampling import (
    MAX_SIBLINGS,
    STREAM_RECOVER,
    STREAM_SAMPLE,
    STREAM_SIBLING_ACCEPT,
    STREAM_SIBLING_DRAFT,
    processed_logprobs,
    raw_logprobs_reusing,
    sample_probs,
    uniforms,
)
from specrl.spec.proposers.base import Draft
from specrl.spec.verify import PAD_TOKEN, Verified


@dataclass(frozen=True)
class SiblingDraft:
    """First-token siblings of one speculative step: leaves under the root, stored after a chain
    of ``chain`` drafts."""

    tokens: torch.Tensor  # [B, s] int64 candidates, drawn without replacement after draft 0
    valid: torch.Tensor  # [B, s] bool
    chain: int  # chain drafts verified this step (kk)

    @property
    def mask(self) -> torch.Tensor:
        """Ancestor-or-self mask [T, T] of the step's T = 1 + chain + s tokens."""
        return sibling_tree(self.chain, self.tokens.shape[1]).to(self.tokens.device)

    @staticmethod
    def draw(
        draft: Draft,
        lengths: torch.Tensor,  # [B] chain drafts each row verifies
        chain: int,
        count: int,
        seeds: torch.Tensor,  # [B]
        counters: torch.Tensor,  # [B]
    ) -> SiblingDraft | None:
        """``count`` siblings per row of a stochastic draft (None: no count or no q)."""
        if count == 0 or draft.probs is None:
            return None
        tokens, valid = draw_siblings(draft.probs[:, 0], draft.tokens[:, 0], count, seeds, counters)
        return SiblingDraft(tokens, valid & (lengths[:, None] >= 1), chain)

    def extend(
        self, ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Root + chain ids/positions [B, 1 + chain] -> the tree's [B, 1 + chain + s]: siblings
        after the chain, each at the first draft's RoPE position."""
        ids = torch.cat([ids, self.tokens], 1)
        return ids, torch.cat([positions, positions[:, 1:2].expand_as(self.tokens)], 1)

    def adopt(
        self,
        cache: KVCache,
        pos: list[int],  # per row: cache position of the root
        chosen: torch.Tensor,  # [B] accepted sibling, -1 = none
        *kept: torch.Tensor | None,  # each [B, T, ...]: per-token outputs of the step's forward
    ) -> int:
        """Move each accepted sibling's cache entries and ``kept`` outputs (features, experts;
        stored after the chain) to the first draft position, where the next step expects them;
        returns how many moved."""
        rows = torch.nonzero(chosen >= 0)[:, 0]
        if len(rows) == 0:
            return 0
        dst = torch.tensor(pos, device=rows.device)[rows] + 1
        cache.move_positions(rows, dst + self.chain + chosen[rows], dst)
        for t in kept:
            if t is not None:
                t[rows, 1] = t[rows, 1 + self.chain + chosen[rows]]
        return len(rows)


def without(q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``q`` [B, V] with ``tokens`` [B] removed, renormalised; an emptied row is all zero."""
    q = q.scatter(-1, tokens[:, None], 0.0)
    total = q.sum(-1, keepdim=True)  # [B, 1]
    return torch.where(total > 0, q / total.clamp(min=torch.finfo(q.dtype).tiny), 0.0)


def sibling_tree(chain: int, siblings: int) -> torch.Tensor:
    """Ancestor-or-self mask [T, T] of the root, a chain of ``chain`` drafts and ``siblings``
    leaves under the root, in that token order (T = 1 + chain + siblings)."""
    t = 1 + chain + siblings
    tree = torch.ones(t, t, dtype=torch.bool).tril()
    tree[1 + chain :, 1:] = torch.eye(t, dtype=torch.bool)[1 + chain :, 1:]
    return tree


def draw_siblings(
    q0: torch.Tensor,  # [B, V] distribution the first draft token was drawn from
    first: torch.Tensor,  # [B] int64 first draft token
    count: int,
    seeds: torch.Tensor,  # [B] int64
    counters: torch.Tensor,  # [B] int64 counter of the step's first token
) -> tuple[torch.Tensor, torch.Tensor]:
    """Siblings [B, count] int64 drawn without replacement after ``first``, and valid [B, count]."""
    if not 0 <= count <= MAX_SIBLINGS:
        raise ValueError(f"siblings must be in [0, {MAX_SIBLINGS}], got {count}")
    q = without(q0, first)
    tokens, valid = [], []
    for j in range(count):
        has = q.sum(-1) > 0  # [B]
        u = uniforms(seeds, counters, STREAM_SIBLING_DRAFT + j)
        y = sample_probs(torch.where(has[:, None], q, q0), u)  # [B]
        tokens.append(torch.where(has, y, 0))
        valid.append(has)
        q = without(q, y)
    b = q0.shape[0]
    if not tokens:
        empty = torch.zeros(b, 0, dtype=torch.int64, device=q0.device)
        return empty, empty.bool()
    return torch.stack(tokens, 1), torch.stack(valid, 1)


def resolve_siblings(
    chain: Verified,  # verify() of the root and the chain
    chain_lengths: torch.Tensor,  # [B] drafts the chain verified
    first: torch.Tensor,  # [B] the chain's first draft token
    q0: torch.Tensor,  # [B, V] its draft distribution
    siblings: torch.Tensor,  # [B, s] int64
    valid: torch.Tensor,  # [B, s] bool
    root_logits: torch.Tensor,  # [B, V] target logits at the root
    sibling_logits: torch.Tensor,  # [B, s, V] target logits at each sibling
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
    seeds: torch.Tensor,  # [B]
    counters: torch.Tensor,  # [B]
) -> tuple[Verified, torch.Tensor]:
    """The step's result with sibling rounds applied, and the accepted sibling [B] (-1: none)."""
    b, s = siblings.shape
    chosen = torch.full((b,), -1, dtype=torch.int64, device=siblings.device)
    active = (chain.num_accepted == 0) & (chain_lengths >= 1) & valid.any(-1)  # [B]
    if s == 0 or not bool(active.any()):
        return chain, chosen
    logp = processed_logprobs(root_logits.float(), temperature, top_k, top_p)  # [B, V]
    p = logp.exp()
    cur, q = _residual(p, q0.to(p.dtype)), without(q0.to(p.dtype), first)
    for j in range(s):
        y = siblings[:, j]
        live = active & valid[:, j] & (chosen < 0)  # [B]
        u = uniforms(seeds, counters, STREAM_SIBLING_ACCEPT + j)
        ok = live & (u < _threshold(cur, q, y))
        chosen = torch.where(ok, j, chosen)
        rejected = (live & ~ok)[:, None]
        cur = torch.where(rejected, _residual(cur, q), cur)
        q = torch.where(rejected, without(q, y), q)
    return _merge(chain, active, chosen, cur, logp, siblings, sibling_logits, root_logits,
                  (temperature, top_k, top_p, seeds, counters)), chosen  # fmt: skip


def _threshold(cur: torch.Tensor, q: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """min(1, cur(y) / q(y)) [B] in float64 (0 where cur(y) = 0)."""
    r_y = cur.gather(1, y[:, None])[:, 0].double()
    q_y = q.gather(1, y[:, None])[:, 0].double()
    ratio = r_y / torch.where(q_y > 0, q_y, 1.0)
    return torch.where(r_y <= 0, 0.0, torch.where(r_y >= q_y, 1.0, ratio))


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) [B, V]; ``p`` where that is all zero (then rejection had chance 0)."""
    r = (p - q).clamp(min=0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


def _merge(chain, active, chosen, cur, logp, siblings, sibling_logits, root_logits, rows):
    """Replace the outcome of ``active`` rows: [sibling, bonus] where one was accepted, else
    [token from the last residual]."""
    temperature, top_k, top_p, seeds, counters = rows
    b = siblings.shape[0]
    took = chosen >= 0  # [B]
    pick = chosen.clamp(min=0)
    rows_ = torch.arange(b, device=pick.device)
    at = sibling_logits[rows_, pick].float()  # [B, V] logits at the chosen sibling
    at_logp = processed_logprobs(at, temperature, top_k, top_p)  # [B, V]
    bonus = sample_probs(at_logp.exp(), uniforms(seeds, counters + 1, STREAM_SAMPLE))
    recovered = sample_probs(cur, uniforms(seeds, counters, STREAM_RECOVER))
    first = torch.where(took, siblings.gather(1, pick[:, None])[:, 0], recovered)  # [B]
    second = torch.where(took, bonus, 0)[:, None]  # [B, 1]
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    proc = (_at(logp, first), torch.where(took, at_logp.gather(1, second)[:, 0], zero))
    settings = (temperature, top_k, top_p)
    raw_root = raw_logprobs_reusing(root_logits.float(), logp, *settings)
    raw_at = raw_logprobs_reusing(at, at_logp, *settings)
    raw = (_at(raw_root, first), torch.where(took, raw_at.gather(1, second)[:, 0], zero))
    tokens = torch.stack([first, torch.where(took, bonus, PAD_TOKEN)], 1)  # [B, 2]
    accepted = took.to(torch.int64)
    return replace(
        chain,
        tokens=_rows_where(active, tokens, chain.tokens, PAD_TOKEN),
        num_emitted=torch.where(active, accepted + 1, chain.num_emitted),
        logprobs_processed=_rows_where(active, torch.stack(proc, 1), chain.logprobs_processed, 0),
        logprobs_raw=_rows_where(active, torch.stack(raw, 1), chain.logprobs_raw, 0),
        num_accepted=torch.where(active, accepted, chain.num_accepted),
    )


def _at(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logp [B, V] at tokens [B] -> [B]."""
    return logp.gather(1, tokens[:, None])[:, 0]


def _rows_where(
    rows: torch.Tensor,  # [B] bool
    new: torch.Tensor,  # [B, 2]
    old: torch.Tensor,  # [B, W], W >= 2
    fill: float,
) -> torch.Tensor:
    """``old`` with the selected rows replaced by ``new`` padded with ``fill`` to width W."""
    padded = torch.nn.functional.pad(new, (0, old.shape[1] - new.shape[1]), value=fill)
    return torch.where(rows[:, None], padded.to(old.dtype), old)
