"""The speculative rejection sampler: a pure, batched, ragged verification step.

Draft ``x_i`` (drawn from ``q_i``; ``None`` = one-hot) is accepted iff ``u_i < min(1, p_i(x_i) /
q_i(x_i))``, ``p`` the target's processed distribution; the first rejection emits a recovered
token from ``norm(max(0, p - q))``, full acceptance a bonus token from ``p``: the output follows
plain sampling's distribution (Leviathan et al. 2023; Chen et al. 2023). ``rule="sample"``
accepts a draft iff it equals plain sampling's token: the output is plain sampling's, token for
token. Each row emits ``num_accepted + 1`` tokens with processed and raw logprobs and consumes
as many counters. Stateless; no input is modified. With ``hints`` (``SamplingHints`` of the
rows) no device data is read on the host (capturable) and the result is bit for bit the same.
Details: docs/internals.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrl.sampling import (
    STREAM_ACCEPT,
    STREAM_RECOVER,
    STREAM_SAMPLE,
    SamplingHints,
    processed_logprobs,
    raw_logprobs_reusing,
    sample_logits,
    sample_probs,
    uniforms,
)

PAD_TOKEN = -1  # token id at positions >= num_emitted of ``Verified.tokens``
RULES = ("distribution", "sample")  # verify's rules: rejection sampling, plain sampling's tokens


@dataclass(frozen=True)
class Verified:
    """Result of one verification step for a batch of B rows and k draft slots."""

    tokens: torch.Tensor  # [B, k+1] int64; emitted tokens, PAD_TOKEN after num_emitted
    num_emitted: torch.Tensor  # [B] int64 in [1, lengths+1]
    logprobs_processed: torch.Tensor  # [B, k+1] float32; log p_i(token_i), 0 at padding
    logprobs_raw: torch.Tensor  # [B, k+1] float32; T=1 log-softmax at token_i, 0 at padding
    num_accepted: torch.Tensor  # [B] int64; accepted drafts = num_emitted - 1


def verify(
    draft_tokens: torch.Tensor,  # [B, k] int64; positions >= draft_lengths are padding
    draft_lengths: torch.Tensor,  # [B] int64 in [0, k]
    draft_probs: torch.Tensor | None,  # [B, k, V] q the drafts were drawn from; None = one-hot
    target_logits: torch.Tensor,  # [B, k+1, V]
    temperature: torch.Tensor,  # [B] float; 0 = greedy
    top_k: torch.Tensor,  # [B] int64; 0 = off
    top_p: torch.Tensor,  # [B] float; 1 = off
    seeds: torch.Tensor,  # [B] int64
    counters: torch.Tensor,  # [B] int64; counter of the first token emitted this step
    rule: str = "distribution",
    *,
    hints: SamplingHints | None = None,  # of the B rows (padding included), vocabulary V
) -> Verified:
    """Accept a prefix of each row's drafts and emit one recovered or bonus token after it
    (``rule``: "distribution", the rejection sampler, or "sample", plain sampling's tokens)."""
    _, k = _check_shapes(draft_tokens, draft_lengths, draft_probs, target_logits)
    lengths = draft_lengths.to(torch.int64)
    counters = counters.to(torch.int64)
    valid = torch.arange(k, device=lengths.device)[None, :] < lengths[:, None]  # [B, k]
    drafts = torch.where(valid, draft_tokens.to(torch.int64), 0)  # [B, k], padding -> 0
    if rule == "sample":
        return _verify_sample(drafts, valid, target_logits, temperature, top_k, top_p, seeds,
                              counters, hints)  # fmt: skip
    if rule != "distribution":
        raise ValueError(f"unknown verification rule {rule!r} (choose {', '.join(RULES)})")
    logp = _per_position(target_logits, temperature, top_k, top_p, hints)  # [B, k+1, V]
    num_accepted = _count_accepted(drafts, valid, draft_probs, logp, seeds, counters)
    final = _final_token(drafts, lengths, draft_probs, logp, num_accepted, seeds, counters,
                         hints)  # fmt: skip
    tokens = _assemble(drafts, num_accepted, final)  # [B, k+1]
    safe = tokens.clamp(min=0)[..., None]  # [B, k+1, 1]
    settings = (temperature, top_k, top_p)
    raw = raw_logprobs_reusing(target_logits, logp, *settings, hints=hints)  # [B, k+1, V]
    return _verified(
        tokens, num_accepted, logp.gather(-1, safe).squeeze(-1), raw.gather(-1, safe).squeeze(-1)
    )


def _verify_sample(
    drafts: torch.Tensor,  # [B, k] int64, padding replaced by 0
    valid: torch.Tensor,  # [B, k] bool
    target_logits: torch.Tensor,  # [B, k+1, V]
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
    seeds: torch.Tensor,  # [B]
    counters: torch.Tensor,  # [B]
    hints: SamplingHints | None,
) -> Verified:
    """The "sample" rule: accept drafts while they equal what plain sampling draws; emit plain
    sampling's tokens with its own logprobs (the same function: the same numbers)."""
    k = drafts.shape[1]
    settings = (temperature, top_k, top_p)
    plain, lp, raw = _plain_tokens(target_logits, *settings, seeds, counters, hints)
    num_accepted = (drafts == plain[:, :k]) & valid  # [B, k]
    num_accepted = num_accepted.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B]
    final = plain.gather(1, num_accepted[:, None])[:, 0]  # [B]
    return _verified(_assemble(drafts, num_accepted, final), num_accepted, lp, raw)


