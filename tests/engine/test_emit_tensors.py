"""The engine's tensor hand-off: ``Call.emit``'s stop/length cut against the per-token loop it
replaced, a row's record as tensors, ``RolloutTensors`` views and the learner's behaviour
tensors against a per-row reference."""

from __future__ import annotations

import pickle
import random

import torch

from specrl.engine.call import _cut
from specrl.engine.rows import Seq
from specrl.rl.learner import Learner, TrainSample
from specrl.rollout_types import Completion, RolloutTensors
from specrl.sampling import SamplingParams


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


def test_record_restart_and_tensors() -> None:
    rng = random.Random(1)
    seq = _seq(rng, frozenset())
    seq.restart_record()
    seq.record([4, 5], [-1.0, -2.0], [-1.5, -2.5], 3)
    seq.record([6], [-3.0], [-3.5], 4)
    tokens, lp, raw, versions = seq.tensors()
    assert seq.history == [1, 2, 3, 4, 5, 6] and tokens.tolist() == [4, 5, 6]
    assert lp.tolist() == [-1.0, -2.0, -3.0] and raw.tolist() == [-1.5, -2.5, -3.5]
    assert versions.tolist() == [3, 3, 4] and tokens.dtype == torch.int64
    seq.restart_record()
    assert seq.history == [1, 2, 3] and all(t.numel() == 0 for t in seq.tensors())


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
