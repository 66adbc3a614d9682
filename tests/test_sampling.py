"""Sampling: processed distributions are right, sampled tokens follow them (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specrl import sampling
from specrl.kernels import gemv
from specrl.sampling import (
    SMALL_DRAW,
    STREAM_SAMPLE,
    SamplingParams,
    draw,
    processed_logprobs,
    raw_logprobs,
    raw_logprobs_reusing,
    sample,
    sample_logits,
    uniforms,
)


def naive_processed(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """A slow, obviously-correct reference for one row."""
    if t == 0:
        out = torch.zeros_like(logits)
        out[logits.argmax()] = 1
        return out
    probs = torch.softmax(logits / t, -1)
    order = sorted(range(len(logits)), key=lambda i: -float(logits[i]))
    keep = order[:k] if k > 0 else order
    kept = torch.zeros_like(probs)
    kept[keep] = probs[keep]
    kept = kept / kept.sum()
    mass, chosen = 0.0, []
    for i in sorted(keep, key=lambda i: -float(kept[i])):
        if mass >= p:
            break
        chosen.append(i)
        mass += float(kept[i])
    final = torch.zeros_like(probs)
    final[chosen] = kept[chosen]
    return final / final.sum()


SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.6), (0.8, 4, 0.7), (0, 0, 1.0)]


@pytest.mark.parametrize("t,k,p", SETTINGS)
def test_processed_matches_reference(t, k, p):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 8, generator=gen) * 2
    before = logits.clone()
    n = logits.shape[0]
    lp = processed_logprobs(logits, torch.full((n,), t), torch.full((n,), k), torch.full((n,), p))
    assert torch.equal(logits, before)  # input untouched
    for row in range(n):
        ref = naive_processed(logits[row], t, k, p)
        torch.testing.assert_close(lp[row].exp(), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("t,k,p", SETTINGS)
def test_sampled_tokens_follow_processed_distribution(t, k, p):
    """Chi-square goodness of fit with fixed seeds (p-value > 0.001)."""
    vocab, draws = 8, 20000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(2)) * 1.5
    rows = logits.expand(draws, vocab)
    lp = processed_logprobs(
        rows, torch.full((draws,), t), torch.full((draws,), k), torch.full((draws,), p)
    )
    u = uniforms(torch.full((draws,), 1234), torch.arange(draws), STREAM_SAMPLE)
    counts = np.bincount(sample(lp, u).numpy(), minlength=vocab)
    probs = lp[0].exp().double().numpy()
    assert counts[probs == 0].sum() == 0  # masked tokens never drawn
    support = probs > 0
    if support.sum() == 1:
        assert counts[support][0] == draws
        return
    expected = probs[support] / probs[support].sum() * draws
    assert stats.chisquare(counts[support], expected).pvalue > 1e-3


def test_uniforms_are_uniform_and_stream_independent():
    n = 50000
    seeds = torch.arange(n) * 7919
    a = uniforms(seeds, torch.zeros(n, dtype=torch.int64), 1).numpy()
    b = uniforms(seeds, torch.zeros(n, dtype=torch.int64), 2).numpy()
    assert stats.kstest(a, "uniform").pvalue > 1e-3
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.02
    assert ((a >= 0) & (a < 1)).all()
    # pure function of (seed, counter, stream)
    again = uniforms(seeds[:10], torch.zeros(10, dtype=torch.int64), 1).numpy()
    assert np.array_equal(again, a[:10])


def test_small_draws_hash_with_python_ints_bit_for_bit():
    """Draws of <= SMALL_DRAW values take the Python-int path; they must equal the tensor path
    (negative and 64-bit seeds, 2-D counters broadcast against seeds, every stream kind)."""
    seeds = torch.tensor([0, -5, 2**62 + 12345, 7919, -(2**63), 42])
    counters = torch.arange(6 * 5).view(6, 5) * 104729
    for stream in (STREAM_SAMPLE, 3, 77):
        big = uniforms(seeds, counters, stream)  # 30 values: tensor path
        assert counters.numel() > SMALL_DRAW
        for rows, cols in ((1, 1), (2, 3), (6, 2), (3, 5)):
            small = uniforms(seeds[:rows], counters[:rows, :cols], stream)
            assert small.dtype == torch.float64 and small.shape == (rows, cols)
            assert torch.equal(small, big[:rows, :cols])
        one = uniforms(seeds[:4], counters[:4, 0], stream)  # [N] counters
        assert torch.equal(one, big[:4, 0])


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("temperature", -0.5, "temperature must be >= 0, got -0.5"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\], got 1.5"),
        ("top_k", -1, "top_k must be >= 0"),
        ("max_new_tokens", 0, "max_new_tokens must be >= 1, got 0"),
        ("temperature", float("inf"), "temperature must be a finite number, got inf"),
        ("temperature", float("nan"), "temperature must be a finite number, got nan"),
        ("top_p", float("nan"), r"top_p must be in \(0, 1\], got nan"),
        ("n", 0, "n must be >= 1, got 0"),
        ("seed", 2**64, r"seed must be in \[0, 2\*\*63 - 1\], got 18446744073709551616"),
        ("seed", 2**63, r"seed must be in \[0, 2\*\*63 - 1\]"),
        ("seed", -1, r"seed must be in \[0, 2\*\*63 - 1\], got -1"),
    ],
)
def test_bad_sampling_params(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value}).validate()


def test_seed_range_is_exactly_what_the_engine_takes_without_wrapping():
    """Seeds 0 and 2**63 - 1 are accepted; the engine's per-sample seeds of distinct accepted
    seeds differ (its arithmetic is mod 2**63, so a larger seed would alias a smaller one)."""
    from specrl.engine.admission import Admission
    from specrl.sampling import MAX_SEED

    assert MAX_SEED == 2**63 - 1
    for seed in (0, 1, MAX_SEED):
        SamplingParams(seed=seed).validate()
    derive = Admission._seed
    seeds = [derive(None, SamplingParams(seed=s), 0) for s in (0, 1, MAX_SEED - 1, MAX_SEED)]
    assert len(set(seeds)) == 4
    # the wrap that validate() now refuses: 2**63 would give seed 0's tokens
    assert derive(None, SamplingParams(seed=2**63), 0) == seeds[0]


def test_two_level_inverse_cdf_equals_full_float64_cdf():
    """sample_probs over chunks picks exactly the token a full float64 CDF picks."""
    from specrl.sampling import sample_probs

    vocab, n = 2500, 4000  # spans three chunks, the last one padded
    probs = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 3, -1)
    probs[vocab // 2] = 0.0  # a zero-probability token in the middle
    u = torch.linspace(0, 1 - 1e-9, n, dtype=torch.float64)
    got = sample_probs(probs.expand(n, vocab), u)
    cdf = torch.cumsum(probs.double(), 0)
    want = torch.searchsorted(cdf, (u * cdf[-1])[:, None], right=True)[:, 0].clamp(max=vocab - 1)
    mismatch = (got != want).float().mean().item()
    assert mismatch < 1e-3  # only float rounding exactly at a CDF step may differ
    assert not (got == vocab // 2).any()


def test_raw_logprobs_reusing_is_raw_bit_for_bit():
    """Reusing the processed log-probs of plain rows gives exactly raw_logprobs; any other row
    (temperature, top-k, top-p) makes it compute them."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    plain = (torch.ones(3), torch.zeros(3, dtype=torch.int64), torch.ones(3))
    lp = processed_logprobs(logits, *plain)
    assert torch.equal(raw_logprobs_reusing(logits, lp, *plain), raw_logprobs(logits))
    for t, k, p in [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9), (0.0, 0, 1.0)]:
        mixed = (torch.tensor([1.0, t, 1.0]), torch.tensor([0, k, 0]), torch.tensor([1.0, p, 1.0]))
        lp = processed_logprobs(logits, *mixed)
        assert torch.equal(raw_logprobs_reusing(logits, lp, *mixed), raw_logprobs(logits))


