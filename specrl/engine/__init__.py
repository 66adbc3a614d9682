"""Turns a model into rollouts: batched, continuously batched, optionally speculative generation.

Knows token ids, never text or rewards.
"""

from specrl.engine.engine import Engine
from specrl.engine.types import Completion, Request

__all__ = ["Completion", "Engine", "Request"]
