"""Scoring completions: the run's reward functions, weighted, run off the critical path.

Contract: ``Rewards.build(cfg, env, given=None)`` resolves the run's reward functions (the
config's ``reward.funcs``, or callables / names handed to ``specrl.train``; none named: the
environment's ``default_rewards``) and checks each before any work (``RewardError``, one line);
'env' is the environment's own ``reward`` / ``correct``. ``Rewards.scorer(codec, prompts)``
scores one rollout: ``submit(i, comps)`` sends prompt ``i``'s group to the worker pool (one call
per function; the pipeline calls it as the backend announces a finished group, so rewards run
while the rest of the batch generates), ``result(comps, gen_end)`` submits what is left, waits
and returns ``Scores``: rewards and correctness ``[P, G]``, each function's mean, the rows whose
reward failed (counted, scored 0, with ``reward.on_error='zero'``; else the first failure is a
``RewardError`` naming the function and the prompt's row), the reward seconds generation hid
(``overlap_s``) and the wait after it. Rewards see TRL's standard format: the prompt's user
text, the completion's text, and the prompt's columns (``Prompt.meta``), one value per
completion. Details: docs/training.md ("Your own task").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specrl.config import RewardCfg
from specrl.envs.reasoning_gym_env import Env, Prompt, ScoredEnv
from specrl.rewards import RewardError, check_result, check_signature, resolve_reward, reward_name
from specrl.rewards.env_reward import EnvReward
from specrl.rewards.pool import Named, Outcome, Pending, RewardCall, RewardPool
from specrl.rollout_types import Completion

ENV_REWARD = "env"  # the environment's own reward (reasoning-gym's scorer)
UNNAMED = "python:"  # config.toml's name of a callable given to specrl.train that has no name


class Decoder(Protocol):
    """Completion ids -> text (the run's codec)."""

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class RewardFunc:
    """One reward of the run: its metric ``name``, its ``label`` as the user named it, what the
    workers call and its weight."""

    name: str
    label: str
    fn: Callable[..., Any]
    weight: float


def _resolve(
    item: str | Callable[..., Any], env: Env, cfg: RewardCfg, columns: set[str]
) -> RewardFunc:
    """A configured name or a given callable as a checked ``RewardFunc`` (weight 1)."""
    if callable(item):
        check_signature(item, reward_name(item))
        return RewardFunc(reward_name(item), reward_name(item), item, 1.0)
    if item.startswith(UNNAMED):
        raise RewardError(
            f"reward {item!r} was a Python callable handed to specrl.train that config.toml "
            "cannot name (a lambda, a closure, a notebook's function): pass it again, "
            "specrl.train(..., resume=RUN, reward_funcs=[...]), or define it in a .py file"
        )
    if item == ENV_REWARD:
        if not isinstance(env, ScoredEnv):
            raise RewardError(
                f"reward 'env': the {type(env).__name__} environment scores nothing itself; "
                "name a reward in reward.funcs (e.g. 'math')"
            )
        return RewardFunc(ENV_REWARD, ENV_REWARD, EnvReward(env), 1.0)
    fn = resolve_reward(item)  # imports it here: a bad name fails before any work
    check_signature(fn, item)
    bound = (("pattern", cfg.pattern),) if item == "regex" else ()
    _check_columns(fn, item, columns | {name for name, _ in bound})
    return RewardFunc(reward_name(item), item, Named(item, bound), 1.0)


def _columns(env: Env) -> set[str]:
    """The column names a reward sees (a train prompt's ``meta``), and prompts/completions."""
    train = env.prompts("train")
    return {"prompts", "completions", *(train[0].meta if train else {})}


def _check_columns(fn: Callable[..., Any], label: str, columns: set[str]) -> None:
    """``RewardError`` naming a parameter ``fn`` requires that no column provides (the 'math'
    reward's ``answer`` with ``env.answer_column`` unset, say), before any work."""
    import inspect

    fn = getattr(fn, "func", fn)  # a functools.partial: its function
    required = [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    missing = [name for name in required if name not in columns]
    if missing:
        have = ", ".join(sorted(columns - {"prompts", "completions"})) or "none"
        raise RewardError(
            f"reward {label!r} needs the column {missing[0]!r}, which the prompts do not have "
            f"(columns: {have}; env.answer_column names the one passed as 'answer')"
        )


def _picklable(func: RewardFunc) -> None:
    """``RewardError`` unless ``func`` can be sent to a worker process."""
    import pickle
    import sys

    main = sys.modules.get("__main__")
    if getattr(func.fn, "__module__", None) == "__main__" and not hasattr(main, "__file__"):
        raise RewardError(
            f"reward {func.label!r} is defined in an interactive session (a notebook, a REPL), "
            "which the reward worker processes cannot import; define it in a .py file, or set "
            "reward.workers=0 to score in the trainer's thread"
        )
    try:
        pickle.dumps(func.fn)
    except Exception as e:
        raise RewardError(
            f"reward {func.label!r} cannot be sent to the reward worker processes ({e}); define "
            "it at module level, or set reward.workers=0 to score in the trainer's thread"
        ) from None


class Rewards:
    """The run's reward functions, weights, accuracy rule and worker pool."""

    def __init__(self, funcs: list[RewardFunc], pool: RewardPool, on_error: str, correct: Any):
        self.funcs, self.pool, self.on_error = funcs, pool, on_error
        self.correct = correct  # EnvReward(correct=True) when the first reward is 'env', else None

    @classmethod
    def build(
        cls,
        cfg: RewardCfg,
        env: Env,
        given: Sequence[str | Callable[..., Any]] | None = None,
    ) -> Rewards:
        """See the module docstring; ``given`` replaces ``cfg.funcs`` (weights still apply)."""
        names = list(given) if given else list(cfg.funcs) or list(_defaults(env))
        weights = list(cfg.weights) or [1.0] * len(names)
        if len(weights) != len(names):
            raise RewardError(f"reward.weights has {len(weights)} values for {len(names)} rewards")
        columns = _columns(env)  # what every reward is called with
        funcs = [_resolve(item, env, cfg, columns) for item in names]
        funcs = [RewardFunc(f.name, f.label, f.fn, w) for f, w in zip(funcs, weights, strict=True)]
        _unique_names(funcs)
        if cfg.workers > 0:
            for func in funcs:
                _picklable(func)
        correct = EnvReward(env, correct=True) if funcs[0].label == ENV_REWARD else None
        return cls(funcs, RewardPool(cfg.workers, cfg.timeout_s), cfg.on_error, correct)

    def scorer(self, codec: Decoder, prompts: Sequence[Prompt]) -> Scorer:
        return Scorer(self, codec, list(prompts))

    def close(self) -> None:
        self.pool.close()


def _defaults(env: Env) -> tuple[str, ...]:
    """The rewards an environment is scored with when none is named."""
    return tuple(getattr(env, "default_rewards", (ENV_REWARD,)))


def _unique_names(funcs: list[RewardFunc]) -> None:
    names = [f.name for f in funcs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RewardError(f"two rewards log as reward_{twice[0]}_mean: name each reward once")


@dataclass
class Scores:
    """One rollout's scores (see the module docstring)."""

    rewards: torch.Tensor  # [P, G] weighted sum
    correct: torch.Tensor  # [P, G] 0/1
    means: dict[str, float] = field(default_factory=dict)  # function name -> mean value
    errors: int = 0  # completions with a failed reward, scored 0 for it
    overlap_s: float = 0.0  # reward seconds that ran before generation ended
    wait_s: float = 0.0  # seconds waited for rewards after generation ended

    def metrics(self) -> dict[str, float]:
        """The metric-row fields of these scores."""
        means = {f"reward_{name}_mean": v for name, v in self.means.items()}
        return means | {
            "reward_errors": self.errors,
            "reward_overlap_s": self.overlap_s,
            "reward_wait_s": self.wait_s,
        }


class Scorer:
    """One rollout's scoring (see the module docstring)."""

    def __init__(self, rewards: Rewards, codec: Decoder, prompts: list[Prompt]) -> None:
        self.rewards, self.codec, self.prompts = rewards, codec, prompts
        self.pending: dict[int, list[Pending]] = {}  # prompt index -> one call per function

    def submit(self, index: int, comps: Sequence[Completion]) -> None:
        """Send prompt ``index``'s completions to every reward function."""
        prompt = self.prompts[index]
        texts = [self.codec.decode(c.token_ids) for c in comps]
        columns = {key: [value] * len(texts) for key, value in prompt.meta.items()}
        fns = [f.fn for f in self.rewards.funcs]
        fns += [self.rewards.correct] if self.rewards.correct is not None else []
        pool = self.rewards.pool
        self.pending[index] = [
            pool.submit(RewardCall(fn, [prompt.text] * len(texts), texts, columns)) for fn in fns
        ]

    def result(self, comps: Sequence[Completion], gen_end: float) -> Scores:
        """Submit the groups not yet sent, wait for all and combine (``gen_end``:
        ``time.monotonic()`` when generation ended)."""
        groups = _groups(comps, len(self.prompts))
        for i, group in enumerate(groups):
            if i not in self.pending:
                self.submit(i, group)
        return self._combine(len(groups[0]) if groups else 0, gen_end)

    def _combine(self, n: int, gen_end: float) -> Scores:
        """Wait for the calls group by group (under on_error='fail' the first failure raises
        at once) and combine them."""
        funcs, groups = self.rewards.funcs, len(self.prompts)
        values = torch.zeros(len(funcs), groups, n)  # [F, P, G]
        correct = torch.zeros(groups, n)  # [P, G]
        failed = torch.zeros(groups, n, dtype=torch.bool)  # [P, G]
        outcomes: list[Outcome] = []
        for i in range(groups):
            calls = [p.outcome() for p in self.pending[i]]
            outcomes += calls
            for f, outcome in enumerate(calls[: len(funcs)]):
                row, ok = self._values(funcs[f].label, i, outcome, n)
                values[f, i] = torch.tensor(row)
                failed[i] |= ~torch.tensor(ok)
            correct[i] = self._correct(i, values[0, i], calls, n)
        wait_s = max(time.monotonic() - gen_end, 0.0)
        weights = torch.tensor([f.weight for f in funcs])  # [F]
        total = (values * weights[:, None, None]).sum(0)  # [P, G]
        total[failed] = 0.0
        overlap = sum(_before(o, gen_end) for o in outcomes)
        means = {f.name: float(values[k].mean()) for k, f in enumerate(funcs)}
        return Scores(total, correct, means, int(failed.sum()), overlap, wait_s)

    def _values(self, label: str, index: int, outcome: Outcome, n: int) -> tuple[list, list]:
        """A call's values [G] (None -> 0) and which rows succeeded; a failure raises under
        on_error='fail'."""
        row_ids = [self.prompts[index].id] * n
        try:
            if outcome.error is not None:
                raise RewardError(f"reward {label!r} {outcome.error} on prompt row {row_ids[0]!r}")
            checked = check_result(label, outcome.value, n, row_ids)
        except RewardError:
            if self.rewards.on_error == "fail":
                raise
            return [0.0] * n, [False] * n
        return [0.0 if v is None else float(v) for v in checked], [True] * n

    def _correct(self, index: int, first: torch.Tensor, calls: list[Outcome], n: int):
        """0/1 per completion: the environment's own check when the first reward is 'env',
        else the first reward's value >= 1."""
        if self.rewards.correct is None:
            return (first >= 1.0).float()
        row, _ = self._values(ENV_REWARD, index, calls[-1], n)
        return torch.tensor(row)


def _groups(comps: Sequence[Completion], prompts: int) -> list[list[Completion]]:
    """Completions per prompt, in request order."""
    groups: list[list[Completion]] = [[] for _ in range(prompts)]
    for c in comps:
        groups[c.request_index].append(c)
    return groups


def _before(outcome: Outcome, gen_end: float) -> float:
    """Seconds of a call that ran before ``gen_end``."""
    if not outcome.end:  # never ran
        return 0.0
    return max(0.0, min(outcome.end, gen_end) - outcome.start)
