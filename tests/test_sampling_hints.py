"""``SamplingHints``: with hints the sampler reads no device data and returns bit for bit the same.

Bit-identity is checked on many random batches (mixed greedy / temperature / top-k / top-p rows,
every branch the hint-free code takes from the data); "no host sync" twice: on ``meta`` tensors
(no data at all: any read raises) and under ``NoSync``, a dispatch mode that fails on the ops a
host read or a data-dependent shape dispatches to, on real CPU tensors.
"""

from __future__ import annotations

import random
from dataclasses import fields

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specrl.sampling import (
    SamplingHints,
    draw,
    processed_logprobs,
    raw_logprobs_reusing,
    sample,
    sample_logits,
    sample_probs,
    uniforms,
)
from tests.conftest import DEVICES

aten = torch.ops.aten
META = torch.device("meta")
VOCABS = (7, 64, 1500)  # 1500: two inverse-CDF chunks
KINDS = ("plain", "greedy", "temp", "top_k", "top_p", "both", "big_k", "rounded", "tiny_t")
Settings = list[tuple[float, int, float]]  # (temperature, top_k, top_p) per row


class NoSync(TorchDispatchMode):
    """Fails on every op that reads device data on the host or makes a data-dependent shape,
    and on host tensors (other than 0-dim scalars) mixed into an op on another device (a copy
    from host memory in the step)."""

    BANNED = (
        aten._local_scalar_dense,  # bool(), int(), float(), .item()
        aten.item,
        aten.is_nonzero,
        aten.equal,
        aten.nonzero,
        aten.masked_select,
        aten._unique2,
        aten.unique_consecutive,
    )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func.overloadpacket is aten.index and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        )
        if func.overloadpacket in self.BANNED or bool_index:
            raise AssertionError(f"host read of device data: {func}")
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        devices = {x.device for x in tensors if x.dim() > 0 or x.device.type != "cpu"}
        if len(devices) > 1:
            raise AssertionError(f"host tensor in a device op: {func} on {devices}")
        return func(*args, **kwargs)


def row_setting(kind: str, rng: random.Random, vocab: int) -> tuple[float, int, float]:
    """One row's (temperature, top_k, top_p) of a kind."""
    t = rng.choice([1.0, rng.uniform(0.3, 2.0)])
    return {
        "plain": (1.0, 0, 1.0),
        "greedy": (0.0, rng.choice([0, 3]), rng.choice([1.0, 0.8])),
        "temp": (rng.uniform(0.3, 2.0), 0, 1.0),
        "top_k": (t, rng.randint(1, vocab), 1.0),
        "top_p": (t, 0, rng.uniform(0.2, 0.99)),  # no top_k: the full vocabulary is sorted
        "both": (t, rng.randint(1, vocab), rng.uniform(0.2, 0.99)),
        "big_k": (t, vocab + rng.randint(0, 5), 1.0),  # top_k at or past the vocabulary
        "rounded": (1 + 1e-9, 0, 1 - 1e-9),  # plain once float32
        "tiny_t": (1e-50, 0, 1.0),  # greedy once float32
    }[kind]


def random_settings(rng: random.Random, n: int, vocab: int) -> Settings:
    """n rows drawn from a random subset of one to three kinds (so all-plain, all-greedy, ...)."""
    kinds = rng.sample(KINDS, rng.randint(1, 3))
    return [row_setting(rng.choice(kinds), rng, vocab) for _ in range(n)]


