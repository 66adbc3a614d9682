"""specrl's requests as vLLM requests, and vLLM's outputs and counters as specrl's results.

``completions`` turns each request into ``n`` one-sample vLLM requests with the native engine's
per-sample seeds (a request the native engine would reject: an ``"error"`` completion);
``sampling_params`` sets stop tokens and the context limit. ``finish`` fills the completions'
processed and raw logprobs (one extra prefill where vLLM's own differ) and versions.
``read_counters`` / ``fill_stats`` make ``EngineStats`` from vLLM's speculative-decoding
counters (phase times stay 0).
Details: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specrl.rollout_types import Completion, EngineStats, Request, request_problem

METRIC_PREFIX = "vllm:spec_decode_"
Live = list[tuple[Completion, Request]]  # the completions vLLM runs, with their requests


def completions(
    requests: Sequence[Request],
    version: int,
    max_context: int,
    vocab_size: int,
    seed: Callable[[Request, int], int],
) -> tuple[list[Completion], Live]:
    """Every sample's completion in request order, and those vLLM runs (the others carry their
    error); ``seed(request, j)`` is sample j's seed."""
    comps: list[Completion] = []
    live: Live = []
    for i, req in enumerate(requests):
        error = request_problem(
            req, max_context - 1, vocab_size, "prompt + >= 1 new + 1 for the raw-logprob pass"
        )
        for j in range(max(req.sampling.n, 1)):
            c = Completion(i, j, list(req.prompt_ids), seed=seed(req, j), policy_version=version)
            if error:
                c.finish_reason, c.error = "error", error
            else:
                live.append((c, req))
            comps.append(c)
    return comps, live


def sampling_params(live: Live, max_context: int) -> tuple[list[dict[str, Any]], list[Any]]:
    """vLLM's prompts and ``SamplingParams`` for the live completions."""
    from vllm import SamplingParams as VllmParams

    inputs, params = [], []
    for c, req in live:
        s = req.sampling
        inputs.append({"prompt_token_ids": c.prompt_ids})
        params.append(VllmParams(
            n=1, temperature=s.temperature, top_k=s.top_k if s.top_k > 0 else 0,
            top_p=s.top_p, seed=c.seed, ignore_eos=True, stop_token_ids=list(s.stop_token_ids),
            max_tokens=min(s.max_new_tokens, max_context - 1 - len(c.prompt_ids)),
            logprobs=0, detokenize=False, skip_special_tokens=False))  # fmt: skip
    return inputs, params


def finish(llm: Any, live: Live, outs: Sequence[Any], version: int, wall0: float) -> None:
    """The live completions filled from vLLM's outputs (``wall0``: the call's wall-clock start),
    raw logprobs by one extra prefill where vLLM's processed ones are not raw."""
    need_raw = []
    for (c, req), out in zip(live, outs, strict=True):
        _fill(c, req, out, version, wall0)
        if not raw_is_processed(req):
            need_raw.append(c)
    if need_raw:
        _raw_pass(llm, need_raw)


def _fill(c: Completion, req: Request, out: Any, version: int, wall0: float) -> None:
    o = out.outputs[0]
    c.token_ids = list(o.token_ids)
    lps = [d[t].logprob for d, t in zip(o.logprobs or [], c.token_ids, strict=False)]
    if req.sampling.temperature == 0:
        c.raw_logprobs, c.logprobs = lps, [0.0] * len(lps)  # processed: one-hot
    else:
        c.logprobs = lps
        c.raw_logprobs = list(lps) if raw_is_processed(req) else []
    c.finish_reason = {"stop": "stop", "length": "length"}.get(o.finish_reason, "error")
    if c.finish_reason == "error":
        c.error = f"vLLM finished with {o.finish_reason!r}"
    c.token_versions = [version] * len(c.token_ids)
    m = out.metrics
    if m is not None and m.first_token_latency:
        c.first_token_s = max(0.0, m.arrival_time - wall0) + m.first_token_latency
        c.latency_s = c.first_token_s + max(0.0, m.last_token_ts - m.first_token_ts)
    sd = o.spec_decode_metrics
    if sd is not None:
        c.drafted = sd.num_draft_tokens
        c.accepted = sum(j * n for j, n in enumerate(sd.histogram))
    c.verify_steps = max(len(c.token_ids) - 1 - c.accepted, 0)


def _raw_pass(llm: Any, comps: list[Completion]) -> None:
    """Raw (temperature 1, untruncated) logprobs of sampled tokens: vLLM's prompt logprobs
    of prompt + completion (one prefill each)."""
    from vllm import SamplingParams as VllmParams

    todo = [c for c in comps if c.token_ids]
    if not todo:
        return
    params = VllmParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0)
    outs = llm.generate(
        [{"prompt_token_ids": c.prompt_ids + c.token_ids} for c in todo], params, use_tqdm=False
    )
    for c, out in zip(todo, outs, strict=True):
        plp = out.prompt_logprobs[len(c.prompt_ids) :]
        c.raw_logprobs = [d[t].logprob for d, t in zip(plp, c.token_ids, strict=True)]


def raw_is_processed(req: Request) -> bool:
    """Whether the processed distribution of ``req`` equals the raw one on sampled tokens
    (temperature 1 untruncated; greedy, where vLLM's logprob is the raw one)."""
    s = req.sampling
    return s.temperature in (0.0, 1.0) and s.top_k == 0 and s.top_p >= 1.0


# --------------------------------------------------------------------------- statistics


@dataclass
class Counters:
    """vLLM's speculative-decoding counters of one engine."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: tuple[int, ...] = ()

    def minus(self, other: Counters) -> Counters:
        pos = [a - (other.per_pos[i] if i < len(other.per_pos) else 0)
               for i, a in enumerate(self.per_pos)]  # fmt: skip
        return Counters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                        self.accepted - other.accepted, tuple(pos))  # fmt: skip


def read_counters(llm: Any, name: str) -> Counters:
    """The counters vLLM keeps for the engine serving ``name``."""
    out = Counters()
    for m in llm.get_metrics():
        if not m.name.startswith(METRIC_PREFIX) or m.labels.get("model_name") != name:
            continue
        key = m.name.removeprefix(METRIC_PREFIX)
        if key == "num_drafts":
            out.drafts += int(m.value)
        elif key == "num_draft_tokens":
            out.draft_tokens += int(m.value)
        elif key == "num_accepted_tokens":
            out.accepted += int(m.value)
        elif key == "num_accepted_tokens_per_pos":
            pos = list(out.per_pos) + [0] * max(0, len(m.values) - len(out.per_pos))
            for i, v in enumerate(m.values):
                pos[i] += int(v)
            out.per_pos = tuple(pos)
    return out


def fill_stats(st: EngineStats, comps: list[Completion], d: Counters, k: int) -> None:
    """``st`` from a call's completions and counter difference ``d`` (``k``: the configured
    draft length)."""
    st.tokens = sum(len(c.token_ids) for c in comps)
    st.drafted, st.accepted = d.draft_tokens, d.accepted
    st.per_position_accepted = list(d.per_pos)
    k = max(k, len(d.per_pos))
    if d.drafts:
        left, drafted = d.draft_tokens, []
        for _ in range(k):  # exact when every draft had k tokens; else longest first
            drafted.append(min(d.drafts, left))
            left -= drafted[-1]
        st.per_position_drafted = drafted
    st.emitted_per_row_step = sum(max(len(c.token_ids) - 1, 0) for c in comps)
    st.row_steps = sum(c.verify_steps for c in comps)
