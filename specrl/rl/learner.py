"""The learner: recompute token logprobs of packed sequences, and take policy-gradient steps.

Contract:
- ``token_logprobs(model, sequences, ...)`` returns, for each ``(prompt_ids, completion_ids)``,
  the log-probabilities ``[len(completion)]`` the model assigns to the completion tokens given
  everything before them (raw logits / temperature, log-softmax, no top-k/top-p). Sequences are
  packed into rows (``pack_sequences``): a prompt segment then a completion segment that sees it,
  positions from 0, attention never crossing into other sequences, so a packed sequence sees
  exactly what it would see alone; with ``share_prompts`` (the learner's default) consecutive
  sequences with the same prompt (a GRPO group) share one copy of it, so the prompt's tokens run
  once per micro-batch instead of once per sample (same values, fewer FLOPs). The LM head and
  the float32 log-softmax run only at completion positions, in chunks of
  ``chunk`` positions; with autograd on, each chunk is recomputed in backward (activation
  checkpointing), so the [positions, vocab] float32 logits never exist for more than one chunk.
- ``raw_logprobs`` is the same at temperature 1 without autograd: the numbers a rollout engine
  reports as raw logprobs, for the engine-vs-learner mismatch metric (``Learner.raw_logprobs``
  does it in the learner's precision).
- ``Learner.train_step(samples)`` takes one optimizer step on a batch of ``TrainSample`` (prompt,
  completion, advantage, optional behaviour logprobs): micro-batches of at most
  ``micro_batch_tokens`` tokens, each normalised with batch-wide counts so that the accumulated
  gradient equals the whole-batch gradient; then gradient-norm clipping and AdamW. Returns float
  metrics (loss, grad_norm, clip_frac, kl, ratio_mean, tokens, micro_batches, time_s).
  With ``capture=FeatureSink(layers)`` the same training forward also records, per sample, the
  outputs of those layers and the final hidden state over prompt + completion (``Captured``,
  bfloat16, detached): a learned drafter's training data at no extra forward.
- Precision: ``dtype="fp32"`` runs everything in float32. ``dtype="bf16"`` keeps float32 master
  weights, gradients and AdamW state and runs the trunk under CPU bf16 autocast (AMX matmuls);
  the LM head and log-softmax always run in float32, because bf16 logits (8-bit mantissa) would
  shift log-probabilities by several hundredths. Autocast was chosen over bf16 parameters with
  a float32 master copy: it gives the same matmul speed here with no weight copies to keep in sync.
- Behaviour logprobs reach the loss through the registered off-policy correction
  (``rl.corrections``, ``correction=``): 'ppo' clips against them, 'tis' weights each token by
  the truncated importance ratio. Without behaviour logprobs a sample is on-policy: the current
  logprobs detached (ratio 1, one step per batch), which costs no extra forward pass.
The learner knows nothing about how rollouts were produced.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from specrl.models.precision import resolve_precision
from specrl.rl.corrections import get_correction
from specrl.rl.losses import LossNorm, get_loss

if TYPE_CHECKING:
    from specrl.config import LearnerCfg

DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class TrainSample:
    """One completion to learn from."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    advantage: float
    old_logprobs: Sequence[float] | None = None  # behaviour policy, per completion token


@dataclass(frozen=True)
class PackedBatch:
    """Sequences packed into rows; completion-token coordinates listed in sequence order."""

    ids: torch.Tensor  # [R, L] token ids (padding: 0)
    positions: torch.Tensor  # [R, L] position within the own sequence
    segments: torch.Tensor  # [R, L] segment id (a prompt or a completion); -1 = padding
    parents: torch.Tensor  # [R, L] a completion's prompt segment; -2 = none
    rows: torch.Tensor  # [M] row of each completion token's *predicting* position
    cols: torch.Tensor  # [M] column of the predicting position
    targets: torch.Tensor  # [M] the completion token ids
    lengths: list[int]  # completion length per sequence (sum = M)
    spans: list[Span] = field(default_factory=list)  # where each sequence's tokens sit


