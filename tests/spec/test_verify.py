"""Tests of the speculative rejection sampler ``specrl.spec.verify``.

The core tests are *exact*: they replace the counter-based uniforms inside the verifier's module
with a table of controlled values, enumerate every draft sequence (weighted by q), every
accept/reject pattern (cells ``[0, t)`` / ``[t, 1)`` of each accept uniform, ``t = min(1, p/q)``)
and every cell of the inverse CDF of the final token's distribution, run the real ``verify`` at
both ends of every cell (it must give the same answer at both ends, so it is constant on the cell)
and add up the cell widths. The resulting distribution of emitted sequences is compared with the
target: every emitted token, given the tokens emitted before it, must follow the processed target
distribution within 1e-6. The target distribution depends on the context through a table indexed
by the emitted prefix, so positions are checked conditionally, not only marginally.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, fields

import numpy as np
import pytest
import torch
from scipy import stats

import specrl.spec.verify as verify_module
from specrl.sampling import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_RECOVER,
    STREAM_SAMPLE,
    processed_logprobs,
    raw_logprobs,
    sample,
    uniforms,
)
from specrl.spec.verify import PAD_TOKEN, Verified, verify
from tests.conftest import DEVICES

EPS = 1e-6  # inset of the evaluation points from the cell edges (float32 rounding of p, q)
TOL = 1e-6  # tolerance on exact probabilities


# ---------------------------------------------------------------------------------------------
# Exact enumeration machinery
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    vocab: int
    k: int
    stochastic: bool  # drafts drawn from q (draft_probs given) or deterministic (None)
    temperature: float
    top_k: int
    top_p: float
    mode: str  # how drafts/q are chosen: random | masked | argmax | close | equal
    seed: int


def on_cpu(v: Verified) -> Verified:
    """A ``Verified`` made on any device, copied to the CPU."""
    return Verified(*(getattr(v, f.name).cpu() for f in fields(v)))


class FakeUniforms:
    """Stand-in for ``uniforms``: row r (= its seed) reads tables[stream][r, counter - base_r]."""

    def __init__(self, tables: dict[int, torch.Tensor], base: torch.Tensor) -> None:
        self.tables = tables  # stream -> [R, k+1] float64
        self.base = base  # [R] int64, counters of the rows

    def __call__(self, seeds: torch.Tensor, counters: torch.Tensor, stream: int) -> torch.Tensor:
        rows = seeds.to(torch.int64)
        while rows.dim() < counters.dim():
            rows = rows.unsqueeze(-1)
        offset = counters - self.base[rows]
        table = self.tables[stream]
        assert bool((offset >= 0).all()) and bool((offset < table.shape[1]).all()), "bad counter"
        return table[rows.expand_as(offset), offset]


def processed(logits: torch.Tensor, case: Case) -> torch.Tensor:
    """Processed log-probs [P, V] of table rows under the case's sampling settings."""
    n = logits.shape[0]
    return processed_logprobs(
        logits,
        torch.full((n,), case.temperature),
        torch.full((n,), case.top_k, dtype=torch.int64),
        torch.full((n,), case.top_p),
    )


def cell_points(lo: float, hi: float) -> tuple[float, float]:
    """Two evaluation points inside [lo, hi): near both ends, or the midpoint twice."""
    if hi - lo > 4 * EPS:
        return lo + EPS, hi - EPS
    return (lo + hi) / 2, (lo + hi) / 2


