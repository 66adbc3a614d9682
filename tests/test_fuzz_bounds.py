"""Fuzz every number the ``specrl`` command line takes, and every pair of options that cannot
apply together (issue 42).

Contract checked: each case below ends in exactly one ``error: ...`` line naming the option (or
``--set`` key) with exit code 2, within ``BOUND_S`` seconds, before any work: a case that reaches
the first expensive call of its command (``ReachedWork``), runs past the bound, exits 0 or shows a
traceback fails. The cases are read from the CLI and the config models themselves, so an option
or field added later is fuzzed too:

- every integer option of every command (``train-drafter``, ``simulate`` and ``bench`` included)
  with 10**30, -(10**30) and 2**63 (past int64), and every float option with nan, inf and -inf;
- every integer field of the training config (``train --set``) and of a simulator scenario
  (``simulate --set``) with the same integers, and every float field with nan and inf;
- ``PAIRS``: options and fields set where they cannot apply.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from specrl.cli import app
from specrl.config import Config
from specrl.config_drafter import TrainDrafterCfg
from specrl.sim.scenario import Scenario
from tests.test_fuzz_cli import COMMANDS, WORK, ReachedWork

BOUND_S = 10  # seconds: a case still running then has started real work
HUGE = [str(10**30), str(-(10**30)), str(2**63)]
NOT_FINITE = ["nan", "inf", "-inf"]
# Arguments that get each command past its own argument checks to the option under test.
BASE_ARGS = {
    ("bench", "generate"): [],
    ("bench", "grpo"): [],
    ("bench", "gpu"): [],
    ("export",): ["RUN", "OUT"],
    ("generate",): ["hi"],
    ("simulate", "calibrate"): ["{trace}"],
    ("upcycle",): ["OUT"],
}
TRACE = {  # a good engine trace for ``simulate calibrate`` (its fit is never reached)
    "machine": "test", "model": "smollm2-135m",
    "records": [{"kind": "decode", "batch_size": b, "tokens_per_seq": 1, "context_len": 64.0,
                 "step_time_s": 0.01 * b, "config": f"b{b}"} for b in (1, 2, 4, 8)],
}  # fmt: skip


class TookTooLong(BaseException):  # noqa: N818 - a case ran past the bound
    pass


@contextmanager
def bounded(seconds: int) -> Iterator[None]:
    def expire(*_: Any) -> None:
        raise TookTooLong

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _reached(*args, **kwargs):
    raise ReachedWork


@pytest.fixture(scope="module", autouse=True)
def warm_imports() -> None:
    """Import what validation uses once, so that no case pays the imports within its bound."""
    from specrl.envs.reasoning_gym_env import task_names
    from specrl.pipelines.validate import check_names  # noqa: F401
    from specrl.spec.proposers import available_proposers

    task_names(), available_proposers()


def refused(args: list[str], cwd: Path, *names: str) -> None:
    """Run ``specrl ARGS``: it must end in one ``error:`` line (naming one of ``names``) with
    exit code 2, before any work and within ``BOUND_S``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.setenv("SPECRL_CACHE", str(cwd / "cache"))
        for target in WORK:
            mp.setattr(target, _reached)
        try:
            with bounded(BOUND_S):
                result = CliRunner().invoke(app, args)
        except ReachedWork:
            pytest.fail(f"accepted, and work started: specrl {' '.join(args)}")
        except TookTooLong:
            pytest.fail(f"still running after {BOUND_S} s: specrl {' '.join(args)}")
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        args, repr(result.exception))  # fmt: skip
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code == 2, (args, result.exit_code, result.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, lines)
    assert any(n in lines[0] for n in names), (args, names, lines[0])
    made = [p.name for p in cwd.iterdir() if p.name not in ("cache", "trace.json")]
    assert not made, (args, made)


# --------------------------------------------------------------------------- options


def _number_kind(annotation: Any) -> str | None:
    kinds = {a for a in (annotation, *get_args(annotation)) if a in (int, float)}
    return "int" if int in kinds else "float" if float in kinds else None


def number_options() -> Iterator[tuple[tuple[str, ...], Any, str]]:
    """(command, option, value) for every integer and float option of every command."""
    for command, cmd in sorted(COMMANDS.items()):
        for p in cmd.params:
            if p.param_type_name != "option" or p.is_flag:
                continue
            kind = _number_kind(p.type_descriptor.annotation)
            if kind is not None:
                yield from ((command, p, v) for v in (HUGE if kind == "int" else NOT_FINITE))


OPTION_CASES = list(number_options())


@pytest.mark.parametrize(
    ("command", "option", "value"),
    OPTION_CASES,
    ids=[f"{' '.join(c)} {o.opts[0]}={v}" for c, o, v in OPTION_CASES],
)
def test_every_number_option_is_bounded(command, option, value, tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(TRACE))
    base = [a.format(trace=trace) for a in BASE_ARGS.get(command, [])]
    args = [*command, *base, option.opts[0], value]
    name = option.name or ""
    refused(args, tmp_path, option.opts[0], name, name.replace("_", "-"), f"got {value}")