@dataclass(frozen=True)
class Span:
    """One packed sequence's place: its row, the column and length of its (possibly shared)
    prompt segment, and the column where its completion starts."""

    row: int
    prompt_col: int
    prompt_len: int
    completion_col: int

    def columns(self, completion_len: int) -> torch.Tensor:  # [prompt_len + completion_len]
        """The columns of the sequence's tokens in order: prompt, then completion."""
        p = torch.arange(self.prompt_col, self.prompt_col + self.prompt_len)
        c = torch.arange(self.completion_col, self.completion_col + completion_len)
        return torch.cat([p, c])


@dataclass(frozen=True)
class Captured:
    """The policy's features over one sample's tokens (prompt + completion), taken from the
    learner's training forward (before its update): the outputs of the requested layers
    concatenated ``feats`` [T, F] and the final normed hidden ``final`` [T, H], both detached
    copies in bfloat16 (what an EAGLE-3 / MTP head learns from, with no extra forward)."""

    tokens: torch.Tensor  # [T] int64
    prompt_len: int
    feats: torch.Tensor  # [T, F]
    final: torch.Tensor  # [T, H]


@dataclass
class _Block:
    """A prompt and the (consecutive) sequences whose completions follow it in one row."""

    prompt: list[int]
    members: list[int]
    size: int  # tokens: the prompt once + every member's completion


def _blocks(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]], width: int, share: bool
) -> list[_Block]:
    """One block per sequence, or with ``share`` consecutive sequences of the same prompt in
    one block while it fits ``width`` tokens."""
    blocks: list[_Block] = []
    for i, (p, c) in enumerate(sequences):
        if len(p) == 0:
            raise ValueError(f"sequence {i} has an empty prompt: nothing predicts its first token")
        last = blocks[-1] if blocks else None
        if share and last and last.size + len(c) <= width and last.prompt == list(p):
            last.members.append(i)
            last.size += len(c)
        else:
            blocks.append(_Block(list(p), [i], len(p) + len(c)))
    return blocks


