"""Building a run: check everything that can fail, then make its parts.

``build_run(cfg, model=None, codec=None, env=None, backend=None, rewards=None)`` checks the
config's names, makes its rollout plan (``specrl.backends.plan_rollout``), checks the tracking
extras, reads the environment (a file environment's rows all checked) and resolves the reward
functions before any model is loaded (``ConfigError``, ``FileEnvError``, ``RewardError``: one
line naming the bad value), then returns the frozen ``RunParts``: env, codec, learner, the
rollout backend built from the plan, the weight-sync guard, the acceptance alarm, a learned
head's trainer, the rewards (``pipelines.scoring``) and console notes (prompts dropped for
length). ``RunParts.push_weights(version)`` sends the learner's weights through the guard (from
train workers to Ray rollout workers through Ray's object store only, unless a learned drafter
shares this process's copy). Tests pass a tiny model, codec and env, or a fake backend.
Details: docs/internals.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specrl.backends import RolloutBackend, build_backend, plan_rollout
from specrl.backends.ray_ import RayBackend
from specrl.config import Config, ConfigError, EnvCfg
from specrl.envs.reasoning_gym_env import Env, Prompt
from specrl.models.precision import torch_dtype
from specrl.pipelines.alarm import AcceptanceAlarm
from specrl.pipelines.drafter import DrafterSide, build_drafter_side
from specrl.pipelines.guard import WeightGuard
from specrl.pipelines.scoring import Rewards
from specrl.pipelines.tracking import check_tracking
from specrl.pipelines.train_workers import TrainGroup
from specrl.pipelines.validate import check_names
from specrl.rewards import RewardFn
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
    rewards: Rewards | None = None  # the reward functions and their worker pool
    notes: tuple[str, ...] = ()  # console lines about how the run was built (prompts dropped)

    def push_weights(self, version: int) -> float:
        """Send the learner's weights to the backend as ``version`` and check what it serves
        (``WeightGuard.push``); seconds, the check included (and, on train workers, gathering
        their shards into the learner's ``model`` block by block)."""
        t0 = time.perf_counter()
        if isinstance(self.learner, TrainGroup):
            if isinstance(self.backend, RayBackend) and self.drafter is None:
                # rank 0 -> object store -> the workers: not through this process
                direct = self.learner.weight_blocks(self.guard.dtype)
                return time.perf_counter() - t0 + self.guard.push(self.backend, direct, version)
            self.learner.pull_weights()  # the drafter shares this process's copy
        named = dict(self.learner.model.named_parameters())
        return time.perf_counter() - t0 + self.guard.push(self.backend, named, version)

    def close(self) -> None:
        """Close the backend, then the train workers and the reward workers (idempotent)."""
        try:
            self.backend.close()
        finally:
            try:
                if isinstance(self.learner, TrainGroup):
                    self.learner.close()
            finally:
                if self.rewards is not None:
                    self.rewards.close()


def build_run(
    cfg: Config,
    model: torch.nn.Module | None = None,
    codec: Codec | None = None,
    env: Env | None = None,
    backend: RolloutBackend | None = None,
    rewards: Sequence[str | RewardFn] | None = None,
) -> RunParts:
    """Check and build a run; ``model``/``codec``/``env``/``backend`` default to the configured
    ones (a given ``backend`` must serve the same weights as ``model``); ``rewards`` (names or
    callables) replace ``reward.funcs``."""
    check_names(cfg, env_given=env is not None)
    plan = plan_rollout(cfg)
    check_tracking(cfg)
    env = env or make_env(cfg.env)  # a bad file: one line, before any model is loaded
    scoring = Rewards.build(cfg.reward, env, rewards)  # a bad reward too
    try:
        return _build_model_side(cfg, plan, env, scoring, model, codec, backend)
    except BaseException:
        scoring.close()
        raise


def _build_model_side(
    cfg: Config,
    plan: RolloutPlan,
    env: Env,
    scoring: Rewards,
    model: torch.nn.Module | None,
    codec: Codec | None,
    backend: RolloutBackend | None,
) -> RunParts:
    """The tokenizer, the model, the prompts that fit, the learner and the parts around it."""
    if model is None or codec is None:
        from specrl.models.checkpoints import load_model, load_tokenizer, resolve_model

        resolve_model(cfg.model.name)  # unknown model: CheckpointError, before any work
        codec = codec or ChatCodec(load_tokenizer(cfg.model.name))
    if model is None:
        model = load_model(cfg.model.name, dtype=torch.float32)
    notes = fit_prompts(cfg, env, codec, model.config.max_position_embeddings)
    model = model.to(plan.device)  # the learner's copy; the engine's is made from it, on it
    learner = make_learner(cfg, plan, model)
    try:
        parts = _assemble(cfg, plan, env, codec, learner, backend)
    except BaseException:
        if isinstance(learner, TrainGroup):
            learner.close()
        raise
    return dataclasses.replace(parts, rewards=scoring, notes=notes)


def make_env(cfg: EnvCfg) -> Env:
    """The configured environment (``env.kind``)."""
    from specrl.envs import ENV_KINDS

    return ENV_KINDS[cfg.kind](cfg)


def fit_prompts(cfg: Config, env: Env, codec: Codec, context: int) -> tuple[str, ...]:
    """Drop a file environment's prompts longer than ``env.max_prompt_tokens`` (at most, and by
    default, the context less ``rollout.max_new_tokens``) once rendered; the console note
    saying how many."""
    drop = getattr(env, "drop_long", None)
    if drop is None:
        return ()
    limit = min(cfg.env.max_prompt_tokens or context, context - cfg.rollout.max_new_tokens)
    if limit < 1:
        raise ConfigError(
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves no room for a prompt in "
            f"the model's {context}-token context"
        )
    dropped = drop(lambda p: len(codec.prompt_ids(p)), limit)
    if not dropped:
        return ()
    return (f"dropped {dropped} prompts longer than {limit} tokens (env.max_prompt_tokens)",)


def make_learner(cfg: Config, plan: RolloutPlan, model: torch.nn.Module) -> Learner | TrainGroup:
    """The run's learner over ``model``: in this process, or ``cluster.train_workers`` ranks."""
    s = plan.sampling
    if cfg.cluster.train_workers > 1:
        return TrainGroup.start(cfg, model, plan.device, s.max_new_tokens, s.temperature)
    return Learner(model, cfg.learner, max_len=s.max_new_tokens, temperature=s.temperature)


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
