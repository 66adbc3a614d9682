"""Logits -> processed distribution -> sampled tokens, with counter-based per-request randomness.

``SamplingParams`` validates one request's settings (``ValueError`` naming the field);
``processed_logprobs`` is the distribution actually sampled from (temperature, top-k, top-p;
temperature 0 = greedy), the one "p" of plain sampling and the verifier alike;
``uniforms(seeds, counters, stream)`` is a pure function, so a request samples the same tokens
alone or batched; ``sample`` and ``sample_logits`` draw by inverse CDF. Given
``hints=SamplingHints.of(...)`` (host-known facts about every row's settings) the functions read
no device data (no host-device sync, output shapes known from input shapes: capturable) and
return bit for bit what they return without. Imports neither the engine nor the speculation
code. Details: docs/internals.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specrl.kernels import gemv

MASK32 = 0xFFFFFFFF
# (temperature, top_k, top_p) of a padding row in a static step: plain sampling, no truncation
PAD_SETTINGS = (1.0, 0, 1.0)
MAX_SEED = (1 << 63) - 1  # largest request seed (the engine derives sample seeds mod 2**63)
# Stream ids: independent random streams of one request.
STREAM_SAMPLE = 1
STREAM_ACCEPT = 2
STREAM_RECOVER = 3
STREAM_DRAFT = 4
# Sibling j of a first draft token (``specrl.spec.siblings``): drawn with stream
# STREAM_SIBLING_DRAFT + j, tested with STREAM_SIBLING_ACCEPT + j (j < MAX_SIBLINGS).
MAX_SIBLINGS = 16
STREAM_SIBLING_DRAFT = 64
STREAM_SIBLING_ACCEPT = STREAM_SIBLING_DRAFT + MAX_SIBLINGS


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request.

    temperature: 0 = greedy; > 0 scales logits by 1/temperature.
    top_k: keep the k most likely tokens (0 = off).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1 = off).
    max_new_tokens: most tokens generated per completion (>= 1).
    stop_token_ids: tokens that end a completion (the stop token is emitted).
    seed: per-request seed in [0, MAX_SEED]; None = drawn by the engine.
    n: completions per prompt (a GRPO group).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1

    def validate(self) -> SamplingParams:
        """Return self, or raise ``ValueError`` naming the bad value."""
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        return self

    def replace(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SamplingHints:
    """Host-known facts about a batch's settings that replace reads of device data (``hints=``).

    unit_temperature: every row has temperature == 1 (no scaling pass).
    any_greedy: some row has temperature <= 0.
    truncate_width: 0 when no row truncates (top_k > 0 or top_p < 1); else the sorted width
        top-k/top-p work in: the largest top_k (at most the vocabulary) when every truncating
        row has one, else the vocabulary.
    plain: every row samples at temperature 1 untruncated (``all_plain``).

    Build them with ``of``. Hints that do not describe the tensors are the caller's error,
    not detected: the results are then wrong (e.g. a greedy row sampled, a truncated row not
    truncated), except that unit_temperature=False or any_greedy=True only cost a pass.
    """

    unit_temperature: bool
    any_greedy: bool
    truncate_width: int
    plain: bool

    @classmethod
    def of(
        cls,
        temperatures: Sequence[float],
        top_ks: Sequence[int],
        top_ps: Sequence[float],
        vocab: int,
        dtype: torch.dtype = torch.float32,
    ) -> SamplingHints:
        """The hints of a batch from the settings of every row of its tensors, padding rows
        included (in any order; rows repeated, as verify repeats them per position, change
        nothing); ``vocab``: the logits' last dimension (a drafter's own for ``draw``);
        ``dtype``: that of the temperature and top_p tensors (values compared as they hold
        them). The hint-free code's own checks, run on small host tensors."""
        temperature = torch.tensor(temperatures, dtype=dtype)  # [N]
        top_k = torch.tensor(top_ks, dtype=torch.int64)  # [N]
        top_p = torch.tensor(top_ps, dtype=dtype)  # [N]
        truncated = _truncated(top_k, top_p)  # [N]
        width = 0
        if bool(truncated.any()):
            width = _width(top_k, truncated, _keep_counts(top_k, vocab), vocab)
        return cls(
            unit_temperature=bool((temperature == 1).all()),
            any_greedy=bool((temperature <= 0).any()),
            truncate_width=width,
            plain=all_plain(temperature, top_k, top_p),
        )


