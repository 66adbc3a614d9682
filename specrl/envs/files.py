"""Prompts from the user's own dataset file: one row per prompt (``env.kind = 'file'``).

Contract:
- ``load_rows(path)`` reads a ``.jsonl``/``.json``, ``.parquet`` or ``.csv`` file, or a directory
  written by ``datasets``' ``save_to_disk`` (a ``DatasetDict``'s ``'train'`` split), through
  ``datasets`` offline: local files only, its cache in a temporary directory (nothing is written
  under the user's home), its progress bars and logging silenced while it reads (and restored).
- Each row's prompt (``prompt_column``) is a non-empty string (the user turn) or a list of
  ``{role, content}`` messages with string values, roles in system/user/assistant, ending with a
  user turn (other keys of a message are ignored).
- ``answer_column`` (None: no answer) is a column, or a dotted path into a dict column:
  ``"reward_model.ground_truth"`` reads ``row["reward_model"]["ground_truth"]`` (DAPO-Math-17K's
  layout); a column whose own name is the whole string wins. A null answer is an error.
- ``Prompt.meta`` holds every other column as it is, the answer under ``"answer"`` whatever its
  name in the file, plus ``"row"`` (the row's 0-based index in its own file) and ``"file"``; a
  file column that would clash with one of these keys is an error. ``Prompt.id`` is
  ``"<split>/<row>"``. ``system_prompt`` is put before each prompt that has no system turn.
- Splits: train = the train file's rows; eval = ``eval_file``'s first ``num_eval`` rows, or else
  the ``num_eval`` distinct prompts of the train file with the smallest stable hash (sha1 of the
  prompt's JSON text; every row with such a prompt leaves train), whatever the file order. Train
  is then capped at its first ``num_train`` rows when ``num_train`` is given.
- Every problem is a ``FileEnvError`` (a ``ValueError``) of one line naming the file and, where
  it applies, the row and the column; every row is checked at construction, before any model is
  loaded. ``drop_long`` removes prompts longer than a token limit (the caller counts tokens).
Torch-free; ``datasets`` is imported when a file is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from specrl.envs.reasoning_gym_env import Prompt
from specrl.errors import one_line, unknown

if TYPE_CHECKING:
    from specrl.config import EnvCfg

BUILDERS: Mapping[str, str] = MappingProxyType(
    {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
)  # a file's suffix -> the datasets builder that reads it
ROLES = ("system", "user", "assistant")
META_KEYS = ("answer", "row", "file")  # the keys FileEnv itself puts in each prompt's meta
SPLITS = ("train", "eval")

PromptValue = str | tuple[dict[str, str], ...]  # a checked prompt: text or chat messages


class FileEnvError(ValueError):
    """A problem with the user's prompt file: one line naming the file (row, column)."""


# --------------------------------------------------------------------------- reading files


# datasets.config switches set while a file is read: offline (no Hub request at all, not even the
# HEAD that counts a packaged builder's loads, which waits up to 3 s without a network)
_OFFLINE = (("HF_HUB_OFFLINE", True), ("HF_DATASETS_OFFLINE", True),
            ("HF_UPDATE_DOWNLOAD_COUNTS", False))  # fmt: skip


@contextmanager
def _offline_quiet_datasets() -> Iterator[None]:
    """For the block: ``datasets`` offline, its progress bars and logging silenced; each
    setting restored afterwards (os.environ untouched)."""
    import datasets

    cfg, logger = datasets.config, logging.getLogger("datasets")
    saved, level = [(name, getattr(cfg, name)) for name, _ in _OFFLINE], logger.level
    # an explicit HF_DATASETS_DISABLE_PROGRESS_BARS is the user's choice: leave it
    toggle = cfg.HF_DATASETS_DISABLE_PROGRESS_BARS is None and not (
        datasets.are_progress_bars_disabled()
    )
    for name, value in _OFFLINE:
        setattr(cfg, name, value)
    logger.setLevel(logging.CRITICAL + 1)
    if toggle:
        datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, value in saved:
            setattr(cfg, name, value)
        logger.setLevel(level)
        if toggle:
            datasets.enable_progress_bars()


