"""Loading rewards (built-in, module, file), checking signatures and results, weighting."""

from __future__ import annotations

import functools
import math
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from specrl.rewards import (
    BUILTIN,
    RewardError,
    check_result,
    check_signature,
    resolve_reward,
    reward_name,
    weighted_sum,
)

TRL_STYLE = """
import re

def format_reward(completions, **kwargs):
    return [1.0 if re.search(r"<think>.*?</think>", c, re.S) else 0.0 for c in completions]

def accuracy(prompts, completions, answer, **kwargs):
    return [float(c.strip().endswith(str(a))) for c, a in zip(completions, answer)]

WEIGHT = 0.5
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def one_line_error(value: str) -> str:
    """The message ``resolve_reward(value)`` fails with; it must be one line naming the value."""
    with pytest.raises(RewardError) as info:
        resolve_reward(value)
    message = str(info.value)
    assert "\n" not in message and value in message, message
    return message


# --------------------------------------------------------------------------- resolve_reward


def test_builtins_resolve_by_name():
    for name, fn in BUILTIN.items():
        assert resolve_reward(name) is fn


def test_a_trl_style_reward_file_loads_and_runs(tmp_path):
    path = write(tmp_path, "my_rewards.py", TRL_STYLE)
    fn = resolve_reward(f"{path}:accuracy")
    check_signature(fn, "accuracy")
    assert fn(["p", "q"], ["so 12", "so 13"], answer=[12, 12], level=[1, 2]) == [1.0, 0.0]
    assert resolve_reward(f"{path}:accuracy") is fn  # loaded once, as an import is


def test_a_relative_file_path_resolves_from_the_working_directory(tmp_path, monkeypatch):
    write(tmp_path, "sub/r.py", "def f(prompts, completions, **kw):\n    return [2.0]\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_reward(f"sub{os.sep}r.py:f")(["p"], ["c"]) == [2.0]


def test_two_files_with_one_stem_do_not_collide(tmp_path):
    a = write(tmp_path, "a/rewards.py", "def f(prompts, completions, **kw):\n    return [1.0]\n")
    b = write(tmp_path, "b/rewards.py", "def f(prompts, completions, **kw):\n    return [2.0]\n")
    fa, fb = resolve_reward(f"{a}:f"), resolve_reward(f"{b}:f")
    assert fa(["p"], ["c"]) == [1.0] and fb(["p"], ["c"]) == [2.0]
    assert fa.__module__ != fb.__module__ and fa.__module__ in sys.modules


def test_a_module_function_resolves():
    fn = resolve_reward("specrl.rewards.builtin:exact")
    assert fn is BUILTIN["exact"]


def test_unknown_builtin_suggests_and_lists():
    message = one_line_error("maths")
    assert "did you mean math?" in message and "exact, math, regex" in message


@pytest.mark.parametrize(
    ("value", "expect"),
    [
        ("no_such_pkg_xyz.mod:f", "cannot import 'no_such_pkg_xyz.mod' (ModuleNotFoundError:"),
        ("specrl.rewards.builtin:nope", "has no function 'nope'"),
        ("specrl.rewards.builtin:BUILTIN", "'BUILTIN' is a mappingproxy, not a function"),
        ("specrl.rewards.builtin:", "names no function"),
    ],
)
def test_module_errors_are_one_line(value, expect):
    assert expect in one_line_error(value)


def test_file_errors_are_one_line(tmp_path):
    assert "no such file" in one_line_error(f"{tmp_path / 'missing.py'}:f")
    path = write(tmp_path, "r.py", TRL_STYLE)
    assert "has no function 'acuracy' (did you mean accuracy?)" in one_line_error(f"{path}:acuracy")
    assert "'WEIGHT' is a float, not a function" in one_line_error(f"{path}:WEIGHT")


@pytest.mark.parametrize(
    ("source", "expect"),
    [
        (
            "import no_such_pkg_xyz\n",
            "raised ModuleNotFoundError: No module named 'no_such_pkg_xyz'",
        ),
        ("raise RuntimeError('bad\\nsetup')\n", "raised RuntimeError: bad"),
        ("def f(:\n", "raised SyntaxError:"),
        ("import sys\nsys.exit(3)\n", "raised SystemExit: 3"),
    ],
)
def test_a_file_that_raises_while_importing_is_one_line(tmp_path, source, expect):
    path = write(tmp_path, "broken.py", source)
    assert expect in one_line_error(f"{path}:f")
    assert not any(getattr(m, "__file__", None) == str(path) for m in list(sys.modules.values()))


# --------------------------------------------------------------------------- check_signature


def _trl(prompts, completions, **kwargs):
    return []


def _star(*args, **kwargs):
    return []


def _no_kwargs(prompts, completions):
    return []


def _one_positional(completions, **kwargs):  # TRL's reward_len shape: called by keyword
    return []


def _positional_only(prompts, completions, /, **kwargs):  # cannot be called by keyword
    return []


class _Callable:
    def __call__(self, prompts, completions, **columns):
        return []


@pytest.mark.parametrize(
    "fn", [_trl, _star, _one_positional, _Callable(), functools.partial(_trl), *BUILTIN.values()]
)
def test_trl_signatures_pass(fn):
    check_signature(fn, "f")


@pytest.mark.parametrize("fn", [_no_kwargs, _positional_only, lambda: None])
def test_other_signatures_fail_in_one_line(fn):
    with pytest.raises(RewardError) as info:
        check_signature(fn, "mymod:f")
    message = str(info.value)
    assert "\n" not in message and "'mymod:f'" in message
    assert "fn(prompts, completions, **kwargs)" in message


# --------------------------------------------------------------------------- reward_name


def test_reward_name():
    assert reward_name("math") == "math"
    assert reward_name("pkg.mod:Format_Reward") == "format_reward"
    assert reward_name("path/to/my-file.py:len-reward") == "len_reward"
    assert reward_name(_trl) == "trl"
    assert reward_name(functools.partial(_star, x=1)) == "star"
    assert reward_name(_Callable()) == "callable"
    assert reward_name(lambda p, c, **k: p) == "lambda"


# --------------------------------------------------------------------------- check_result


def test_check_result_accepts_numbers_bools_none_and_arrays():
    assert check_result("f", [1, 0.5, True, None], 4, ["r"] * 4) == [1.0, 0.5, 1.0, None]
    assert check_result("f", (np.float32(0.25),), 1, ["r"]) == [0.25]
    got = check_result("f", np.array([1.0, 2.0]), 2, ["r", "r"])
    assert got == [1.0, 2.0] and all(type(v) is float for v in got)


@pytest.mark.parametrize(
    ("values", "expect"),
    [
        (
            [1.0, 0.0, 1.0],
            "reward 'mymod:f' returned 3 values for 4 completions (prompt row 'train/0')",
        ),
        ([1.0, math.nan, 0, 0], "reward 'mymod:f' returned nan for prompt row 'train/1'"),
        ([0, 0, math.inf, 0], "reward 'mymod:f' returned inf for prompt row 'train/2'"),
        ([0, 0, 0, "1.0"], "reward 'mymod:f' returned '1.0' for prompt row 'train/3'"),
        ([0, 0, 0, 10**400], "returned 1000000000"),
        ([0, [1], 0, 0], "returned [1] for prompt row 'train/1'"),
        (0.5, "reward 'mymod:f' returned 0.5, not a list of 4 values (prompt row 'train/0')"),
        ({"a": 1}, "returned {'a': 1}, not a list"),
        (np.zeros((2, 2)), "returned an array of shape (2, 2)"),
        ("x" * 500, "returned 'xxxxxxxx"),
    ],
)
def test_check_result_names_the_function_row_and_value(values, expect):
    with pytest.raises(RewardError) as info:
        check_result("mymod:f", values, 4, [f"train/{i}" for i in range(4)])
    message = str(info.value)
    assert expect in message and "\n" not in message and len(message) < 200, message


# --------------------------------------------------------------------------- weighted_sum


def test_weighted_sum_counts_none_as_zero():
    got = weighted_sum([[1.0, None, 0.5], [None, None, 1.0]], [2.0, 0.5])
    assert got == [2.0, 0.0, 1.5]
    assert weighted_sum([], []) == []


def test_weighted_sum_refuses_mismatches():
    with pytest.raises(RewardError, match="2 reward weights for 1 rewards"):
        weighted_sum([[1.0]], [1.0, 1.0])
    with pytest.raises(RewardError, match=r"different numbers of values: \[1, 2\]"):
        weighted_sum([[1.0], [1.0, 2.0]], [1.0, 1.0])
