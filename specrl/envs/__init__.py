"""Environments: prompts with metadata and verifiable rewards (``reasoning_gym_env``: generated
tasks; ``files``: the user's own dataset files). ``ENV_KINDS``: ``env.kind`` -> the
constructor taking the run's ``EnvCfg``."""

from types import MappingProxyType

from specrl.envs.files import FileEnv, FileEnvError
from specrl.envs.reasoning_gym_env import (
    TEMPLATES,
    Env,
    Prompt,
    ReasoningGymEnv,
    ScoredEnv,
    Template,
    get_template,
    task_names,
)

ENV_KINDS = MappingProxyType(
    {"reasoning_gym": ReasoningGymEnv.from_config, "file": FileEnv.from_config}
)

__all__ = [
    "ENV_KINDS",
    "TEMPLATES",
    "Env",
    "FileEnv",
    "FileEnvError",
    "Prompt",
    "ReasoningGymEnv",
    "ScoredEnv",
    "Template",
    "get_template",
    "task_names",
]
