"""The built-in rewards: math (math-verify, last answer, any thread), exact and regex."""

from __future__ import annotations

import threading
from functools import partial

import pytest

from specrl.rewards import BUILTIN, exact, math, regex, stated_answer


def one(fn, completion: str, **columns) -> float | None:
    """``fn`` on a batch of one completion, each column given as a single row."""
    (value,) = fn(["the prompt"], [completion], **{k: [v] for k, v in columns.items()})
    return value


# --------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        ("so $\\boxed{\\frac{1}{2}}$", "0.5"),
        ("Step 1...\nAnswer: 34", 34),
        ("Step 1...\nAnswer: 34", "34"),
        ("Answer: 0.5", "\\frac{1}{2}"),
        ("The final answer is $\\boxed{\\dfrac{3}{4}}$.", "\\frac34"),
        ("**Answer:** 1,000", 1000),
        ("Answer: x^2+1", "x^2+1"),  # bare LaTeX on an answer line
        ("Answer: \\sqrt{2}", "\\sqrt{2}"),
        ("Answer: 5\n\nThat is my answer.", 5),  # a later 'answer' word with no value in it
        ("2 + 2 gives 4", 4),  # no marker: math-verify's pick in the whole text
    ],
)
def test_math_verifies_equal_answers(completion, gold):
    assert one(math, completion, answer=gold) == 1.0


def test_math_reads_the_last_answer():
    text = "Answer: 3\nWait, I made a mistake.\nAnswer: 5"
    assert one(math, text, answer=5) == 1.0
    assert one(math, text, answer=3) == 0.0
    boxed_then_line = "First \\boxed{3}. Checking again...\nAnswer: 5"  # boxed outranks in m-v
    assert one(math, boxed_then_line, answer=5) == 1.0
    assert one(math, boxed_then_line, answer=3) == 0.0


@pytest.mark.parametrize("completion", ["Answer: 35", "\\boxed{-34}", "garbage", "", "Answer:"])
def test_math_scores_wrong_or_unparsable_answers_zero(completion):
    assert one(math, completion, answer=34) == 0.0


def test_math_is_none_without_a_usable_gold():
    assert math(["p"] * 3, ["Answer: 1"] * 3, answer=[None, "", "  "]) == [None, None, None]


def test_math_scores_a_batch_row_by_row():
    got = math(["p"] * 3, ["Answer: 1", "Answer: 2", "\\boxed{3}"], answer=[1, 1, 3], extra=[0] * 3)
    assert got == [1.0, 0.0, 1.0]


def test_math_runs_outside_the_main_thread():
    """math-verify's default timeouts use signal.alarm, which raises off the main thread."""
    out: list = []
    errors: list = []

    def work() -> None:
        try:
            out.append(math(["p", "p"], ["\\boxed{\\frac{1}{2}}", "Answer: 7"], answer=["0.5", 8]))
        except Exception as e:  # pragma: no cover - what the test guards against
            errors.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not errors and out == [[1.0, 0.0]]


# --------------------------------------------------------------------------- exact


@pytest.mark.parametrize(
    ("completion", "gold", "want"),
    [
        ("Let me think.\nAnswer: Paris.", "paris", 1.0),
        ("so the answer is **PARIS**, clearly", "Paris", 1.0),
        ("Answer: 3\nno wait\nAnswer: 4", 4, 1.0),  # the last stated answer
        ("Answer: 3\nno wait\nAnswer: 4", 3, 0.0),
        ("working...\n2 + 3 = 5", "5", 1.0),  # no stated answer: the last line after '='
        ("Answer: Paris", "London", 0.0),
        ("", "x", 0.0),
    ],
)
def test_exact(completion, gold, want):
    assert one(exact, completion, answer=gold) == want


def test_exact_is_none_without_an_answer_and_ignores_other_columns():
    assert exact(["p", "p"], ["a", "a"], answer=[None, "a"], difficulty=[1, 2]) == [None, 1.0]


def test_stated_answer():
    assert stated_answer("x\nThe answer is 42.") == "42"
    assert stated_answer("x\n  \n") == "x"
    assert stated_answer("") is None


# --------------------------------------------------------------------------- regex


def test_regex_compares_the_last_match_group_with_the_answer():
    comps = ["<a>1</a> then <a>2</a>", "<a>2</a> then <a>1</a>", "no tags"]
    got = regex(["p"] * 3, comps, pattern=r"<a>(\d)</a>", answer=["2", "2", "2"])
    assert got == [1.0, 0.0, 0.0]


def test_regex_without_groups_uses_the_whole_match():
    assert one(regex, "codes: AB-1, CD-2", pattern=r"[A-Z]{2}-\d", answer="cd-2") == 1.0


def test_regex_without_an_answer_checks_the_pattern_matches():
    bound = partial(regex, pattern=r"^<think>.*</think>")  # bound by the caller, as a partial
    assert bound(["p", "p"], ["<think>x</think> 4", "4"]) == [1.0, 0.0]


def test_regex_takes_the_pattern_as_a_column():
    got = regex(["p", "p"], ["x=1", "y=2"], pattern=[r"x=(\d)", r"x=(\d)"], answer=[1, 2])
    assert got == [1.0, 0.0]


def test_a_column_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 2 completions"):
        exact(["p", "p"], ["a", "b"], answer=["a"])


def test_the_registry_is_read_only():
    assert dict(BUILTIN) == {"math": math, "exact": exact, "regex": regex}
    with pytest.raises(TypeError):
        BUILTIN["mine"] = exact  # type: ignore[index]


@pytest.mark.parametrize(
    ("text", "gold", "want"),
    [("The answer is 42.", "42", 1.0), ("So the answer is 42", "42", 1.0),
     ("Thus the answer is 42.", "42", 1.0), ("answer is: -3", "-3", 1.0),
     ("The answer is 41.", "42", 0.0)],
)  # fmt: skip
def test_math_reads_the_answer_is_sentences(text, gold, want):
    assert math(["p"], [text], answer=[gold]) == [want]