def _mul32(x: torch.Tensor | int, c: int) -> torch.Tensor | int:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) without int64 overflow (tensor or int)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def _mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit integer hash (lowbias32): bijective, good avalanche (tensor or Python int)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


SMALL_DRAW = 16  # up to this many uniforms, hash with Python ints (fewer, cheaper ops)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in [0, 1), a pure function of (seed, counter, stream).

    seeds: [N] int64 (any value); counters: [N, ...] int64 >= 0, broadcast against seeds' rows.
    Returns float64 with the shape of counters, on their device. Small draws on the CPU
    (<= ``SMALL_DRAW`` values, e.g. one decode step at batch 1) run the same integer hash on
    Python ints: bit for bit the same
    values, ~10x cheaper than ~80 tensor ops on a handful of elements.
    """
    seeds = seeds.to(torch.int64)
    while seeds.dim() < counters.dim():
        seeds = seeds.unsqueeze(-1)
    if counters.numel() <= SMALL_DRAW and counters.device.type == "cpu":  # no device sync
        flat = seeds.expand_as(counters).flatten().tolist(), counters.flatten().tolist()
        pairs = zip(*flat, strict=True)
        values = [_hash(seed, counter, stream) / float(1 << 32) for seed, counter in pairs]
        return torch.tensor(values, dtype=torch.float64).view(counters.shape)
    return _hash(seeds, counters.to(torch.int64), stream).to(torch.float64) / float(1 << 32)


def _hash(seeds: torch.Tensor | int, counters: torch.Tensor | int, stream: int):
    """The 32-bit hash of (seed, counter, stream) behind ``uniforms`` (tensors or Python ints)."""
    lo, hi = seeds & MASK32, (seeds >> 32) & MASK32
    h = _mix32((counters & MASK32) ^ _mix32(stream))
    h = _mix32(h ^ lo)
    return _mix32(h ^ _mix32(hi ^ 0x9E3779B9))


def _apply_top_k_top_p(
    scaled: torch.Tensor,  # [N, V] logits after temperature
    top_k: torch.Tensor,  # [N] int64, 0 = off
    top_p: torch.Tensor,  # [N] float, 1 = off
    width: int | None = None,  # None: ``_width`` from the data
) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k and then outside top-p; returns a new tensor.

    Works in the sorted space of the ``width`` most likely tokens: the largest top-k when every
    truncated row has one (a cheap ``topk``), else the whole vocabulary (a full sort).
    """
    vocab = scaled.shape[-1]
    truncated = _truncated(top_k, top_p)  # [N]
    k = _keep_counts(top_k, vocab)  # [N]
    if width is None:
        width = _width(top_k, truncated, k, vocab)
    sorted_logits, order = torch.topk(scaled, width, dim=-1, sorted=True)  # [N, width]
    ranks = torch.arange(width, device=scaled.device)
    keep = ranks[None, :] < k[:, None]  # [N, width]
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
    keep &= mass_before < top_p.float()[:, None]
    keep[:, 0] = True  # the most likely token always survives
    kept = sorted_logits.masked_fill(~keep, float("-inf"))
    out = torch.full_like(scaled, float("-inf")).scatter_(-1, order, kept)  # [N, V]
    return torch.where(truncated[:, None], out, scaled)