def _verified(
    tokens: torch.Tensor,  # [B, k+1], PAD_TOKEN after the emitted ones
    num_accepted: torch.Tensor,  # [B]
    logprobs: torch.Tensor,  # [B, k+1] processed logprob of each position's token
    raw: torch.Tensor,  # [B, k+1] raw (T=1) logprob of each position's token
) -> Verified:
    """``Verified`` with logprobs zeroed past the emitted tokens."""
    emitted = tokens >= 0  # [B, k+1]
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    return Verified(
        tokens=tokens,
        num_emitted=num_accepted + 1,
        logprobs_processed=torch.where(emitted, logprobs, zero),
        logprobs_raw=torch.where(emitted, raw, zero),
        num_accepted=num_accepted,
    )


def _plain_tokens(
    target_logits: torch.Tensor,  # [B, k+1, V]
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
    seeds: torch.Tensor,  # [B]
    counters: torch.Tensor,  # [B]
    hints: SamplingHints | None,  # hold for the rows repeated per position too
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, processed and raw logprobs [B, k+1] each: what plain sampling draws at each
    position (its own function and uniforms: the same logits give the same numbers)."""
    batch, positions, vocab = target_logits.shape
    steps = torch.arange(positions, device=counters.device)
    u = uniforms(seeds, counters[:, None] + steps[None, :], STREAM_SAMPLE)  # [B, k+1]
    rows = [x.repeat_interleave(positions) for x in (temperature, top_k, top_p)]
    flat = target_logits.reshape(batch * positions, vocab)
    tokens, lp, raw = sample_logits(flat, *rows, u.reshape(-1), hints=hints)
    return tokens.view(batch, positions), lp.view(batch, positions), raw.view(batch, positions)


def _check_shapes(
    draft_tokens: torch.Tensor,
    draft_lengths: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
) -> tuple[int, int]:
    """Return (B, k) or raise ``ValueError`` describing the mismatch."""
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, k], got shape {tuple(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    if target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (batch, k + 1):
        raise ValueError(
            f"target_logits must be [B, k+1, V] = [{batch}, {k + 1}, V], "
            f"got {tuple(target_logits.shape)}"
        )
    if tuple(draft_lengths.shape) != (batch,):
        raise ValueError(f"draft_lengths must be [{batch}], got {tuple(draft_lengths.shape)}")
    if draft_probs is not None and draft_probs.shape != (batch, k, target_logits.shape[-1]):
        raise ValueError(
            f"draft_probs must be [B, k, V] = [{batch}, {k}, {target_logits.shape[-1]}], "
            f"got {tuple(draft_probs.shape)}"
        )
    return batch, k


def _per_position(
    target_logits: torch.Tensor,  # [B, k+1, V]
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
    hints: SamplingHints | None,
) -> torch.Tensor:
    """Processed log-probs [B, k+1, V] of every position, each row with its own settings."""
    batch, positions, vocab = target_logits.shape
    rows = [x.repeat_interleave(positions) for x in (temperature, top_k, top_p)]
    flat = target_logits.reshape(batch * positions, vocab)
    logp = processed_logprobs(flat, *rows, hints=hints)
    return logp.view(batch, positions, vocab)


def _count_accepted(
    drafts: torch.Tensor,  # [B, k] int64, padding replaced by 0
    valid: torch.Tensor,  # [B, k] bool, i < lengths
    draft_probs: torch.Tensor | None,  # [B, k, V]
    logp: torch.Tensor,  # [B, k+1, V] processed target log-probs
    seeds: torch.Tensor,  # [B]
    counters: torch.Tensor,  # [B]
) -> torch.Tensor:
    """Number [B] of leading drafts accepted by ``u_i < min(1, p_i(x_i) / q_i(x_i))``."""
    k = drafts.shape[1]
    if k == 0:
        return torch.zeros_like(counters)
    index = drafts[..., None]  # [B, k, 1]
    p_x = logp[:, :k].gather(-1, index).squeeze(-1).exp().double()  # [B, k]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, index).squeeze(-1).double()  # [B, k]
    ratio = p_x / torch.where(q_x > 0, q_x, torch.ones_like(q_x))
    threshold = torch.where(p_x <= 0, 0.0, torch.where(p_x >= q_x, 1.0, ratio))  # [B, k]
    steps = torch.arange(k, device=counters.device)
    u = uniforms(seeds, counters[:, None] + steps[None, :], STREAM_ACCEPT)  # [B, k] float64
    accepted = (u < threshold) & valid  # [B, k]
    return accepted.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def _final_token(
    drafts: torch.Tensor,  # [B, k]
    lengths: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [B, k, V]
    logp: torch.Tensor,  # [B, k+1, V]
    num_accepted: torch.Tensor,  # [B]
    seeds: torch.Tensor,  # [B]
    counters: torch.Tensor,  # [B]
    hints: SamplingHints | None,  # given: the general form, no branch on the data
) -> torch.Tensor:
    """The token [B] emitted at position j = num_accepted: recovered if j < lengths, else bonus."""
    j = num_accepted
    rows = torch.arange(j.shape[0], device=j.device)
    p_j = logp[rows, j].exp()  # [B, V]
    counter_j = counters + j
    u_bonus = uniforms(seeds, counter_j, STREAM_SAMPLE)  # [B]
    rejected = j < lengths  # [B]
    # every row drew a bonus token (or had no draft slots)
    if (not bool(rejected.any())) if hints is None else drafts.shape[1] == 0:
        return sample_probs(p_j, u_bonus, hints=hints)
    residual = _residual(drafts, draft_probs, p_j, j, hints)  # [B, V]
    u = torch.where(rejected, uniforms(seeds, counter_j, STREAM_RECOVER), u_bonus)  # [B]
    if hints is None and bool(rejected.all()):  # the usual case at batch 1: no [B, V] select
        return sample_probs(residual, u)
    return sample_probs(torch.where(rejected[:, None], residual, p_j), u, hints=hints)


def _residual(
    drafts: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V]
    p_j: torch.Tensor,  # [B, V] processed target probabilities at position j
    j: torch.Tensor,  # [B] position of the (possible) rejection
    hints: SamplingHints | None = None,  # given: the general form, no branch on the data
) -> torch.Tensor:
    """Unnormalised ``max(0, p_j - q_j)`` [B, V]; ``p_j`` where that is all zero."""
    k = drafts.shape[1]
    jj = j.clamp(max=k - 1)  # rows with j == k are bonus rows; their residual is unused
    if draft_probs is None:
        x_j = drafts.gather(1, jj[:, None])  # [B, 1]
        residual = p_j.scatter(-1, x_j, 0.0)  # p_j with the drafted token removed (new tensor)
    else:
        rows = torch.arange(jj.shape[0], device=jj.device)
        q_j = draft_probs[rows, jj].to(p_j.dtype)  # [B, V]
        residual = (p_j - q_j).clamp(min=0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # [B, 1]
    if hints is None and not bool(empty.any()):
        return residual
    return torch.where(empty, p_j, residual)


def _assemble(
    drafts: torch.Tensor,  # [B, k]
    num_accepted: torch.Tensor,  # [B]
    final: torch.Tensor,  # [B]
) -> torch.Tensor:
    """Tokens [B, k+1]: accepted drafts, then the final token, then PAD_TOKEN."""
    batch, k = drafts.shape
    positions = torch.arange(k + 1, device=drafts.device)[None, :]  # [1, k+1]
    padded = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1)  # [B, k+1]
    j = num_accepted[:, None]
    out = torch.where(positions < j, padded, torch.full_like(padded, PAD_TOKEN))
    return torch.where(positions == j, final[:, None], out)
