"""The learner: recompute token logprobs of packed sequences, and take policy-gradient steps.

``token_logprobs(model, sequences, ...)`` returns each completion's token log-probabilities
(sequences packed into rows, a group's prompt shared); ``raw_logprobs`` is the same at T=1
without autograd. ``Learner(model, cfg)`` takes its settings from a ``LearnerCfg``; only per-run
values (``max_len``, ``temperature``, ``row_len``, a reference model) are keywords.
``Learner.train_step(samples)`` takes one optimizer step whose accumulated gradient equals the
whole batch's, through the registered loss and correction, and returns a ``StepResult``: float
metrics (loss, grad norm, throughput, MFU), with ``keep_logprobs`` the step's per-token logprobs,
with ``capture`` (layer indices) a drafter's features (``Captured``) from the same forward;
``accumulate_share`` takes one rank's share under the whole batch's normalisers (``rl.sharded``).
A mixture-of-experts policy reports its router's balance per step (``moe_load_max``,
``moe_aux_loss``), adds ``cfg.moe_aux_loss_coef`` times that loss, and with
``cfg.routing_replay`` routes each token to the experts its sample recorded
(``TrainSample.routing``, the engine's ``Completion.routing``). fp32, or bf16 with float32
masters. It knows nothing of how rollouts were produced.
Details: docs/internals.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from specrl.malloc import return_freed_memory
from specrl.models.device import (
    autocast,
    model_device,
    on,
    peak_flops,
    synchronize,
)
from specrl.models.flops import train_flops
from specrl.models.moe import Routing
from specrl.models.precision import resolve_precision
from specrl.rl.corrections import get_correction
from specrl.rl.head import HEAD_PRECISIONS, head_logprobs
from specrl.rl.losses import LossNorm, get_loss
from specrl.rl.packing import (  # noqa: F401 (Span re-exported)
    PackedBatch,
    Span,
    pack_sequences,
    packed_routing,
)

if TYPE_CHECKING:
    from specrl.config_training import LearnerCfg

DTYPES = ("fp32", "bf16")
BF16_MODES = ("autocast", "params")


@dataclass(frozen=True)
class TrainSample:
    """One completion to learn from."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    advantage: float
    # behaviour policy per completion token: [n] (a tensor, e.g. ``Completion.token_logprobs``,
    # or a list of floats)
    old_logprobs: torch.Tensor | Sequence[float] | None = None
    # an MoE policy's experts [P + n - 1, moe_layers, top_k] as the rollout routed the prompt and
    # completion tokens (``Completion.routing``): what ``routing_replay`` imposes
    routing: torch.Tensor | None = None

    def __getstate__(self) -> dict:
        """Tensors copied compact: a view would pickle all of its base (a flat rollout)."""
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}


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


def packed_logprobs(
    model: nn.Module,
    batch: PackedBatch,
    temperature: float = 1.0,
    chunk: int = 256,
    head: str = "auto",
) -> torch.Tensor:  # [M] flat, in sequence order
    """Completion logprobs of a packed batch. The batch goes to the model's device (one copy
    per tensor) unless it is there."""
    return packed_logprobs_and_features(model, batch, temperature, chunk, None, head)[0]


def packed_logprobs_and_features(
    model: nn.Module,
    batch: PackedBatch,
    temperature: float = 1.0,
    chunk: int = 256,
    capture: tuple[int, ...] | None = None,
    head: str = "auto",
    routing: Routing | None = None,
) -> tuple[torch.Tensor, list[Captured]]:  # [M] flat in sequence order, one per sequence
    """``packed_logprobs`` and, with ``capture`` (layer indices, possibly empty), one
    ``Captured`` per sequence from the same forward (else no features); ``routing``: the MoE
    layers' record / replay (``models.moe.Routing``, replay in the batch's row order)."""
    batch = batch.to(model_device(model))
    hidden, layers = model.hidden_states(
        batch.ids, batch.positions, segments=batch.segments, parents=batch.parents,
        capture=tuple(capture or ()), routing=routing,
    )  # fmt: skip
    features = capture_features(batch, hidden, layers) if capture is not None else []
    selected = hidden[batch.rows, batch.cols]  # [M, H]
    weight = model.lm_head.weight
    flat = head_logprobs(selected, weight, batch.targets, temperature, chunk, head)
    return flat, features


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
        cols = span.columns(n).to(hidden.device)
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
class StepResult:
    """What a step (or a gradient accumulation) computed: its float ``metrics``; ``logprobs``,
    the forward's (before the update, at the learner's temperature) per-token logprobs, one
    ``[len(completion)]`` tensor per sample with a non-empty completion, in order (``None``
    unless asked for); ``features``, that forward's ``Captured`` of the same samples in the same
    order (empty unless layers were given to capture; a sharded rank: its own share's)."""

    metrics: dict[str, float]
    logprobs: list[torch.Tensor] | None = None
    features: list[Captured] = field(default_factory=list)