def _truncated(top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows [N] bool that top-k or top-p truncate."""
    return (top_k > 0) | (top_p < 1)


def _keep_counts(top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    """Tokens [N] top-k keeps per row: top_k at most the vocabulary, all of it when off."""
    return torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))


def _width(top_k: torch.Tensor, truncated: torch.Tensor, k: torch.Tensor, vocab: int) -> int:
    """The sorted width top-k/top-p work in (some row truncated; reads the data)."""
    bounded = bool(((top_k > 0) | ~truncated).all())
    return int(k[truncated].max()) if bounded else vocab


def processed_logprobs(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N] float, 0 = greedy
    top_k: torch.Tensor,  # [N] int64
    top_p: torch.Tensor,  # [N] float
    *,
    hints: SamplingHints | None = None,
) -> torch.Tensor:
    """Log-probs [N, V] (float32) of the distribution plain sampling draws from.

    Masked tokens are -inf. Greedy rows are one-hot on the first argmax. ``logits`` is not
    modified.
    """
    logits = logits.float()
    greedy = temperature <= 0
    unit = bool((temperature == 1).all()) if hints is None else hints.unit_temperature
    if unit:  # x / 1.0 == x exactly: skip a vocabulary pass
        scaled = logits
    else:
        safe_t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
        scaled = logits / safe_t[:, None]
    if hints is None:
        if bool(_truncated(top_k, top_p).any()):
            scaled = _apply_top_k_top_p(scaled, top_k, top_p)
    elif hints.truncate_width:
        scaled = _apply_top_k_top_p(scaled, top_k, top_p, hints.truncate_width)
    logp = torch.log_softmax(scaled, dim=-1)
    if bool(greedy.any()) if hints is None else hints.any_greedy:
        one_hot = torch.full_like(logp, float("-inf"))
        one_hot.scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
        logp = torch.where(greedy[:, None], one_hot, logp)
    return logp


def processed_logprobs_for(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``processed_logprobs`` with one request's settings for every row of logits [N, V]."""
    n = logits.shape[0]
    return processed_logprobs(
        logits,
        torch.full((n,), float(params.temperature)),
        torch.full((n,), int(params.top_k), dtype=torch.int64),
        torch.full((n,), float(params.top_p)),
    )


def sample(
    logprobs: torch.Tensor, u: torch.Tensor, *, hints: SamplingHints | None = None
) -> torch.Tensor:
    """Inverse-CDF sample: logprobs [N, V], u [N] in [0, 1) -> tokens [N] int64.

    Tokens of probability 0 are never drawn.
    """
    return sample_probs(logprobs.exp(), u, hints=hints)


def draw(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N]
    top_k: torch.Tensor,  # [N]
    top_p: torch.Tensor,  # [N]
    u: torch.Tensor,  # [N] uniforms
    *,
    hints: SamplingHints | None = None,  # of the drafter's vocabulary V
) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's draw: tokens [N] from the processed distribution and that distribution as
    probabilities [N, V] (its q), bit for bit ``sample(processed_logprobs(...), u)`` and
    ``processed_logprobs(...).exp()`` with one exponential pass instead of two."""
    probs = processed_logprobs(logits, temperature, top_k, top_p, hints=hints).exp()
    return sample_probs(probs, u, hints=hints), probs


CHUNK = 1024


def sample_probs(
    probs: torch.Tensor, u: torch.Tensor, *, hints: SamplingHints | None = None
) -> torch.Tensor:
    """Inverse-CDF sample from (unnormalised) probabilities [N, V] with uniforms u [N].

    Two levels keep it cheap and exact: a float64 CDF over chunk masses picks a chunk, then a
    float64 CDF inside that chunk picks the token, so no full-vocabulary float64 pass is needed
    and tiny tail probabilities keep their chance. Any ``hints``: no check of the data first.
    """
    n, vocab = probs.shape
    pad = (-vocab) % CHUNK
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    chunks = probs.view(n, -1, CHUNK)  # [N, C, CHUNK]
    chunk_cdf = torch.cumsum(chunks.sum(-1, dtype=torch.float64), dim=-1)  # [N, C]
    target = u.to(torch.float64) * chunk_cdf[:, -1]  # [N]
    c = _search(chunk_cdf, target)  # [N] chunk index
    before = torch.where(c > 0, chunk_cdf.gather(1, (c - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    inner = chunks[torch.arange(n, device=c.device), c]  # [N, CHUNK]
    inner_cdf = torch.cumsum(inner, dim=-1, dtype=torch.float64)  # [N, CHUNK]
    j = _search(inner_cdf, (target - before).clamp(min=0))
    idx = c * CHUNK + j
    # Rounding between the two levels can land past the last nonzero token: use the argmax then.
    ok = (idx < vocab) & (probs.gather(1, idx[:, None].clamp(max=probs.shape[1] - 1))[:, 0] > 0)
    if hints is None and bool(ok.all()):
        return idx
    return torch.where(ok, idx, probs[:, :vocab].argmax(-1))


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """First index i with cdf[i] > target, clamped to the last index: [N, L], [N] -> [N]."""
    idx = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    return idx.clamp(max=cdf.shape[1] - 1)


def sample_logits(
    logits: torch.Tensor,  # [N, V]
    temperature: torch.Tensor,  # [N]
    top_k: torch.Tensor,  # [N]
    top_p: torch.Tensor,  # [N]
    u: torch.Tensor,  # [N] uniforms
    *,
    hints: SamplingHints | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain sampling in few vocabulary passes: (tokens, processed, raw logprobs), [N] each.

    Same distribution and inverse CDF as ``sample(processed_logprobs(...), u)`` (up to float
    rounding), without full log-prob tensors when temperature is 1 and nothing is truncated.
    """
    if all_plain(temperature, top_k, top_p) if hints is None else hints.plain:
        kernel = _native_sampler(logits)
        if kernel is not None:  # one pass over the logits, no [N, V] intermediates
            tokens, raw = kernel.sample_t1(logits, u)
            return tokens, raw, raw
        # one fused softmax pass; log of the sampled token's probability
        probs = torch.softmax(logits.float(), dim=-1)  # [N, V]
        tokens = sample_probs(probs, u, hints=hints)
        raw = probs.gather(1, tokens[:, None])[:, 0].log()
        return tokens, raw, raw
    logits = logits.float()
    raw_lse = torch.logsumexp(logits, dim=-1)  # [N]
    lp = processed_logprobs(logits, temperature, top_k, top_p, hints=hints)
    tokens = sample(lp, u, hints=hints)
    raw = logits.gather(1, tokens[:, None])[:, 0] - raw_lse
    return tokens, token_logprobs(lp, tokens), raw


