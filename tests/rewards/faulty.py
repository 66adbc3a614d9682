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
