"""Reward functions in TRL's convention that misbehave, for the reward pool's containment tests
(importable by name, so a spawned worker process can run them)."""

from __future__ import annotations

import math
import os
import signal
import time
from typing import Any


def length_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """A well-behaved reward: the completion's length in characters."""
    return [float(len(c)) for c in completions]


def sleeps_forever(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    while True:
        time.sleep(1)


def raises(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    raise ZeroDivisionError("the user's bug")


def wrong_length(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    return [1.0] * (len(completions) + 1)


def returns_nan(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    return [math.nan] * len(completions)


def kills_worker(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    os.kill(os.getpid(), signal.SIGKILL)
    return []


def sleeps_50ms(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """1.0 per completion after 50 ms per completion (a slow verifier)."""
    time.sleep(0.05 * len(completions))
    return [1.0] * len(completions)


def reward_len(completions: list[str], **kwargs: Any) -> list[float]:
    """TRL's documented example shape: only ``completions`` named, called by keyword."""
    return [-abs(20 - len(c)) for c in completions]


def accuracy_like(completions: list[str], solution: list[Any], **kwargs: Any) -> list[float]:
    """A column named as a parameter (TRL's accuracy_reward shape)."""
    return [float(c == str(s)) for c, s in zip(completions, solution, strict=True)]


def quits(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    raise SystemExit(3)


class _NeedsKeywords(Exception):
    def __init__(self, *, message: str) -> None:  # cannot be rebuilt from its args (openai's)
        super().__init__(message)


def raises_unpicklable(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    raise _NeedsKeywords(message="judge unavailable")


def own_timeout(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    raise TimeoutError("database call timed out")


def notes_pid_then_hangs(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """Writes its worker's pid to the file named by the ``note`` column, then hangs."""
    with open(columns["note"][0], "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(1)
