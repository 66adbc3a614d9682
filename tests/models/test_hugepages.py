"""Huge-page buffers (``specrl.kernels.hugepages``) and where they are used: zeroed tensors that
behave like any other; on huge pages where Linux grants them; the model's packed weights in one
buffer that a repack reuses in place; KV caches on them; and the same results throughout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specrl.kernels import gemv
from specrl.kernels.hugepages import HUGE_MIN_BYTES, huge_zeros
from specrl.models.linear import Linear, prepack
from tests.conftest import make_tiny

KERNEL = gemv.gemv_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="native kernels cannot run here")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
BF = torch.bfloat16


def thp_mode() -> str | None:
    """The selected transparent huge page mode ("always", "madvise", "never"), or None."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


def anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds ``address``."""
    inside, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


@pytest.mark.parametrize("numel", [10, HUGE_MIN_BYTES // 2 + 3])
def test_huge_zeros_is_an_ordinary_zeroed_tensor(numel):
    t = huge_zeros((numel,), BF)
    assert t.dtype == BF and t.shape == (numel,) and t.is_contiguous()
    assert not t.any()
    t[numel // 2] = 3.0
    t.view(-1)[:4] += 1
    assert t.sum().item() == 7.0


def test_huge_zeros_shapes_and_dtypes():
    t = huge_zeros((4, 3, HUGE_MIN_BYTES // 48), torch.float32)
    assert t.shape == (4, 3, HUGE_MIN_BYTES // 48) and t.dtype == torch.float32
    assert torch.equal(t[1:3], torch.zeros_like(t[1:3]))


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="no transparent huge pages")
def test_large_buffers_get_huge_pages():
    t = huge_zeros((16 << 20,), BF)  # 32 MiB: several whole 2 MiB pages inside
    t.fill_(1.0)  # touch every page
    assert anon_huge_kib(t.data_ptr()) >= 2048


def packed_buffers(model) -> list[torch.Tensor]:
    return [m.native_weight() for m in model.modules() if isinstance(m, Linear)]


@needs_kernel
def test_prepack_puts_the_packed_weights_in_one_buffer_and_repacks_in_place():
    model = make_tiny(head_dim=32).to(BF)
    prepack(model)
    packed = packed_buffers(model)
    assert packed and all(p is not None for p in packed)
    assert len({p.untyped_storage().data_ptr() for p in packed}) == 1
    for m, p in zip([m for m in model.modules() if isinstance(m, Linear)], packed, strict=True):
        assert torch.equal(p, KERNEL.pack(m.weight))  # what a fresh pack gives
    pointers = [p.data_ptr() for p in packed]
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Linear):
                m.weight.mul_(-2.0)  # a weight update in place
    prepack(model)
    after = packed_buffers(model)
    assert [p.data_ptr() for p in after] == pointers  # the same buffers, no new allocation
    for m, p in zip([m for m in model.modules() if isinstance(m, Linear)], after, strict=True):
        assert torch.equal(p, KERNEL.pack(m.weight))


@needs_kernel
def test_pack_refuses_a_buffer_of_another_shape():
    w = torch.randn(32, 64).to(BF)
    with pytest.raises(ValueError, match=r"\[32, 64\]"):
        KERNEL.pack(w, torch.empty(2, 32, 16, 2, dtype=BF).transpose(0, 1))
    with pytest.raises(ValueError, match=r"\[32, 64\]"):
        KERNEL.pack(w, torch.empty(1, 32, 16, 2, dtype=BF))


@needs_kernel
def test_prepacked_model_computes_what_a_lazily_packed_one_does():
    eager, lazy = make_tiny(head_dim=32).to(BF), make_tiny(head_dim=32).to(BF)
    prepack(eager)
    ids = torch.randint(0, eager.config.vocab_size, (3, 7))
    pos = torch.arange(7).expand(3, 7)
    with torch.inference_mode():
        a = eager(ids, pos, eager.new_cache(3, 8), kv_len=7, prefill=True).logits
        b = lazy(ids, pos, lazy.new_cache(3, 8), kv_len=7, prefill=True).logits
    assert torch.equal(a, b)


def test_kv_cache_on_huge_pages_is_zeroed_and_keeps_entries_when_grown():
    model = make_tiny(head_dim=32)
    cache = model.new_cache(64, 256)  # large enough for the huge-page path
    assert cache.k.numel() * cache.k.element_size() >= HUGE_MIN_BYTES and not cache.k.any()
    cache.k[:, 3, :, 5] = 2.0
    cache.grow(300)
    assert cache.max_len == 300 and cache.k[:, 3, :, 5].eq(2.0).all()
    assert cache.k.sum().item() == 2.0 * cache.k[:, 3, :, 5].numel()
