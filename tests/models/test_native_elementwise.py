"""The native per-token kernels (RMSNorm with and without the residual add, SwiGLU's
silu * up, RoPE): they agree with the PyTorch ops they replace to a bf16 rounding flip, a row's
result does not depend on the other rows, and the modules use them only in bf16 inference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specrl.kernels import gemv
from specrl.models.rope import rotate_half
from specrl.models.transformer import (
    MLP,
    RMSNorm,
    set_native_elementwise,
    set_native_kernels,
)
from tests.conftest import make_tiny

KERNEL = gemv.gemv_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="native kernels cannot run here")
BF = torch.bfloat16


def close_to_rounding(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal but for rare one-ulp flips: no element off by more than one bf16 step of its
    size, and at most 1% of them off at all."""
    y, ref = y.float(), ref.float()
    off = y != ref
    step = ref.abs().clamp(min=1e-30) * 2**-7
    assert bool(((y - ref).abs() <= step).all()), float((y - ref).abs().max())
    assert float(off.float().mean()) <= 0.01


def torch_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@needs_kernel
@pytest.mark.parametrize("h", [576, 36])
def test_rmsnorm_and_residual_sum_agree_with_pytorch(h):
    g = torch.Generator().manual_seed(h)
    x, d = (torch.randn(5, 7, h, generator=g) * 3).to(BF), torch.randn(5, 7, h, generator=g).to(BF)
    w = (torch.rand(h, generator=g) + 0.5).to(BF)
    close_to_rounding(KERNEL.rmsnorm(x, w, 1e-5), torch_norm(x, w, 1e-5))
    total, normed = KERNEL.rmsnorm(x, w, 1e-5, delta=d)
    assert torch.equal(total, x + d)  # the residual stream itself is exact
    close_to_rounding(normed, torch_norm(x + d, w, 1e-5))


@needs_kernel
@pytest.mark.parametrize("i", [1536, 20])
def test_silu_mul_agrees_with_pytorch(i):
    gu = (torch.randn(9, 2 * i, generator=torch.Generator().manual_seed(i)) * 4).to(BF)
    gate, up = gu.chunk(2, dim=-1)
    close_to_rounding(KERNEL.silu_mul(gu), F.silu(gate) * up)


def rope_case(b: int, t: int, heads: int = 12, d: int = 64):
    """A fused projection's q|k view (strided, as Attention.project makes it), cos and sin."""
    g = torch.Generator().manual_seed(b * 100 + t)
    qkv = torch.randn(b, t, (heads + 3) * d, generator=g).to(BF)
    qk = qkv[..., : heads * d].view(b, t, heads, d)
    pos = torch.randint(0, 4000, (b, t), generator=g).float()
    freqs = pos[..., None] / 10000 ** (torch.arange(0, d, 2).float() / d)
    emb = torch.cat([freqs, freqs], -1)[:, :, None]  # [B, T, 1, D]
    return qk, emb.cos().to(BF), emb.sin().to(BF)


@needs_kernel
@pytest.mark.parametrize("b,t", [(1, 1), (3, 4)])
def test_rope_reads_the_projection_in_place_and_agrees_with_pytorch(b, t):
    qk, cos, sin = rope_case(b, t)
    out = KERNEL.rope(qk, cos, sin)
    assert out.is_contiguous() and out.shape == qk.shape
    close_to_rounding(out, qk * cos + rotate_half(qk) * sin)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows():
    g = torch.Generator().manual_seed(1)
    x, d = torch.randn(64, 576, generator=g).to(BF), torch.randn(64, 576, generator=g).to(BF)
    w = torch.rand(576, generator=g).to(BF)
    gu = torch.randn(64, 3072, generator=g).to(BF)
    assert torch.equal(KERNEL.rmsnorm(x[5:6], w, 1e-5), KERNEL.rmsnorm(x, w, 1e-5)[5:6])
    alone = KERNEL.rmsnorm(x[5:6], w, 1e-5, delta=d[5:6])[1]
    assert torch.equal(alone, KERNEL.rmsnorm(x, w, 1e-5, delta=d)[1][5:6])
    assert torch.equal(KERNEL.silu_mul(gu[5:6]), KERNEL.silu_mul(gu)[5:6])
    qk, cos, sin = rope_case(8, 4)
    whole = KERNEL.rope(qk, cos, sin)
    assert torch.equal(KERNEL.rope(qk[2:3, 1:2], cos[2:3, 1:2], sin[2:3, 1:2]), whole[2:3, 1:2])


@needs_kernel
def test_kernels_refuse_shapes_they_cannot_take():
    qk, cos, sin = rope_case(1, 1, d=48)
    with pytest.raises(ValueError, match="rope kernel refused"):
        KERNEL.rope(qk, cos, sin)


@needs_kernel
def test_modules_use_the_kernels_in_bf16_inference_only(monkeypatch):
    calls: list[str] = []
    kernel = gemv.gemv_kernel()  # what the modules get now (other tests clear the cache)
    for name in ("rmsnorm", "silu_mul"):
        real = getattr(kernel, name)
        monkeypatch.setattr(
            kernel, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k)
        )
    norm, mlp = RMSNorm(32, 1e-5).to(BF), MLP(make_tiny().config).to(BF)  # hidden size 32
    x = torch.randn(2, 3, 32).to(BF)
    with torch.no_grad():
        norm(x), norm.add_norm(x, x), mlp(x)
    assert calls == ["rmsnorm", "rmsnorm", "silu_mul"]
    calls.clear()
    norm(x.requires_grad_()).float().sum().backward()  # autograd: PyTorch's ops, gradients flow
    with torch.no_grad():
        norm.float()(x.float())  # float32: PyTorch's ops
        set_native_kernels(mlp, False)
        mlp(x)
    assert calls == [] and x.grad is not None


@needs_kernel
def test_a_model_with_the_native_elementwise_kernels_matches_pytorchs_ops():
    model = make_tiny(head_dim=32).to(BF).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        native = model(ids, pos).logits
        assert sum(isinstance(m, RMSNorm) and m.native for m in model.modules()) > 2
        set_native_elementwise(model, False)
        assert not any(getattr(m, "native_rope", False) for m in model.modules())
        plain = model(ids, pos).logits
    assert not torch.equal(native, torch.zeros_like(native))
    torch.testing.assert_close(native.float(), plain.float(), atol=0.05, rtol=0.05)


@needs_kernel
def test_cache_write_stores_what_index_put_stores_and_refuses_outside_positions():
    from specrl.models.cache import KVCache

    g = torch.Generator().manual_seed(4)
    native, plain = (KVCache(2, 5, 3, 16, 64, dtype=BF) for _ in range(2))
    qkv = torch.randn(4, 2, 9 * 64, generator=g).to(BF)  # v as Attention.project views it
    k, v = qkv[..., 3 * 64 : 6 * 64].view(4, 2, 3, 64), qkv[..., 6 * 64 :].view(4, 2, 3, 64)
    rows = torch.tensor([[4], [0], [2], [1]]).expand(4, 2)
    positions = torch.tensor([[0, 1], [7, 8], [14, 15], [3, 9]])
    with torch.no_grad():
        native.write(1, rows, positions, k, v)
    plain.k[1][rows, :, positions], plain.v[1][rows, :, positions] = k, v
    assert torch.equal(native.k, plain.k) and torch.equal(native.v, plain.v)
    before = native.k.clone()
    with pytest.raises(ValueError, match="cache write kernel refused"):
        KERNEL.cache_write(native.k[0], rows, positions + 1, k)  # position 16 of 16
    assert torch.equal(native.k, before)  # nothing written
