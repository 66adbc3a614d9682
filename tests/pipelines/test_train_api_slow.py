"""``specrl.train(...)`` in Python is the run ``specrl train`` makes: same config, same seed,
the same metrics (timings aside), on the bundled model with a file task and two rewards, one a
Python callable; a ``datasets.Dataset`` is saved into the run and read from there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import specrl
from specrl.cli import app
from specrl.pipelines.loop import TIMING_KEYS
from tests.rewards.faulty import length_reward

pytestmark = pytest.mark.slow

# A fixed draft count (1000 tokens per forward: k at these few rows): the default timing-driven
# controller picks k from measured step times, and the verify shapes it picks move the engine's
# logprobs by float noise (~1e-5), which the learner's metrics carry; timings are not compared.
SETS = (
    "env.num_eval=2", "rollout.max_new_tokens=12", "rollout.prompts_per_step=2",
    "rollout.group_size=2", "run.steps=2", "run.eval_every=2", "reward.weights=[1.0, 0.01]",
    "rollout.max_tokens_per_forward=1000",
)  # fmt: skip
ROWS = [{"prompt": f"Tom has {a} apples and finds {b} more. How many now?", "answer": a + b,
         "level": a % 3} for a in range(1, 5) for b in range(1, 4)]  # fmt: skip


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def test_the_api_run_equals_the_cli_run(tmp_path):
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    funcs = json.dumps(["math", "tests.rewards.faulty:length_reward"])
    args = ["train", "--run-dir", str(tmp_path / "cli"), "--no-progress", "--no-compare",
            "--set", 'env.kind="file"', "--set", f"env.train_file={json.dumps(str(data))}",
            "--set", f"reward.funcs={funcs}"]  # fmt: skip
    for s in SETS:
        args += ["--set", s]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    run = specrl.train(overrides=SETS, reward_funcs=["math", length_reward], dataset=data,
                       run_dir=tmp_path / "api", compare=False, progress=False)  # fmt: skip
    assert run == tmp_path / "api"
    cli, api = metrics(tmp_path / "cli"), metrics(run)
    assert len(cli) == 2 and cli == api
    assert {"reward_math_mean", "reward_length_reward_mean"} <= set(cli[0])
    # the callable is recorded by its importable name: the run's config can rebuild it
    assert "tests.rewards.faulty:length_reward" in (run / "config.toml").read_text()


def test_a_datasets_dataset_is_saved_into_the_run(tmp_path):
    from datasets import Dataset

    run = specrl.train({"run": {"steps": 1, "eval_every": 0}}, dataset=Dataset.from_list(ROWS),
                       overrides=SETS[:4], run_dir=tmp_path / "ds", compare=False,
                       progress=False)  # fmt: skip
    assert (run / "dataset").is_dir()
    cfg = (run / "config.toml").read_text()
    assert f'train_file = "{run / "dataset"}"' in cfg and 'kind = "file"' in cfg
    assert len(metrics(run)) == 1
