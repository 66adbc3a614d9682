"""Requests in, completions out: the engine's public data types.

Contract: a ``Request`` is a prompt (token ids) plus ``SamplingParams``; ``Engine.generate`` returns
``n`` ``Completion`` objects per request, in request order, each carrying the sampled token ids,
their log-probabilities under the processed (sampled-from) and raw (T=1) distributions, the
finish reason ("stop", "length", or "error" with a message), the policy version that produced
each token, timings and speculation counts. ``request_problem(req, context, vocab)`` is why a
request cannot run (one line) or ``None``; ``sample_seed(seed, index)`` is the seed of sample
``index`` of a request seeded ``seed``. Every rollout backend uses both, so a request is refused
and seeded the same way by all of them.
"""

from __future__ import annotations

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
