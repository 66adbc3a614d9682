"""What a run changes as it steps, and which thread owns it when.

Contract:
- ``RunParts`` (``pipelines.build``) is frozen: nothing rebinds its parts; the stateful ones
  (backend, learner, guard, alarm, drafter side) change only through their own methods. In the
  async loop the producer only generates and evaluates through the backend and reads the
  guard's ``floor()`` and the alarm's ``spec_override()``; the rest is the learner thread's.
- ``StepState(step, version)``: the steps learned (the next step to learn) and the policy
  version the learner pushed last. ``step.learn`` advances both; a checkpoint saves them and a
  resume restores them (``loop.open_run``). It belongs to the learner: in the sync loop to its
  only thread; in the async loop to the learner thread (the caller's), and the producer never
  reads it: the learner hands each new version over through ``Producer.published``, the
  producer hands each batch over through its buffer.
- ``TrainStream(env, seed, per_step)``: ``draw(step)`` is prompts ``step*P .. step*P+P-1`` of
  the train stream (the train split in a seeded permutation per epoch, cycled): a pure function
  of (seed, step), so a resume needs no data-order state. It caches the epoch orders it has
  computed, so it belongs to the thread that draws prompts: the loop's own (the producer's, in
  the async loop), a fresh one elsewhere.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from specrl.config import Config
from specrl.envs.reasoning_gym_env import Env, Prompt


@dataclass
class StepState:
    """The learner's progress (see the module docstring)."""

    step: int = 0  # steps learned: the next step to learn
    version: int = 0  # the policy version the learner pushed last (its updates)

    def learned(self, step: int) -> int:
        """Step ``step`` is learned: advance past it; the new policy version."""
        self.step, self.version = step + 1, self.version + 1
        return self.version


@dataclass
class TrainStream:
    """The seeded, cycled train prompts of a run (see the module docstring)."""

    env: Env
    seed: int
    per_step: int
    orders: dict[int, list[Prompt]] = field(default_factory=dict, repr=False)  # epoch -> order

    @classmethod
    def of(cls, cfg: Config, env: Env) -> TrainStream:
        return cls(env, cfg.run.seed, cfg.rollout.prompts_per_step)

    def epoch(self, epoch: int) -> list[Prompt]:
        """The train split in epoch ``epoch``'s seeded order."""
        if epoch not in self.orders:
            seed = random.Random(f"{self.seed}/{epoch}").getrandbits(32)
            self.orders[epoch] = self.env.prompts("train", seed=seed)
        return self.orders[epoch]

    def draw(self, step: int) -> list[Prompt]:
        """Prompts of step ``step``: positions step*P .. step*P+P-1 of the cycled stream."""
        p, n = self.per_step, len(self.epoch(0))
        return [self.epoch(i // n)[i % n] for i in range(step * p, step * p + p)]