def _root_cause(exc: BaseException) -> BaseException:
    """The library's own error under ``datasets``' generic generation wrapper."""
    from datasets.exceptions import DatasetGenerationError

    while isinstance(exc, DatasetGenerationError) and (exc.__cause__ or exc.__context__):
        exc = exc.__cause__ or exc.__context__
    return exc


def _is_blank(path: Path) -> bool:
    """Whether the file holds only whitespace (reads until its first other byte)."""
    with path.open("rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _read_file(path: Path, builder: str, shown: str) -> list[dict[str, Any]]:
    from datasets import DownloadConfig, load_dataset

    with tempfile.TemporaryDirectory(prefix="specrl-files-") as cache, _offline_quiet_datasets():
        download = DownloadConfig(cache_dir=cache, local_files_only=True, disable_tqdm=True)
        try:
            data = load_dataset(
                builder,
                data_files=str(path),
                split="train",
                cache_dir=cache,
                download_config=download,
                keep_in_memory=True,
            )
        except Exception as e:  # the readers fail in many ways on a corrupt file
            cause = _root_cause(e)
            if "corresponds to no data" in str(cause):  # a CSV with a header and no rows
                raise FileEnvError(f"{shown}: the file has no rows") from None
            raise FileEnvError(f"{shown}: cannot read it as {builder}: {one_line(cause)}") from None
        return data.to_list()


def _read_dir(path: Path, shown: str) -> list[dict[str, Any]]:
    from datasets import DatasetDict, load_from_disk

    with _offline_quiet_datasets():
        try:
            data = load_from_disk(str(path), keep_in_memory=True)
        except Exception as e:  # not a save_to_disk directory, or a damaged one
            raise FileEnvError(
                f"{shown}: cannot read it as a saved dataset: {one_line(e)}"
            ) from None
        if isinstance(data, DatasetDict):
            if "train" not in data:
                raise FileEnvError(
                    f"{shown}: the saved dataset has no 'train' split; splits: "
                    f"{', '.join(data) or 'none'}"
                )
            data = data["train"]
        return data.to_list()


def load_rows(path: str | PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a prompt file or ``save_to_disk`` directory, offline (module docstring)."""
    shown, file = str(path), Path(path).expanduser()
    if not file.exists():
        raise FileEnvError(f"{shown}: no such file or directory")
    if file.is_dir():
        rows = _read_dir(file, shown)
    else:
        builder = BUILDERS.get(file.suffix.lower())
        if builder is None:
            raise FileEnvError(
                f"{shown}: unsupported file kind {file.suffix or '(no suffix)'!r}; accepted: "
                f"{', '.join(BUILDERS)} or a directory written by datasets' save_to_disk"
            )
        if _is_blank(file):
            raise FileEnvError(f"{shown}: the file is empty")
        rows = _read_file(file, builder, shown)
    if not rows:
        raise FileEnvError(f"{shown}: the file has no rows")
    return rows


# --------------------------------------------------------------------------- checking rows


def _kind(value: Any) -> str:
    """What a value is, for an error message."""
    if value is None:
        return "null"
    if isinstance(value, str) and not value.strip():
        return "an empty string"
    if isinstance(value, list | tuple) and not value:
        return "an empty list"
    return type(value).__name__


def _messages(value: Sequence[Any]) -> tuple[dict[str, str], ...]:
    """A checked chat-message list; ``ValueError`` says what is wrong with it."""
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, Mapping):
            raise ValueError(f"message {i} is {_kind(msg)}, not a {{role, content}} dict")
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise ValueError(f"message {i} has role {role!r}; roles: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"message {i} has content {_kind(content)}, not text")
        out.append({"role": role, "content": content})
    if out[-1]["role"] != "user":
        raise ValueError(f"the last message has role {out[-1]['role']!r}, not 'user'")
    return tuple(out)


def check_prompt(value: Any) -> PromptValue:
    """``value`` as a prompt (a non-empty string, or checked chat messages); otherwise
    ``ValueError`` saying what it is instead."""
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list | tuple) and value:
        try:
            return _messages(value)
        except ValueError as e:
            raise ValueError(f"expected text or a list of chat messages: {e}") from None
    raise ValueError(f"expected text or a list of chat messages, got {_kind(value)}")


def _answer_path(columns: Sequence[str], answer_column: str) -> tuple[str, tuple[str, ...]]:
    """(column, keys into it): the longest dotted prefix of ``answer_column`` that is a column."""
    parts = answer_column.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in columns:
            return ".".join(parts[:k]), tuple(parts[k:])
    raise KeyError(answer_column)


def _lookup(value: Any, column: str, keys: Sequence[str]) -> Any:
    """``value[k1][k2]...``; ``ValueError`` names the step that is missing."""
    where = column
    for key in keys:
        if not isinstance(value, Mapping):
            raise ValueError(f"{where!r} is {_kind(value)}, not a dict with key {key!r}")
        if key not in value:
            raise ValueError(f"{where!r} has no key {key!r}; keys: {', '.join(map(str, value))}")
        value, where = value[key], f"{where}.{key}"
    return value


def _is_null(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


@dataclass(frozen=True)
class Row:
    """One checked row: its index in its file, its prompt and its meta (module docstring)."""

    index: int
    prompt: PromptValue
    meta: dict[str, Any]


def _check_columns(
    shown: str, columns: Sequence[str], prompt_column: str, answer_column: str | None
) -> tuple[str, tuple[str, ...]] | None:
    """The answer's (column, keys), after checking that the named columns exist and no column
    clashes with the meta keys FileEnv sets."""
    listed = ", ".join(columns)
    if prompt_column not in columns:
        raise FileEnvError(
            f"{shown}: no prompt column {prompt_column!r} (env.prompt_column); columns: {listed}"
        )
    answer = None
    if answer_column is not None:
        try:
            answer = _answer_path(columns, answer_column)
        except KeyError:
            raise FileEnvError(
                f"{shown}: no answer column {answer_column!r} "
                f"(env.answer_column); columns: {listed}"
            ) from None
    renamed = answer == (answer_column, ())  # the answer is a whole column: it moves to 'answer'
    for key in META_KEYS:
        if key not in columns or key == prompt_column or (renamed and key == answer_column):
            continue
        if key == "answer" and answer_column is None:
            continue  # no answer column: a column named 'answer' passes as it is
        raise FileEnvError(
            f"{shown}: column {key!r} clashes with the {key!r} that specrl puts in each prompt's "
            f"meta (env.answer_column={answer_column!r}); rename the column"
        )
    return answer


def read_prompt_rows(
    path: str | PathLike[str], prompt_column: str = "prompt", answer_column: str | None = "answer"
) -> list[Row]:
    """Every row of ``path``, checked (module docstring); the first problem raises."""
    shown, rows = str(path), load_rows(path)
    columns = list(rows[0])
    answer = _check_columns(shown, columns, prompt_column, answer_column)
    out = []
    for i, raw in enumerate(rows):
        try:
            prompt = check_prompt(raw[prompt_column])
        except ValueError as e:
            raise FileEnvError(f"{shown}: row {i} column {prompt_column!r}: {e}") from None
        meta = {k: v for k, v in raw.items() if k != prompt_column}
        if answer is not None:
            try:
                value = _lookup(raw[answer[0]], *answer)
            except ValueError as e:
                raise FileEnvError(f"{shown}: row {i} column {answer_column!r}: {e}") from None
            if _is_null(value):
                raise FileEnvError(f"{shown}: row {i} column {answer_column!r}: the answer is null")
            if not answer[1]:
                del meta[answer[0]]
            meta["answer"] = value
        out.append(Row(i, prompt, meta | {"row": i, "file": shown}))
    return out


# --------------------------------------------------------------------------- splits


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def prompt_hash(prompt: PromptValue) -> str:
    """The stable hash of a checked prompt: sha1 of its JSON text."""
    value = list(prompt) if isinstance(prompt, tuple) else prompt
    return hashlib.sha1(_json(value).encode()).hexdigest()


def hold_out(rows: Sequence[Row], n: int, shown: str) -> tuple[list[Row], list[Row]]:
    """(train, eval): eval = one row of each of the ``n`` distinct prompts with the smallest hash
    (ties between copies broken by the whole row's hash); train = the rows with other prompts,
    in file order. Independent of the file's order."""
    hashes = [prompt_hash(r.prompt) for r in rows]
    distinct = len(set(hashes))
    if n >= distinct:
        raise FileEnvError(
            f"{shown}: holding out num_eval={n} prompts for eval leaves none to train on (the "
            f"file has {distinct} distinct prompts); lower env.num_eval or set env.eval_file"
        )
    order = sorted(range(len(rows)), key=lambda i: (hashes[i], _json(rows[i].meta | {"row": 0})))
    chosen: dict[str, Row] = {}
    for i in order:
        if len(chosen) == n:
            break
        chosen.setdefault(hashes[i], rows[i])
    train = [r for r, h in zip(rows, hashes, strict=True) if h not in chosen]
    return train, list(chosen.values())


def to_prompt(split: str, row: Row, system_prompt: str | None = None) -> Prompt:
    """The Prompt of a checked row: ``system_prompt`` first when the row has no system turn."""
    msgs = ({"role": "user", "content": row.prompt},) if isinstance(row.prompt, str) else row.prompt
    if system_prompt is not None and not any(m["role"] == "system" for m in msgs):
        msgs = ({"role": "system", "content": system_prompt}, *msgs)
    return Prompt(f"{split}/{row.index}", tuple(dict(m) for m in msgs), dict(row.meta))


# --------------------------------------------------------------------------- the environment


class FileEnv:
    """Train and eval prompts read from the user's files (module docstring)."""

    default_rewards: ClassVar[tuple[str, ...]] = ("math",)

    def __init__(
        self,
        train_file: str | PathLike[str],
        eval_file: str | PathLike[str] | None = None,
        prompt_column: str = "prompt",
        answer_column: str | None = "answer",
        system_prompt: str | None = None,
        num_train: int | None = None,
        num_eval: int = 48,
    ) -> None:
        if (num_train is not None and num_train < 1) or num_eval < 0:
            raise ValueError(f"need num_train >= 1 and num_eval >= 0, got {num_train}, {num_eval}")
        self.train_file = str(train_file)
        self.eval_file = None if eval_file is None else str(eval_file)
        train = read_prompt_rows(train_file, prompt_column, answer_column)
        if eval_file is not None:
            evals = read_prompt_rows(eval_file, prompt_column, answer_column)[:num_eval]
        else:
            train, evals = hold_out(train, num_eval, self.train_file)
        if num_train is not None:
            train = train[:num_train]
        self._prompts: dict[str, list[Prompt]] = {
            "train": [to_prompt("train", r, system_prompt) for r in train],
            "eval": [to_prompt("eval", r, system_prompt) for r in evals],
        }

    @classmethod
    def from_config(cls, cfg: EnvCfg) -> FileEnv:
        """From ``env.*``; ``num_train`` (None: all rows) caps the train rows."""
        if cfg.train_file is None:
            raise FileEnvError("env.kind='file' needs env.train_file")
        return cls(
            cfg.train_file,
            cfg.eval_file,
            cfg.prompt_column,
            cfg.answer_column,
            cfg.system_prompt,
            cfg.num_train,
            cfg.num_eval,
        )

    def prompts(self, split: str, seed: int | None = None) -> list[Prompt]:
        """A split's prompts in file order, or shuffled deterministically by ``seed``."""
        if split not in self._prompts:
            raise ValueError(unknown("split", split, SPLITS))
        out = list(self._prompts[split])
        if seed is not None:
            random.Random(seed).shuffle(out)
        return out

    def drop_long(self, length: Callable[[Prompt], int], limit: int) -> int:
        """Remove the prompts of both splits whose ``length`` exceeds ``limit``; how many went.
        Raises (nothing removed) when every train prompt would go."""
        lengths = {s: [length(p) for p in ps] for s, ps in self._prompts.items()}
        if all(n > limit for n in lengths["train"]):
            raise FileEnvError(
                f"{self.train_file}: every train prompt is longer than {limit} tokens (the "
                f"shortest has {min(lengths['train'])}); raise env.max_prompt_tokens"
            )
        dropped = 0
        for split, prompts in self._prompts.items():
            kept = [p for p, n in zip(prompts, lengths[split], strict=True) if n <= limit]
            dropped += len(prompts) - len(kept)
            self._prompts[split] = kept
        return dropped