def _behaviour_of(s: TrainSample) -> torch.Tensor | None:  # -> [n] float32, or None
    """A sample's behaviour logprobs as a tensor (``ValueError`` if not one per token)."""
    if s.old_logprobs is None:
        return None
    old = torch.as_tensor(s.old_logprobs, dtype=torch.float32).reshape(-1)
    if len(old) != len(s.completion_ids):
        raise ValueError(
            f"sample has {len(old)} old_logprobs for {len(s.completion_ids)} completion tokens"
        )
    return old


def _padded(values: list[torch.Tensor], width: int) -> torch.Tensor:  # -> [N, width]
    out = values[0].new_zeros(len(values), width)
    for i, v in enumerate(values):
        out[i, : len(v)] = v
    return out


def _adamw(
    params: list[torch.Tensor], device: torch.device, **kwargs: float | tuple[float, float]
) -> torch.optim.AdamW:
    """AdamW with the fast implementation for ``device``: fused on CUDA, foreach elsewhere."""
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, **kwargs, **fast)


def _masters(params: list[torch.Tensor]) -> list[nn.Parameter]:
    """float32 master copies of ``params`` (taken before they are cast to bf16)."""
    return [nn.Parameter(p.detach().float().clone()) for p in params]


def check_bf16_mode(dtype: str, bf16_mode: str) -> None:
    """Raise ``ValueError`` unless ``bf16_mode`` is known and fits ``dtype``."""
    if bf16_mode not in BF16_MODES:
        raise ValueError(f"bf16_mode must be one of {BF16_MODES}, got {bf16_mode!r}")
    if bf16_mode == "params" and dtype != "bf16":
        raise ValueError(f"bf16_mode='params' needs dtype='bf16', got dtype={dtype!r}")


def _model_for_training(
    model: nn.Module, dtype: str, bf16_mode: str
) -> tuple[list[torch.Tensor], list[nn.Parameter] | None]:
    """Convert ``model`` in place for training: (its trained parameters, their float32 masters
    in 'params' mode, else None)."""
    check_bf16_mode(dtype, bf16_mode)
    params = [p for p in model.float().requires_grad_(True).parameters()]
    if bf16_mode != "params" or dtype != "bf16":
        return params, None
    masters = _masters(params)
    model.to(torch.bfloat16)
    return params, masters


