"""Requests in, completions out: the engine's public data types.

Contract: a ``Request`` is a prompt (token ids) plus ``SamplingParams``; ``Engine.generate`` returns
``n`` ``Completion`` objects per request, in request order, each carrying the sampled token ids,
their log-probabilities under the processed (sampled-from) and raw (T=1) distributions, the
finish reason ("stop", "length", or "error" with a message), the policy version that produced
each token, timings and speculation counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specrl.sampling import SamplingParams


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


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
