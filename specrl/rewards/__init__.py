"""Reward functions in TRL's convention: ``fn(prompts, completions, **columns) -> list[float |
None]``, batch in, batch out.

Contract: ``columns`` are the dataset's other columns, each a list aligned with the batch
(``answer=[...]``); a reward accepts (``**kwargs``) the columns it does not use; None means
"does not apply to this sample". ``builtin``: the built-in rewards (``math``, ``exact``,
``regex``) and their read-only registry ``BUILTIN``; ``loading``: ``resolve_reward`` (a built-in,
``package.module:function`` or ``path/to/file.py:function``), ``check_signature``,
``reward_name``, ``check_result`` and ``weighted_sum``, failing with one-line ``RewardError``s;
``pool``: reward calls in worker processes with a timeout. A leaf of specrl that never imports
torch (math-verify is imported on the first ``math`` call).
"""

from specrl.rewards.builtin import BUILTIN, RewardFn, exact, math, regex, stated_answer
from specrl.rewards.loading import (
    RewardError,
    check_result,
    check_signature,
    resolve_reward,
    reward_name,
    weighted_sum,
)

__all__ = [
    "BUILTIN",
    "RewardError",
    "RewardFn",
    "check_result",
    "check_signature",
    "exact",
    "math",
    "regex",
    "resolve_reward",
    "reward_name",
    "stated_answer",
    "weighted_sum",
]
