"""Building a run: check everything that can fail, then make its parts.

``build_run(cfg, model=None, codec=None, env=None, backend=None)`` checks the config's names,
makes its rollout plan (``specrl.backends.plan_rollout``) and checks the tracking extras before
any work (``ConfigError``: one line naming the bad value), then returns the frozen ``RunParts``:
env, codec, learner, the rollout backend built from the plan, the weight-sync guard, the
acceptance alarm and a learned head's trainer. ``RunParts.push_weights(version)`` sends the
learner's weights through the guard. Tests pass a tiny model, codec and env, or a fake backend.
Details: docs/internals.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specrl.backends import RolloutBackend, build_backend, plan_rollout
from specrl.config import Config
from specrl.envs.reasoning_gym_env import Env, Prompt
from specrl.models.precision import torch_dtype
from specrl.pipelines.alarm import AcceptanceAlarm
from specrl.pipelines.drafter import DrafterSide, build_drafter_side
from specrl.pipelines.guard import WeightGuard
from specrl.pipelines.tracking import check_tracking
from specrl.pipelines.train_workers import TrainGroup
from specrl.pipelines.validate import check_names
from specrl.rl import Learner
from specrl.rollout_plan import RolloutPlan, check_backend


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
    learner: Learner | TrainGroup  # one process, or ``cluster.train_workers`` Ray actors
    backend: RolloutBackend
    plan: RolloutPlan  # the rollout settings, resolved and checked
    guard: WeightGuard = field(default_factory=WeightGuard)
    alarm: AcceptanceAlarm = field(default_factory=AcceptanceAlarm)
    drafter: DrafterSide | None = None  # a learned head: its trainer / training length

    def push_weights(self, version: int) -> float:
        """Send the learner's weights to the backend as ``version`` and check what it serves
        (``WeightGuard.push``); seconds, the check included (and, on train workers, gathering
        their shards into the learner's ``model`` block by block)."""
        t0 = time.perf_counter()
        if isinstance(self.learner, TrainGroup):
            self.learner.pull_weights()
        named = dict(self.learner.model.named_parameters())
        return time.perf_counter() - t0 + self.guard.push(self.backend, named, version)

    def close(self) -> None:
        """Close the backend, then the train workers if any (idempotent)."""
        try:
            self.backend.close()
        finally:
            if isinstance(self.learner, TrainGroup):
                self.learner.close()


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
    plan = plan_rollout(cfg)
    check_tracking(cfg)
    if model is None or codec is None:
        from specrl.models.checkpoints import load_model, load_tokenizer, resolve_model

        resolve_model(cfg.model.name)  # unknown model: CheckpointError, before any work
        codec = codec or ChatCodec(load_tokenizer(cfg.model.name))
    if env is None:
        from specrl.envs.reasoning_gym_env import ReasoningGymEnv

        env = ReasoningGymEnv.from_config(cfg.env)
    if model is None:
        model = load_model(cfg.model.name, dtype=torch.float32)
    model = model.to(plan.device)  # the learner's copy; the engine's is made from it, on it
    learner = make_learner(cfg, plan, model)
    try:
        return _assemble(cfg, plan, env, codec, learner, backend)
    except BaseException:
        if isinstance(learner, TrainGroup):
            learner.close()
        raise


def make_learner(cfg: Config, plan: RolloutPlan, model: torch.nn.Module) -> Learner | TrainGroup:
    """The run's learner over ``model``: in this process, or ``cluster.train_workers`` ranks."""
    s = plan.sampling
    if cfg.cluster.train_workers > 1:
        return TrainGroup.start(cfg, model, plan.device, s.max_new_tokens, s.temperature)
    return Learner.from_config(model, cfg.learner, max_len=s.max_new_tokens,
                               temperature=s.temperature)  # fmt: skip


def _assemble(
    cfg: Config,
    plan: RolloutPlan,
    env: Env,
    codec: Codec,
    learner: Learner | TrainGroup,
    backend: RolloutBackend | None,
) -> RunParts:
    """The parts around a built learner: backend, guard, alarm, drafter side (a backend built
    here is closed if what follows fails)."""
    built = backend is None
    backend = backend or build_backend(plan, learner.model)
    try:
        check_backend(plan, backend)
        guard = WeightGuard(torch_dtype(plan.dtype, plan.device))
        guard.remember(0, dict(learner.model.named_parameters()))  # what the backend copied
        drafter = build_drafter_side(cfg, plan, learner.model, backend, guard)
    except BaseException:
        if built:
            backend.close()
        raise
    return RunParts(cfg, env, codec, learner, backend, plan, guard=guard,
                    alarm=AcceptanceAlarm(plan.alarm_action), drafter=drafter)  # fmt: skip