class Learner:
    """AdamW policy-gradient learner over a ``Transformer``.

    The learner owns ``model``: it is converted in place (to float32, the master weights; or to
    bf16 with float32 ``masters`` in 'params' mode) and updated in place on its own device; give
    a rollout engine its own copy and refit it after steps.
    """

    devices: int = 1  # the devices whose peak FLOPs bound ``mfu`` (a sharded learner: its ranks)

    def __init__(
        self,
        model: nn.Module,
        cfg: LearnerCfg,
        *,
        max_len: int | None = None,
        temperature: float = 1.0,
        row_len: int = 256,
        ref_model: nn.Module | None = None,
    ) -> None:
        """A learner over ``model`` with ``cfg``'s settings ('auto' precision resolved for the
        model's device); per run: ``max_len`` (Dr. GRPO) is the generation budget,
        ``temperature`` the sampling one, ``row_len`` the packed row length, ``ref_model`` the
        frozen reference that ``cfg.kl_coef > 0`` needs."""
        dtype = resolve_precision(cfg.dtype, model_device(model))
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if cfg.kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs a frozen ref_model")
        self.moe = _check_moe(model, cfg)
        bf16_mode, head = cfg.bf16_mode, cfg.head_precision
        self.params, self.masters = self._for_training(model, dtype, bf16_mode)
        if head not in HEAD_PRECISIONS:
            raise ValueError(f"head precision must be one of {HEAD_PRECISIONS}, got {head!r}")
        self.cfg = cfg
        self.model, self.bf16_mode, self.head = model, bf16_mode, head
        model.checkpoint_layers = cfg.activation_checkpointing  # recompute blocks in backward
        self.loss_fn, self.loss_name = get_loss(cfg.loss), cfg.loss
        self.correction, self.is_cap = get_correction(cfg.correction), cfg.is_cap
        self.loss_kwargs = dict(eps_low=cfg.clip_eps_low, kl_coef=cfg.kl_coef, max_len=max_len)
        if cfg.clip_eps_high is not None:
            self.loss_kwargs["eps_high"] = cfg.clip_eps_high
        self.ref_model = ref_model.requires_grad_(False).eval() if ref_model else None
        self.max_grad_norm, self.micro_batch_tokens, self.dtype = (
            cfg.max_grad_norm, cfg.micro_batch_tokens, dtype,
        )  # fmt: skip
        self.temperature, self.chunk, self.row_len = temperature, cfg.logprob_chunk, row_len
        self.share_prompts = cfg.share_prompts  # a GRPO group's prompt runs once per micro-batch
        stepped = self.masters if self.masters is not None else self.params
        self.optimizer = _adamw(stepped, self.device, lr=cfg.lr, betas=tuple(cfg.betas),
                                weight_decay=cfg.weight_decay)  # fmt: skip

    @staticmethod
    def _for_training(
        model: nn.Module, dtype: str, bf16_mode: str
    ) -> tuple[list[torch.Tensor], list[nn.Parameter] | None]:
        """Convert ``model`` for training (a subclass may also shard it here)."""
        return _model_for_training(model, dtype, bf16_mode)

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    def _autocast(self):
        bf16_autocast = self.dtype == "bf16" and self.bf16_mode == "autocast"
        return autocast(self.device, bf16_autocast, torch.bfloat16)

    @torch.no_grad()
    def raw_logprobs(
        self,
        sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
        routings: Sequence[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """Temperature-1 completion logprobs with the learner's own precision (for the
        engine-vs-learner mismatch metric); ``routings``: each sequence's experts to replay."""
        batch = pack_sequences(sequences, self.row_len, self.share_prompts)
        replay = packed_routing(batch, routings) if routings is not None else None
        routing = None if replay is None else Routing(replay=replay.to(self.device))
        with self._autocast():
            flat, _ = packed_logprobs_and_features(self.model, batch, 1.0, self.chunk, None,
                                                   self.head, routing)  # fmt: skip
        return list(flat.split(batch.lengths))

    def _logprobs(
        self,
        model: nn.Module,
        batch: PackedBatch,
        capture: tuple[int, ...] | None = None,
        routing: Routing | None = None,
    ) -> tuple[torch.Tensor, list[Captured]]:  # [M], one per sequence with ``capture``
        with self._autocast():
            return packed_logprobs_and_features(model, batch, self.temperature, self.chunk,
                                                capture, self.head, routing)  # fmt: skip

    @property
    def token_means(self) -> tuple[str, ...]:
        """The token-weighted metrics of a step (``TOKEN_MEANS``, an MoE's ``MOE_MEANS``)."""
        return TOKEN_MEANS + (MOE_MEANS if self.moe else ())

    def _routing(self, samples: list[TrainSample], batch: PackedBatch) -> Routing | None:
        """An MoE policy's routing for a micro-batch's forward: recorded (router statistics,
        the load-balancing loss) and, with ``routing_replay``, the samples' experts imposed."""
        if not self.moe:
            return None
        replay = None
        if self.cfg.routing_replay:
            replay = packed_routing(batch, [s.routing for s in samples])
        return Routing(replay=None if replay is None else replay.to(self.device), record=True)

    def _micro_step(
        self,
        samples: list[TrainSample],
        norm: LossNorm,
        capture: tuple[int, ...] | None = None,
    ) -> StepResult:
        """One micro-batch's forward and backward: its metrics, its samples' detached
        logprobs and (with ``capture``) features."""
        pairs = [(s.prompt_ids, s.completion_ids) for s in samples]
        batch = pack_sequences(pairs, self.row_len, self.share_prompts)
        forward_tokens = batch.tokens
        batch = batch.to(self.device)
        width = max(batch.lengths)
        routing = self._routing(samples, batch)
        flat, features = self._logprobs(self.model, batch, capture, routing)  # [M]
        per_sample = list(flat.split(batch.lengths))
        logprobs = _padded(per_sample, width)
        mask = _padded([torch.ones(n) for n in batch.lengths], width)  # [N, T]
        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)  # [N]
        mask, adv = on(self.device, mask, adv)
        behaviour, has = self._behaviour(samples, logprobs)
        corr = self.correction(logprobs.detach(), behaviour, has, self.is_cap)
        ref = None
        if self.ref_model is not None:
            replayed = None if routing is None else Routing(replay=routing.replay)
            with torch.no_grad():
                ref_flat, _ = self._logprobs(self.ref_model, batch, routing=replayed)
            ref = _padded(list(ref_flat.split(batch.lengths)), width)
        out = self.loss_fn(logprobs, corr.old, adv, mask, ref_logprobs=ref, norm=norm,
                           is_weight=corr.weight, **self.loss_kwargs)  # fmt: skip
        loss, moe = out.loss, {}
        if routing is not None:
            moe, aux = routing.summary()
            share = len(samples) / norm.num_sequences  # the micro-batch's part of the batch mean
            loss = loss + self.cfg.moe_aux_loss_coef * share * aux
        loss.backward()
        self._grads_to_masters()
        metrics = out.metrics | moe | {"loss": float(loss.detach())}
        metrics |= {"forward_tokens": float(forward_tokens)}
        return StepResult(metrics, [lp.detach() for lp in per_sample], features)

    @staticmethod
    def _behaviour(
        samples: list[TrainSample],
        logprobs: torch.Tensor,  # [N, T]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Behaviour logprobs [N, T] (the current ones where a sample has none, and at
        padding) and which samples have them [N], on ``logprobs``' device (the samples'
        tensors padded on the host, no Python per token, and moved once)."""
        none = torch.zeros(0)
        old = [_behaviour_of(s) for s in samples]
        has = torch.tensor([o is not None for o in old])  # [N]
        width = logprobs.shape[1]
        given = _padded([none if o is None else o for o in old], width)  # [N, T]
        known = _padded([torch.ones(0 if o is None else len(o)) for o in old], width).bool()
        given, known, has = on(logprobs.device, given.to(logprobs.dtype), known, has)
        return torch.where(known, given, logprobs.detach()), has

    def _grads_to_masters(self) -> None:
        """'params' mode: add the bf16 gradients, in float32, to the masters' ``.grad``."""
        if self.masters is None:
            return
        for p, m in zip(self.params, self.masters, strict=True):
            if p.grad is not None:
                g = p.grad.float()
                m.grad = g if m.grad is None else m.grad.add_(g)
                p.grad = None

    @torch.no_grad()
    def _refresh_from_masters(self) -> None:
        """'params' mode: the bf16 parameters become the updated masters, rounded."""
        if self.masters is not None:
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)

    def train_step(
        self,
        samples: Sequence[TrainSample],
        *,
        keep_logprobs: bool = False,
        capture: tuple[int, ...] | None = None,
    ) -> StepResult:
        """One optimizer step on ``samples`` (gradient accumulated over micro-batches): its
        metrics; with ``keep_logprobs`` the step's forward's logprobs; with ``capture`` (layer
        indices) that forward's features (``StepResult``)."""
        device = self.device
        synchronize(device)
        t0 = time.perf_counter()
        stepped = self.optimizer.param_groups[0]["params"]
        self.optimizer.zero_grad(set_to_none=True)
        result = self.accumulate_gradients(samples, keep_logprobs=keep_logprobs, capture=capture)
        metrics = result.metrics
        grad_norm = torch.nn.utils.clip_grad_norm_(stepped, self.max_grad_norm)
        self.optimizer.step()
        self._refresh_from_masters()
        if self.moe:  # experts' token groups vary in size step to step: the freed heap
            return_freed_memory()  # would otherwise grow (measured: 7 GB held as 14 GB)
        synchronize(device)
        seconds = time.perf_counter() - t0
        metrics.update(grad_norm=float(grad_norm), time_s=seconds)
        metrics.update(self._throughput(metrics["forward_tokens"], metrics["tokens"], seconds))
        return result

    def _throughput(self, forward_tokens: float, positions: float, seconds: float) -> dict:
        """tokens_per_s, model_tflops and (peak known) mfu of a step (see the module)."""
        flops = train_flops(self.model, int(forward_tokens), int(positions)) / seconds
        out = {"tokens_per_s": forward_tokens / seconds, "model_tflops": flops / 1e12}
        peak = peak_flops(self.device)
        if peak is not None:
            out["mfu"] = flops / peak / self.devices
        return out

    def accumulate_gradients(
        self,
        samples: Sequence[TrainSample],
        *,
        keep_logprobs: bool = False,
        capture: tuple[int, ...] | None = None,
    ) -> StepResult:
        """Add the batch loss's gradient to ``.grad`` (micro-batch by micro-batch; the
        masters' in 'params' mode); no step (``keep_logprobs``, ``capture``: see
        ``train_step``)."""
        samples = nonempty(samples)
        result = self.accumulate_share(samples, batch_norm(samples), capture)
        return result if keep_logprobs else replace(result, logprobs=None)

    def accumulate_share(
        self,
        samples: Sequence[TrainSample],
        norm: LossNorm,
        capture: tuple[int, ...] | None = None,
    ) -> StepResult:
        """``accumulate_gradients`` over non-empty ``samples``, a share of a batch whose
        normalisers are ``norm`` (no samples: no gradient, zero metrics), with the share's
        logprobs always."""
        groups = micro_batches(samples, self.micro_batch_tokens, self.share_prompts)
        parts = [self._micro_step([samples[i] for i in g], norm, capture) for g in groups]
        metrics = _combine([p.metrics for p in parts], self.token_means)
        metrics.update(micro_batches=float(len(groups)), sequences=float(len(samples)))
        logprobs = [lp for p in parts for lp in p.logprobs]
        return StepResult(metrics, logprobs, [f for p in parts for f in p.features])


