"""An environment's own reward as a reward function in TRL's convention (torch-free).

Contract: ``EnvReward(env)`` called as ``(prompts, completions, **columns)`` returns
``env.reward(completion, meta)`` per completion, where a row's ``meta`` is its columns (the
prompt's ``meta``, as ``pipelines.scoring`` passes it); ``EnvReward(env, correct=True)`` returns
``env.correct`` as 0.0 / 1.0. It is pickled to the reward workers with its environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvReward:
    """See the module docstring."""

    env: Any  # an ``envs.Env``: ``reward(text, meta)`` and ``correct(text, meta)``
    correct: bool = False

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        names = list(columns)
        metas = [dict(zip(names, row, strict=True)) for row in zip(*columns.values(), strict=True)]
        metas = metas or [{} for _ in completions]
        judge = self.env.correct if self.correct else self.env.reward
        return [float(judge(text, meta)) for text, meta in zip(completions, metas, strict=True)]
