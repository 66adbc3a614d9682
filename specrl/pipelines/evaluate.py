"""Held-out evaluation of the policy the backend serves.

Contract: ``evaluate(parts, updates)`` rolls out every eval prompt once greedily and once sampled
(the rollout temperature), scores both and returns a row with ``step`` = ``updates`` (the
learner updates done before it in sync; in async the producer's step, whose weights may be up to
``max_staleness`` versions older), the oldest served ``policy_version`` and ``{greedy,sampled}_
{accuracy,reward}``. ``eval_due(cfg, updates)``: every ``run.eval_every`` updates and after the
last one.
"""

from __future__ import annotations

import time
from typing import Any

from specrl.config import Config
from specrl.pipelines.build import RunParts
from specrl.pipelines.step import STREAM_GREEDY, STREAM_SAMPLED, scored_rollout


def evaluate(parts: RunParts, updates: int) -> dict[str, Any]:
    """Greedy and sampled (one sample, the rollout temperature) accuracy on the eval split."""
    t0 = time.perf_counter()
    prompts = parts.env.prompts("eval")
    row: dict[str, Any] = {"step": updates, "num_prompts": len(prompts)}
    if not prompts:
        return row
    for name, stream, temp in (("greedy", STREAM_GREEDY, 0.0), ("sampled", STREAM_SAMPLED, None)):
        out, scores = scored_rollout(parts, prompts, updates, stream=stream, n=1,
                                     temperature=temp)  # fmt: skip
        row[f"{name}_accuracy"] = float(scores.correct.mean())
        row[f"{name}_reward"] = float(scores.rewards.mean())
        row[f"{name}_reward_errors"] = scores.errors
        version = min(c.policy_version for c in out.completions)
        row["policy_version"] = min(row.get("policy_version", version), version)
    row["eval_time_s"] = time.perf_counter() - t0
    return row


def eval_due(cfg: Config, updates: int) -> bool:
    every = cfg.run.eval_every
    return every > 0 and (updates % every == 0 or updates == cfg.run.steps)
