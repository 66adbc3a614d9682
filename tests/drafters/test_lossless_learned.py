"""Learned drafters (EAGLE-3, MTP, block) keep speculation lossless: whole-sequence distribution
on a tiny model matches exact enumeration (chi-square), and greedy output equals plain decoding."""

from __future__ import annotations

import pytest
import torch

from specrl.engine import Engine
from specrl.models.head_kinds import new_head
from specrl.models.heads import DraftHead
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig
from tests.conftest import make_tiny
from tests.engine.test_spec_engine import NEW, PROMPT, VOCAB, assert_matches_exact

torch.set_num_threads(1)
KINDS = ["eagle3", "mtp", "eagle3-vocab", "block", "block-vocab"]  # -vocab: half the tokens


def noisy_head(target, kind: str, seed: int = 0) -> DraftHead:
    """An untrained head with large random weights: drafts differ from the target a lot."""
    torch.manual_seed(seed)
    kind, reduced = kind.removesuffix("-vocab"), kind.endswith("-vocab")
    v = target.config.vocab_size
    head = new_head(target, kind, draft_vocab=torch.arange(1, v, 2) if reduced else None)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return head.eval()


def engine_for(kind: str, target, k: int = 3, max_batch: int = 512) -> Engine:
    head = noisy_head(target, kind)
    spec = SpecConfig(head.kind, k, options={"drafter": head})
    return Engine(target, max_batch=max_batch, spec=spec)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=NEW, n=3000, seed=1),
        SamplingParams(temperature=0.7, top_k=3, top_p=0.9, max_new_tokens=NEW, n=3000, seed=2),
    ],
    ids=["T1", "T0.7-topk3-topp0.9"],
)
def test_sequence_distribution_matches_exact(kind, params):
    target = make_tiny(seed=11, vocab_size=VOCAB, num_layers=4)
    engine = engine_for(kind, target)
    out = engine.generate([Request(PROMPT, params)])
    assert_matches_exact(out, target, params)
    st = engine.stats
    assert st.drafted > 0 and st.accepted < st.drafted  # drafts were made, some rejected
    if params.temperature == 1.0:
        assert st.accepted > 0  # ... and at T=1 some accepted


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_and_logprobs_equal_plain_tiny(kind):
    target = make_tiny(seed=3, vocab_size=32, num_layers=4)
    prompts = [[1, 2, 3, 1, 2, 3], [5, 6, 7, 8], [9, 9, 9, 9, 9]]
    params = SamplingParams(temperature=0, max_new_tokens=12, n=2)
    plain = Engine(target, max_batch=2).generate([Request(p, params) for p in prompts])
    engine = engine_for(kind, target, max_batch=3)  # continuous batching: rows join and leave
    spec = engine.generate([Request(p, params) for p in prompts])
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.raw_logprobs), torch.tensor(b.raw_logprobs))
    assert engine.stats.drafted > 0


def test_engine_refuses_head_of_another_target():
    target = make_tiny(seed=3, vocab_size=32, num_layers=4)
    other = make_tiny(seed=3, vocab_size=32, num_layers=6)
    with pytest.raises(ValueError, match="layer count 6, but the target has 4"):
        Engine(target, spec=SpecConfig("eagle3", 3, options={"drafter": DraftHead(other)}))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_greedy_equal_plain_smollm2(kind, smollm2, smollm2_tok):
    """SmolLM2 (fp32): greedy output with a learned drafter equals plain decoding. Uses the
    trained head from the user cache when present (``specrl train-drafter``), else a random one."""
    from specrl.models.head_kinds import load_head
    from specrl.paths import drafter_cache_dir
    from tests.conftest import PROMPTS

    path = drafter_cache_dir("smollm2-135m-instruct", kind)
    torch.manual_seed(0)
    head = load_head(path, smollm2) if (path / "head.json").exists() else DraftHead(smollm2, kind)
    prompts = [smollm2_tok.encode_chat(p) for p in PROMPTS[:6]]
    params = SamplingParams(temperature=0, max_new_tokens=24)
    plain = Engine(smollm2, max_batch=4).generate([Request(p, params) for p in prompts])
    engine = Engine(smollm2, max_batch=4, spec=SpecConfig(kind, 3, options={"drafter": head}))
    spec = engine.generate([Request(p, params) for p in prompts])
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids
    assert engine.stats.drafted > 0
