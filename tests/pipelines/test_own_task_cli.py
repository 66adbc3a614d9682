"""``specrl train`` on the user's own files and rewards: every bad input is one ``error:`` line
naming the file, row, column or function, exit code 2, before any model is loaded; the
dapo-math preset runs on a fixture with DAPO-Math-17K's columns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specrl.cli import app

FIXTURE = Path(__file__).parents[1] / "fixtures" / "dapo_math_tiny.jsonl"


@pytest.fixture
def no_model(monkeypatch):
    """Loading the model (or its tokenizer) fails the test: errors come before any work."""
    import specrl.models.checkpoints as ckpt

    def loaded(*a, **k):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(ckpt, "load_model", loaded)
    monkeypatch.setattr(ckpt, "load_tokenizer", loaded)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def refused(tmp_path: Path, *sets: str) -> str:
    args = ["train", "--run-dir", str(tmp_path / "run"), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not (tmp_path / "run").exists()  # nothing written
    return lines[0]


def file_sets(path: Path, *more: str) -> tuple[str, ...]:
    return ('env.kind="file"', f"env.train_file={json.dumps(str(path))}", "env.num_eval=2", *more)


GOOD = [{"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(8)]


def test_a_missing_file(tmp_path, no_model):
    line = refused(tmp_path, *file_sets(tmp_path / "nope.jsonl"))
    assert "nope.jsonl" in line and "no such file" in line


def test_a_missing_column(tmp_path, no_model):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "x", "answer": 1}])
    line = refused(tmp_path, *file_sets(path))
    assert "d.jsonl" in line and "'prompt'" in line and "question" in line


def test_a_broken_row(tmp_path, no_model):
    path = write_jsonl(tmp_path / "d.jsonl", [*GOOD[:3], {"prompt": 17, "answer": 1}])
    line = refused(tmp_path, *file_sets(path))
    assert "d.jsonl" in line and "row 3" in line and "'prompt'" in line


def test_a_reward_that_does_not_import(tmp_path, no_model):
    path = write_jsonl(tmp_path / "d.jsonl", GOOD)
    line = refused(tmp_path, *file_sets(path, 'reward.funcs=["no_such_module_xyz:f"]'))
    assert "no_such_module_xyz" in line


def test_a_reward_with_the_wrong_signature(tmp_path, no_model):
    path = write_jsonl(tmp_path / "d.jsonl", GOOD)
    (tmp_path / "r.py").write_text("def one(completion):\n    return 1.0\n")
    spec = json.dumps([f"{tmp_path / 'r.py'}:one"])
    line = refused(tmp_path, *file_sets(path, f"reward.funcs={spec}"))
    assert "r.py:one" in line and "completions" in line


def test_env_reward_on_a_file_task(tmp_path, no_model):
    path = write_jsonl(tmp_path / "d.jsonl", GOOD)
    line = refused(tmp_path, *file_sets(path, 'reward.funcs=["env"]'))
    assert "reward 'env'" in line and "math" in line


@pytest.mark.slow
def test_the_dapo_math_preset_runs_on_its_fixture(tmp_path):
    """The preset's columns, prompt and reward on the bundled model (short replies here)."""
    args = ["train", "--preset", "dapo-math", "--run-dir", str(tmp_path / "run"),
            "--no-progress", "--no-compare"]  # fmt: skip
    for s in (f"env.train_file={json.dumps(str(FIXTURE))}", "env.num_eval=2",
              "rollout.max_new_tokens=8", "rollout.prompts_per_step=2", "rollout.group_size=2",
              "run.steps=1", "run.eval_every=1", "reward.workers=1"):  # fmt: skip
        args += ["--set", s]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward_errors"] == 0 and "reward_math_mean" in row
    assert len(row["prompts"]) == 2 and all(p.startswith("train/") for p in row["prompts"])
    cfg = (tmp_path / "run" / "config.toml").read_text()
    assert 'answer_column = "reward_model.ground_truth"' in cfg


def test_prompts_too_long_for_the_context_are_dropped_and_counted(tmp_path):
    """``fit_prompts``: the limit defaults to the context less max_new_tokens; the note counts
    what was dropped; an explicit env.max_prompt_tokens wins."""
    from specrl.config import load_config
    from specrl.envs import FileEnv
    from specrl.pipelines.build import fit_prompts

    class Chars:  # one token per character of the user turn
        stop_token_ids = (0,)

        def prompt_ids(self, prompt):
            return list(range(len(prompt.text)))

    rows = [{"prompt": "x" * n, "answer": n} for n in (5, 10, 20, 40, 80, 160)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = load_config(None, file_sets(path, "env.num_eval=1", "rollout.max_new_tokens=48"))
    env = FileEnv(str(path), num_eval=1)
    assert fit_prompts(cfg, env, Chars(), context=100) == (
        "dropped 2 prompts longer than 52 tokens (env.max_prompt_tokens)",
    )
    kept = env.prompts("train") + env.prompts("eval")
    assert sorted(len(p.text) for p in kept) == [5, 10, 20, 40]
    cfg = load_config(None, file_sets(path, "env.num_eval=1", "env.max_prompt_tokens=12"))
    assert fit_prompts(cfg, FileEnv(str(path), num_eval=1), Chars(), context=100) == (
        "dropped 4 prompts longer than 12 tokens (env.max_prompt_tokens)",
    )


def test_a_reward_needing_a_column_the_prompts_lack_is_refused_before_work(tmp_path):
    """``math`` without an answer column (``env.answer_column=None``, from Python), a TRL-style
    function naming a column the file does not have: one line at build, not a failure per call."""
    from specrl.config import RewardCfg
    from specrl.envs import FileEnv
    from specrl.pipelines.scoring import Rewards
    from specrl.rewards import RewardError

    bare = write_jsonl(tmp_path / "bare.jsonl", [{"prompt": r["prompt"]} for r in GOOD])
    with pytest.raises(RewardError, match="reward 'math' needs the column 'answer'"):
        Rewards.build(RewardCfg(workers=0), FileEnv(str(bare), answer_column=None, num_eval=2))
    env = FileEnv(str(write_jsonl(tmp_path / "d.jsonl", GOOD)), num_eval=2)
    with pytest.raises(RewardError, match="column 'solution'.*columns: answer, file, row"):
        Rewards.build(RewardCfg(funcs=["tests.rewards.faulty:accuracy_like"], workers=0), env)
    Rewards.build(RewardCfg(funcs=["math", "tests.rewards.faulty:reward_len"], workers=0), env)
