"""The one-call decoder (``specrl.models.fused``): bit for bit what the modules compute (logits,
hidden state, captured layers, the KV cache) for decode steps, verify passes, other slots and
draft trees; used exactly where it applies; a refused call writes nothing."""

from __future__ import annotations

import pytest
import torch

from specrl.kernels import gemv
from specrl.models.transformer import set_native_kernels
from tests.conftest import make_tiny

KERNEL = gemv.gemv_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="native kernels cannot run here")
BF = torch.bfloat16
PROMPT = 11


def tiny_bf16(**overrides):
    return make_tiny(head_dim=32, num_layers=3, hidden_size=64, intermediate_size=96,
                     num_heads=4, num_kv_heads=2, vocab_size=48, **overrides).to(BF)  # fmt: skip


@pytest.fixture
def calls(monkeypatch):
    """How many times the one-call path ran (the kernel the model gets now)."""
    kernel, seen = gemv.gemv_kernel(), []
    real = kernel.layers
    monkeypatch.setattr(kernel, "layers", lambda *a, **k: seen.append(1) or real(*a, **k))
    return seen


def run(model, fused: bool, b: int, t: int, tree=None, slots=None):
    """Prefill b rows, then three forwards of t tokens each (capturing layers 0 and 2); every
    output and the cache."""
    model.native_layers = fused
    g = torch.Generator().manual_seed(b * 10 + t)
    v = model.config.vocab_size
    cache = model.new_cache(8, PROMPT + 3 * t + 2)
    outs = []
    with torch.no_grad():
        prompt = torch.randint(0, v, (b, PROMPT), generator=g)
        model(prompt, torch.arange(PROMPT).expand(b, PROMPT), cache, kv_len=PROMPT, slots=slots,
              prefill=True)  # fmt: skip
        for step in range(3):
            start = PROMPT + step * t
            ids = torch.randint(0, v, (b, t), generator=g)
            if tree is None:
                pos = torch.arange(start, start + t).expand(b, t)
            else:  # RoPE at depth, stored from the root's position
                pos = start + torch.tensor([0, 1, 1, 2])[:t].expand(b, t)
            o = model(ids, pos, cache, kv_len=start + t, capture=(0, 2), slots=slots, tree=tree)
            outs.append([o.logits, o.hidden, *o.captured])
    return outs, cache


def assert_same(a, b):
    (outs_a, cache_a), (outs_b, cache_b) = a, b
    for xs, ys in zip(outs_a, outs_b, strict=True):
        assert len(xs) == len(ys) == 4
        for x, y in zip(xs, ys, strict=True):
            assert torch.equal(x, y)
    assert torch.equal(cache_a.k, cache_b.k) and torch.equal(cache_a.v, cache_b.v)


@needs_kernel
@pytest.mark.parametrize("b,t", [(1, 1), (5, 1), (3, 4)])
def test_one_call_equals_the_modules_bit_for_bit(b, t, calls):
    model = tiny_bf16()
    modules = run(model, False, b, t)
    assert calls == []
    assert_same(modules, run(model, True, b, t))
    assert len(calls) == 3  # every cached forward after the prefill


@needs_kernel
def test_other_slots_and_a_draft_tree_match_too(calls):
    model = tiny_bf16()
    slots = torch.tensor([6, 1, 3])
    assert_same(run(model, False, 3, 1, slots=slots), run(model, True, 3, 1, slots=slots))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert_same(run(model, False, 2, 4, tree=tree), run(model, True, 2, 4, tree=tree))
    assert len(calls) == 6


@needs_kernel
def test_the_modules_run_where_the_one_call_does_not_apply(calls):
    qwen3 = tiny_bf16(qk_norm=True)
    run(qwen3, True, 2, 1)
    model = tiny_bf16()
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None])  # no cache
    set_native_kernels(model, False)
    run(model, True, 2, 1)
    run(tiny_bf16().float(), True, 2, 1)  # float32
    assert calls == []


@needs_kernel
def test_a_weight_changed_in_place_is_repacked_before_the_one_call_uses_it(calls):
    model = tiny_bf16()
    run(model, True, 2, 1)
    with torch.no_grad():
        model.layers[1].mlp.down.weight.mul_(-1)  # a refit in place: the packed copy is stale
    assert model.layers[1].mlp.down.native_weight() is None
    fused = run(model, True, 2, 1)  # its prefill repacks; the cached forwards run in one call
    assert len(calls) == 6
    assert_same(run(model, False, 2, 1), fused)


@needs_kernel
def test_a_refused_call_raises_one_line_and_writes_nothing(calls):
    model = tiny_bf16()
    run(model, True, 2, 1)  # packs every product
    cache = model.new_cache(2, 8)
    before = cache.k.clone()
    with torch.no_grad(), pytest.raises(ValueError, match="decoder layers kernel refused"):
        model(torch.zeros(2, 1, dtype=torch.long), torch.full((2, 1), 8), cache, kv_len=8)
    assert torch.equal(cache.k, before)
    assert len(calls) == 4


@needs_kernel
@pytest.mark.parametrize("arch,fused_calls", [("proj", 3), ("eagle3", 0)])
def test_a_draft_heads_layer_runs_in_one_call_bit_for_bit(arch, fused_calls, calls):
    from specrl.models.heads import DraftHead

    target = tiny_bf16()
    head = DraftHead(target, "eagle3", arch=arch)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 5, 64, generator=g).to(BF)
    tokens = torch.randint(0, 48, (2, 5), generator=g)
    results = []
    for fused in (False, True):
        target.native_layers = fused
        cache = head.new_cache(3, 16)
        rows, slots = torch.tensor([[2], [0]]).expand(2, 5), torch.tensor([2, 0])
        with torch.no_grad():
            head.step(h, tokens, torch.arange(5).expand(2, 5), cache, rows, slots)
            g1 = head.step(h[:, :1], tokens[:, :1], torch.full((2, 1), 5), cache, rows[:, :1],
                           slots)  # fmt: skip
            g2 = head.step(g1, tokens[:, 1:2], torch.full((2, 1), 6), cache, rows[:, :1], slots)
        results.append((g1, g2, head.logits(g2[:, 0]), cache.k.clone(), cache.v.clone()))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert len(calls) == fused_calls  # the second pass: all three steps (packed by the first)


@needs_kernel
def test_prepack_packs_every_product_now_and_changes_no_result(calls):
    from specrl.models.linear import Linear, prepack

    model = tiny_bf16()
    before = run(model, True, 2, 1)
    with torch.no_grad():
        model.layers[1].mlp.down.weight.mul_(-1)
        model.layers[1].mlp.down.weight.mul_(-1)  # same values, a new version: stale copy
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert model.layers[1].mlp.down.native_weight() is None
    prepack(model)
    assert all(m.native_weight() is not None for m in linears)
    packed = [m.native_weight() for m in linears]
    after = run(model, True, 2, 1)  # no product is repacked: the same packed tensors
    assert all(m.native_weight() is p for m, p in zip(linears, packed, strict=True))
    assert_same(before, after)


def test_prepack_leaves_float32_and_autograd_models_unpacked():
    from specrl.models.linear import Linear, prepack

    model = tiny_bf16().float()
    prepack(model)
    assert all(m._native is None and m._packed is None
               for m in model.modules() if isinstance(m, Linear))  # fmt: skip
