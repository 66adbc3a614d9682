"""What a run changes as it steps, and which thread owns it when.

``RunParts`` is frozen; ``StepState(step, version)`` (steps learned, policy version pushed) is
the learner thread's: ``learn`` advances it, a checkpoint saves it, a resume restores it. The
async producer never reads it: versions are handed to it (``Producer.published``), batches
back (its buffer). ``TrainStream.draw(step)`` is a step's prompts, a pure function of (seed,
step) whose cached epoch orders belong to the thread that draws prompts.
Details: docs/internals.md.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from specrl.envs.reasoning_gym_env import Env, Prompt
from specrl.rollout_plan import RolloutPlan


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
    def of(cls, plan: RolloutPlan, env: Env) -> TrainStream:
        return cls(env, plan.seed, plan.sampling.prompts_per_step)

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
