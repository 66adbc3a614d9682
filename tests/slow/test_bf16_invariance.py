"""The real SmolLM2 in bf16 (the default dtype): speculation changes nothing, bit for bit.

With the native kernels (``specrl.kernels.gemv``: products and cache attention whose sums run in
one fixed order per output element) a position's logits do not depend on how many rows or query
positions share its forward. So greedy speculative output equals greedy plain output for every
drafter, a request's tokens and logprobs do not depend on its batch neighbours, and sample-exact
speculation (``exact="sample"``) reproduces plain sampling token for token, all in bf16.
"""

from __future__ import annotations

import pytest

from specrl.engine import Engine
from specrl.kernels import gemv
from specrl.models.transformer import layer_prefix_model
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig
from tests.conftest import PROMPTS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(gemv.gemv_kernel() is None, reason="native kernels cannot run here"),
]
DRAFTERS = ["ngram", "suffix", "self", "draft", "eagle3", "mtp"]
NEW_TOKENS = 64


def run(model, requests: list[Request], spec: SpecConfig | None = None, warm=()) -> tuple:
    """Completions of ``requests`` in one engine batch, and the engine's stats; ``warm``
    requests run first (the suffix drafter indexes their completions)."""
    spec = spec or SpecConfig("none", 0)
    draft = layer_prefix_model(model, 4) if spec.method == "draft" else None
    engine = Engine(model, max_batch=64, spec=spec, draft_model=draft)
    if warm:
        engine.generate(list(warm))
    return engine.generate(requests), engine.stats


@pytest.fixture(scope="module")
def prompts(smollm2_tok) -> list[list[int]]:
    return [smollm2_tok.encode_chat(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def greedy_plain(smollm2_bf16, prompts) -> list:
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS)
    return run(smollm2_bf16, [Request(p, params) for p in prompts])[0]


@pytest.mark.parametrize("method", DRAFTERS)
def test_greedy_speculation_equals_greedy_plain_in_bf16(
    smollm2_bf16, prompts, greedy_plain, method
):
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS)
    requests = [Request(p, params) for p in prompts]
    warm = requests[:10] if method == "suffix" else ()
    spec, stats = run(smollm2_bf16, requests, SpecConfig(method, 3), warm)
    assert stats.drafted > 0
    assert all(len(c.token_ids) == NEW_TOKENS for c in greedy_plain)  # no early stops hide text
    for a, b in zip(greedy_plain, spec, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # the same logits: the same numbers, not close ones
    if method in ("self", "ngram", "suffix"):
        assert stats.accepted > 0


def test_a_request_does_not_depend_on_its_batch_neighbours(smollm2_bf16, prompts):
    """Sampled at T=1 with its own seed, one request alone, among 8 and among 64 others (other
    prompts, other lengths) gives the same tokens and logprobs, bit for bit."""
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=11)
    mine = Request(prompts[3], params)
    others = [Request(prompts[i % 20], SamplingParams(temperature=1.0, max_new_tokens=48, seed=i))
              for i in range(1, 64)]  # fmt: skip
    alone = run(smollm2_bf16, [mine])[0][0]
    for batch in (8, 64):
        got = run(smollm2_bf16, others[: batch // 2] + [mine] + others[batch // 2 : batch - 1])[0]
        row = got[batch // 2]
        assert row.token_ids == alone.token_ids
        assert row.logprobs == alone.logprobs


@pytest.mark.parametrize(
    "settings", [dict(), dict(top_k=20, top_p=0.9)], ids=["plain", "topk-topp"]
)
def test_sample_exact_speculation_equals_plain_sampling_in_bf16(smollm2_bf16, prompts, settings):
    params = SamplingParams(temperature=1.0, max_new_tokens=32, seed=5, **settings)
    requests = [Request(p, params) for p in prompts[:8]]
    plain = run(smollm2_bf16, requests)[0]
    for method in DRAFTERS:
        warm = requests[:4] if method == "suffix" else ()
        spec, stats = run(smollm2_bf16, requests, SpecConfig(method, 3, exact="sample"), warm)
        assert stats.drafted > 0, method
        for a, b in zip(plain, spec, strict=True):
            assert a.token_ids == b.token_ids, method
            assert a.logprobs == b.logprobs, method