def _native_sampler(logits: torch.Tensor) -> gemv.GemvKernel | None:
    """The native kernel for sampling from logits [N, V] (bf16/float32 on the CPU, N >= 1)."""
    ok = logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32)
    return gemv.gemv_kernel() if ok and logits.numel() > 0 and logits.dim() == 2 else None


def token_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Gather logprobs [N, V] at tokens [N] -> [N]."""
    return logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax at temperature 1, no truncation: [N, V] -> [N, V] float32."""
    return torch.log_softmax(logits.float(), dim=-1)


def raw_logprobs_reusing(
    logits: torch.Tensor,  # [N, V]
    processed: torch.Tensor,  # [N, V] processed_logprobs(logits, temperature, top_k, top_p)
    temperature: torch.Tensor,  # [N]
    top_k: torch.Tensor,  # [N]
    top_p: torch.Tensor,  # [N]
    *,
    hints: SamplingHints | None = None,
) -> torch.Tensor:
    """``raw_logprobs(logits)``; when every row samples at temperature 1 untruncated that is
    ``processed`` itself (bit for bit: the same log-softmax of logits / 1.0), so no second pass."""
    plain = all_plain(temperature, top_k, top_p) if hints is None else hints.plain
    return processed if plain else raw_logprobs(logits)


def all_plain(temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> bool:
    """Whether every row samples at temperature 1 without truncation (processed == raw)."""
    return bool(((temperature == 1) & (top_k == 0) & (top_p >= 1)).all())
