"""What a rollout backend takes and returns: requests, completions, statistics.

A ``Request`` is a prompt (token ids) plus ``SamplingParams``; a backend returns ``n``
``Completion`` objects per request, in request order (per-token tensors: token ids, processed
and raw logprobs, the policy version of each token; finish reason, timings, speculation counts);
``RolloutTensors`` are completions' tokens as flat ragged tensors (the native engine returns its
completions as views of one).
``request_problem`` and ``sample_seed`` make every backend refuse and seed a request alike.
``EngineStats`` holds a call's counters (``add`` accumulates; rates are properties) and, with
``record_steps``, one ``StepRecord`` per forward in the trace format ``sim.calibrate`` reads.
Details: docs/internals.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

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


def _ids(values: Sequence[int] | torch.Tensor = ()) -> torch.Tensor:  # -> [n] int64
    return torch.as_tensor(values, dtype=torch.int64).reshape(-1)


def _floats(values: Sequence[float] | torch.Tensor = ()) -> torch.Tensor:  # -> [n] float32
    return torch.as_tensor(values, dtype=torch.float32).reshape(-1)


TOKEN_FIELDS = ("tokens", "token_logprobs", "token_raw_logprobs", "versions")


class _ListView:
    """A per-token tensor field read as a list and set from one (``Completion.token_ids``)."""

    def __init__(self, field: str, convert: Callable[[Any], torch.Tensor]) -> None:
        self.field, self.convert = field, convert

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self.field).tolist()

    def __set__(self, obj: Any, values: Sequence[Any]) -> None:
        setattr(obj, self.field, self.convert(values))


@dataclass(eq=False)
class Completion:
    """One sampled completion. Its per-token data are host tensors [n] (``tokens``,
    ``token_logprobs``: the processed distribution's, ``token_raw_logprobs``: temperature 1,
    no truncation, empty where a backend has none, ``versions``: the weights version that
    sampled each token); after ``Engine.generate`` they are views of one flat
    ``RolloutTensors``. ``token_ids``, ``logprobs``, ``raw_logprobs`` and ``token_versions``
    read (and set) them as lists. Pickling copies only a completion's own tokens."""

    request_index: int
    sample_index: int
    prompt_ids: list[int]
    tokens: torch.Tensor = field(default_factory=_ids)  # [n] int64
    token_logprobs: torch.Tensor = field(default_factory=_floats)  # [n] float32
    token_raw_logprobs: torch.Tensor = field(default_factory=_floats)  # [n] float32 (or [0])
    versions: torch.Tensor = field(default_factory=_ids)  # [n] int64
    finish_reason: str = "length"  # "stop" | "length" | "error"
    error: str | None = None
    seed: int = 0
    policy_version: int = 0  # the engine's weights version when the completion finished
    first_token_s: float = 0.0  # seconds from generate() start to the first token
    latency_s: float = 0.0  # seconds from generate() start to the last token
    verify_steps: int = 0  # decode/verify forwards that emitted tokens (the prefill's excluded)
    drafted: int = 0
    accepted: int = 0
    # a mixture-of-experts target's experts [P + n - 1, moe_layers, top_k] (int16) of every
    # input position (prompt, then the completion's tokens but the last) as the engine routed
    # them: what the learner replays (``learner.routing_replay``); None: not recorded
    routing: torch.Tensor | None = None

    def __post_init__(self) -> None:  # lists given for the token fields become tensors
        self.tokens, self.versions = _ids(self.tokens), _ids(self.versions)
        self.token_logprobs = _floats(self.token_logprobs)
        self.token_raw_logprobs = _floats(self.token_raw_logprobs)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    token_ids = _ListView("tokens", _ids)  # list[int]
    logprobs = _ListView("token_logprobs", _floats)  # list[float]
    raw_logprobs = _ListView("token_raw_logprobs", _floats)  # list[float]
    token_versions = _ListView("versions", _ids)  # list[int]

    def set_tokens(self, *tensors: torch.Tensor) -> None:
        """tokens, logprobs, raw logprobs, versions := ``tensors`` ([n] each)."""
        for name, t in zip(TOKEN_FIELDS, tensors, strict=True):
            setattr(self, name, t)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Completion):
            return NotImplemented
        return all(
            torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            else a is b if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else a == b
            for a, b in zip(vars(self).values(), vars(other).values(), strict=True)
        )  # fmt: skip

    def __getstate__(self) -> dict:
        """Its own tokens only (a view would pickle the whole flat rollout's storage)."""
        state = dict(vars(self))
        for name in TOKEN_FIELDS:
            state[name] = state[name].clone()
        return state

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per decode/verify step (EAGLE's tau: the first token, which the
        prefill emits, is not counted); 1.0 without speculation or without any decode step."""
        if not self.verify_steps:
            return 1.0 if self.num_tokens else 0.0
        return (self.num_tokens - 1) / self.verify_steps


@dataclass(frozen=True)
class RolloutTensors:
    """Completions' per-token data as flat ragged host tensors: row r is [offsets[r],
    offsets[r+1]) of each."""

    tokens: torch.Tensor  # [N] int64
    logprobs: torch.Tensor  # [N] float32
    raw_logprobs: torch.Tensor  # [N] float32; NaN where a completion has none (so logprobs)
    versions: torch.Tensor  # [N] int64; a completion's policy_version where it has none
    offsets: torch.Tensor  # [R + 1] int64

    @classmethod
    def of(cls, comps: Sequence[Completion]) -> RolloutTensors:
        """The completions' tokens concatenated (one copy per field)."""
        nan = float("nan")
        offsets = torch.tensor([0, *(c.num_tokens for c in comps)], dtype=torch.int64).cumsum(0)
        return cls(_cat([c.tokens for c in comps], _ids()),
                   _column(comps, "token_logprobs", lambda c: nan, torch.float32),
                   _column(comps, "token_raw_logprobs", lambda c: nan, torch.float32),
                   _column(comps, "versions", lambda c: c.policy_version, torch.int64),
                   offsets)  # fmt: skip

    def share(self, comps: Sequence[Completion]) -> None:
        """Point each completion's tokens at its rows of these tensors (views, no copy); the
        completions are the ones ``of`` was given, in order (logprobs left alone where a
        completion had none; missing versions become its ``policy_version``)."""
        bounds = self.offsets.tolist()
        flat = (self.tokens, self.logprobs, self.raw_logprobs, self.versions)
        for c, lo, hi in zip(comps, bounds[:-1], bounds[1:], strict=True):
            for name, t in zip(TOKEN_FIELDS, flat, strict=True):
                if name == "versions" or getattr(c, name).numel() == hi - lo:
                    setattr(c, name, t[lo:hi])  # missing logprobs stay missing


def _cat(parts: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else empty


def _column(
    comps: Sequence[Completion], name: str, fill: Callable[[Completion], float], dtype: torch.dtype
) -> torch.Tensor:  # -> [N]
    """One per-token field of the completions concatenated; ``fill(c)`` where ``c`` has none
    (NaN for missing logprobs, the completion's version for missing versions)."""
    parts = [
        t if t.numel() == c.num_tokens else torch.full((c.num_tokens,), fill(c), dtype=dtype)
        for c in comps
        for t in (getattr(c, name),)
    ]
    return _cat(parts, torch.zeros(0, dtype=dtype))


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
