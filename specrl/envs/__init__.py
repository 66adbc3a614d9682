"""Environments: prompts with metadata and verifiable rewards (see ``reasoning_gym_env``)."""

from specrl.envs.reasoning_gym_env import (
    TEMPLATES,
    Env,
    Prompt,
    ReasoningGymEnv,
    Template,
    get_template,
    task_names,
)

__all__ = [
    "TEMPLATES",
    "Env",
    "Prompt",
    "ReasoningGymEnv",
    "Template",
    "get_template",
    "task_names",
]
