"""The engine section's part (c): rollouts with an oracle drafter at set acceptance lengths.

Contract: ``rollout_batch(engine, prompt, batch, z, deadline)`` times plain and oracle-drafted
rollouts of ``batch`` rows (sample-exact verification, k = ``z.rollout_k`` fixed) at each of
``z.acceptance_lengths`` and returns ``{"rows": [...]}`` (row layout: docs/gpu.md). The oracle
drafts a settled book (``settle_book``): on a GPU a verify step can round a position's logits
unlike the plain step and flip a sampled token, past which plain's book is of no use.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from specrl.engine import Engine
from specrl.gpubench.common import seconds
from specrl.gpubench.oracle import book_of, oracle_spec, solve_alpha
from specrl.gpubench.sizes import EngineSizes
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig

BOOK_ROUNDS = 8  # at most this many oracle rollouts settle the book (``settle_book``)
SEED = 1  # every request's seed: its B samples get sample seeds sample_seed(SEED, i)


def requests(prompt: list[int], batch: int, new_tokens: int) -> list[Request]:
    """``batch`` samples of ``prompt`` (one request, n = batch), exactly ``new_tokens`` each
    (temperature 1, no stop token)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, n=batch, seed=SEED)
    return [Request(prompt, params)]


def book_spec(z: EngineSizes, book: dict[int, list[int]], alpha: float) -> SpecConfig:
    """The oracle at fixed k drafting ``book`` with per-token acceptance ``alpha``; a row off
    its book drafts k wrong tokens (every step of a row a verify step of k + 1)."""
    return oracle_spec(book, z.rollout_k, alpha, off_book=True, adaptive=False)


def settle_book(
    engine: Engine,
    reqs: list[Request],
    book: dict[int, list[int]],
    z: EngineSizes,
    deadline: float = math.inf,
) -> tuple[dict[int, list[int]], int, bool]:
    """The book the oracle's own rollouts reproduce, the rounds it took and whether one did:
    oracle rollouts at acceptance 1, each drafting the last one's tokens, until one reproduces
    its book (at most ``BOOK_ROUNDS``, none begun past ``deadline`` after the first). A
    position sampled in a verify step (k + 1 tokens per row) may round differently from the
    plain step's (1 token) in bf16 on a GPU, and with near-uniform logits (random weights) an
    inverse-CDF sample flips often. Past a row's first flip the oracle drafts k wrong tokens,
    so every token of a round comes from a verify step of the timed runs' shape; where a
    position rounds alike at every offset of that step (one GEMM shape) the next round
    reproduces it: two rounds settle the book (more where it does not). On the CPU the verify
    step rounds like the plain one and round 0 settles it (the plain book)."""
    for rounds in range(BOOK_ROUNDS):
        if rounds and time.perf_counter() > deadline:
            return book, rounds, False
        out = book_of(engine.generate(reqs, spec=book_spec(z, book, 1.0)))
        if out == book:
            return book, rounds, True
        book = out
    return book, BOOK_ROUNDS, False


def static_builds(engine: Engine) -> int:
    """Static steps the engine has built so far (0 without static steps; the oracle drafts on
    the host, so it has none of its own)."""
    return 0 if engine.static is None else engine.static.graphs.built


def warm_seconds(engine: Engine, fn: Callable[[], Any]) -> tuple[float, Any, int]:
    """Seconds and result of ``fn`` (a generate call), and its runs: run again (once) when it
    built static steps (captured a CUDA graph) on the way, so the time is of warm steps. An
    oracle at acceptance < 1 meets batch buckets and spans a lockstep run does not (rows finish
    apart), and its rollouts repeat exactly, so the second run builds none."""
    before = static_builds(engine)
    t, out = seconds(fn, engine.device)
    if static_builds(engine) == before:
        return t, out, 1
    t, out = seconds(fn, engine.device)
    return t, out, 2


def rollout_batch(
    engine: Engine, prompt: list[int], batch: int, z: EngineSizes, deadline: float
) -> dict:
    """Plain and oracle-drafted rollouts of ``batch`` rows, each timed once after a warm-up
    call; the oracle drafts the settled book (``settle_book``, whose first round is the
    oracle's warm-up; a timed oracle run that built static steps is run again,
    ``warm_seconds``). ``same_tokens``: the oracle's rollout equals plain's (sample-exact; on a
    GPU only where the step shapes round alike); ``same_as_book``: it equals the book it
    drafted."""
    reqs = requests(prompt, batch, z.rollout_tokens)
    engine.generate(reqs)  # warm-up
    plain_s, plain = seconds(partial(engine.generate, reqs), engine.device)
    book, rounds, settled = settle_book(engine, reqs, book_of(plain), z, deadline)
    rows = []
    for i, target in enumerate(z.acceptance_lengths):
        config = f"al{target}_bs{batch}"
        if i and time.perf_counter() > deadline:
            rows.append({"config": config, "batch_size": batch, "skipped": "deadline"})
            continue
        alpha = solve_alpha(target, z.rollout_k)
        spec = book_spec(z, book, alpha)
        spec_s, out, runs = warm_seconds(engine, partial(engine.generate, reqs, spec=spec))
        rows.append(rollout_row(engine, config, batch, len(prompt), z, target, alpha)
                    | timings(plain_s, spec_s, batch * z.rollout_tokens)
                    | {"spec_runs": runs, "book_rounds": rounds, "book_settled": settled,
                       "same_tokens": [c.token_ids for c in out] == [c.token_ids for c in plain],
                       "same_as_book": book_of(out) == book})  # fmt: skip
    return {"rows": rows}


def rollout_row(
    engine: Engine,
    config: str,
    batch: int,
    prompt_tokens: int,
    z: EngineSizes,
    target: float,
    alpha: float,
) -> dict:
    """A row's point and the acceptance its last oracle call measured."""
    return {
        "config": config,
        "batch_size": batch,
        "prompt_tokens": prompt_tokens,
        "new_tokens": z.rollout_tokens,
        "k": z.rollout_k,
        "acceptance_length": target,
        "alpha": alpha,
        "measured_acceptance_length": engine.stats.acceptance_length,
    }


def timings(plain_s: float, spec_s: float, tokens: int) -> dict:
    """A row's times, throughputs and speedup (plain over speculative)."""
    return {
        "plain_s": plain_s,
        "spec_s": spec_s,
        "plain_tokens_per_s": tokens / plain_s,
        "spec_tokens_per_s": tokens / spec_s,
        "speedup": plain_s / spec_s,
    }
