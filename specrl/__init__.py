"""specrl: RL post-training with lossless speculative rollouts.

``specrl.train(config, reward_funcs=..., dataset=...)`` runs what ``specrl train`` runs and
returns the run directory (``specrl.pipelines.api``); imported on first use, so ``import
specrl`` stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["train"]


def __getattr__(name: str) -> Any:
    if name == "train":
        from specrl.pipelines.api import train

        return train
    raise AttributeError(f"module 'specrl' has no attribute {name!r}")