def nonempty(samples: Sequence[TrainSample]) -> list[TrainSample]:
    """The samples with a non-empty completion (at least one, else ``ValueError``)."""
    samples = [s for s in samples if len(s.completion_ids) > 0]
    if not samples:
        raise ValueError("a training batch needs at least one non-empty completion")
    return samples


def batch_norm(samples: Sequence[TrainSample]) -> LossNorm:
    """The batch-wide loss normalisers of (non-empty) ``samples``."""
    return LossNorm(len(samples), sum(len(s.completion_ids) for s in samples))


TOKEN_MEANS = ("clip_frac", "ratio_mean", "kl", "is_weight_mean")  # token-weighted metrics
MOE_MEANS = ("moe_load_max", "moe_aux_loss")  # token-weighted too, an MoE policy's only


def _combine(parts: list[dict[str, float]], means: tuple[str, ...]) -> dict[str, float]:
    """Sum losses and token counts; token-weighted means of the per-token metrics ``means``."""
    tokens = sum(p["tokens"] for p in parts)
    out = {"loss": sum(p["loss"] for p in parts), "tokens": tokens}
    out["forward_tokens"] = sum(p["forward_tokens"] for p in parts)
    for key in means:
        out[key] = sum(p[key] * p["tokens"] for p in parts) / max(tokens, 1.0)
    return out


def _check_moe(model: nn.Module, cfg: LearnerCfg) -> bool:
    """Whether ``model`` is a mixture of experts; ``ValueError`` for MoE settings on a dense
    one."""
    config = model.config
    if not config.is_moe and (cfg.routing_replay or cfg.moe_aux_loss_coef > 0):
        what = "learner.routing_replay" if cfg.routing_replay else "learner.moe_aux_loss_coef > 0"
        raise ValueError(f"{what} needs a mixture-of-experts policy; the model is a dense "
                         f"{config.model_type}")  # fmt: skip
    return config.is_moe
