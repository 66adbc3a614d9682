"""Building a run: check everything that can fail, then make its parts.

Contract: ``build_run(cfg, model=None, codec=None, env=None, backend=None)`` checks the config's
names (task, template, loss, advantage, correction, drafter), the sampling settings GRPO needs,
the pipeline options against what the backend supports and the tracking extras, all before any
work, raising ``ConfigError`` with one line naming the bad value. It returns ``RunParts``: env,
codec (prompt -> token ids, ids -> text), learner (owns the float32 policy) and the rollout
backend (its own copy of the policy; ``specrl.backends.build_backend`` per
``rollout.placement``), the weight-sync guard (``pipelines.guard.WeightGuard`` in the engine's
dtype, expecting the learner's weights as version 0), the acceptance alarm (``pipelines.alarm``,
``rollout.alarm_action``) and, for a learned head, its trainer (``pipelines.drafter``); frozen
(``pipelines.state`` holds what changes per step). ``RunParts.push_weights(version)`` sends the
learner's weights through the guard, so a backend that skips or corrupts an update fails the
run with a ``WeightSyncError``.
Tests pass a tiny model, codec and env, or a fake backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specrl.backends import (
    IN_FLIGHT,
    RolloutBackend,
    build_backend,
    check_device,
    placement,
    run_device,
)
from specrl.config import Config, ConfigError
from specrl.envs.reasoning_gym_env import Env, Prompt
from specrl.models.precision import torch_dtype
from specrl.pipelines.alarm import AcceptanceAlarm
from specrl.pipelines.drafter import DrafterSide, build_drafter_side
from specrl.pipelines.guard import WeightGuard
from specrl.pipelines.tracking import check_tracking
from specrl.pipelines.validate import check_names
from specrl.rl import Learner


class Codec(Protocol):
    """Text side of the model: prompt -> token ids, completion ids -> text, stop tokens."""

    stop_token_ids: tuple[int, ...]

    def prompt_ids(self, prompt: Prompt) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ChatCodec:
    """A ``TextTokenizer`` with its chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(tokenizer.stop_token_ids)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.chat_prompt(list(prompt.messages)))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))


@dataclass(frozen=True)
class RunParts:
    """Everything a run needs, built and checked before any work; frozen: what changes as the
    run steps is ``state.StepState`` (and the parts' own state, behind their methods)."""

    cfg: Config
    env: Env
    codec: Codec
    learner: Learner
    backend: RolloutBackend
    guard: WeightGuard = field(default_factory=WeightGuard)
    alarm: AcceptanceAlarm = field(default_factory=AcceptanceAlarm)
    drafter: DrafterSide | None = None  # a learned head: its trainer / training length

    def push_weights(self, version: int) -> float:
        """Send the learner's weights to the backend as ``version`` and check what it serves
        (``WeightGuard.push``); seconds, the check included."""
        named = dict(self.learner.model.named_parameters())
        return self.guard.push(self.backend, named, version)


def check_sampling(cfg: Config) -> None:
    if cfg.rollout.temperature <= 0:
        raise ConfigError("bad value for rollout.temperature: GRPO needs sampling (> 0), got 0")
    if cfg.rollout.group_size < 2:
        raise ConfigError("bad value for rollout.group_size: GRPO needs >= 2 completions, got 1")


def truncated(cfg: Config) -> bool:
    """Whether sampling truncates the distribution (top-k or top-p on)."""
    return cfg.rollout.top_k > 0 or cfg.rollout.top_p < 1.0


def _ignored(cfg: Config) -> str | None:
    """A setting that the rest of the config would ignore and that the config alone cannot
    tell (``config.APPLIES_ONLY`` refuses the others as they are read)."""
    if cfg.rollout.threads and placement(cfg) != "process":
        return (
            f"rollout.threads={cfg.rollout.threads} needs the engine in a worker process "
            "(rollout.placement='process', or 'auto' with pipeline.mode='async')"
        )
    return None


def check_pipeline(cfg: Config) -> None:
    """Pipeline options that contradict each other, or would be ignored, refused."""
    p = cfg.pipeline
    ignored = _ignored(cfg)
    if ignored:
        raise ConfigError(f"{ignored}: it would be ignored")
    if p.mode == "sync":
        if p.update != "between_steps":
            raise ConfigError(
                f"pipeline.update={p.update!r} needs pipeline.mode='async' (the sync pipeline "
                "never updates weights while generating)"
            )
        return
    if p.max_staleness > 0 and truncated(cfg) and cfg.learner.correction == "ppo":
        raise ConfigError(
            "pipeline.mode='async' with top-k/top-p sampling needs learner.correction='tis': "
            "'ppo' cannot use the engine's truncated behaviour logprobs, so stale groups "
            "would go uncorrected"
        )
    if p.update == "in_flight" and p.max_staleness == 0:
        raise ConfigError(
            "pipeline.update='in_flight' needs pipeline.max_staleness >= 1 (at 0 the producer "
            "never generates while the learner trains)"
        )


def check_backend(cfg: Config, backend: RolloutBackend) -> None:
    """The backend can honour the pipeline's options."""
    in_flight = cfg.pipeline.mode == "async" and cfg.pipeline.update == "in_flight"
    if in_flight and IN_FLIGHT not in backend.features:
        raise ConfigError(
            f"pipeline.update='in_flight': the {type(backend).__name__} backend cannot "
            "update weights between decode steps"
        )


def build_run(
    cfg: Config,
    model: torch.nn.Module | None = None,
    codec: Codec | None = None,
    env: Env | None = None,
    backend: RolloutBackend | None = None,
) -> RunParts:
    """Check and build a run; ``model``/``codec``/``env``/``backend`` default to the configured
    ones (a given ``backend`` must serve the same weights as ``model``)."""
    check_names(cfg, env_given=env is not None)
    check_sampling(cfg)
    check_pipeline(cfg)
    check_tracking(cfg)
    if model is None or codec is None:
        from specrl.models.checkpoints import load_model, load_tokenizer, resolve_model

        resolve_model(cfg.model.name)  # unknown model: CheckpointError, before any work
        codec = codec or ChatCodec(load_tokenizer(cfg.model.name))
    if env is None:
        from specrl.envs.reasoning_gym_env import ReasoningGymEnv

        env = ReasoningGymEnv.from_config(cfg.env)
    device = run_device(cfg)
    check_device(cfg)
    if model is None:
        model = load_model(cfg.model.name, dtype=torch.float32)
    model = model.to(device)  # the learner's copy; the engine's is made from it, on it
    learner = Learner.from_config(model, cfg.learner, max_len=cfg.rollout.max_new_tokens,
                                  temperature=cfg.rollout.temperature)  # fmt: skip
    backend = backend or build_backend(cfg, learner.model)
    check_backend(cfg, backend)
    guard = WeightGuard(torch_dtype(cfg.model.dtype, device))
    guard.remember(0, dict(learner.model.named_parameters()))  # what the backend copied
    drafter = build_drafter_side(cfg, learner.model, backend, guard)
    return RunParts(cfg, env, codec, learner, backend, guard=guard,
                    alarm=AcceptanceAlarm(cfg.rollout.alarm_action), drafter=drafter)  # fmt: skip