def reference_residual(p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """normalize(max(0, p - q)), one-hot q when None; p when the residual is empty."""
    if q is None:
        r = p.copy()
        r[x] = 0.0
    else:
        r = np.maximum(p - q, 0.0)
    return p if r.sum() <= 0 else r / r.sum()


class Tables:
    """Target logits/probs and draft q for every context prefix of length 0..k."""

    def __init__(self, case: Case) -> None:
        gen = torch.Generator().manual_seed(case.seed)
        self.case = case
        v, k = case.vocab, case.k
        self.prefixes = [pre for n in range(k + 1) for pre in itertools.product(range(v), repeat=n)]
        self.index = {pre: i for i, pre in enumerate(self.prefixes)}
        self.logits = torch.randn(len(self.prefixes), v, generator=gen) * 2.0  # [P, V]
        self.logp = processed(self.logits, case)  # [P, V] float32
        self.raw = raw_logprobs(self.logits)  # [P, V]
        self.p = self.logp.exp().double().numpy()  # [P, V]
        self.q = self._draft_table(gen) if case.stochastic else None  # [P, V] float32

    def _draft_table(self, gen: torch.Generator) -> torch.Tensor:
        mode = self.case.mode
        if mode == "equal":
            return self.logp.exp()
        if mode == "masked":  # q prefers the tokens the target finds unlikely (often masked)
            return torch.softmax(-self.logits * 1.5, dim=-1)
        if mode == "close":
            q = self.logp.exp() + 0.05 * torch.rand(self.logits.shape, generator=gen)
            return q / q.sum(-1, keepdim=True)
        return torch.softmax(torch.randn(self.logits.shape, generator=gen) * 1.5, dim=-1)

    def probs(self, prefix: tuple[int, ...]) -> np.ndarray:
        return self.p[self.index[prefix]]

    def draft_q(self, prefix: tuple[int, ...], normalized: bool = False) -> np.ndarray | None:
        """q at a prefix as verify sees it (float32 values), or renormalised in float64."""
        if self.q is None:
            return None
        q = self.q[self.index[prefix]].double().numpy()
        return q / q.sum() if normalized else q

    def deterministic_drafts(self, length: int, rng: np.random.Generator) -> list[tuple]:
        """A few fixed draft sequences: random, mode-specific (masked / argmax chain)."""
        argmax, argmin, wrong = [], [], []
        for i in range(length):
            argmax.append(int(np.argmax(self.probs(tuple(argmax)))))
            argmin.append(int(np.argmin(self.probs(tuple(argmin)))))
            pre = tuple(wrong)
            wrong.append(int(np.argsort(self.probs(pre))[-2 if i == length - 1 else -1]))
        random = [int(t) for t in rng.integers(0, self.case.vocab, size=length)]
        return [tuple(random), tuple(argmax), tuple(argmin), tuple(wrong)]


def stochastic_drafts(tables: Tables, length: int) -> list[tuple[tuple[int, ...], float]]:
    """Every draft sequence of the given length with its probability under q."""
    out = []
    for x in itertools.product(range(tables.case.vocab), repeat=length):
        w = 1.0
        for i in range(length):
            w *= float(tables.draft_q(x[:i], normalized=True)[x[i]])
        if w > 0:
            out.append((x, w))
    return out


@dataclass
class Enumeration:
    """Rows for one verify call: pairs (2m, 2m+1) evaluate one cell at both ends."""

    target_rows: list[list[int]]  # [R][k+1] row of Tables.logits (or -1 - garbage id)
    q_rows: list[list[int]]  # [R][k] row of Tables.q (or -1 - garbage id)
    drafts: list[list[int]]  # [R][k]
    lengths: list[int]  # [R]
    u: dict[int, list[list[float]]]  # stream -> [R][k+1]
    weights: list[float]  # [R / 2] cell probability of each pair
    groups: list[tuple]  # [R / 2] (length, draft id) the pair belongs to


def enumerate_case(tables: Tables, rng: np.random.Generator) -> Enumeration:
    case = tables.case
    enum = Enumeration([], [], [], [], {s: [] for s in (1, 2, 3)}, [], [])
    for length in range(case.k + 1):
        if case.stochastic:
            draft_set = [(x, w, (length,)) for x, w in stochastic_drafts(tables, length)]
        else:
            fixed = tables.deterministic_drafts(length, rng)
            draft_set = [(x, 1.0, (length, i)) for i, x in enumerate(fixed)]
        for x, w, group in draft_set:
            add_draft(tables, enum, x, w, group, rng)
    return enum


def add_draft(
    tables: Tables, enum: Enumeration, x: tuple, weight: float, group: tuple, rng
) -> None:
    """Add the pairs of rows for one draft sequence x: every accept pattern x final cell."""
    case, length = tables.case, len(x)
    thresholds = []
    for i in range(length):
        p_x = tables.probs(x[:i])[x[i]]
        q = tables.draft_q(x[:i])
        q_x = 1.0 if q is None else q[x[i]]
        thresholds.append(0.0 if p_x <= 0 else min(1.0, p_x / q_x))
    for accepted in range(length + 1):  # first rejection at `accepted`, or none
        w_pattern = float(np.prod(thresholds[:accepted]))
        if accepted < length:
            w_pattern *= 1.0 - thresholds[accepted]
            final = reference_residual(
                tables.probs(x[:accepted]), tables.draft_q(x[:accepted]), x[accepted]
            )
        else:
            final = tables.probs(x)
        if w_pattern <= 0:
            continue
        edges = np.minimum(np.concatenate([[0.0], np.cumsum(final / final.sum())]), 1.0)
        edges[-1] = 1.0
        for token in range(case.vocab):
            width = edges[token + 1] - edges[token]
            if width <= 0:
                continue
            final_points = cell_points(edges[token], edges[token + 1])
            for end in (0, 1):
                add_row(tables, enum, x, thresholds, accepted, final_points[end], end, rng)
            enum.weights.append(weight * w_pattern * width)
            enum.groups.append(group)


def add_row(tables, enum, x, thresholds, accepted, u_final, end, rng) -> None:
    case, length, k = tables.case, len(x), tables.case.k
    garbage = lambda: -1 - int(rng.integers(0, 16))  # noqa: E731
    enum.target_rows.append(
        [tables.index[x[:i]] if i <= length else garbage() for i in range(k + 1)]
    )
    enum.q_rows.append([tables.index[x[:i]] if i < length else garbage() for i in range(k)])
    pad = [int(t) for t in rng.integers(-3, case.vocab + 3, size=k - length)]
    enum.drafts.append(list(x) + pad)
    enum.lengths.append(length)
    u_accept = list(rng.random(k + 1))
    for i in range(min(accepted + 1, length)):
        lo, hi = (0.0, thresholds[i]) if i < accepted else (thresholds[i], 1.0)
        u_accept[i] = cell_points(lo, hi)[end]
    u_recover, u_sample = list(rng.random(k + 1)), list(rng.random(k + 1))
    (u_recover if accepted < length else u_sample)[accepted] = u_final
    enum.u[STREAM_ACCEPT].append(u_accept)
    enum.u[STREAM_RECOVER].append(u_recover)
    enum.u[STREAM_SAMPLE].append(u_sample)


def run_enumeration(
    tables: Tables, enum: Enumeration, monkeypatch, device: str = "cpu"
) -> tuple[Verified, dict]:
    """Call the real verify on all rows (on ``device``) with the fake uniforms; return its
    output and inputs (on the CPU)."""
    case, rows = tables.case, len(enum.lengths)
    gen = torch.Generator().manual_seed(case.seed + 1000)
    garbage_logits = torch.randn(16, case.vocab, generator=gen) * 3
    all_logits = torch.cat([tables.logits, garbage_logits.flip(0)])  # index -1-g -> garbage g
    target_logits = all_logits[torch.tensor(enum.target_rows)]  # [R, k+1, V]
    draft_probs = None
    if case.stochastic:
        garbage_q = torch.softmax(torch.randn(16, case.vocab, generator=gen), -1)
        all_q = torch.cat([tables.q, garbage_q.flip(0)])
        draft_probs = all_q[torch.tensor(enum.q_rows).reshape(rows, case.k)]
    base = 1000 + 7 * torch.arange(rows, dtype=torch.int64)
    tables_u = {s: torch.tensor(v, dtype=torch.float64, device=device) for s, v in enum.u.items()}
    fake = FakeUniforms(tables_u, base.to(device))
    monkeypatch.setattr(verify_module, "uniforms", fake)
    inputs = dict(
        draft_tokens=torch.tensor(enum.drafts, dtype=torch.int64).reshape(rows, case.k),
        draft_lengths=torch.tensor(enum.lengths, dtype=torch.int64),
        draft_probs=draft_probs,
        target_logits=target_logits,
        temperature=torch.full((rows,), case.temperature),
        top_k=torch.full((rows,), case.top_k, dtype=torch.int64),
        top_p=torch.full((rows,), case.top_p),
        seeds=torch.arange(rows, dtype=torch.int64),
        counters=base,
    )
    out = verify(**{k: v if v is None else v.to(device) for k, v in inputs.items()})
    return on_cpu(out), inputs


def emitted_distributions(enum: Enumeration, out: Verified) -> dict[tuple, dict[tuple, float]]:
    """group -> {emitted sequence: probability}; asserts verify is constant on every cell."""
    n = out.num_emitted.tolist()
    tokens = out.tokens.tolist()
    dists: dict[tuple, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
    for pair, (weight, group) in enumerate(zip(enum.weights, enum.groups, strict=True)):
        lo, hi = 2 * pair, 2 * pair + 1
        seq_lo, seq_hi = tuple(tokens[lo][: n[lo]]), tuple(tokens[hi][: n[hi]])
        assert seq_lo == seq_hi, f"verify not constant on a cell: {seq_lo} vs {seq_hi}"
        dists[group][seq_lo] += weight
    return dists


def check_lossless(tables: Tables, dist: dict[tuple, float]) -> None:
    """Each emitted token, given the ones before it, follows the target within TOL."""
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-9)
    max_len = max(len(s) for s in dist)
    for t in range(max_len):
        joint: dict[tuple, float] = defaultdict(float)
        for seq, w in dist.items():
            if len(seq) > t:
                joint[seq[: t + 1]] += w
        reach: dict[tuple, float] = defaultdict(float)
        for seq, w in joint.items():
            reach[seq[:t]] += w
        for prefix, mass in reach.items():
            p = tables.probs(prefix)
            got = np.array([joint.get(prefix + (v,), 0.0) for v in range(len(p))])
            np.testing.assert_allclose(got, mass * p, atol=TOL, rtol=0, err_msg=f"{prefix}")
    check_extension(tables, dist, max_len)


def check_extension(tables: Tables, dist: dict[tuple, float], max_len: int) -> None:
    """Emitted prefix continued by plain target sampling == plain target sampling throughout."""
    for z in itertools.product(range(tables.case.vocab), repeat=max_len):
        plain = np.prod([tables.probs(z[:t])[z[t]] for t in range(max_len)])
        spec = 0.0
        for n in range(1, max_len + 1):
            w = dist.get(z[:n], 0.0)
            if w:
                spec += w * np.prod([tables.probs(z[:t])[z[t]] for t in range(n, max_len)])
        assert spec == pytest.approx(plain, abs=TOL), f"sequence {z}"


def check_logprobs(tables: Tables, out: Verified) -> None:
    """Processed and raw logprobs of every emitted token; padding after num_emitted."""
    rows, width = out.tokens.shape
    n = out.num_emitted.tolist()
    tokens = out.tokens.tolist()
    prefix_rows = [
        [tables.index[tuple(tokens[r][:i])] if i < n[r] else 0 for i in range(width)]
        for r in range(rows)
    ]
    idx = torch.tensor(prefix_rows)  # [R, k+1] table row of each emitted position
    emitted = torch.arange(width)[None, :] < out.num_emitted[:, None]  # [R, k+1]
    safe = out.tokens.clamp(min=0)
    want_processed = tables.logp[idx, safe].masked_fill(~emitted, 0.0)
    want_raw = tables.raw[idx, safe].masked_fill(~emitted, 0.0)
    np.testing.assert_allclose(out.logprobs_processed.numpy(), want_processed.numpy(), atol=1e-5)
    np.testing.assert_allclose(out.logprobs_raw.numpy(), want_raw.numpy(), atol=1e-5)
    assert torch.equal(out.num_accepted, out.num_emitted - 1)
    assert bool((out.tokens[~emitted] == PAD_TOKEN).all())
    assert bool((out.tokens[emitted] >= 0).all())


EXACT_CASES = [
    Case(2, 1, False, 1.0, 0, 1.0, "random", 0),
    Case(5, 2, False, 1.0, 0, 1.0, "random", 1),
    Case(8, 3, False, 0.7, 0, 1.0, "random", 2),
    Case(8, 3, False, 1.0, 3, 1.0, "masked", 3),
    Case(6, 3, False, 1.3, 0, 0.7, "masked", 4),
    Case(8, 3, False, 0.0, 0, 1.0, "argmax", 5),
    Case(8, 2, False, 0.9, 4, 0.8, "random", 6),
    Case(3, 1, True, 1.0, 0, 1.0, "random", 7),
    Case(5, 2, True, 1.0, 0, 1.0, "random", 8),
    Case(8, 3, True, 0.7, 0, 1.0, "random", 9),
    Case(8, 3, True, 1.0, 3, 1.0, "masked", 10),
    Case(7, 3, True, 1.2, 0, 0.6, "masked", 11),
    Case(8, 3, True, 0.0, 0, 1.0, "random", 12),
    Case(8, 2, True, 0.8, 5, 0.9, "close", 13),
    Case(4, 3, True, 1.0, 0, 1.0, "equal", 14),
    Case(6, 3, True, 2.0, 2, 0.9, "random", 15),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", EXACT_CASES, ids=lambda c: f"{c}")
def test_exact_losslessness(case: Case, monkeypatch, device: str) -> None:
    """Exact distribution of every emitted position (given the previous ones) equals p."""
    tables = Tables(case)
    enum = enumerate_case(tables, np.random.default_rng(case.seed))
    out, _ = run_enumeration(tables, enum, monkeypatch, device)
    dists = emitted_distributions(enum, out)
    assert len(dists) == (case.k + 1 if case.stochastic else 4 * (case.k + 1))
    for dist in dists.values():
        check_lossless(tables, dist)
    check_logprobs(tables, out)


# ---------------------------------------------------------------------------------------------
# Known bug classes of rejection samplers, each pinned by a small direct test
# ---------------------------------------------------------------------------------------------


def fake_call(
    monkeypatch,
    target_probs: torch.Tensor,  # [B, k+1, V] processed target (T=1, no truncation)
    drafts: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V]
    u_accept: torch.Tensor,  # [B, k+1]
    u_recover: torch.Tensor,  # [B, k+1]
    u_sample: torch.Tensor | None = None,  # [B, k+1]
    **settings,
) -> Verified:
    """verify with logits = log(target_probs) and the given uniforms per stream."""
    rows, k = drafts.shape
    base = torch.full((rows,), 5, dtype=torch.int64)
    tables = {
        STREAM_ACCEPT: u_accept.double(),
        STREAM_RECOVER: u_recover.double(),
        STREAM_SAMPLE: (u_sample if u_sample is not None else torch.rand(rows, k + 1)).double(),
    }
    monkeypatch.setattr(verify_module, "uniforms", FakeUniforms(tables, base))
    return verify(
        drafts,
        torch.full((rows,), k, dtype=torch.int64),
        draft_probs,
        target_probs.log(),
        settings.get("temperature", torch.ones(rows)),
        settings.get("top_k", torch.zeros(rows, dtype=torch.int64)),
        settings.get("top_p", torch.ones(rows)),
        torch.arange(rows, dtype=torch.int64),
        base,
    )


def test_stochastic_residual_subtracts_all_of_q(monkeypatch) -> None:
    """Bug class: residual that subtracts only q(x) at the drafted token.

    p = [.5, .3, .2], q = [.1, .6, .3], draft 1 rejected: max(0, p - q) = [.4, 0, 0], so the
    recovered token is 0 for every u. The buggy residual [.5, 0, .2] gives token 2 for u > 5/7.
    """
    grid = torch.linspace(0.0, 0.999, 50)
    rows = len(grid)
    p = torch.tensor([0.5, 0.3, 0.2]).expand(rows, 2, 3)
    q = torch.tensor([0.1, 0.6, 0.3]).expand(rows, 1, 3)
    drafts = torch.ones(rows, 1, dtype=torch.int64)
    u_reject = torch.full((rows, 2), 0.9)  # threshold p/q = 0.5 -> rejected
    out = fake_call(monkeypatch, p, drafts, q, u_reject, grid[:, None].expand(rows, 2))
    assert (out.num_accepted == 0).all()
    assert (out.tokens[:, 0] == 0).all()


def test_first_draft_is_verified(monkeypatch) -> None:
    """Bug class: the first draft token accepted without a test.

    p_0(x_0) = 0.2 with a one-hot q: accepted exactly when u_0 < 0.2, and never when p_0(x_0) = 0.
    """
    grid = torch.linspace(0.0, 0.999, 101)
    rows = len(grid)
    p = torch.tensor([0.5, 0.2, 0.3, 0.0]).expand(rows, 2, 4).clone()
    drafts = torch.ones(rows, 1, dtype=torch.int64)
    u = grid[:, None].expand(rows, 2)
    out = fake_call(monkeypatch, p, drafts, None, u, torch.full((rows, 2), 0.5))
    assert torch.equal(out.num_accepted, (grid < 0.2).long())
    out = fake_call(monkeypatch, p, torch.full((rows, 1), 3), None, u, torch.full((rows, 2), 0.5))
    assert (out.num_accepted == 0).all()
    assert (out.tokens[:, 0] != 3).all()


@pytest.mark.parametrize("stochastic", [False, True])
def test_draft_on_masked_token_is_never_accepted(monkeypatch, stochastic: bool) -> None:
    """Bug class: a draft on a token top-k/top-p masks out (p = 0 after processing).

    Token 2 has raw probability 0.25 but lies outside top-k = 2 (rows 0..49) and outside
    top-p = 0.6 (rows 50..99); q(2) = 0.05 would make an unprocessed p/q ratio exceed 1.
    """
    grid = torch.linspace(0.0, 0.999, 50).repeat(2)
    rows = len(grid)
    p = torch.tensor([0.4, 0.35, 0.25]).expand(rows, 2, 3)
    q = torch.tensor([0.5, 0.45, 0.05]).expand(rows, 1, 3) if stochastic else None
    drafts = torch.full((rows, 1), 2, dtype=torch.int64)
    u = grid[:, None].expand(rows, 2)
    top_k = torch.tensor([2] * 50 + [0] * 50)
    top_p = torch.tensor([1.0] * 50 + [0.6] * 50)
    out = fake_call(monkeypatch, p, drafts, q, u, u, top_k=top_k, top_p=top_p)
    assert (out.num_accepted == 0).all()
    assert (out.tokens[:, 0] != 2).all()
    assert torch.isfinite(out.logprobs_processed[:, 0]).all()


def test_inputs_are_not_modified() -> None:
    """Bug class: in-place modification of logits / p / q / drafts."""
    gen = torch.Generator().manual_seed(3)
    rows, k, vocab = 64, 3, 10
    inputs = dict(
        draft_tokens=torch.randint(0, vocab, (rows, k), generator=gen),
        draft_lengths=torch.randint(0, k + 1, (rows,), generator=gen),
        draft_probs=torch.softmax(torch.randn(rows, k, vocab, generator=gen), -1),
        target_logits=torch.randn(rows, k + 1, vocab, generator=gen),
        temperature=torch.rand(rows, generator=gen) * 1.5,
        top_k=torch.randint(0, 5, (rows,), generator=gen),
        top_p=torch.rand(rows, generator=gen) * 0.5 + 0.5,
        seeds=torch.randint(0, 2**40, (rows,), generator=gen),
        counters=torch.randint(0, 1000, (rows,), generator=gen),
    )
    before = {name: t.clone() for name, t in inputs.items()}
    for probs in (inputs["draft_probs"], None):
        out = verify(**{**inputs, "draft_probs": probs})
        assert (out.num_accepted < inputs["draft_lengths"]).any()  # rejections happened
        for name, tensor in inputs.items():
            assert torch.equal(tensor, before[name]), name


def test_recovered_logprob_is_under_p_not_the_residual(monkeypatch) -> None:
    """In-place residual written over p would report log(residual) for the recovered token."""
    rows = 8
    p = torch.tensor([0.5, 0.3, 0.2]).expand(rows, 2, 3)
    q = torch.tensor([0.1, 0.6, 0.3]).expand(rows, 1, 3)
    u = torch.full((rows, 2), 0.9)
    out = fake_call(monkeypatch, p, torch.ones(rows, 1, dtype=torch.int64), q, u, u)
    assert (out.tokens[:, 0] == 0).all()
    np.testing.assert_allclose(out.logprobs_processed[:, 0].numpy(), np.log(0.5), atol=1e-6)


def test_empty_residual_falls_back_to_p() -> None:
    """p == q exactly at the rejected position: the residual is empty, fall back to p."""
    p_j = torch.tensor([[0.25, 0.25, 0.5], [0.0, 1.0, 0.0]])
    drafts = torch.tensor([[1], [1]])
    residual = verify_module._residual(drafts, p_j[:, None, :], p_j, torch.zeros(2, dtype=int))
    assert torch.equal(residual, p_j)
    one_hot = verify_module._residual(drafts, None, p_j, torch.zeros(2, dtype=torch.int64))
    assert torch.equal(one_hot, torch.tensor([[0.25, 0.0, 0.5], [0.0, 1.0, 0.0]]))


# ---------------------------------------------------------------------------------------------
# Real uniforms: Monte-Carlo distribution, ragged batches, greedy, plain-sampling equivalence
# ---------------------------------------------------------------------------------------------


def prefix_ids(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Row in a prefix table (all prefixes of length 0..k, ordered by length) per position.

    tokens [N, k] -> [N, k+1]: id of the prefix tokens[:, :i] for i = 0..k.
    """
    rows, k = tokens.shape
    ids = torch.zeros(rows, k + 1, dtype=torch.int64)
    offset, code = 0, torch.zeros(rows, dtype=torch.int64)
    for i in range(k + 1):
        ids[:, i] = offset + code
        if i < k:
            offset += vocab**i
            code = code * vocab + tokens[:, i]
    return ids


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value, cells with expected count < 5 pooled into one."""
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(stats.chisquare(obs[keep], exp[keep]).pvalue)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("settings", [(1.0, 0, 1.0), (0.9, 6, 0.9)], ids=["plain", "truncated"])
def test_monte_carlo_chi_square(stochastic: bool, settings: tuple, device: str) -> None:
    """Real uniforms, V=12, ragged lengths 0..3: first token and (token 1, token 2) follow p.

    Rows that emitted one token continue with plain sampling for token 2, so the pair must follow
    the target's joint distribution exactly.
    """
    vocab, k, rows = 12, 3, 20000
    temperature, top_k, top_p = settings
    gen = torch.Generator().manual_seed(11 + stochastic)
    n_prefix = sum(vocab**i for i in range(k + 1))
    logits_table = torch.randn(n_prefix, vocab, generator=gen)
    full = lambda v, dtype=None: torch.full((rows,), v, dtype=dtype)  # noqa: E731
    settings_t = (full(temperature), full(top_k, torch.int64), full(top_p))
    seeds = torch.randint(0, 2**62, (rows,), generator=gen)
    counters = torch.randint(0, 10**6, (rows,), generator=gen)
    lengths = torch.randint(0, k + 1, (rows,), generator=gen)
    q_table = torch.softmax(torch.randn(n_prefix, vocab, generator=gen), -1)
    drafts = torch.zeros(rows, k, dtype=torch.int64)
    for i in range(k):  # drafts drawn from q (stochastic) or half argmax, half random
        ids = prefix_ids(drafts[:, :i], vocab)[:, i]
        if stochastic:
            u = uniforms(seeds, counters + i, STREAM_DRAFT)
            drafts[:, i] = sample(q_table[ids].log(), u)
        else:
            guess = torch.randint(0, vocab, (rows,), generator=gen)
            drafts[:, i] = torch.where(torch.rand(rows, generator=gen) < 0.5, guess, 0)
            drafts[:, i] = torch.where(
                drafts[:, i] == 0, logits_table[ids].argmax(-1), drafts[:, i]
            )
    ids = prefix_ids(drafts, vocab)  # [N, k+1]
    draft_probs = q_table[ids[:, :k]] if stochastic else None
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    args = (drafts, lengths, draft_probs, logits_table[ids], *settings_t, seeds, counters)
    out = on_cpu(verify(*map(on, args)))  # verified on the device
    assert 0 < out.num_accepted.float().mean() < lengths.float().mean()
    p_root = processed(logits_table[:1], Case(vocab, k, False, *settings, "", 0)).exp()[0]
    assert int((p_root > 0).sum()) >= 3  # truncation leaves a real distribution to test
    first = out.tokens[:, 0]
    counts = np.bincount(first.numpy(), minlength=vocab)
    assert chi_square_pvalue(counts, p_root.double().numpy()) > 0.001
    # token 2: emitted if num_emitted >= 2, otherwise plain sampling from p(. | token 1)
    logp_1 = processed_logprobs(logits_table[1 + first], *settings_t)  # prefix (token 1,)
    plain = sample(logp_1, uniforms(seeds, counters + 1, STREAM_SAMPLE))
    second = torch.where(out.num_emitted >= 2, out.tokens[:, 1], plain)
    pairs = np.bincount((first * vocab + second).numpy(), minlength=vocab * vocab)
    logp_all = processed_logprobs(logits_table[1 : 1 + vocab], *[s[:vocab] for s in settings_t])
    joint = (p_root[:, None] * logp_all.exp()).double().numpy().ravel()
    assert chi_square_pvalue(pairs, joint) > 0.001


def random_batch(rows: int, k: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """A ragged mixed batch: greedy and sampled rows, truncation, lengths 0..k, stochastic q."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, k + 1, vocab, generator=gen) * 2
    greedy = torch.rand(rows, generator=gen) < 0.3
    drafts = torch.where(
        torch.rand(rows, k, generator=gen) < 0.6,
        logits[:, :k].argmax(-1),
        torch.randint(0, vocab, (rows, k), generator=gen),
    )
    return dict(
        draft_tokens=drafts,
        draft_lengths=torch.randint(0, k + 1, (rows,), generator=gen),
        draft_probs=torch.softmax(torch.randn(rows, k, vocab, generator=gen), -1),
        target_logits=logits,
        temperature=torch.where(greedy, 0.0, torch.rand(rows, generator=gen) + 0.5),
        top_k=torch.randint(0, 6, (rows,), generator=gen),
        top_p=torch.where(torch.rand(rows, generator=gen) < 0.5, 1.0, 0.8),
        seeds=torch.randint(0, 2**62, (rows,), generator=gen),
        counters=torch.randint(0, 10**6, (rows,), generator=gen),
    )


@pytest.mark.parametrize("stochastic", [False, True])
def test_rows_are_independent_of_the_batch(stochastic: bool) -> None:
    """Ragged mixed batch == each row verified alone (same seeds and counters), bit for bit."""
    batch = random_batch(rows=40, k=3, vocab=9, seed=5)
    if not stochastic:
        batch["draft_probs"] = None
    whole = verify(**batch)
    assert len(set(batch["draft_lengths"].tolist())) == 4
    assert len(set(whole.num_accepted.tolist())) > 2
    for row in range(40):
        alone = verify(
            **{n: (t[row : row + 1] if t is not None else None) for n, t in batch.items()}
        )
        for field in ("tokens", "num_emitted", "logprobs_processed", "logprobs_raw"):
            assert torch.equal(getattr(alone, field)[0], getattr(whole, field)[row]), field
    assert (whole.num_accepted <= batch["draft_lengths"]).all()


@pytest.mark.parametrize("stochastic", [False, True])
def test_greedy_rows_accept_while_draft_is_argmax(stochastic: bool) -> None:
    """Temperature 0: accept the argmax chain up to the first wrong draft, then emit the argmax."""
    rows, k, vocab = 4 * (3 + 1), 3, 7
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(rows, k + 1, vocab, generator=gen)
    argmax = logits.argmax(-1)  # [N, k+1]
    wrong_at = torch.arange(rows) % (k + 1)  # k+1 means all drafts right
    drafts = argmax[:, :k].clone()
    wrong_rows = wrong_at < k
    col = wrong_at.clamp(max=k - 1)
    drafts[wrong_rows, col[wrong_rows]] = (argmax[wrong_rows, col[wrong_rows]] + 1) % vocab
    q = torch.softmax(torch.randn(rows, k, vocab, generator=gen), -1) if stochastic else None
    out = verify(
        drafts,
        torch.full((rows,), k),
        q,
        logits,
        torch.zeros(rows),
        torch.zeros(rows, dtype=torch.int64),
        torch.ones(rows),
        torch.arange(rows),
        torch.zeros(rows, dtype=torch.int64),
    )
    assert torch.equal(out.num_accepted, wrong_at.clamp(max=k))
    for row in range(rows):
        n = int(out.num_emitted[row])
        assert torch.equal(out.tokens[row, :n], argmax[row, :n])
    assert (out.logprobs_processed[out.tokens >= 0] == 0).all()  # log 1


def test_zero_length_rows_are_plain_sampling() -> None:
    """lengths = 0: bit-identical to sample(processed_logprobs, uniforms(STREAM_SAMPLE))."""
    batch = random_batch(rows=200, k=2, vocab=11, seed=9)
    batch["draft_lengths"] = torch.zeros(200, dtype=torch.int64)
    out = verify(**batch)
    settings = (batch["temperature"], batch["top_k"], batch["top_p"])
    logp = processed_logprobs(batch["target_logits"][:, 0], *settings)
    plain = sample(logp, uniforms(batch["seeds"], batch["counters"], STREAM_SAMPLE))
    assert torch.equal(out.tokens[:, 0], plain)
    assert (out.num_emitted == 1).all() and (out.tokens[:, 1:] == PAD_TOKEN).all()
    assert torch.equal(out.logprobs_processed[:, 0], logp.gather(-1, plain[:, None])[:, 0])


def test_shapes_and_dtypes() -> None:
    batch = random_batch(rows=6, k=4, vocab=13, seed=1)
    batch["draft_probs"] = batch["draft_probs"].to(torch.bfloat16)
    out = verify(**batch)
    assert out.tokens.shape == (6, 5) and out.tokens.dtype == torch.int64
    assert out.num_emitted.shape == (6,) and out.num_emitted.dtype == torch.int64
    assert out.num_accepted.dtype == torch.int64
    assert out.logprobs_processed.shape == (6, 5) and out.logprobs_processed.dtype == torch.float32
    assert out.logprobs_raw.shape == (6, 5) and out.logprobs_raw.dtype == torch.float32
    assert ((out.num_emitted >= 1) & (out.num_emitted <= batch["draft_lengths"] + 1)).all()


def test_no_draft_slots() -> None:
    """k = 0: one plain-sampled token per row."""
    batch = random_batch(rows=5, k=0, vocab=6, seed=4)
    out = verify(**batch)
    assert out.tokens.shape == (5, 1) and (out.num_emitted == 1).all()
    assert (out.tokens >= 0).all()


def test_padding_drafts_may_hold_any_value() -> None:
    """Draft slots at or after lengths are ignored, even out-of-vocabulary ids."""
    batch = random_batch(rows=30, k=3, vocab=6, seed=8)
    batch["draft_lengths"] = torch.randint(0, 2, (30,))
    out = verify(**batch)
    junk = batch["draft_tokens"].clone()
    junk[:, 1:] = -7
    junk[:, 2] = 10**6
    assert torch.equal(verify(**{**batch, "draft_tokens": junk}).tokens, out.tokens)


@pytest.mark.parametrize(
    "field,value",
    [
        ("target_logits", torch.zeros(3, 3, 5)),
        ("draft_lengths", torch.zeros(4, dtype=torch.int64)),
        ("draft_probs", torch.zeros(3, 2, 5)),
        ("draft_tokens", torch.zeros(3, dtype=torch.int64)),
    ],
)
def test_bad_shapes_raise(field: str, value: torch.Tensor) -> None:
    batch = random_batch(rows=3, k=3, vocab=5, seed=0)
    with pytest.raises(ValueError, match=field):
        verify(**{**batch, field: value})
