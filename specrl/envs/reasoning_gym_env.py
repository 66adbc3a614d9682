"""Reasoning-gym tasks as RL environments: prompts with metadata and verifiable rewards.

``ReasoningGymEnv(task, task_config, num_train, num_eval, template, seed, format_bonus)`` builds
disjoint train/eval splits (questions partitioned by a stable hash); ``prompts(split, seed)``
returns a split (a seed gives a deterministic permutation); ``reward`` scores a completion with
the task's own scorer in [0, 1] (plus ``format_bonus`` when an answer was extracted).
``TASK_PRESETS`` and ``TEMPLATES`` hold per-task settings and prompt templates; an unknown task
or template raises ``ValueError`` (did-you-mean). Text only: tokenisation is the rollout side's.
Details: docs/internals.md.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from specrl.errors import one_line, unknown

if TYPE_CHECKING:
    from specrl.config import EnvCfg

SEED_STRIDE = 1 << 20  # reasoning-gym seeds entry i with seed + i: keep env seeds' streams apart
EVAL_BUCKETS = 4
_MAX_POOL_FACTOR = 64


@dataclass(frozen=True)
class Prompt:
    """One prompt: a stable id, chat messages and what the reward needs (``meta``)."""

    id: str
    messages: tuple[dict[str, str], ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def text(self) -> str:
        """The user turn's text."""
        return next(m["content"] for m in reversed(self.messages) if m["role"] == "user")

    @property
    def system(self) -> str | None:
        return next((m["content"] for m in self.messages if m["role"] == "system"), None)


@runtime_checkable
class Env(Protocol):
    """Prompts with metadata (``meta``: the columns a reward sees). An environment that scores
    completions itself also has ``reward(text, meta) -> float`` and ``correct(text, meta) ->
    bool`` (``ScoredEnv``: the 'env' reward); ``default_rewards``, where present, names the
    rewards a run uses when its config names none (else 'env')."""

    def prompts(self, split: str, seed: int | None = None) -> list[Prompt]: ...


@runtime_checkable
class ScoredEnv(Env, Protocol):
    """An environment with its own verifiable reward (reasoning-gym's scorers)."""

    def reward(self, completion_text: str, meta: Mapping[str, Any]) -> float: ...

    def correct(self, completion_text: str, meta: Mapping[str, Any]) -> bool: ...


# --------------------------------------------------------------------------- templates


@dataclass(frozen=True)
class Template:
    """How a question is asked and how the answer is read back."""

    system: str | None
    suffix: str
    extract: Callable[[str], str | None]

    def messages(self, question: str) -> tuple[dict[str, str], ...]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        msgs.append({"role": "user", "content": question.rstrip() + self.suffix})
        return tuple(msgs)


_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
_OPEN_TAG = re.compile(r"<answer>\s*(.*?)\s*$", re.DOTALL)
_LINE = re.compile(r"answer\s*(?:is)?\s*[:=]\s*\**\s*(.+)", re.IGNORECASE)
_IS = re.compile(r"answer\s+is\s*:?\s*\**\s*(.+?)\s*(?:[.,;!](?:\s|$)|$)", re.IGNORECASE | re.M)


def extract_tag(text: str) -> str | None:
    """The last ``<answer>...</answer>`` content; an unclosed final tag counts too."""
    matches = _TAG.findall(text)
    if matches:
        return matches[-1].strip()
    tail = _OPEN_TAG.search(text)
    return tail.group(1).strip() or None if tail else None


def extract_line(text: str) -> str | None:
    """The rest of the last line that says ``Answer: X`` or ``answer is X`` (trailing period and
    ** removed)."""
    matches = _LINE.findall(text) or _IS.findall(text)
    if not matches:
        return None
    return _clean(matches[-1])


def _clean(value: str) -> str | None:
    """Strip markdown bold, quotes, trailing periods and whitespace; None when nothing is left."""
    value = value.strip().lstrip("*").rstrip("*. ").strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'`":
        value = value[1:-1].rstrip(".").strip()
    return value or None


def extract_last_line(text: str) -> str | None:
    """For 'reply with only the answer' prompts: X of the last 'answer is X' / 'Answer: X' in the
    text, else the last non-empty line after its last '=' ('5 - 3 = 2' -> '2')."""
    stated = extract_line(text)
    if stated is not None:
        return stated
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return _clean(lines[-1].rsplit("=", 1)[-1]) if lines else None


TEMPLATES: dict[str, Template] = {
    "answer_tag": Template(
        None, "\nPut only the final answer inside <answer></answer> tags.", extract_tag
    ),
    "answer_line": Template(None, "\nEnd your reply with a line 'Answer: <answer>'.", extract_line),
    "answer_only": Template(None, "\nReply with only the final answer.", extract_last_line),
    # long, variable replies (the reasoning preset): the last "answer is X" or last line's value
    "step_by_step": Template(
        None,
        "\nExplain your reasoning step by step, then end with 'The answer is <answer>.'",
        extract_last_line,
    ),
}


def get_template(name: str) -> Template:
    if name not in TEMPLATES:
        raise ValueError(unknown("prompt template", name, TEMPLATES))
    return TEMPLATES[name]


# --------------------------------------------------------------------------- tasks


