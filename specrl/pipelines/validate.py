"""The names a run config holds, checked against their registries before any work starts.

``check_names(cfg)`` returns None when every name in ``cfg`` is registered, else raises
``ConfigError``: one line in ``load_config``'s form (``bad value for KEY: WHY (got VALUE)``,
several joined by ``; ``). Checked: ``env.task``, ``env.task_config``, ``env.template`` (for
``env.kind='reasoning_gym'``), ``learner.loss``, ``learner.advantage`` and
``learner.correction``. ``specrl.config`` stays a leaf (types and bounds only); ``build_run``
calls this before any work (the rollout names are the rollout plan's to check). Details:
docs/internals.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from specrl.config import Config, ConfigError
from specrl.envs.reasoning_gym_env import (
    check_task,
    check_task_config,
    get_template,
    task_config_with_preset,
    task_names,
)
from specrl.rl.advantages import get_advantage
from specrl.rl.corrections import get_correction
from specrl.rl.losses import get_loss


def check_names(cfg: Config, env_given: bool = False) -> None:
    """Raise ``ConfigError`` naming every unregistered name in ``cfg`` (see the module doc);
    with ``env_given`` (the caller brings its own environment) the ``env`` section is not
    checked: it is not used."""
    env, learner = cfg.env, cfg.learner
    env_checks: list[tuple[str, Any, Callable[[], object]]] = [
        ("env.task", env.task, lambda: check_task(env.task)),
        ("env.task_config", env.task_config, lambda: _check_task_config(env.task, env.task_config)),
        ("env.template", env.template, lambda: get_template(env.template)),
    ]
    checks: list[tuple[str, Any, Callable[[], object]]] = [
        *([] if env_given or env.kind != "reasoning_gym" else env_checks),
        ("learner.loss", learner.loss, lambda: get_loss(learner.loss)),
        ("learner.advantage", learner.advantage, lambda: get_advantage(learner.advantage)),
        ("learner.correction", learner.correction, lambda: get_correction(learner.correction)),
    ]
    problems = [p for key, value, check in checks if (p := _problem(key, value, check))]
    if problems:
        raise ConfigError("; ".join(problems))


def _check_task_config(task: str, config: dict[str, Any]) -> None:
    """The task accepts ``config`` merged over its preset (an unknown task is reported apart)."""
    if task in task_names():
        check_task_config(task, task_config_with_preset(task, config))


def _problem(key: str, value: Any, check: Callable[[], object]) -> str | None:
    try:
        check()
    except ValueError as e:
        return f"bad value for {key}: {e} (got {json.dumps(value, default=str)})"
    return None
