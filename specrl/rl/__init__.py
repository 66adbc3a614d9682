"""The learning side: advantages, policy losses and the learner (knows nothing about rollouts).

``advantages``: registered estimators ``rewards [num_groups, G] -> advantages``; ``losses``:
registered GRPO-family policy losses and the k3 KL; ``corrections``: registered off-policy
corrections (ppo, tis); ``learner``: packed, chunked logprob
recomputation and the optimizer step.
"""

from specrl.rl.advantages import ADVANTAGES, compute_advantages, get_advantage
from specrl.rl.corrections import CORRECTIONS, get_correction
from specrl.rl.learner import (
    Captured,
    Learner,
    StepResult,
    TrainSample,
    raw_logprobs,
    token_logprobs,
)
from specrl.rl.losses import LOSSES, LossNorm, LossOutput, get_loss

__all__ = [
    "ADVANTAGES",
    "CORRECTIONS",
    "Captured",
    "LOSSES",
    "Learner",
    "LossNorm",
    "LossOutput",
    "StepResult",
    "TrainSample",
    "compute_advantages",
    "get_advantage",
    "get_correction",
    "get_loss",
    "raw_logprobs",
    "token_logprobs",
]