def test_every_command_with_number_options_gets_past_its_arguments():
    """A command added later with number options needs its ``BASE_ARGS`` (else its cases
    could fail on a missing argument instead of the option)."""
    assert {c for c, _, _ in OPTION_CASES} == set(BASE_ARGS)


# --------------------------------------------------------------------------- --set values


def number_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, "int" | "float") of every number field of ``model``, sections included."""
    for key, info in model.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            yield from number_fields(sub, f"{prefix}{key}.")
        elif (kind := _number_kind(sub)) is not None:
            yield f"{prefix}{key}", kind


def set_cases(model: type[BaseModel]) -> list[tuple[str, str]]:
    return [(key, v) for key, kind in number_fields(model)
            for v in (HUGE if kind == "int" else NOT_FINITE[:2])]  # fmt: skip


TRAIN_SETS = set_cases(Config)
SIM_SETS = set_cases(Scenario)
DRAFTER_SETS = set_cases(TrainDrafterCfg)  # train-drafter's numbers are settings, as train's


@pytest.mark.parametrize(("key", "value"), TRAIN_SETS, ids=[f"{k}={v}" for k, v in TRAIN_SETS])
def test_every_train_number_is_bounded(key, value, tmp_path):
    refused(["train", "--set", f"{key}={value}"], tmp_path, key)


@pytest.mark.parametrize(("key", "value"), SIM_SETS, ids=[f"{k}={v}" for k, v in SIM_SETS])
def test_every_scenario_number_is_bounded(key, value, tmp_path):
    refused(["simulate", "paper-8b-sync", "--set", f"{key}={value}"], tmp_path, key)


@pytest.mark.parametrize(("key", "value"), DRAFTER_SETS, ids=[f"{k}={v}" for k, v in DRAFTER_SETS])
def test_every_train_drafter_number_is_bounded(key, value, tmp_path):
    refused(["train-drafter", "--set", f"{key}={value}"], tmp_path, key)


def test_the_set_cases_cover_the_fields_the_issue_found():
    assert ("rollout.top_k", str(2**63)) in TRAIN_SETS
    assert ("generation.gpus", str(2**63)) in SIM_SETS
    assert ("train.steps", str(2**63)) in DRAFTER_SETS


# --------------------------------------------------------------------------- pairs


PAIRS = [  # (argv, words the one line must hold: both options)
    (["train", "--set", "pipeline.max_staleness=1"], "pipeline.mode"),
    (["train", "--set", "pipeline.update=in_flight"], "pipeline.mode"),
    (["train", "--set", "rollout.spec_siblings=3"], "rollout.spec"),
    (["train", "--set", 'cluster.address="10.9.9.9:6379"'], "cluster.rollout_workers"),
    (["train", "--set", "cluster.threads=2"], "cluster.rollout_workers"),
    (["train", "--set", "rollout.spec=none", "--set", "rollout.num_spec_tokens=7"],
     "rollout.spec"),
    (["simulate", "paper-8b-sync", "--set", "pipeline.staleness=3"], "pipeline.mode"),
    (["generate", "hi", "--spec", "ngram", "--spec-siblings", "3"], "'ngram'"),
    (["generate", "hi", "--spec-siblings", "3"], "'none'"),
    (["generate", "hi", "--num-spec-tokens", "5"], "--spec"),
    (["generate", "hi", "--spec", "suffix", "--drafter", "x"], "--spec"),
    (["bench", "generate", "--spec", "ngram", "--num-spec-tokens", "0"], "--spec ngram"),
    (["bench", "generate", "--num-spec-tokens", "4"], "--spec"),
    (["bench", "generate", "--batch-sizes", "1,,2"], "--batch-sizes"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "words"), PAIRS, ids=[" ".join(a) for a, _ in PAIRS])
def test_options_that_cannot_apply_are_refused(args, words, tmp_path):
    refused(args, tmp_path, words)


def test_a_resume_refuses_what_it_would_ignore(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(Config().to_toml())
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {i}}}\n' for i in range(4)))
    for extra, words in [(["--run-dir", str(tmp_path / "other")], "--run-dir"),
                         (["--set", "run.run_dir=x"], "run.run_dir"),
                         (["--set", "run.steps=2"], "run.steps")]:  # fmt: skip
        with pytest.MonkeyPatch.context() as mp:
            for target in WORK:
                mp.setattr(target, _reached)
            result = CliRunner().invoke(app, ["train", "--resume", str(run), *extra])
        assert result.exit_code == 2 and words in result.stderr, (extra, result.output)


def test_bounded_stops_a_case_that_runs_too_long():
    with pytest.raises(TookTooLong), bounded(1):
        signal.pause()
