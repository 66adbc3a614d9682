"""A weight update on the native backend packs the engine's weights at once: the next rollout's
first forward packs nothing, and generates what the lazily packed engine generates."""

from __future__ import annotations

import pytest
import torch

from specrl.backends.native import NativeBackend
from specrl.engine import Engine
from specrl.kernels import gemv
from specrl.models.linear import Linear
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from tests.conftest import make_tiny

KERNEL = gemv.gemv_kernel()
REQUESTS = [Request([3, 5, 7, 9], SamplingParams(temperature=1.0, max_new_tokens=6, seed=s))
            for s in range(3)]  # fmt: skip


def engine_bf16() -> Engine:
    return Engine(make_tiny(head_dim=32).to(torch.bfloat16), max_batch=4)


def new_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {n: p + 0.3 * torch.randn(p.shape, generator=gen)
            for n, p in make_tiny(head_dim=32).named_parameters()}  # fmt: skip


@pytest.mark.skipif(KERNEL is None, reason="native kernels cannot run here")
def test_update_packs_now_and_the_next_rollout_packs_nothing(monkeypatch):
    backend = NativeBackend(engine_bf16())
    backend.generate(REQUESTS)
    backend.update_weights(new_weights(), version=1)
    linears = [m for m in backend.engine.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.native_weight() is not None for m in linears)
    lazy, named = engine_bf16(), new_weights()  # built (and packed) before the count starts
    packs, kernel = [], gemv.gemv_kernel()  # what the modules get now (other tests clear it)
    real = kernel.pack
    monkeypatch.setattr(kernel, "pack", lambda *a, **k: packs.append(1) or real(*a, **k))
    out = backend.generate(REQUESTS)
    assert packs == []
    # the same tokens as an engine that loads the weights and packs on first use
    with torch.no_grad():
        for name, p in lazy.model.named_parameters():
            p.copy_(named[name])
    expected = lazy.generate(REQUESTS)
    assert [c.token_ids for c in out.completions] == [c.token_ids for c in expected]
    assert len(packs) == len(linears)  # the lazy engine packed each product on first use


@pytest.mark.skipif(KERNEL is None, reason="native kernels cannot run here")
@pytest.mark.parametrize("in_flight", [None, "keep"])
def test_every_update_enters_through_load_weights_and_is_packed_there(in_flight, monkeypatch):
    """Idle, after the call, and in flight (between two decode steps): one way in,
    ``Engine.load_weights``, which leaves every product packed for the new weights."""
    engine = engine_bf16()
    backend = NativeBackend(engine, in_flight=in_flight)
    linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
    seen: list[tuple[int, bool, bool]] = []
    real = engine.load_weights

    def spy(named, version):
        real(named, version)
        running = engine._call is not None  # a generate call is decoding
        seen.append((version, running, all(m.native_weight() is not None for m in linears)))

    monkeypatch.setattr(engine, "load_weights", spy)
    backend.update_weights(new_weights(), version=1)  # idle: at once
    step, sent = engine._step, []  # the second update arrives while the call decodes

    def step_then_update(rows, start):
        if not sent:  # once, the backend busy generating
            sent.append(backend.update_weights(new_weights(), version=2))
        return step(rows, start)

    monkeypatch.setattr(engine, "_step", step_then_update)
    backend.generate(REQUESTS)
    assert seen == [(1, False, True), (2, in_flight is not None, True)]
    assert backend.versions().policy == engine.policy_version == 2
