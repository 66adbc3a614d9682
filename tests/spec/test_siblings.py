"""Tests of first-position sibling drafts (``specrl.spec.siblings``): lossless with real uniforms.

The chain drafts up to two tokens from q (per prefix), siblings are drawn without replacement,
the target's logits depend on the emitted prefix through a table; the first emitted token and the
pair of the first two must follow the processed target distribution (chi-square, fixed seeds).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specrl.sampling import (
    STREAM_DRAFT,
    STREAM_SAMPLE,
    processed_logprobs,
    sample,
    sample_probs,
    uniforms,
)
from specrl.spec.config import SpecConfig
from specrl.spec.siblings import draw_siblings, resolve_siblings, without
from specrl.spec.verify import verify
from tests.spec.test_verify import chi_square_pvalue, prefix_ids

VOCAB, K = 8, 2


def run_tree(rows: int, siblings: int, settings: tuple, seed: int) -> dict:
    """Draft a chain of K plus ``siblings`` first-position candidates per row, verify, resolve."""
    gen = torch.Generator().manual_seed(seed)
    n_prefix = sum(VOCAB**i for i in range(K + 1))
    logits = torch.randn(n_prefix, VOCAB, generator=gen) * 1.5
    q_table = torch.softmax(torch.randn(n_prefix, VOCAB, generator=gen), -1)
    full = lambda v, dtype=None: torch.full((rows,), v, dtype=dtype)  # noqa: E731
    st = (full(settings[0]), full(settings[1], torch.int64), full(settings[2]))
    seeds = torch.randint(0, 2**62, (rows,), generator=gen)
    counters = torch.randint(0, 10**6, (rows,), generator=gen)
    lengths = torch.randint(1, K + 1, (rows,), generator=gen)
    drafts = torch.zeros(rows, K, dtype=torch.int64)
    for i in range(K):
        ids = prefix_ids(drafts[:, :i], VOCAB)[:, i]
        drafts[:, i] = sample(q_table[ids].log(), uniforms(seeds, counters + i, STREAM_DRAFT))
    ids = prefix_ids(drafts, VOCAB)  # [N, K+1]
    q0 = q_table[torch.zeros(rows, dtype=torch.int64)]  # [N, V]
    sib, valid = draw_siblings(q0, drafts[:, 0], siblings, seeds, counters)
    chain = verify(drafts, lengths, q_table[ids[:, :K]], logits[ids], *st, seeds, counters)
    out, chosen = resolve_siblings(
        chain, lengths, drafts[:, 0], q0, sib, valid, logits[ids[:, 0]], logits[1 + sib],
        *st, seeds, counters,
    )  # fmt: skip
    return {"chain": chain, "out": out, "chosen": chosen, "logits": logits, "settings": st,
            "seeds": seeds, "counters": counters, "siblings": sib, "valid": valid}  # fmt: skip


@pytest.mark.parametrize("siblings", [1, 3])
@pytest.mark.parametrize("settings", [(1.0, 0, 1.0), (0.8, 6, 0.95)], ids=["plain", "truncated"])
def test_siblings_are_lossless(siblings: int, settings: tuple) -> None:
    r = run_tree(30000, siblings, settings, seed=5 + siblings)
    out, st, logits = r["out"], r["settings"], r["logits"]
    took = r["chosen"] >= 0
    assert 0.02 < took.float().mean() < 0.5  # the sibling rounds really run and accept
    assert out.num_emitted.float().mean() > r["chain"].num_emitted.float().mean()
    p_root = processed_logprobs(logits[:1], *[s[:1] for s in st]).exp()[0]
    first = out.tokens[:, 0]
    assert chi_square_pvalue(np.bincount(first.numpy(), minlength=VOCAB),
                             p_root.double().numpy()) > 0.001  # fmt: skip
    logp_1 = processed_logprobs(logits[1 + first], *st)
    plain = sample(logp_1, uniforms(r["seeds"], r["counters"] + 1, STREAM_SAMPLE))
    second = torch.where(out.num_emitted >= 2, out.tokens[:, 1], plain)
    pairs = np.bincount((first * VOCAB + second).numpy(), minlength=VOCAB * VOCAB)
    p_next = processed_logprobs(logits[1 : 1 + VOCAB], *[s[:VOCAB] for s in st]).exp()
    joint = (p_root[:, None] * p_next).double().numpy().ravel()
    assert chi_square_pvalue(pairs, joint) > 0.001


def test_sibling_logprobs_are_the_targets() -> None:
    """An accepted sibling and its bonus carry log p under the processed and raw distributions."""
    r = run_tree(2000, 2, (0.8, 0, 1.0), seed=3)
    out, logits, st = r["out"], r["logits"], r["settings"]
    rows = torch.nonzero(r["chosen"] >= 0)[:, 0]
    assert len(rows) > 0
    sib = out.tokens[rows, 0]
    root = logits[0].expand(len(rows), -1)
    proc = processed_logprobs(root, *[s[rows] for s in st]).gather(1, sib[:, None])[:, 0]
    assert torch.allclose(out.logprobs_processed[rows, 0], proc, atol=1e-6)
    raw = torch.log_softmax(root, -1).gather(1, sib[:, None])[:, 0]
    assert torch.allclose(out.logprobs_raw[rows, 0], raw, atol=1e-6)
    bonus = out.tokens[rows, 1]
    at = logits[1 + sib]
    proc2 = processed_logprobs(at, *[s[rows] for s in st]).gather(1, bonus[:, None])[:, 0]
    assert torch.allclose(out.logprobs_processed[rows, 1], proc2, atol=1e-6)


def test_draw_siblings_without_replacement() -> None:
    rows, count = 20000, 3
    gen = torch.Generator().manual_seed(0)
    q0 = torch.softmax(torch.randn(1, VOCAB, generator=gen), -1).expand(rows, -1)
    seeds = torch.arange(rows)
    counters = torch.zeros(rows, dtype=torch.int64)
    first = sample_probs(q0, uniforms(seeds, counters, STREAM_DRAFT))
    sib, valid = draw_siblings(q0, first, count, seeds, counters)
    assert bool(valid.all())
    drawn = torch.cat([first[:, None], sib], 1)
    assert bool((drawn.sort(1).values.diff(1) != 0).all())  # all distinct per row
    # sibling 0 given first follows q0 with first removed
    mask = first == 0
    expected = without(q0[:1], torch.zeros(1, dtype=torch.int64))[0]
    counts = np.bincount(sib[mask, 0].numpy(), minlength=VOCAB)
    assert chi_square_pvalue(counts, expected.double().numpy()) > 0.001


def test_one_hot_draft_has_no_valid_sibling() -> None:
    q0 = torch.nn.functional.one_hot(torch.tensor([2, 5]), VOCAB).float()
    q0[1] = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.5, 0.0, 0.0])
    sib, valid = draw_siblings(q0, torch.tensor([2, 5]), 2, torch.arange(2), torch.zeros(2).long())
    assert valid.tolist() == [[False, False], [True, False]]
    assert int(sib[1, 0]) == 2


def test_too_many_siblings_is_refused() -> None:
    with pytest.raises(ValueError, match="siblings must be in"):
        draw_siblings(torch.ones(1, VOCAB) / VOCAB, torch.zeros(1).long(), 99,
                      torch.zeros(1).long(), torch.zeros(1).long())  # fmt: skip


def test_steps_drop_siblings_past_the_token_budget() -> None:
    capped = SpecConfig("eagle3", 3, max_tokens_per_forward=16, siblings=3)
    assert [capped.siblings_for_batch(b, 3) for b in (1, 2, 3)] == [3, 3, 0]  # 2 * 7 <= 16 < 21
    assert capped.siblings_for_batch(1, 0) == 0  # nothing drafted: nothing to branch from
    assert SpecConfig("eagle3", 3, siblings=3).siblings_for_batch(64, 3) == 3  # no budget
    with pytest.raises(ValueError, match="siblings must be in"):
        SpecConfig("eagle3", 3, siblings=17).validate()


def test_rollout_config_bound_is_max_siblings() -> None:
    from specrl.config import load_config
    from specrl.sampling import MAX_SIBLINGS

    assert load_config(None, [f"rollout.spec_siblings={MAX_SIBLINGS}"]).rollout.spec_siblings
    with pytest.raises(ValueError, match="spec_siblings"):
        load_config(None, [f"rollout.spec_siblings={MAX_SIBLINGS + 1}"])