def setting_tensors(settings: Settings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' settings as the engine holds them (``RowTensors``): float32, int64, float32."""
    t, k, p = zip(*settings, strict=True)
    return (
        torch.tensor(t, dtype=torch.float32),
        torch.tensor(k, dtype=torch.int64),
        torch.tensor(p, dtype=torch.float32),
    )


def hints_of(settings: Settings, vocab: int) -> SamplingHints:
    return SamplingHints.of(*zip(*settings, strict=True), vocab)


def assert_same(a: object, b: object) -> None:
    """Tensors (or tuples / dataclasses of them) equal bit for bit, with the same dtypes."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        for f in fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))


def random_logits(rng: random.Random, shape: tuple[int, ...]) -> torch.Tensor:
    """Logits of a random scale and dtype (bf16/float32 take the native T=1 sampler on the CPU,
    float16 PyTorch's ops, as on a GPU)."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    return (torch.randn(shape, generator=gen) * rng.uniform(0.5, 4)).to(dtype)


def seen_hints(hints: list[SamplingHints], vocab_of: list[int]) -> set[str]:
    """Which branch of each hint the batches took (for the coverage checks)."""
    seen = set()
    for h, vocab in zip(hints, vocab_of, strict=True):
        seen |= {f"unit={h.unit_temperature}", f"greedy={h.any_greedy}", f"plain={h.plain}"}
        seen.add(
            f"width={'0' if not h.truncate_width else 'V' if h.truncate_width == vocab else 'k'}"
        )
    return seen


ALL_BRANCHES = {
    *(f"{name}={v}" for name in ("unit", "greedy", "plain") for v in (True, False)),
    "width=0",
    "width=k",
    "width=V",
}


# ------------------------------------------------------------------------ SamplingHints.of


def test_hints_of_known_batches():
    v = 50
    assert SamplingHints.of([1.0, 1.0], [0, 0], [1.0, 1.0], v) == SamplingHints(
        True, False, 0, True
    )
    assert SamplingHints.of([0.0, 0.5], [5, 0], [1.0, 1.0], v) == SamplingHints(
        False, True, 5, False
    )
    assert SamplingHints.of([1.0, 1.0], [5, 9], [1.0, 0.5], v).truncate_width == 9
    assert SamplingHints.of([1.0, 1.0], [5, 0], [1.0, 0.5], v).truncate_width == v  # a top_p row
    assert SamplingHints.of([1.0], [80], [1.0], v).truncate_width == v  # top_k past the vocab
    assert SamplingHints.of([1 + 1e-9], [0], [1 - 1e-9], v).plain  # float32 holds 1 and 1
    assert SamplingHints.of([1e-50], [0], [1.0], v).any_greedy  # float32 holds 0
    assert not SamplingHints.of([1e-50], [0], [1.0], v, dtype=torch.float64).any_greedy
    assert SamplingHints.of([], [], [], v) == SamplingHints(True, False, 0, True)
    assert len({SamplingHints.of([1.0], [0], [1.0], v), SamplingHints(True, False, 0, True)}) == 1


# ------------------------------------------------------------------------------ bit-identity


@pytest.mark.parametrize("device", DEVICES)
def test_hinted_sampling_is_bit_identical_on_random_batches(device: str):
    """processed_logprobs, sample_logits (the engine's plain step), draw, sample and
    raw_logprobs_reusing give the same tokens and floats with hints as without."""
    rng = random.Random(0)
    hints_seen, vocabs = [], []
    for _ in range(240):
        vocab, n = rng.choice(VOCABS), rng.randint(1, 6)
        settings = random_settings(rng, n, vocab)
        rows = [x.to(device) for x in setting_tensors(settings)]
        hints = hints_of(settings, vocab)
        logits = random_logits(rng, (n, vocab)).to(device)
        u = uniforms(torch.arange(n) + rng.randrange(1000), torch.arange(n), 1).to(device)
        lp = processed_logprobs(logits, *rows)
        assert_same(processed_logprobs(logits, *rows, hints=hints), lp)
        assert_same(sample_logits(logits, *rows, u, hints=hints), sample_logits(logits, *rows, u))
        assert_same(draw(logits, *rows, u, hints=hints), draw(logits, *rows, u))
        assert_same(sample(lp, u, hints=hints), sample(lp, u))
        raw = raw_logprobs_reusing(logits, lp, *rows)
        assert_same(raw_logprobs_reusing(logits, lp, *rows, hints=hints), raw)
        hints_seen.append(hints)
        vocabs.append(vocab)
    assert seen_hints(hints_seen, vocabs) == ALL_BRANCHES


def test_sample_probs_past_the_last_nonzero_token_is_the_same_with_hints():
    """Where the inverse CDF lands on a token of probability 0 (u at 1) both forms take the
    argmax, the hinted one without checking first."""
    probs = torch.zeros(3, 2100)
    probs[:, :5] = torch.tensor([0.1, 0.4, 0.2, 0.2, 0.1])
    u = torch.tensor([0.3, 1.0, 0.99], dtype=torch.float64)
    hints = SamplingHints(True, False, 0, True)
    got = sample_probs(probs, u, hints=hints)
    assert_same(got, sample_probs(probs, u))
    assert int(got[1]) == 1  # the argmax: the CDF ran past the last nonzero token


def test_conservative_hints_cost_a_pass_but_change_nothing():
    """unit_temperature=False and any_greedy=True on batches without either are still exact."""
    rng = random.Random(1)
    for _ in range(40):
        vocab, n = rng.choice(VOCABS), rng.randint(1, 5)
        settings = [row_setting(rng.choice(["plain", "top_k", "top_p"]), rng, vocab)] * n
        rows, hints = setting_tensors(settings), hints_of(settings, vocab)
        loose = SamplingHints(False, True, hints.truncate_width, hints.plain)
        logits = random_logits(rng, (n, vocab))
        assert_same(
            processed_logprobs(logits, *rows, hints=loose), processed_logprobs(logits, *rows)
        )


# ---------------------------------------------------------------------------- no host sync

META_SETTINGS = {  # batches that take each branch with hints
    "plain": [(1.0, 0, 1.0)] * 3,
    "mixed": [(0.0, 0, 1.0), (0.7, 4, 1.0), (1.0, 2, 0.9)],
    "full_vocab": [(1.0, 0, 0.5), (1.3, 0, 1.0), (1.0, 0, 1.0)],
}


def sampling_calls(settings: Settings, device: torch.device, vocab: int = 40) -> list:
    """Every hinted sampling function on tensors on ``device``, with its expected shapes."""
    n = len(settings)
    hints = hints_of(settings, vocab)
    rows = [x.to(device) for x in setting_tensors(settings)]
    cpu_logits = torch.randn(n, vocab)
    logits = cpu_logits.to(device)
    counters = torch.arange(n).to(device)
    u = uniforms(counters + 7, counters, 1)
    lp = processed_logprobs(cpu_logits, *setting_tensors(settings)).to(device)
    return [
        (lambda: processed_logprobs(logits, *rows, hints=hints), [(n, vocab)]),
        (lambda: sample_logits(logits, *rows, u, hints=hints), [(n,), (n,), (n,)]),
        (lambda: draw(logits, *rows, u, hints=hints), [(n,), (n, vocab)]),
        (lambda: sample(lp, u, hints=hints), [(n,)]),
        (lambda: sample_probs(lp.exp(), u, hints=hints), [(n,)]),
        (lambda: raw_logprobs_reusing(logits, lp, *rows, hints=hints), [(n, vocab)]),
        (lambda: uniforms(counters, counters[:, None] + counters, 3), [(n, n)]),
    ]


def shapes(out: object) -> list[tuple[int, ...]]:
    outs = out if isinstance(out, tuple) else (out,)
    return [tuple(x.shape) for x in outs]


def test_meta_and_no_sync_catch_host_reads():
    """The checks can fail: a host read raises on meta tensors and under ``NoSync``, and so does
    the hint-free sampler."""
    with pytest.raises(RuntimeError):
        bool(torch.zeros(2, device=META).any())
    rows = setting_tensors(META_SETTINGS["mixed"])
    with pytest.raises(RuntimeError):
        processed_logprobs(torch.zeros(3, 40, device=META), *(x.to(META) for x in rows))
    with NoSync(), pytest.raises(AssertionError, match="host read"):
        bool(torch.zeros(2).any())
    with NoSync(), pytest.raises(AssertionError, match="host read"):
        torch.zeros(3)[torch.tensor([True, False, True])]
    with NoSync(), pytest.raises(AssertionError, match="host read"):
        processed_logprobs(torch.zeros(3, 40), *rows)
    with NoSync(), pytest.raises(AssertionError, match="host tensor"):
        torch.zeros(3, 4, device=META)[torch.arange(3), torch.zeros(3, dtype=torch.int64)]


@pytest.mark.parametrize("batch", sorted(META_SETTINGS))
def test_hinted_sampling_reads_no_device_data(batch: str):
    """On meta tensors (no data) the hinted functions complete with the right shapes; on CPU
    tensors under ``NoSync`` they dispatch no host read."""
    for device in (META, torch.device("cpu")):
        for call, want in sampling_calls(META_SETTINGS[batch], device):
            with NoSync():
                assert shapes(call()) == want