def test_plain_rows_are_processed_the_same_alone_or_mixed():
    """All rows at temperature 1 skip the division by 1.0; a plain row gets bit for bit the
    log-probs it gets beside a row that needs the division (batch composition changes nothing)."""
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(3)) * 4
    zero, one = torch.zeros(2, dtype=torch.int64), torch.ones(2)
    alone = processed_logprobs(logits, one, zero, one)
    mixed = processed_logprobs(logits, torch.tensor([1.0, 0.7]), zero, one)
    assert torch.equal(alone[0], mixed[0])
    assert torch.equal(alone, torch.log_softmax(logits, -1))
    assert not torch.equal(alone[1], mixed[1])


@pytest.mark.parametrize("t, k, p", [(1.0, 0, 1.0), (0.8, 5, 0.9), (0.0, 0, 1.0)])
def test_draw_is_sample_of_processed_bit_for_bit(t, k, p):
    """``draw`` returns what ``sample(processed_logprobs)`` draws and the exp of those log-probs."""
    rows = 64
    logits = torch.randn(rows, 40, generator=torch.Generator().manual_seed(5)) * 3
    settings = (torch.full((rows,), t), torch.full((rows,), k), torch.full((rows,), p))
    u = torch.rand(rows, generator=torch.Generator().manual_seed(6)).double()
    tokens, probs = draw(logits, *settings, u)
    lp = processed_logprobs(logits, *settings)
    assert torch.equal(tokens, sample(lp, u))
    assert torch.equal(probs, lp.exp())