def pack_sequences(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    row_len: int = 256,
    share_prompts: bool = False,
) -> PackedBatch:
    """First-fit packing (in order) into rows of ``max(row_len, longest sequence)`` tokens.

    Each sequence is a prompt segment followed by a completion segment that also sees that
    prompt (``parents``), positions continuing after it. With ``share_prompts`` consecutive
    sequences with the same prompt share one copy of it (a GRPO group: the prompt's tokens run
    once, not G times); each completion still sees exactly the prompt and itself.
    """
    width = max([row_len] + [len(p) + len(c) for p, c in sequences])
    blocks = _blocks(sequences, width, share_prompts)
    fill: list[int] = []
    place: list[tuple[int, int]] = []  # (row, start column) per block
    for b in blocks:
        r = next((i for i, used in enumerate(fill) if used + b.size <= width), len(fill))
        if r == len(fill):
            fill.append(0)
        place.append((r, fill[r]))
        fill[r] += b.size
    shape = (len(fill), width)
    ids = torch.zeros(shape, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    segments = torch.full(shape, -1, dtype=torch.long)
    parents = torch.full(shape, -2, dtype=torch.long)
    rows, cols, targets, lengths, spans = [], [], [], [], []
    seg = 0
    for b, (r, start) in zip(blocks, place, strict=True):
        n = len(b.prompt)
        ids[r, start : start + n] = torch.tensor(b.prompt, dtype=torch.long)
        positions[r, start : start + n] = torch.arange(n)
        segments[r, start : start + n] = prompt_seg = seg
        col = start + n
        for i in b.members:
            c = list(sequences[i][1])
            seg += 1
            ids[r, col : col + len(c)] = torch.tensor(c, dtype=torch.long)
            positions[r, col : col + len(c)] = torch.arange(n, n + len(c))
            segments[r, col : col + len(c)] = seg
            parents[r, col : col + len(c)] = prompt_seg
            rows += [r] * len(c)
            cols += [start + n - 1, *range(col, col + len(c) - 1)][: len(c)]
            targets += c
            lengths.append(len(c))
            spans.append(Span(r, start, n, col))
            col += len(c)
        seg += 1
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return PackedBatch(ids, positions, segments, parents, as_long(rows), as_long(cols),
                       as_long(targets), lengths, spans)  # fmt: skip


def _chunk_logprobs(
    hidden: torch.Tensor,  # [m, H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [m]
    temperature: float,
) -> torch.Tensor:  # [m]
    with torch.autocast("cpu", enabled=False):
        logits = hidden.float() @ weight.float().T  # [m, V] float32
        if temperature != 1.0:
            logits = logits / temperature
        picked = logits.gather(1, targets[:, None]).squeeze(1)
        return picked - torch.logsumexp(logits, dim=-1)


def head_logprobs(
    hidden: torch.Tensor,  # [M, H]
    weight: torch.Tensor,  # [V, H] LM head
    targets: torch.Tensor,  # [M]
    temperature: float = 1.0,
    chunk: int = 256,
) -> torch.Tensor:  # [M] float32
    """log softmax(hidden @ weight.T / temperature)[targets], ``chunk`` rows at a time."""
    out = []
    for s in range(0, hidden.shape[0], chunk):
        h, t = hidden[s : s + chunk], targets[s : s + chunk]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            out.append(checkpoint(_chunk_logprobs, h, weight, t, temperature, use_reentrant=False))
        else:
            out.append(_chunk_logprobs(h, weight, t, temperature))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


def packed_logprobs(
    model: nn.Module,
    batch: PackedBatch,
    temperature: float = 1.0,
    chunk: int = 256,
    capture: tuple[int, ...] | None = None,
    captured: list[Captured] | None = None,
) -> torch.Tensor:  # [M] flat, in sequence order
    """Completion logprobs of a packed batch; with ``capture`` (layer indices, possibly empty)
    one ``Captured`` per sequence is appended to ``captured`` from the same forward."""
    hidden, layers = model.hidden_states(
        batch.ids, batch.positions, segments=batch.segments, parents=batch.parents,
        capture=tuple(capture or ()),
    )  # fmt: skip
    if capture is not None and captured is not None:
        captured.extend(capture_features(batch, hidden, layers))
    selected = hidden[batch.rows, batch.cols]  # [M, H]
    return head_logprobs(selected, model.lm_head.weight, batch.targets, temperature, chunk)


@torch.no_grad()
def capture_features(
    batch: PackedBatch,
    hidden: torch.Tensor,  # [R, L, H]
    layers: list[torch.Tensor],  # each [R, L, H]
) -> list[Captured]:
    """One ``Captured`` per sequence of ``batch`` (bfloat16 copies, detached)."""
    feats = torch.cat(layers, dim=-1) if layers else hidden.new_zeros(*hidden.shape[:2], 0)
    out = []
    for span, n in zip(batch.spans, batch.lengths, strict=True):
        cols = span.columns(n)
        row = batch.ids[span.row, cols]  # [T]
        out.append(Captured(row.clone(), span.prompt_len,
                            feats[span.row, cols].detach().to(torch.bfloat16),
                            hidden[span.row, cols].detach().to(torch.bfloat16)))  # fmt: skip
    return out


def token_logprobs(
    model: nn.Module,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    temperature: float = 1.0,
    chunk: int = 256,
    row_len: int = 256,
) -> list[torch.Tensor]:
    """Per-sequence completion logprobs (each ``[len(completion)]``), packed and chunked."""
    batch = pack_sequences(sequences, row_len)
    flat = packed_logprobs(model, batch, temperature, chunk)
    return list(flat.split(batch.lengths))


@torch.no_grad()
def raw_logprobs(
    model: nn.Module,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    chunk: int = 256,
    row_len: int = 256,
) -> list[torch.Tensor]:
    """Temperature-1 completion logprobs without autograd (what an engine reports as raw)."""
    return token_logprobs(model, sequences, 1.0, chunk, row_len)


def micro_batches(
    samples: Sequence[TrainSample], token_budget: int, share_prompts: bool = False
) -> list[list[int]]:
    """Consecutive groups of sample indices with at most ``token_budget`` tokens each (>= 1);
    with ``share_prompts`` a prompt repeated by consecutive samples counts once per group."""
    groups: list[list[int]] = []
    used = token_budget + 1
    for i, s in enumerate(samples):
        shared = share_prompts and i > 0 and list(s.prompt_ids) == list(samples[i - 1].prompt_ids)
        extra = len(s.completion_ids) + (0 if shared else len(s.prompt_ids))
        if used + extra > token_budget:  # a new group, where the prompt counts again
            groups.append([])
            used = len(s.prompt_ids) + len(s.completion_ids)
        else:
            used += extra
        groups[-1].append(i)
    return groups


@dataclass
class FeatureSink:
    """Which target layers to capture in the training forward, and where the ``Captured``
    features go (one per non-empty sample, in order)."""

    layers: tuple[int, ...]
    captured: list[Captured] = field(default_factory=list)


def _padded(values: list[torch.Tensor], width: int) -> torch.Tensor:  # -> [N, width]
    out = values[0].new_zeros(len(values), width)
    for i, v in enumerate(values):
        out[i, : len(v)] = v
    return out


class Learner:
    """AdamW policy-gradient learner over a ``Transformer``.

    The learner owns ``model``: it is converted to float32 in place (the master weights) and
    updated in place; give a rollout engine its own (e.g. bf16) copy and refit it after steps.
    """

    def __init__(
        self,
        model: nn.Module,
        loss: str = "grpo",
        lr: float = 1e-5,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        micro_batch_tokens: int = 4096,
        dtype: str = "bf16",
        eps_low: float = 0.2,
        eps_high: float | None = None,
        kl_coef: float = 0.0,
        ref_model: nn.Module | None = None,
        max_len: int | None = None,
        temperature: float = 1.0,
        chunk: int = 256,
        row_len: int = 256,
        share_prompts: bool = True,
        correction: str = "ppo",
        is_cap: float = 2.0,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs a frozen ref_model")
        self.model = model.float().requires_grad_(True)
        self.loss_fn, self.loss_name = get_loss(loss), loss
        self.correction, self.is_cap = get_correction(correction), is_cap
        self.loss_kwargs = dict(eps_low=eps_low, kl_coef=kl_coef, max_len=max_len)
        if eps_high is not None:
            self.loss_kwargs["eps_high"] = eps_high
        self.ref_model = ref_model.requires_grad_(False).eval() if ref_model else None
        self.max_grad_norm, self.micro_batch_tokens, self.dtype = (
            max_grad_norm, micro_batch_tokens, dtype,
        )  # fmt: skip
        self.temperature, self.chunk, self.row_len = temperature, chunk, row_len
        self.share_prompts = share_prompts  # a GRPO group's prompt runs once per micro-batch
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=lr, betas=betas, weight_decay=weight_decay, foreach=True
        )

    @classmethod
    def from_config(
        cls,
        model: nn.Module,
        cfg: LearnerCfg,
        max_len: int | None = None,
        temperature: float = 1.0,
        ref_model: nn.Module | None = None,
    ) -> Learner:
        """A learner from ``LearnerCfg``; ``max_len`` (Dr. GRPO) is the generation budget."""
        return cls(
            model, loss=cfg.loss, lr=cfg.lr, betas=tuple(cfg.betas),
            weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
            micro_batch_tokens=cfg.micro_batch_tokens, dtype=resolve_precision(cfg.dtype),
            eps_low=cfg.clip_eps_low,
            eps_high=cfg.clip_eps_high, kl_coef=cfg.kl_coef, ref_model=ref_model,
            max_len=max_len, temperature=temperature, chunk=cfg.logprob_chunk,
            share_prompts=cfg.share_prompts, correction=cfg.correction, is_cap=cfg.is_cap,
        )  # fmt: skip

    def _autocast(self):
        if self.dtype == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def raw_logprobs(
        self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> list[torch.Tensor]:
        """Temperature-1 completion logprobs with the learner's own precision (for the
        engine-vs-learner mismatch metric)."""
        batch = pack_sequences(sequences, self.row_len, self.share_prompts)
        with self._autocast():
            flat = packed_logprobs(self.model, batch, 1.0, self.chunk)
        return list(flat.split(batch.lengths))

    def _logprobs(
        self, model: nn.Module, batch: PackedBatch, capture: FeatureSink | None = None
    ) -> torch.Tensor:  # [M]
        layers, sink = (None, None) if capture is None else (capture.layers, capture.captured)
        with self._autocast():
            return packed_logprobs(model, batch, self.temperature, self.chunk, layers, sink)

    def _micro_step(
        self,
        samples: list[TrainSample],
        norm: LossNorm,
        keep: list[torch.Tensor] | None,
        capture: FeatureSink | None = None,
    ) -> dict[str, float]:
        pairs = [(s.prompt_ids, s.completion_ids) for s in samples]
        batch = pack_sequences(pairs, self.row_len, self.share_prompts)
        width = max(batch.lengths)
        per_sample = list(self._logprobs(self.model, batch, capture).split(batch.lengths))
        if keep is not None:
            keep.extend(lp.detach() for lp in per_sample)
        logprobs = _padded(per_sample, width)
        mask = _padded([torch.ones(n) for n in batch.lengths], width)  # [N, T]
        behaviour, has = self._behaviour(samples, logprobs)
        corr = self.correction(logprobs.detach(), behaviour, has, self.is_cap)
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_flat = self._logprobs(self.ref_model, batch)
            ref = _padded(list(ref_flat.split(batch.lengths)), width)
        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
        out = self.loss_fn(logprobs, corr.old, adv, mask, ref_logprobs=ref, norm=norm,
                           is_weight=corr.weight, **self.loss_kwargs)  # fmt: skip
        out.loss.backward()
        return out.metrics | {"loss": float(out.loss.detach())}

    @staticmethod
    def _behaviour(
        samples: list[TrainSample],
        logprobs: torch.Tensor,  # [N, T]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Behaviour logprobs [N, T] (the current ones where a sample has none, and at
        padding) and which samples have them [N]."""
        old = logprobs.detach().clone()
        has = torch.tensor([s.old_logprobs is not None for s in samples])
        for i, s in enumerate(samples):
            if s.old_logprobs is not None:
                if len(s.old_logprobs) != len(s.completion_ids):
                    raise ValueError(
                        f"sample has {len(s.old_logprobs)} old_logprobs for "
                        f"{len(s.completion_ids)} completion tokens"
                    )
                old[i, : len(s.old_logprobs)] = torch.tensor(s.old_logprobs, dtype=old.dtype)
        return old, has

    def train_step(
        self,
        samples: Sequence[TrainSample],
        keep: list[torch.Tensor] | None = None,
        capture: FeatureSink | None = None,
    ) -> dict[str, float]:
        """One optimizer step on ``samples`` (gradient accumulated over micro-batches). With
        ``keep`` (a list), the logprobs of the step's forward (before the update, at the
        learner's temperature) are appended to it, one [len(completion)] tensor per sample
        with a non-empty completion, in order; with ``capture``, that forward's features of
        the same samples (``Captured``, in the same order) are appended to
        ``capture.captured``."""
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.accumulate_gradients(samples, keep, capture)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        metrics.update(grad_norm=float(grad_norm), time_s=time.perf_counter() - t0)
        return metrics

    def accumulate_gradients(
        self,
        samples: Sequence[TrainSample],
        keep: list[torch.Tensor] | None = None,
        capture: FeatureSink | None = None,
    ) -> dict[str, float]:
        """Add the batch loss's gradient to ``.grad`` (micro-batch by micro-batch); no step
        (``keep``, ``capture``: see ``train_step``)."""
        samples = [s for s in samples if len(s.completion_ids) > 0]
        if not samples:
            raise ValueError("a training batch needs at least one non-empty completion")
        tokens = sum(len(s.completion_ids) for s in samples)
        norm = LossNorm(len(samples), tokens)
        groups = micro_batches(samples, self.micro_batch_tokens, self.share_prompts)
        parts = [self._micro_step([samples[i] for i in g], norm, keep, capture) for g in groups]
        metrics = _combine(parts)
        metrics.update(micro_batches=float(len(groups)), sequences=float(len(samples)))
        return metrics


def _combine(parts: list[dict[str, float]]) -> dict[str, float]:
    """Sum losses and token counts; token-weighted means of the per-token metrics."""
    tokens = sum(p["tokens"] for p in parts)
    out = {"loss": sum(p["loss"] for p in parts), "tokens": tokens}
    for key in ("clip_frac", "ratio_mean", "kl", "is_weight_mean"):
        out[key] = sum(p[key] * p["tokens"] for p in parts) / max(tokens, 1.0)
    return out