# Easy settings for SmolLM2-135M (docs/task_choice.md); a task config is merged over its preset.
TASK_PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "basic_arithmetic": MappingProxyType(
            {
                "min_terms": 2,
                "max_terms": 2,
                "min_digits": 1,
                "max_digits": 1,
                "operators": ("+", "-"),
                "allow_parentheses": False,
                "allow_negation": False,
            }  # fmt: skip
        ),
    }
)


def task_config_with_preset(task: str, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The task's preset (if any) updated with ``config``."""
    return dict(TASK_PRESETS.get(task, {})) | dict(config or {})


def task_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_task(task: str) -> None:
    """Raise ``ValueError`` (known names, did-you-mean hint) unless ``task`` is a task."""
    if task not in task_names():
        raise ValueError(unknown("reasoning-gym task", task, task_names()))


def make_dataset(task: str, size: int, seed: int, config: Mapping[str, Any]):
    """``reasoning_gym.create_dataset`` with errors turned into one-line ``ValueError``s."""
    import reasoning_gym

    check_task(task)
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **dict(config))
    except (TypeError, AssertionError, ValueError) as e:
        raise ValueError(f"bad config for task {task!r} {dict(config)}: {one_line(e)}") from None


def check_task_config(task: str, config: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` unless ``task`` exists and accepts ``config`` (cheap: one entry)."""
    ds = make_dataset(task, 1, 0, config)
    try:
        ds[0]
    except Exception as e:  # generators fail in many ways on out-of-range settings
        raise ValueError(f"bad config for task {task!r} {dict(config)}: {one_line(e)}") from None


def is_eval_question(question: str) -> bool:
    """Whether a question belongs to the eval part of the question space (stable across runs)."""
    digest = hashlib.sha1(question.encode()).digest()
    return int.from_bytes(digest[:8], "little") % EVAL_BUCKETS == 0


class ReasoningGymEnv:
    """A reasoning-gym task with fixed, disjoint train and eval splits."""

    default_rewards = ("env",)  # the task's own scorer

    def __init__(
        self,
        task: str = "basic_arithmetic",
        task_config: Mapping[str, Any] | None = None,
        num_train: int = 1000,
        num_eval: int = 48,
        template: str = "answer_only",
        seed: int = 0,
        format_bonus: float = 0.0,
    ) -> None:
        self.task, self.config = task, dict(task_config or {})
        self.template = get_template(template)
        self.format_bonus = format_bonus
        self._scorer = make_dataset(task, 1, 0, self.config)
        self._entries = {
            "train": self._draw(num_train, seed * SEED_STRIDE, want_eval=False, unique=False),
            "eval": self._draw(
                num_eval, (2 * seed + 1) * SEED_STRIDE // 2, want_eval=True, unique=True
            ),  # fmt: skip
        }

    @classmethod
    def from_config(cls, cfg: EnvCfg) -> ReasoningGymEnv:
        config = task_config_with_preset(cfg.task, cfg.task_config)
        from specrl.config_task import RG_NUM_TRAIN

        num_train = RG_NUM_TRAIN if cfg.num_train is None else cfg.num_train
        return cls(cfg.task, config, num_train, cfg.num_eval, cfg.template, cfg.seed,
                   cfg.format_bonus)  # fmt: skip

    def _draw(self, n: int, seed: int, want_eval: bool, unique: bool) -> list[dict]:
        """The first ``n`` entries of the seeded stream that fall in the wanted hash bucket."""
        size = 2 * n
        while n:
            ds = make_dataset(self.task, size, seed, self.config)
            entries = [ds[i] for i in range(size)]
            entries = [e for e in entries if is_eval_question(e["question"]) == want_eval]
            if unique:
                entries = list({e["question"]: e for e in entries}.values())
            if len(entries) >= n:
                return entries[:n]
            if size >= _MAX_POOL_FACTOR * n:
                split = "eval" if want_eval else "train"
                raise ValueError(
                    f"task {self.task!r} with config {self.config} has too few distinct questions "
                    f"for {n} {split} prompts: found {len(entries)}; lower num_{split} or make "
                    "the task larger"
                )
            size *= 4
        return []

    def prompts(self, split: str, seed: int | None = None) -> list[Prompt]:
        if split not in self._entries:
            raise ValueError(unknown("split", split, ["train", "eval"]))
        out = [self._prompt(split, i, e) for i, e in enumerate(self._entries[split])]
        if seed is not None:
            random.Random(seed).shuffle(out)
        return out

    def _prompt(self, split: str, index: int, entry: dict) -> Prompt:
        meta = {"task": self.task, "split": split, "index": index, "answer": entry["answer"]}
        meta["entry"] = entry
        return Prompt(
            f"{self.task}/{split}/{index}", self.template.messages(entry["question"]), meta
        )

    def extract(self, completion_text: str) -> str | None:
        return self.template.extract(completion_text)

    def score(self, completion_text: str, meta: Mapping[str, Any]) -> float:
        """The task scorer's value in [0, 1] for the extracted answer (0 if none)."""
        answer = self.extract(completion_text)
        if answer is None:
            return 0.0
        return float(self._scorer.score_answer(answer, meta["entry"]))

    def reward(self, completion_text: str, meta: Mapping[str, Any]) -> float:
        bonus = self.format_bonus if self.extract(completion_text) is not None else 0.0
        return self.score(completion_text, meta) + bonus

    def correct(self, completion_text: str, meta: Mapping[str, Any]) -> bool:
        return self.score(completion_text, meta) >= 1.0
