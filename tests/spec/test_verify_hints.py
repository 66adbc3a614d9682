"""``verify`` with ``SamplingHints``: bit for bit the hint-free result, no host read of device data.

Random batches cover both rules, k = 0..4, draft_probs given and None, rows that accept every
draft or reject at each position, batches where none / some / all rows reject, and empty
residuals (q = 2p); the checks of ``tests/test_sampling_hints.py`` (meta tensors, ``NoSync``)
show the hinted step reads nothing.
"""

from __future__ import annotations

import random

import pytest
import torch

from specrl.sampling import STREAM_SAMPLE, processed_logprobs, sample_logits, sample_probs
from specrl.spec.verify import RULES, verify
from tests.conftest import DEVICES
from tests.spec.test_verify import on_cpu
from tests.test_sampling_hints import (
    META,
    META_SETTINGS,
    VOCABS,
    NoSync,
    Settings,
    assert_same,
    hints_of,
    random_logits,
    random_settings,
    setting_tensors,
    uniforms,
)

DRAFTS = ("q", "p", "2p", "plain", "argmax", "random")  # how drafts (and q) are made


def random_case(rng: random.Random, b: int, k: int, vocab: int, drafts: str) -> dict:
    """verify's keyword arguments for a random batch; ``drafts``: q = p of other logits, q = p,
    q = 2p (empty residuals), or one-hot drafts: plain sampling's tokens, argmax, uniform."""
    settings = random_settings(rng, b, vocab)
    rows = setting_tensors(settings)
    target = random_logits(rng, (b, k + 1, vocab))
    seeds = torch.tensor([rng.randrange(1 << 40) for _ in range(b)])
    counters = torch.tensor([rng.randrange(100) for _ in range(b)])
    per_row = [x.repeat_interleave(k) for x in rows]
    flat = target[:, :k].reshape(b * k, vocab)
    u = torch.rand(b * k, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    probs = torch.zeros(b, 0, vocab) if drafts in ("q", "p", "2p") else None
    if k == 0:
        tokens = torch.zeros(0, dtype=torch.int64)
    elif drafts in ("q", "p", "2p"):
        other = flat if drafts != "q" else flat.float() + torch.randn_like(flat.float())
        probs = processed_logprobs(other, *per_row).exp() * (2.0 if drafts == "2p" else 1.0)
        tokens = sample_probs(probs, u.double())
        probs = probs.view(b, k, vocab)
    elif drafts == "plain":
        steps = counters[:, None] + torch.arange(k)[None, :]
        tokens = sample_logits(flat, *per_row, uniforms(seeds, steps, STREAM_SAMPLE).view(-1))[0]
    elif drafts == "argmax":
        tokens = flat.argmax(-1)
    else:
        tokens = (u * vocab).long()
    tokens = tokens.view(b, k)
    if k and rng.random() < 0.5:  # one wrong draft at a random position
        tokens[:, rng.randrange(k)] = torch.tensor([rng.randrange(vocab) for _ in range(b)])
    return dict(
        draft_tokens=tokens,
        draft_lengths=torch.tensor([rng.randint(0, k) for _ in range(b)]),
        draft_probs=probs,
        target_logits=target,
        temperature=rows[0],
        top_k=rows[1],
        top_p=rows[2],
        seeds=seeds,
        counters=counters,
    ), settings


def outcomes(case: dict, v, drafts: str) -> set[str]:
    """The branches a verified batch exercised (for the coverage check)."""
    accepted, lengths = v.num_accepted, case["draft_lengths"]
    rejected = accepted < lengths
    seen = {"none" if not rejected.any() else "all" if rejected.all() else "some"}
    seen |= {f"reject@{int(j)}" for j in accepted[rejected]}
    seen |= {"all_accepted" for a, n in zip(accepted, lengths, strict=True) if a == n > 0}
    if drafts == "2p" and rejected.any():
        seen.add("empty_residual")
    return seen


def with_settings(case: dict, settings: Settings) -> dict:
    """verify's arguments with the rows' settings replaced."""
    names = ("temperature", "top_k", "top_p")
    return case | dict(zip(names, setting_tensors(settings), strict=True))


def moved(case: dict, device: torch.device | str) -> dict:
    """verify's arguments on ``device``."""
    return {name: x if x is None else x.to(device) for name, x in case.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", RULES)
def test_hinted_verify_is_bit_identical_on_random_batches(rule: str, device: str):
    rng = random.Random(RULES.index(rule))
    seen = set()
    for i in range(300):
        k, vocab, drafts = i % 5, rng.choice(VOCABS), DRAFTS[(i // 5) % len(DRAFTS)]
        case, settings = random_case(rng, rng.randint(1, 5), k, vocab, drafts)
        want = verify(**moved(case, device), rule=rule)
        assert_same(verify(**moved(case, device), rule=rule, hints=hints_of(settings, vocab)), want)
        seen |= outcomes(case, on_cpu(want), drafts)
    want_seen = {"none", "some", "all", "all_accepted", *(f"reject@{j}" for j in range(4))}
    assert want_seen | ({"empty_residual"} if rule == "distribution" else set()) <= seen


@pytest.mark.parametrize("batch", sorted(META_SETTINGS))
def test_hinted_verify_reads_no_device_data(batch: str):
    """Both rules, k = 0..3, q given or one-hot: on meta tensors (no data) and on CPU tensors
    under ``NoSync`` the hinted step completes with the right shapes."""
    settings = META_SETTINGS[batch]
    b, vocab = len(settings), 40
    hints = hints_of(settings, vocab)
    for k in range(4):
        for drafts in ("q", "plain"):
            case = with_settings(random_case(random.Random(k), b, k, vocab, drafts)[0], settings)
            for device in (META, torch.device("cpu")):
                for rule in RULES:
                    with NoSync():
                        v = verify(**moved(case, device), rule=rule, hints=hints)
                    assert v.tokens.shape == v.logprobs_raw.shape == (b, k + 1)
                    assert v.num_emitted.shape == v.num_accepted.shape == (b,)
    with pytest.raises(RuntimeError):  # the check can fail: the hint-free step reads
        verify(**moved(case, META))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", sorted(META_SETTINGS))
@pytest.mark.parametrize("step", ["plain", *RULES])
def test_hinted_steps_capture_in_a_cuda_graph(step: str, batch: str):
    """On CUDA a hinted step records into a CUDA graph (a host sync raises while capturing);
    replayed on new logits and drafts it gives the hint-free eager result bit for bit."""
    rng, settings = random.Random(7), META_SETTINGS[batch]
    case = with_settings(random_case(rng, len(settings), 3, 1500, "q")[0], settings)
    hints = hints_of(settings, 1500)
    static = moved(case, "cuda")

    def run(h):
        if step == "plain":  # the engine's plain step (``sample_rows``)
            u = uniforms(static["seeds"], static["counters"], STREAM_SAMPLE)
            names = ("temperature", "top_k", "top_p")
            return sample_logits(static["target_logits"][:, 0], *(static[n] for n in names), u,
                                 hints=h)  # fmt: skip
        return verify(**static, rule=step, hints=h)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(hints)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(hints)
    for _ in range(3):
        fresh, _ = random_case(rng, len(settings), 3, 1500, "q")
        for name in ("draft_tokens", "draft_probs", "target_logits", "counters"):
            static[name].copy_(fresh[name].to(static[name].dtype))
        graph.replay()
        assert_same(out, run(None))
