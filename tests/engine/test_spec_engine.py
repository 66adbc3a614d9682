"""Speculative decoding in the engine is lossless: whole-sequence distributions, greedy identity."""

from __future__ import annotations

import copy
import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from specrl.backends.native import NativeBackend
from specrl.engine import Engine
from specrl.models.transformer import layer_prefix_model
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams, processed_logprobs_for
from specrl.spec import proposers
from specrl.spec.config import MAX_SPEC_TOKENS, SpecConfig
from specrl.spec.proposers import Draft, Proposer
from tests.conftest import DEVICES, assert_teacher_forced, make_tiny

VOCAB = 4
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive, so ngram/suffix drafters do propose
NEW = 3
DRAFTERS = ["ngram", "suffix", "self", "draft", "hybrid"]


def tiny_target():
    return make_tiny(seed=11, vocab_size=VOCAB)


def exact_distribution(model, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(sequence) for every NEW-token sequence, by enumeration with full forwards (CPU)."""
    model = copy.deepcopy(model).cpu()
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=NEW):
        ids = torch.tensor([PROMPT + list(seq)])
        logits = model(ids, torch.arange(ids.shape[1])[None]).logits[0, len(PROMPT) - 1 : -1]
        lp = processed_logprobs_for(logits, params)
        probs[seq] = float(lp.gather(1, torch.tensor(seq)[:, None]).sum().exp())
    return probs


def assert_matches_exact(out, target, params: SamplingParams) -> None:
    """Sampled whole sequences follow the exact distribution (chi-square, p > 0.001)."""
    counts = Counter(tuple(c.token_ids) for c in out)
    exact = exact_distribution(target, params)
    support = [s for s, p in exact.items() if p > 0]
    assert sum(counts[s] for s in exact if exact[s] == 0) == 0  # impossible sequences never
    observed = np.array([counts[s] for s in support], dtype=float)
    expected = np.array([exact[s] for s in support]) * len(out)
    expected *= observed.sum() / expected.sum()
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def engine_for(method: str, target, k: int = 3) -> Engine:
    """An engine over ``target`` (on its device) with drafter ``method``."""
    vocab = target.config.vocab_size
    draft = make_tiny(seed=5, vocab_size=vocab) if method == "draft" else None
    return Engine(target, max_batch=512, spec=SpecConfig(method, k), draft_model=draft)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", DRAFTERS)
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=NEW, n=3000, seed=1),
        SamplingParams(temperature=0.7, top_k=3, top_p=0.9, max_new_tokens=NEW, n=3000, seed=2),
    ],
    ids=["T1", "T0.7-topk3-topp0.9"],
)
def test_sequence_distribution_matches_exact(method, params, device):
    target = tiny_target().to(device)
    engine = engine_for(method, target)
    out = engine.generate([Request(PROMPT, params)])
    assert_matches_exact(out, target, params)
    assert engine.stats.drafted > 0  # the drafter really drafted


def test_self_drafter_accepts_everything():
    target = make_tiny(seed=2, vocab_size=16)
    k = 3
    engine = engine_for("self", target, k)
    params = SamplingParams(temperature=1.0, max_new_tokens=13, n=8, seed=4)
    out = engine.generate([Request([1, 2, 3], params)])
    assert engine.stats.accepted == engine.stats.drafted > 0
    assert engine.stats.per_position_acceptance == [1.0] * k
    for c in out:  # 13 tokens = 1 from the prefill + 3 verify steps of k+1
        assert c.acceptance_length == k + 1
        assert c.verify_steps == 3
    assert engine.stats.acceptance_length == k + 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", DRAFTERS)
def test_greedy_and_logprobs_equal_plain_tiny(method, device):
    target = make_tiny(seed=3, vocab_size=32).to(device)  # float32: greedy is exact
    prompts = [[1, 2, 3, 1, 2, 3], [5, 6, 7, 8], [9, 9, 9, 9, 9]]
    params = SamplingParams(temperature=0, max_new_tokens=12)
    plain = Engine(target, max_batch=2).generate([Request(p, params) for p in prompts])
    spec = engine_for(method, target).generate([Request(p, params) for p in prompts])
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.raw_logprobs), torch.tensor(b.raw_logprobs))


def test_stop_token_inside_accepted_run():
    """Nothing after a stop token is emitted, even when the drafts ran past it."""
    target = make_tiny(seed=3, vocab_size=32)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    free = Engine(target).generate([Request([1, 2, 3], params)])[0].token_ids
    stop = free[2]
    params = params.replace(stop_token_ids=(stop,))
    c = engine_for("self", target, k=4).generate([Request([1, 2, 3], params)])[0]
    assert c.token_ids == free[: free.index(stop) + 1]
    assert c.finish_reason == "stop"


def test_per_call_override_and_varying_k():
    target = make_tiny(seed=3, vocab_size=32)
    engine = Engine(target, spec=SpecConfig("self", 2))
    params = SamplingParams(temperature=0, max_new_tokens=9)
    base = engine.generate([Request([4, 5], params)], spec=SpecConfig("none"))[0]
    assert engine.stats.drafted == 0
    for k in (1, 2, 5):
        c = engine.generate([Request([4, 5], params)], spec=SpecConfig("self", k))[0]
        assert c.token_ids == base.token_ids
        assert c.verify_steps == -(-8 // (k + 1))  # the prefill emits the first token


@pytest.mark.parametrize(
    "spec,draft_kwargs,match",
    [
        (SpecConfig("ngram", -1), {}, "num_spec_tokens must be in"),
        (SpecConfig("ngram", MAX_SPEC_TOKENS + 1), {}, "num_spec_tokens must be in"),
        (SpecConfig("nope", 3), {}, "unknown speculation method 'nope'"),
        (SpecConfig("draft", 3), {}, "needs a draft model"),
        (SpecConfig("draft", 3), {"vocab_size": 16}, r"drafter vocabulary \(16\) differs"),
        (SpecConfig("draft", 3), {"max_position_embeddings": 32}, "drafter context"),
    ],
)
def test_bad_speculation_is_refused_when_the_engine_is_built(spec, draft_kwargs, match):
    target = make_tiny(vocab_size=32)
    draft = make_tiny(**({"vocab_size": 32} | draft_kwargs)) if draft_kwargs else None
    with pytest.raises(ValueError, match=match):
        Engine(target, spec=spec, draft_model=draft)


def test_layer_prefix_model_is_a_copy():
    target = make_tiny(num_layers=2)
    small = layer_prefix_model(target, 1)
    assert small.config.num_layers == 1
    assert torch.equal(small.layers[0].mlp.down.weight, target.layers[0].mlp.down.weight)
    small.layers[0].mlp.down.weight.data.zero_()
    assert target.layers[0].mlp.down.weight.abs().sum() > 0


def test_k_adapts_to_batch_size():
    spec = SpecConfig("ngram", 3, max_tokens_per_forward=16)
    assert [spec.k_for_batch(b) for b in (1, 4, 5, 8, 9, 64)] == [3, 3, 2, 1, 0, 0]
    target = make_tiny(seed=3, vocab_size=32)
    params = SamplingParams(temperature=0, max_new_tokens=10)
    prompts = [[1, 2, 3, 1, 2, 3]] * 12
    plain = Engine(target).generate([Request(p, params) for p in prompts])
    engine = Engine(target, spec=SpecConfig("self", 3, max_tokens_per_forward=8))
    out = engine.generate([Request(p, params) for p in prompts])
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    assert engine.stats.drafted == 0  # 12 rows: 8 // 12 - 1 < 1, every step plain
    with pytest.raises(ValueError, match="max_tokens_per_forward"):
        SpecConfig("ngram", 3, max_tokens_per_forward=0).validate()


@pytest.mark.parametrize(
    "method, siblings, temperature, max_batch",
    [("ngram", 0, 0.0, 64), ("eagle3", 3, 1.0, 64), ("eagle3", 0, 1.0, 1)],
    ids=["chain", "tree", "stashed-prompt"],
)
def test_engine_hands_verification_features_to_learned_drafters(
    method, siblings, temperature, max_batch
):
    """A drafter asking for hidden layers gets, each step, exactly the features of the positions
    that became history, taken from the verification forward itself (also after an accepted
    sibling, whose features were computed at its place in the draft tree, and for samples
    admitted after the first, whose prompt features come from the stashed prefill)."""
    target = make_tiny(seed=3, vocab_size=32)
    engine = Engine(target, max_batch=max_batch, spec=SpecConfig(method, 3, siblings=siblings))
    proposer, seen = engine.proposer, []
    if not getattr(proposer, "hidden_layers", None):  # a model-free drafter made to ask
        proposer.hidden_layers = (0, 1)
    propose = proposer.propose

    def recording(batch, k):
        seen.extend(zip([list(h) for h in batch.histories], batch.hidden, strict=True))
        return propose(batch, k)

    proposer.propose = recording
    params = SamplingParams(temperature=temperature, max_new_tokens=16, n=4, seed=1)
    engine.generate([Request([1, 2, 3, 1, 2, 3], params)])
    assert seen
    assert (engine.stats.sibling_accepted > 0) == (siblings > 0)
    assert_teacher_forced(target, proposer.hidden_layers, seen)


def test_stats_per_call_and_cumulative():
    target = make_tiny(seed=3, vocab_size=32)
    engine = Engine(target, spec=SpecConfig("self", 2))
    params = SamplingParams(temperature=1.0, max_new_tokens=7, seed=0)
    calls = []
    for prompt in ([1, 2, 3], [4, 5]):
        engine.generate([Request(prompt, params)])
        calls.append((engine.stats.drafted, engine.stats.tokens, engine.stats.row_steps))
    total = engine.total_stats
    assert (total.drafted, total.tokens, total.row_steps) == tuple(
        map(sum, zip(*calls, strict=True))
    )
    assert total.per_position_drafted == [sum(c[0] for c in calls) // 2] * 2
    assert total.acceptance_length == (14 - 2) / total.row_steps  # two prefills: 1 token each


def sibling_engine(method: str, target, siblings: int) -> Engine:
    vocab = target.config.vocab_size
    draft = make_tiny(seed=5, vocab_size=vocab) if method == "draft" else None
    spec = SpecConfig(method, 3, siblings=siblings)
    return Engine(target, max_batch=512, spec=spec, draft_model=draft)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_siblings_sequence_distribution_matches_exact(method, device):
    """First-token siblings (a draft tree) leave whole-sequence distributions exact."""
    target = tiny_target().to(device)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=NEW, n=3000, seed=3)
    engine = sibling_engine(method, target, siblings=2)
    out = engine.generate([Request(PROMPT, params)])
    assert_matches_exact(out, target, params)
    assert engine.stats.sibling_accepted > 0


def test_sibling_acceptance_keeps_cache_and_logprobs_exact():
    """After a sibling is accepted its cache entries move to the first draft position: every
    later token's raw logprob equals a full forward of the finished sequence (fp32)."""
    target = make_tiny(seed=3, vocab_size=32)
    prompt = [1, 2, 3, 4, 5]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, n=6, seed=9)
    engine = sibling_engine("draft", target, siblings=3)
    out = engine.generate([Request(prompt, params)])
    assert engine.stats.sibling_accepted > 0
    for c in out:
        ids = torch.tensor([prompt + c.token_ids])
        logits = target(ids, torch.arange(ids.shape[1])[None]).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(c.token_ids)[:, None])
        torch.testing.assert_close(torch.tensor(c.raw_logprobs), ref[:, 0], atol=1e-4, rtol=0)


