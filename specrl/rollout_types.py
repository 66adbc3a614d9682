"""What a rollout backend takes and returns: requests, completions, statistics.

Contract: a ``Request`` is a prompt (token ids) plus ``SamplingParams``; a backend returns ``n``
``Completion`` objects per request, in request order, each carrying the sampled token ids, their
log-probabilities under the processed (sampled-from) and raw (T=1) distributions, the finish
reason ("stop", "length", or "error" with a message), the policy version that produced each
token, timings and speculation counts. ``request_problem(req, context, vocab)`` is why a request
cannot run (one line) or ``None``; ``sample_seed(seed, index)`` is the seed of sample ``index``
of a request seeded ``seed``. Every rollout backend uses both, so a request is refused and seeded
the same way by all of them.

``EngineStats`` holds a call's plain counters; ``add`` accumulates another call's counters;
derived rates (acceptance length, per-position acceptance) are properties, never stored. With
``Engine(record_steps=True)`` it also keeps one ``StepRecord`` per engine forward (prefill, plain
decode, draft, verify) in ``step_records``, in the trace format ``specrl.sim.calibrate`` reads;
``add`` concatenates those records (per-position counters are summed element-wise). The
in-flight update counters (``weight_updates`` .. ``reverify_s``) are defined in
``specrl.engine.inflight``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from specrl.sampling import SamplingParams


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


def request_problem(
    req: Request, context: int, vocab: int, needs: str = "prompt + >= 1 new"
) -> str | None:
    """Why ``req`` cannot run in a ``context``-token window over a ``vocab``-token vocabulary
    (bad sampling values, empty prompt, a prompt leaving no room for ``needs``, an id outside
    the vocabulary), or ``None``. ``context`` is the most prompt tokens + 1 the backend takes."""
    try:
        req.sampling.validate()
    except ValueError as e:
        return str(e)
    n = len(req.prompt_ids)
    if n == 0:
        return "empty prompt"
    if n >= context:
        return f"prompt has {n} tokens; the context holds {context} ({needs})"
    bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
    if bad:
        return f"prompt token id {bad[0]} outside the vocabulary [0, {vocab})"
    return None


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded ``seed`` (below 2**63)."""
    return (seed * 1_000_003 + index) & ((1 << 63) - 1)


@dataclass
class Completion:
    request_index: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # processed distribution
    raw_logprobs: list[float] = field(default_factory=list)  # temperature 1, no truncation
    finish_reason: str = "length"  # "stop" | "length" | "error"
    error: str | None = None
    seed: int = 0
    policy_version: int = 0  # the engine's weights version when the completion finished
    token_versions: list[int] = field(default_factory=list)  # per token: version that sampled it
    first_token_s: float = 0.0  # seconds from generate() start to the first token
    latency_s: float = 0.0  # seconds from generate() start to the last token
    verify_steps: int = 0  # decode/verify forwards that emitted tokens (the prefill's excluded)
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per decode/verify step (EAGLE's tau: the first token, which the
        prefill emits, is not counted); 1.0 without speculation or without any decode step."""
        if not self.verify_steps:
            return 1.0 if self.token_ids else 0.0
        return (len(self.token_ids) - 1) / self.verify_steps


@dataclass(frozen=True)
class StepRecord:
    """One timed engine forward, as a calibration trace record (see specrl.sim.calibrate)."""

    kind: str  # "prefill" | "decode" | "draft" | "verify"
    batch_size: int  # rows in the forward (prompts for a prefill)
    tokens_per_seq: int  # 1 decode, k+1 verify, k draft, padded prompt length prefill
    context_len: float  # mean tokens already in the KV cache per row
    step_time_s: float  # wall seconds, sampling and bookkeeping included

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class EngineStats:
    """Cumulative counters of one ``generate`` call."""

    steps: int = 0
    spec_steps: int = 0  # decode steps that verified at least one draft token
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    sibling_accepted: int = 0  # row steps where a sibling replaced the rejected first draft
    per_position_accepted: list[int] = field(default_factory=list)
    per_position_drafted: list[int] = field(default_factory=list)
    emitted_per_row_step: int = 0  # sum over (row, decode/verify step) of emitted tokens
    row_steps: int = 0  # (row, decode/verify step) pairs; prefills are not counted
    # in-flight weight updates (``specrl.engine.inflight``)
    weight_updates: int = 0  # updates applied between decode steps with live rows
    reverified_tokens: int = 0  # older-version tokens checked by a re-verification forward
    reused_tokens: int = 0  # older-version tokens kept (accepted by reverify, or by keep)
    discarded_tokens: int = 0  # older-version tokens thrown away (discard; rejected in reverify)
    reverify_s: float = 0.0  # seconds in re-verification forwards (and their sampling)
    step_records: list[StepRecord] = field(default_factory=list, metadata={"concat": True})

    def add(self, other: EngineStats) -> None:
        """Accumulate another call's counters into these (cumulative statistics)."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.metadata.get("concat"):
                mine.extend(theirs)
            elif isinstance(mine, list):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, v in enumerate(theirs):
                    mine[i] += v
            else:
                setattr(self, f.name, mine + theirs)

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of drafts at position i accepted (i = 0 is the first draft token)."""
        return [
            a / d if d else 0.0
            for a, d in zip(self.per_position_accepted, self.per_position_drafted, strict=False)
        ]

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per (row, decode/verify step): EAGLE's tau, 1.0 without speculation
        (the token each prefill emits is not counted; 1.0 if there was no decode step)."""
        if not self.row_steps:
            return 1.0 if self.tokens else 0.0
        return self.emitted_per_row_step / self.row_steps
