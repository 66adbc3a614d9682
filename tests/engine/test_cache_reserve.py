"""The KV cache is not reserved for prompt + max_new_tokens up front: it starts at the longest
prompt plus ``Engine.cache_chunk`` positions and grows as rows get longer, with the same tokens as
a full reservation; a request longer than the context is clamped there (finish_reason "length")."""

from __future__ import annotations

import pytest
import torch

from specrl.engine import Engine
from specrl.models.cache import KVCache
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig
from tests.conftest import make_tiny
from tests.engine.test_inflight import SwitchEngine, policy_b, weights

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive: the ngram drafter proposes
FULL = 10**9  # a cache_chunk that makes the engine reserve everything up front (the old way)


def test_kv_cache_grow_keeps_entries_and_zero_fills():
    cache = KVCache(2, 3, 2, 5, 4)
    cache.k.normal_()
    cache.v.normal_()
    k, v = cache.k.clone(), cache.v.clone()
    k_ptr, v_ptr = cache.k.data_ptr(), cache.v.data_ptr()
    cache.grow(4)  # shorter: nothing changes, not even the storage (no copy was made)
    assert (cache.k.data_ptr(), cache.v.data_ptr()) == (k_ptr, v_ptr)
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v) and cache.max_len == 5
    cache.grow(9)
    assert cache.k.shape == (2, 3, 2, 9, 4) and cache.max_len == 9
    assert torch.equal(cache.k[:, :, :, :5], k) and torch.equal(cache.v[:, :, :, :5], v)
    assert not cache.k[:, :, :, 5:].any() and not cache.v[:, :, :, 5:].any()


def test_huge_max_new_tokens_does_not_reserve_the_context():
    """``--n 16 --max-new-tokens 100000``: 16 rows that stop at once must not hold 16 x 4096
    cache positions (the old reservation: prompt + max_new_tokens, capped at the context)."""
    model = make_tiny(max_position_embeddings=4096)
    c = model.config
    every_token = tuple(range(c.vocab_size))  # each sample stops at its first token
    params = SamplingParams(max_new_tokens=100_000, n=16, seed=0, stop_token_ids=every_token)
    engine = Engine(model, max_batch=16)
    out = engine.generate([Request(PROMPT, params)])
    assert [len(x.token_ids) for x in out] == [1] * 16
    length = len(PROMPT) + 1 + Engine.cache_chunk
    assert engine.cache.k.shape == (c.num_layers, 16, c.num_kv_heads, length, c.head_dim)
    old = Engine(model, max_batch=16)
    old.cache_chunk = FULL
    old.generate([Request(PROMPT, params)])
    assert old.cache.max_len == 4096 + 1  # what every such call used to allocate
    assert engine.cache.k.nbytes * 15 < old.cache.k.nbytes


@pytest.mark.parametrize(
    "spec",
    [None, SpecConfig("ngram", 3), SpecConfig("suffix", 2)],
    ids=["plain", "ngram", "suffix"],
)
def test_growing_cache_gives_the_tokens_of_a_full_reservation(spec):
    """Rows run to the context (max_new_tokens far past it: clamped, finish_reason "length");
    a cache grown from 4 spare positions gives exactly the tokens and logprobs of a full one."""
    context = 160
    model = make_tiny(seed=3, max_position_embeddings=context)
    params = SamplingParams(temperature=1.0, max_new_tokens=100_000, n=5, seed=4)
    reqs = [Request(PROMPT, params), Request(PROMPT[:3], params.replace(seed=9))]
    outs, engines = [], []
    for chunk in (4, FULL):
        engine = Engine(model, max_batch=3, spec=spec)  # 3 < 10 rows: refills and a stash
        engine.cache_chunk = chunk
        outs.append(engine.generate(reqs))
        engines.append(engine)
    grown, full = outs
    margin = 0 if spec is None else spec.k + 1
    assert engines[1].cache.max_len == context + margin + 1  # reserved up front
    assert len(PROMPT) + margin + 1 + 4 < engines[0].cache.max_len <= context + margin + 1
    for a, b in zip(grown, full, strict=True):
        assert a.finish_reason == b.finish_reason == "length"
        assert len(a.prompt_ids) + len(a.token_ids) == context
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs and a.raw_logprobs == b.raw_logprobs


@pytest.mark.parametrize("mode", ["reverify", "discard"])
def test_in_flight_update_after_growth_matches_a_full_reservation(mode):
    """Re-verification pads past every history inside the cache: still exact after growing."""
    params = SamplingParams(temperature=1.0, max_new_tokens=100_000, n=3, seed=5)
    outs = []
    for chunk in (4, FULL):
        update = (weights(policy_b(32)), 7, mode)
        model = make_tiny(seed=11, vocab_size=32, max_position_embeddings=96)
        engine = SwitchEngine(model, [update], at=40, max_batch=3)  # switch after 40 steps
        engine.cache_chunk = chunk
        outs.append(engine.generate([Request(PROMPT, params)]))
        assert engine.stats.weight_updates == 1
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids and a.token_versions == b.token_versions
        assert a.logprobs == b.logprobs
