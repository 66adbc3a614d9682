"""Finding, checking and combining reward functions; every failure is one ``RewardError`` line.

Contract:
- ``resolve_reward(name)``: a built-in name (``BUILTIN``), ``package.module:function``
  (imported) or ``path/to/file.py:function`` (loaded from the file under a module name unique to
  its resolved path, so two files with one stem never collide; loaded once per process, as an
  import is). Errors name the value: an unknown built-in (with a suggestion and the valid
  names), a module that cannot be imported, a missing file, a module or file that raises while
  importing (the exception's type and message), a missing function, a non-callable attribute.
- ``check_signature(fn, name)``: ``RewardError`` unless ``fn`` takes two positional parameters
  (or ``*args``) and ``**kwargs``: TRL's ``fn(prompts, completions, **kwargs)``.
- ``reward_name(spec_or_fn)``: the metric name of a reward, ``[a-z0-9_]`` only: a built-in's
  name, the function's name of a ``module:function`` / ``file.py:function`` spec or callable.
- ``check_result(name, values, n, row_ids)``: the values a reward returned for ``n``
  completions, as floats or None, else ``RewardError`` naming the reward, the first bad row's id
  and what it returned: a list/tuple (or 1-D array) of ``n`` finite numbers (bools count) or None.
- ``weighted_sum(values_per_fn, weights)``: per completion, the weighted sum over functions; a
  None counts 0 (TRL's nansum).

Torch-free (imports ``specrl.errors`` only from specrl).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from specrl.errors import did_you_mean, one_line, unknown
from specrl.rewards.builtin import BUILTIN, RewardFn

TRL_SIGNATURE = "fn(prompts, completions, **kwargs) or fn(completions, **kwargs)"


class RewardError(ValueError):
    """A reward that cannot be found, called or believed; its message is one line."""


# --------------------------------------------------------------------------- resolving


def resolve_reward(name: str) -> RewardFn:
    """The reward function ``name`` names (see the module docstring)."""
    if name in BUILTIN:
        return BUILTIN[name]
    source, sep, attr = name.rpartition(":")
    if not sep or not source:
        hint = "; or name one as package.module:function or path/to/file.py:function"
        raise RewardError(unknown("reward", name, BUILTIN) + hint)
    if not attr:
        raise RewardError(f"reward {name!r} names no function after ':'")
    is_file = source.endswith(".py") or "/" in source or "\\" in source
    module = _load_file(name, source) if is_file else _import(name, source)
    return _function(name, module, attr)


def _import(name: str, module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise RewardError(f"reward {name!r}: cannot import {module!r} ({one_line(e)})") from None
    except Exception as e:
        raise RewardError(f"reward {name!r}: importing {module!r} raised {one_line(e)}") from None


def _module_name(path: Path) -> str:
    """A module name unique to the file's resolved path."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", path.stem)
    return f"specrl_reward_file_{digest}_{stem}"


def _load_file(name: str, source: str) -> ModuleType:
    path = Path(source).expanduser().resolve()
    if not path.is_file():
        raise RewardError(f"reward {name!r}: no such file {source!r}")
    mod_name = _module_name(path)
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise RewardError(f"reward {name!r}: {source!r} cannot be loaded as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # what pickle and dataclasses look the module up by
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        del sys.modules[mod_name]
        raise RewardError(f"reward {name!r}: importing {source!r} raised {one_line(e)}") from None
    return module


def _function(name: str, module: ModuleType, attr: str) -> RewardFn:
    where = getattr(module, "__file__", None) or module.__name__
    if not hasattr(module, attr):
        public = [a for a in vars(module) if not a.startswith("_")]
        hint = did_you_mean(attr, public)
        raise RewardError(f"reward {name!r}: {where!r} has no function {attr!r}{hint}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"reward {name!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


# --------------------------------------------------------------------------- checking


def check_signature(fn: Callable[..., Any], name: str) -> None:
    """``RewardError`` unless ``fn`` can be called as TRL calls a reward: by keyword,
    ``fn(prompts=..., completions=..., **columns)`` (``**kwargs`` taking what it does not name;
    nothing positional-only without a default)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise RewardError(f"reward {name!r}: cannot read its signature ({one_line(e)})") from None
    kind = inspect.Parameter
    params = list(sig.parameters.values())
    positional_only = [p for p in params if p.kind == kind.POSITIONAL_ONLY and p.default is p.empty]
    if positional_only or not any(p.kind == kind.VAR_KEYWORD for p in params):
        raise RewardError(
            f"reward {name!r} has the signature {sig}; a reward must be callable as "
            f"{TRL_SIGNATURE} (TRL's convention: prompts, completions and the dataset's other "
            "columns passed by keyword, **kwargs taking those it does not use)"
        )


def reward_name(spec_or_fn: str | Callable[..., Any]) -> str:
    """The metric name of a reward: ``[a-z0-9_]``, never empty."""
    if callable(spec_or_fn):
        fn = getattr(spec_or_fn, "func", spec_or_fn)  # a functools.partial: its function
        raw = getattr(fn, "__name__", None) or type(fn).__name__
    else:
        raw = spec_or_fn.rpartition(":")[2]
    return re.sub(r"[^a-z0-9_]+", "_", raw.lower()).strip("_") or "reward"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _row(row_ids: Sequence[Any], i: int) -> Any:
    return row_ids[i] if i < len(row_ids) else f"#{i}"


def check_result(name: str, values: Any, n: int, row_ids: Sequence[Any]) -> list[float | None]:
    """``values`` as ``n`` floats or None (see the module docstring)."""
    if hasattr(values, "ndim") and hasattr(values, "tolist"):  # a numpy array, without numpy
        if values.ndim != 1:
            shape = tuple(getattr(values, "shape", ()))
            raise RewardError(
                f"reward {name!r} returned an array of shape {shape}, not {n} values "
                f"(prompt row {_row(row_ids, 0)!r})"
            )
        values = values.tolist()
    if not isinstance(values, list | tuple):
        raise RewardError(
            f"reward {name!r} returned {_short(values)}, not a list of {n} values "
            f"(prompt row {_row(row_ids, 0)!r})"
        )
    if len(values) != n:
        raise RewardError(
            f"reward {name!r} returned {len(values)} values for {n} completions "
            f"(prompt row {_row(row_ids, 0)!r})"
        )
    return [_checked(name, v, _row(row_ids, i)) for i, v in enumerate(values)]


def _checked(name: str, value: Any, row: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, numbers.Real):
        try:
            number = float(value)
        except OverflowError:  # an int past float's range
            number = math.inf
        if math.isfinite(number):
            return number
    raise RewardError(
        f"reward {name!r} returned {_short(value)} for prompt row {row!r} "
        "(want a finite number or None)"
    )


# --------------------------------------------------------------------------- combining


def weighted_sum(
    values_per_fn: Sequence[Sequence[float | None]], weights: Sequence[float]
) -> list[float]:
    """Per completion, ``sum(w * v)`` over the functions, a None contributing 0."""
    if len(weights) != len(values_per_fn):
        raise RewardError(f"{len(weights)} reward weights for {len(values_per_fn)} rewards")
    lengths = sorted({len(values) for values in values_per_fn})
    if len(lengths) > 1:
        raise RewardError(f"rewards returned different numbers of values: {lengths}")
    n = lengths[0] if lengths else 0
    pairs = list(zip(weights, values_per_fn, strict=True))
    return [float(sum(w * v[i] for w, v in pairs if v[i] is not None)) for i in range(n)]
