"""The LM head's log-probabilities of chosen tokens, in chunks, with float32 logits.

Contract: ``head_logprobs(hidden [M, H], weight [V, H], targets [M], temperature, chunk, head)``
is log softmax(hidden @ weight.T / temperature)[targets] computed ``chunk`` rows at a time
(with autograd, each chunk is recomputed in backward, so the [M, V] float32 logits never exist
for more than one chunk). The logits and the log-softmax are always float32. The product is
float32, except with ``head='auto'`` on CUDA in bf16 (autocast on, or bf16 weights, and a
``torch.mm`` that takes ``out_dtype``: ``bf16_head``), where it takes bf16 inputs with float32
accumulation and output (``Bf16Head``, with its own backward: torch's op has no derivative).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from specrl.models.device import mm_out_dtype

HEAD_PRECISIONS = ("auto", "fp32")


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16 a [m, k] and b [k, n] with float32 accumulation and a float32 result: one
    product on CUDA (``out_dtype``), the float32 product of the same values elsewhere."""
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class Bf16Head(torch.autograd.Function):
    """hidden [m, H] @ weight [V, H].T from bf16 inputs into float32 logits [m, V], and its
    backward in the same precision (bf16 inputs, float32 accumulation): torch's ``mm`` with
    ``out_dtype`` has no derivative of its own."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        h = hidden.to(torch.bfloat16)  # [m, H]
        ctx.save_for_backward(h, weight)
        ctx.hidden_dtype = hidden.dtype
        return mm_f32(h, weight.T)  # [m, V] float32

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205 grad [m, V] float32
        h, weight = ctx.saved_tensors
        g = grad.to(torch.bfloat16)
        grad_h = mm_f32(g, weight).to(ctx.hidden_dtype) if ctx.needs_input_grad[0] else None
        grad_w = mm_f32(g.T, h).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w  # [m, H], [V, H]


def _head_logits(hidden: torch.Tensor, weight: torch.Tensor, bf16: bool) -> torch.Tensor:
    """Float32 logits [m, V] of hidden [m, H] under weight [V, H]: from bf16 inputs
    (``Bf16Head``) or as a float32 product."""
    if bf16:
        return Bf16Head.apply(hidden, weight)
    return hidden.float() @ weight.float().T


def _chunk_logprobs(
    hidden: torch.Tensor,  # [m, H]
    weight: torch.Tensor,  # [V, H] (bf16 for a bf16 head)
    targets: torch.Tensor,  # [m]
    temperature: float,
    bf16: bool = False,  # a bf16 head (``head_logprobs``)
) -> torch.Tensor:  # [m]
    with torch.autocast(hidden.device.type, enabled=False):
        logits = _head_logits(hidden, weight, bf16)  # [m, V] float32
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
    head: str = "auto",
) -> torch.Tensor:  # [M] float32
    """log softmax(hidden @ weight.T / temperature)[targets], ``chunk`` rows at a time, with
    float32 logits. With ``head='auto'`` on CUDA in bf16 (autocast on, or bf16 weights) the
    product takes bf16 inputs with float32 accumulation and output (``bf16_head``): a float32
    product over a 128k vocabulary would cost more than the whole bf16 trunk, and the inputs'
    rounding is that of the bf16 engine's own head; elsewhere, or with 'fp32', float32."""
    if head not in HEAD_PRECISIONS:
        raise ValueError(f"head precision must be one of {HEAD_PRECISIONS}, got {head!r}")
    bf16 = head == "auto" and bf16_head(hidden, weight)
    if bf16:
        weight = weight.to(torch.bfloat16)  # once per call, not per chunk (no-op when bf16)
    out = []
    for s in range(0, hidden.shape[0], chunk):
        h, t = hidden[s : s + chunk], targets[s : s + chunk]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            out.append(checkpoint(_chunk_logprobs, h, weight, t, temperature, bf16,
                                  use_reentrant=False))  # fmt: skip
        else:
            out.append(_chunk_logprobs(h, weight, t, temperature, bf16))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


def bf16_head(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``head_logprobs`` multiplies in bf16 (into float32): a CUDA device whose matmul
    takes ``out_dtype`` (``mm_out_dtype``), with bf16 autocast on or bf16 weights."""
    device = hidden.device
    if device.type != "cuda":
        return False
    bf16 = torch.is_autocast_enabled("cuda") or weight.dtype == torch.bfloat16
    return bf16 and mm_out_dtype(device)
