"""The engine's tensor hand-off: ``Call.emit``'s stop/length cut against the per-token loop it
replaced, a row's record as tensors, ``RolloutTensors`` views and the learner's behaviour
tensors against a per-row reference."""

from __future__ import annotations

import pickle
import random

import torch

from specrl.engine.call import Call, _cut
from specrl.engine.rows import ActiveSpec, Seq
from specrl.rl.learner import Learner, TrainSample
from specrl.rollout_types import Completion, EngineStats, RolloutTensors
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig


def _seq(rng: random.Random, stop: frozenset[int]) -> Seq:
    prompt = [1, 2, 3]
    done = rng.randrange(0, 6)
    history = prompt + [rng.randrange(8) for _ in range(done)]
    limit = len(history) + rng.randrange(1, 6)
    return Seq(Completion(0, 0, prompt), SamplingParams(), history, limit, 0, 0, stop)


def _reference_cut(seq: Seq, toks: list[int], n: int) -> tuple[int, bool]:
    """The per-token loop ``emit`` had: append, stop at a stop token, then at the limit."""
    length = len(seq.history)
    for j, tok in enumerate(toks[:n]):
        length += 1
        if tok in seq.stop:
            return j + 1, True
        if length >= seq.max_total:
            return j + 1, False
    return n, False


def test_cut_equals_the_per_token_loop() -> None:
    rng = random.Random(0)
    stops = [frozenset({5}), frozenset({5, 6}), frozenset(), frozenset({0, 7})]
    for _ in range(2000):
        seq = _seq(rng, rng.choice(stops))
        t = rng.randrange(1, 5)
        toks = [rng.randrange(8) for _ in range(t)]
        n = rng.randrange(1, t + 1)
        assert _cut(seq, toks, n) == _reference_cut(seq, toks, n)


class _Call(Call):
    """``Call.emit`` alone: no model or cache (it touches neither)."""

    def __init__(self) -> None:
        self.stats, self.version, self.active = EngineStats(), 3, ActiveSpec(SpecConfig("none", 0))


def test_emit_records_cuts_finishes_and_restarts() -> None:
    call, rng = _Call(), random.Random(1)
    seq = _seq(rng, frozenset({9}))
    seq.max_total = len(seq.history) + 100
    seq.restart_record()
    tokens = torch.tensor([[4, 5, 7], [1, 1, 1]])
    lp = -tokens.float()
    done = call.emit([seq, _seq(rng, frozenset())], tokens, lp, lp * 2, torch.tensor([2, 1]),
                     0.0, first=True)  # fmt: skip
    assert 0 not in done  # two tokens kept, no stop: the row goes on
    call.version = 4
    assert call.emit([seq], torch.tensor([[6, 9, 8]]), -torch.ones(1, 3), -torch.ones(1, 3),
                     None, 0.0) == [0]  # stops at 9, the 8 after it dropped  # fmt: skip
    tokens, lp, raw, versions = seq.comp.tokens, seq.comp.token_logprobs, *seq.tensors()[2:]
    assert seq.history == [1, 2, 3, 4, 5, 6, 9] and tokens.tolist() == [4, 5, 6, 9]
    assert lp.tolist() == [-4.0, -5.0, -1.0, -1.0] and raw.tolist() == [-8.0, -10.0, -1.0, -1.0]
    assert versions.tolist() == [3, 3, 4, 4] and seq.comp.finish_reason == "stop"
    assert seq.comp.verify_steps == 1 and seq.emitted == 4 and call.stats.tokens == 5
    seq.restart_record()
    assert seq.history == [1, 2, 3] and seq.emitted == 0
    assert all(t.numel() == 0 for t in seq.tensors())


def test_rollout_tensors_views_and_compact_pickles() -> None:
    comps = [
        Completion(0, 0, [1], [4, 5, 6], [-1.0, -2.0, -3.0], [-1.5, -2.5, -3.5], [2, 2, 3]),
        Completion(0, 1, [1], [7], [-4.0], [], policy_version=9),  # no raw logprobs, versions
        Completion(1, 0, [2]),  # no token
    ]
    flat = RolloutTensors.of(comps)
    assert flat.offsets.tolist() == [0, 3, 4, 4]
    assert flat.tokens.tolist() == [4, 5, 6, 7] and flat.versions.tolist() == [2, 2, 3, 9]
    assert torch.isnan(flat.raw_logprobs[3])
    assert flat.raw_logprobs[:3].tolist() == [-1.5, -2.5, -3.5]
    flat.share(comps)
    assert comps[0].tokens.data_ptr() == flat.tokens.data_ptr()  # a view, no copy
    assert comps[1].token_raw_logprobs.numel() == 0  # a missing column stays missing
    assert comps[0].token_ids == [4, 5, 6] and comps[1].token_versions == [9]
    again = pickle.loads(pickle.dumps(comps[1]))
    assert again == comps[1] and again.tokens.untyped_storage().nbytes() == 8


def test_behaviour_tensors_equal_the_per_row_build() -> None:
    g = torch.Generator().manual_seed(1)
    lens = [3, 0, 5, 2]
    samples = [
        TrainSample([1], list(range(n)), 1.0, None if i == 1 else torch.randn(n, generator=g))
        for i, n in enumerate(lens)
    ]
    samples[3] = TrainSample([1], [0, 1], 1.0, samples[3].old_logprobs.tolist())  # a list too
    current = torch.randn(len(lens), max(lens), generator=g)  # [N, T]
    got, has = Learner._behaviour(samples, current)
    want = current.clone()
    for i, s in enumerate(samples):
        if s.old_logprobs is not None:
            want[i, : lens[i]] = torch.as_tensor(s.old_logprobs)
    assert torch.equal(got, want) and has.tolist() == [True, False, True, True]