def test_greedy_output_unchanged_with_siblings():
    """Greedy decoding with siblings on equals plain greedy (that a one-hot q yields no valid
    sibling at all is tested on ``draw_siblings`` in tests/spec/test_siblings.py)."""
    target = make_tiny(seed=3, vocab_size=32)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    plain = Engine(target, max_batch=2).generate([Request([1, 2, 3], params)])
    engine = sibling_engine("draft", target, siblings=2)
    spec = engine.generate([Request([1, 2, 3], params)])
    assert plain[0].token_ids == spec[0].token_ids
    assert engine.stats.sibling_accepted == 0


class ProposeOnly(Proposer):
    """A drafter with only what one must have (every other hook: the base class's no-op):
    the row's last two tokens, again."""

    deterministic = True

    def propose(self, batch, k: int) -> Draft:
        return Draft.from_lists([h[-2:] for h in batch.histories], k)


def test_a_drafter_with_only_propose_runs_and_is_lossless(monkeypatch):
    """The engine and the native backend call every optional hook unconditionally: the base
    class's defaults serve (no state, no tensors, no weights to load)."""
    monkeypatch.setitem(proposers.PROPOSERS._items, "propose-only", ProposeOnly)
    monkeypatch.setattr(ProposeOnly, "name", "propose-only", raising=False)
    target = tiny_target()
    params = SamplingParams(temperature=0, max_new_tokens=12, n=2)
    plain = Engine(target, max_batch=8).generate([Request(PROMPT, params)])
    backend = NativeBackend(Engine(target, max_batch=8, spec=SpecConfig("propose-only", 2)))
    out = backend.generate([Request(PROMPT, params)])
    assert [c.token_ids for c in out.completions] == [c.token_ids for c in plain]
    assert out.stats.drafted > 0
    assert backend.state_dict() == {} and backend.served().drafter is None
    backend.update_drafter({}, 1)  # nothing to load
    with pytest.raises(ValueError, match="keeps none"):
        backend.load_state_dict({"drafter": {"name": "suffix"}})


def test_only_a_proposer_subclass_can_be_registered():
    with pytest.raises(TypeError, match="does not subclass"):
        proposers.register_proposer("not-a-proposer")(type("Loose", (), {}))
