"""A synthetic verifiable task over token ids, for tests and for machines without reasoning-gym.

Contract: ``ModFourEnv`` draws prompts of random ids in [2, vocab) (lengths drawn from
``lengths`` = (lo, hi): lo <= length < hi), per split; the reward of a completion is the share
of its ids (the stop token ``STOP`` excluded) that are multiples of 4, ``correct`` means reward
>= 0.5. A random model starts near 1/4 and GRPO raises it quickly. ``IdCodec`` hands prompt ids
through as they are and writes completions as space-separated ids, so texts round-trip exactly.
No tokenizer, no model files: it runs anywhere specrl's core does.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from specrl.envs.reasoning_gym_env import Prompt

STOP = 1  # the stop token id of the synthetic task


class IdCodec:
    """Prompt -> its ids; completion ids -> space-separated text."""

    stop_token_ids = (STOP,)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return list(prompt.meta["ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(t) for t in ids)


class ModFourEnv:
    """Random-id prompts; reward = share of completion ids divisible by 4 (module docstring)."""

    default_rewards = ("env",)  # its own reward

    def __init__(
        self,
        num_train: int = 24,
        num_eval: int = 6,
        seed: int = 0,
        vocab: int = 32,
        lengths: tuple[int, int] = (3, 7),
    ) -> None:
        rng = random.Random(seed)
        self.vocab, self.lengths = vocab, lengths
        self.splits = {
            split: [self._prompt(split, i, rng) for i in range(n)]
            for split, n in (("train", num_train), ("eval", num_eval))
        }

    def _prompt(self, split: str, i: int, rng: random.Random) -> Prompt:
        ids = [rng.randrange(2, self.vocab) for _ in range(rng.randrange(*self.lengths))]
        return Prompt(f"{split}/{i}", ({"role": "user", "content": str(ids)},), {"ids": ids})

    def prompts(self, split: str, seed: int | None = None) -> list[Prompt]:
        out = list(self.splits[split])
        if seed is not None:
            random.Random(seed).shuffle(out)
        return out

    def reward(self, completion_text: str, meta: Mapping[str, Any]) -> float:
        ids = [int(t) for t in completion_text.split() if int(t) != STOP]
        return sum(t % 4 == 0 for t in ids) / len(ids) if ids else 0.0

    def correct(self, completion_text: str, meta: Mapping[str, Any]) -> bool:
        return self.reward(completion_text, meta) >= 0.5
