"""One RL step, split in two: ``collect(parts, prompts, step) -> Batch`` and
``learn(parts, state, batch, waited_s)``.

``collect``: G seeded completions per prompt from the backend, rewards (``scored_rollout``:
each group sent to the reward workers as soon as it finishes, ``pipelines.scoring``), group
advantages, rollout metrics, the behaviour version and what the backend served. ``learn`` (the
learner's thread): ``check_served`` (weight-sync check), the acceptance alarm, staleness,
``train_policy`` (one learner step, the engine/learner logprob mismatch; the step's captured
features come back in its ``StepResult``), ``publish`` (``state`` advanced, the weights pushed
through the guard), ``train_drafter`` (on those features); it returns the row fields. Generation
goes only through ``parts.backend``. Details: docs/internals.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specrl.backends import GROUP_DONE, Rollout, Served, Versions
from specrl.config import Config
from specrl.envs.reasoning_gym_env import Prompt
from specrl.pipelines.alarm import alarm_fields
from specrl.pipelines.build import RunParts
from specrl.pipelines.drafter import drafter_fields
from specrl.pipelines.guard import WeightGuard
from specrl.pipelines.scoring import Scorer, Scores
from specrl.pipelines.state import StepState
from specrl.pipelines.train_workers import TrainGroup
from specrl.rl import Captured, Learner, TrainSample, compute_advantages
from specrl.rollout_types import Completion, Request
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig

STREAM_TRAIN, STREAM_GREEDY, STREAM_SAMPLED = 0, 1, 2


@dataclass
class Batch:
    """What ``collect`` produced for one step; ``learn`` consumes it."""

    step: int
    prompts: list[Prompt]
    completions: list[Completion]  # G per prompt, prompt-major
    rewards: torch.Tensor  # [P, G]
    advantages: torch.Tensor  # [P, G]
    behaviour_version: int  # the oldest policy version of any token
    metrics: dict[str, Any] = field(default_factory=dict)
    served: Served | None = None  # what the backend served right after the rollout
    floor: Versions | None = None  # versions whose updates had returned before it


def request_seed(run_seed: int, step: int, index: int, stream: int) -> int:
    return ((run_seed * 1_000_003 + step) * 8191 + index) * 4 + stream


# --------------------------------------------------------------------------- collect


def rollout(
    parts: RunParts,
    prompts: Sequence[Prompt],
    step: int,
    stream: int = STREAM_TRAIN,
    n: int | None = None,
    temperature: float | None = None,
    spec: SpecConfig | None = None,
    scorer: Scorer | None = None,
) -> Rollout:
    """n completions per prompt (request order) from the backend; a failed request raises.
    With a ``scorer``, each prompt's group is submitted to it as soon as the backend says it
    finished (backends with ``GROUP_DONE``; the others' groups are scored after the call)."""
    r, codec = parts.plan.sampling, parts.codec
    t = r.temperature if temperature is None else temperature
    reqs = [
        Request(codec.prompt_ids(p), SamplingParams(
            temperature=t, top_k=r.top_k, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
            stop_token_ids=codec.stop_token_ids, n=n or r.group_size,
            seed=request_seed(parts.plan.seed, step, i, stream)))
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    if scorer is not None and GROUP_DONE in parts.backend.features:
        out = parts.backend.generate(reqs, spec=spec, on_done=scorer.submit)
    else:
        out = parts.backend.generate(reqs, spec=spec)
    bad = out.first_error()
    if bad is not None:
        raise RuntimeError(f"generation failed for prompt {bad.request_index}: {bad.error}")
    return out


def scored_rollout(
    parts: RunParts, prompts: Sequence[Prompt], step: int, **kw: Any
) -> tuple[Rollout, Scores]:
    """``rollout`` (``kw``: its stream, n, temperature, spec) with its rewards: groups scored as
    they finish (``pipelines.scoring``)."""
    if parts.rewards is None:
        raise RuntimeError("the run's parts have no rewards: build them with build_run")
    scorer = parts.rewards.scorer(parts.codec, prompts)
    out = rollout(parts, prompts, step, scorer=scorer, **kw)
    return out, scorer.result(out.completions, time.monotonic())


def rollout_metrics(out: Rollout) -> dict[str, Any]:
    """Throughput, acceptance and phase times of one rollout (its own statistics)."""
    st, comps, gen_s = out.stats, out.completions, out.seconds
    tokens = out.tokens
    return {
        "gen_time_s": gen_s,
        "gen_tokens": tokens,
        "rollout_tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
        "acceptance_length": st.acceptance_length,
        "draft_acceptance_rate": st.accepted / st.drafted if st.drafted else 0.0,
        "draft_acceptance_length": draft_acceptance_length(out),
        "drafting_steps": drafting_steps(out),
        "spec_step_share": st.spec_steps / st.steps if st.steps else 0.0,
        "response_length": tokens / max(len(comps), 1),
        "truncated_frac": sum(c.finish_reason == "length" for c in comps) / max(len(comps), 1),
        "prefill_s": st.prefill_s,
        "draft_s": st.draft_s,
        "verify_s": st.verify_s,
        "weight_updates_in_flight": st.weight_updates,
        "reverified_tokens": st.reverified_tokens,
        "reused_tokens": st.reused_tokens,
        "discarded_tokens": st.discarded_tokens,
        "rollout_worker_faults": out.faults,
    }


def drafting_steps(out: Rollout) -> int:
    """(row, verify step) pairs of a rollout that drafted at least one token."""
    drafted = out.stats.per_position_drafted
    return drafted[0] if drafted else 0


def draft_acceptance_length(out: Rollout) -> float:
    """Tokens emitted per (row, verify step) that drafted: 1 + accepted drafts / drafting row
    steps (what serving engines report as acceptance length); 0.0 when nothing was drafted.
    Unlike ``acceptance_length`` it ignores plain steps (adaptive k at a large batch)."""
    drafting = drafting_steps(out)
    return 1.0 + out.stats.accepted / drafting if drafting else 0.0


def behaviour_version(comps: Sequence[Completion]) -> int:
    """The oldest policy version that produced any token (the completions' own versions when
    no completion has a token)."""
    tokens = [c.versions for c in comps if c.num_tokens]
    if tokens:
        return int(torch.cat(tokens).min())
    return min((c.policy_version for c in comps), default=0)


def collect(parts: RunParts, prompts: list[Prompt], step: int) -> Batch:
    """Generate, score and compute advantages of step ``step``'s ``prompts`` (see the module
    docstring)."""
    cfg = parts.cfg
    floor = parts.guard.floor()  # read before the call: a call serves at least these
    out, scores = scored_rollout(parts, prompts, step, spec=parts.alarm.spec_override())
    served = parts.backend.served()
    rewards = scores.rewards  # [P, G]
    adv = compute_advantages(cfg.learner.advantage, rewards, **_adv_kwargs(cfg))
    metrics = rollout_metrics(out) | {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "accuracy": float(scores.correct.mean()),
        "score_time_s": scores.wait_s,
        **scores.metrics(),
        "prompts": [p.id for p in prompts],
    }
    return Batch(step, prompts, out.completions, rewards, adv,
                 behaviour_version(out.completions), metrics, served, floor)  # fmt: skip


def _adv_kwargs(cfg: Config) -> dict[str, Any]:
    return {"normalize_std": cfg.learner.normalize_std} if cfg.learner.advantage == "grpo" else {}


# --------------------------------------------------------------------------- learn


def logprob_delta(
    learner: Learner,
    comps: Sequence[Completion],
    ours: list[torch.Tensor] | None = None,
    replay: bool = False,
    name: str = "logprob_delta",
) -> dict[str, float]:
    """Mean and max |engine raw logprob - learner raw logprob| over all completion tokens
    (``name``_mean, ``name``_max); ``ours``: the learner's raw logprobs of the non-empty
    completions if already computed (the training forward at temperature 1), else a no-grad
    forward computes them (``replay``: routing the completions' recorded experts)."""
    t0 = time.perf_counter()
    live = [c for c in comps if c.num_tokens]
    if ours is None:
        routings = [c.routing for c in live] if replay else None
        ours = learner.raw_logprobs([(c.prompt_ids, c.tokens) for c in live], routings)
    if len(ours) != len(live):
        raise ValueError(f"{len(ours)} learner logprob rows for {len(live)} completions")
    mine = torch.cat([o.float() for o in ours]).cpu() if ours else torch.zeros(0)  # one copy
    theirs = torch.cat([c.token_raw_logprobs for c in live]) if live else torch.zeros(0)  # [M]
    delta = (mine - theirs).abs()  # [M]
    return {
        f"{name}_mean": float(delta.mean()) if delta.numel() else 0.0,
        f"{name}_max": float(delta.max()) if delta.numel() else 0.0,
        "logprob_time_s": time.perf_counter() - t0,
    }


def uses_behaviour_logprobs(parts: RunParts) -> bool:
    """Whether the learner gets the engine's processed logprobs as behaviour logprobs."""
    return parts.cfg.learner.correction != "ppo" or not parts.plan.sampling.truncated


def train_samples(
    comps: Sequence[Completion], advantages: torch.Tensor, behaviour: bool, replay: bool = False
) -> list[TrainSample]:
    """One ``TrainSample`` per completion; ``advantages`` is ``[num_prompts, G]``; ``replay``:
    with the experts the engine routed (``Completion.routing``)."""
    flat = advantages.flatten().tolist()
    return [
        TrainSample(
            c.prompt_ids,
            c.tokens,
            a,
            c.token_logprobs if behaviour else None,
            c.routing if replay else None,
        )  # fmt: skip
        for c, a in zip(comps, flat, strict=True)
    ]


def staleness(version: int, comps: Sequence[Completion]) -> dict[str, Any]:
    """Token staleness (learner version - token version) of a batch: mean, max, histogram."""
    ages = torch.cat([version - c.versions for c in comps]) if comps else torch.zeros(0)  # [N]
    values, freq = torch.unique(ages, return_counts=True)
    counts = dict(zip(values.tolist(), freq.tolist(), strict=True))
    total = sum(counts.values())
    return {
        "staleness_mean": sum(k * n for k, n in counts.items()) / total if total else 0.0,
        "staleness_max": max(counts, default=0),
        "staleness_hist": {str(k): counts[k] for k in sorted(counts)},
    }


def check_served(guard: WeightGuard, batch: Batch) -> None:
    """The weight-sync check of what the backend served for ``batch`` (``WeightSyncError``)."""
    if batch.served is not None:
        guard.verify(batch.served, batch.floor)


def train_policy(
    learner: Learner,
    batch: Batch,
    behaviour: bool,
    capture: tuple[int, ...] | None,
    replay: bool = False,
) -> tuple[dict[str, Any], list[Captured]]:
    """One learner step on ``batch`` (``behaviour``: hand it the engine's processed logprobs;
    ``replay``: the engine's routing, ``learner.routing_replay``) and the engine/learner logprob
    mismatch, with ``replay`` also without it (``logprob_delta_unreplayed_*``, one more no-grad
    forward): (row fields, the forward's features of the ``capture`` layers, empty without)."""
    comps = batch.completions
    samples = train_samples(comps, batch.advantages, behaviour, replay)
    if replay:  # before the step: the policy the completions were sampled from
        free = logprob_delta(learner, comps, name="logprob_delta_unreplayed")
    if learner.temperature == 1.0:  # the training forward's logprobs are the raw ones
        result = learner.train_step(samples, keep_logprobs=True, capture=capture)
        delta = logprob_delta(learner, comps, result.logprobs)
    else:
        delta = logprob_delta(learner, comps, replay=replay)
        result = learner.train_step(samples, capture=capture)
    if replay:
        delta |= free | {"logprob_time_s": delta["logprob_time_s"] + free["logprob_time_s"]}
    stats = dict(result.metrics)
    row = (
        delta
        | {"train_time_s": stats.pop("time_s")}
        | {f"learner_{k}": v for k, v in stats.items()}
    )
    return row, result.features


def publish(parts: RunParts, state: StepState, step: int) -> dict[str, Any]:
    """Advance ``state`` past ``step`` and push the new weights through the guard; on train
    workers, the Ray node of each (``train_nodes``, in rank order)."""
    version = state.learned(step)
    row = {"refit_time_s": parts.push_weights(version), "policy_version": version}
    if isinstance(parts.learner, TrainGroup):
        row["train_nodes"] = list(parts.learner.nodes)
    return row


def train_drafter(
    parts: RunParts, version: int, batch: Batch, captured: list[Captured], step_s: float
) -> dict[str, Any]:
    """A learned drafter's training on this step's ``captured`` features
    (``pipelines.drafter``); ``step_s``: the step's time so far, a lower bound of it."""
    idle = parts.cfg.pipeline.mode == "sync"  # the async producer generates meanwhile
    return drafter_fields(parts.drafter, parts.guard, parts.backend, idle, version,
                          batch.completions, batch.metrics, captured, step_s)  # fmt: skip


def learn(parts: RunParts, state: StepState, batch: Batch, waited_s: float) -> dict[str, Any]:
    """Learn ``batch`` and push the new weights (see the module docstring); ``waited_s``: the
    learner's wait for the batch."""
    check_served(parts.guard, batch)
    row: dict[str, Any] = {"behaviour_version": batch.behaviour_version}
    row |= alarm_fields(parts.alarm, batch.step, batch.metrics, batch.behaviour_version)
    row |= staleness(state.version, batch.completions)
    t0 = time.perf_counter()
    layers = parts.drafter.capture_layers() if parts.drafter is not None else None
    fields, captured = train_policy(parts.learner, batch, uses_behaviour_logprobs(parts), layers,
                                    parts.cfg.learner.routing_replay)  # fmt: skip
    row |= fields
    row |= publish(parts, state, batch.step)
    if parts.drafter is not None:
        step_s = waited_s + time.perf_counter() - t0
        row |= train_drafter(parts, state.version, batch, captured, step_s)
    return row