# ------------------------------------------------------------------ the native T=1 sampler

NATIVE = pytest.mark.skipif(gemv.gemv_kernel() is None, reason="native kernels cannot run here")
PLAIN_ROWS = (torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.ones(1))


def _plain(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(x.expand(n) for x in PLAIN_ROWS)


@NATIVE
def test_native_sampler_picks_the_full_float64_cdfs_token():
    """At T=1 untruncated ``sample_logits`` (the native kernel) draws what a float64 inverse CDF
    of the softmax draws, up to rounding exactly at a step; never a -inf token; the logprob is
    the token's log-softmax; bf16 and float32 logits of the same values give the same draws."""
    vocab, n = 2500, 4000  # three chunks of 1024, the last one short
    logits = (torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 3).to(torch.bfloat16)
    logits[vocab // 2] = float("-inf")
    u = torch.linspace(0, 1 - 1e-9, n, dtype=torch.float64)
    rows = logits.expand(n, vocab)
    tokens, lp, raw = sample_logits(rows, *_plain(n), u)
    probs = torch.softmax(logits.double(), 0)
    cdf = torch.cumsum(probs, 0)
    want = torch.searchsorted(cdf, (u * cdf[-1])[:, None], right=True)[:, 0].clamp(max=vocab - 1)
    assert (tokens != want).float().mean().item() < 1e-3
    assert not (tokens == vocab // 2).any()
    torch.testing.assert_close(lp, probs.log()[tokens].float(), atol=1e-5, rtol=1e-5)
    assert torch.equal(lp, raw)
    again = sample_logits(rows.float(), *_plain(n), u)
    assert torch.equal(again[0], tokens) and torch.equal(again[1], lp)


@NATIVE
def test_native_sampler_follows_the_softmax_and_ignores_the_batch():
    vocab, draws = 8, 20000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(2)) * 1.5
    u = uniforms(torch.full((draws,), 1234), torch.arange(draws), STREAM_SAMPLE)
    tokens, lp, _ = sample_logits(logits.expand(draws, vocab), *_plain(draws), u)
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    expected = torch.softmax(logits.double(), 0).numpy() * draws
    assert stats.chisquare(counts, expected).pvalue > 1e-3
    mixed = torch.randn(5, vocab, generator=torch.Generator().manual_seed(4))
    mixed[2] = logits
    alone = sample_logits(logits[None], *_plain(1), u[7:8])
    beside = sample_logits(mixed, *_plain(5), torch.full((5,), float(u[7])))
    assert int(alone[0]) == int(beside[0][2]) and float(alone[1]) == float(beside[1][2])


def test_pytorch_sampler_agrees_with_the_native_one(monkeypatch):
    """Without the kernel (another CPU) the same inverse CDF runs in PyTorch's ops."""
    vocab, n = 300, 2000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(8)) * 2
    u = torch.linspace(0, 1 - 1e-9, n, dtype=torch.float64)
    native = sample_logits(logits.expand(n, vocab), *_plain(n), u)
    monkeypatch.setattr(sampling, "_native_sampler", lambda logits: None)
    fallback = sample_logits(logits.expand(n, vocab), *_plain(n), u)
    assert (native[0] != fallback[0]).float().mean().item() < 1e-3
    torch.testing.assert_close(native[1], fallback[1], atol=1e-5, rtol=1e-5)
