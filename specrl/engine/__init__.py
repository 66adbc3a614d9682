"""Turns a model into rollouts: batched, continuously batched, optionally speculative generation.

Knows token ids, never text or rewards. Its requests and completions are
``specrl.rollout_types``'s, shared with every rollout backend.
"""

from specrl.engine.engine import Engine

__all__ = ["Engine"]
