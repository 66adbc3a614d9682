"""Rewards of the user's own: functions from a file or a module, several weighted and logged
apart, scored in worker processes as groups finish; every fault of a reward (hang, raise, wrong
length, NaN, a killed worker) is one line naming the function and the prompt's row (or rows
counted and scored 0), never a hang, and the run directory stays resumable."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from specrl.pipelines.train import train
from specrl.rewards import RewardError
from tests.pipelines.pipeline_fakes import tiny_config, tiny_parts

FAULTS = ["sleeps_forever", "raises", "wrong_length", "returns_nan", "kills_worker"]
WHAT = {
    "sleeps_forever": "timed out after 3s",
    "raises": "raised ZeroDivisionError: the user's bug",
    "wrong_length": "returned 5 values for 4 completions",
    "returns_nan": "nan",
    "kills_worker": "killed its worker",
}


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def run_steps(tmp_path: Path, *sets: str, name: str = "run", **kw) -> tuple[Path, list[dict]]:
    parts = tiny_parts(tiny_config(*sets))
    try:
        return tmp_path / name, train(parts, str(tmp_path / name), progress=False, **kw)
    finally:
        parts.close()


TRL_STYLE = """
def divisible(prompts, completions, **kwargs):
    # TRL's convention: the batch in, one float per completion out; ids in kwargs['ids']
    assert len(kwargs["ids"]) == len(completions)
    return [float(sum(int(t) % 4 == 0 for t in c.split()) > 1) for c in completions]
"""


def test_a_trl_style_file_reward_and_two_weights_logged_apart(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(TRL_STYLE))
    funcs = json.dumps([f"{path}:divisible", "env"])
    _, out = run_steps(tmp_path, f"reward.funcs={funcs}", "reward.weights=[0.5, 2.0]",
                       "run.steps=2")  # fmt: skip
    for row in out:
        assert set(row) >= {"reward_divisible_mean", "reward_env_mean", "reward_overlap_s"}
        want = 0.5 * row["reward_divisible_mean"] + 2.0 * row["reward_env_mean"]
        assert row["reward_mean"] == pytest.approx(want, abs=1e-6)
        assert row["reward_errors"] == 0
        # accuracy is the first reward's share >= 1, here the file's 0/1 reward
        assert row["accuracy"] == pytest.approx(row["reward_divisible_mean"], abs=1e-6)
    assert any(0 < r["reward_divisible_mean"] < 1 for r in out)


def test_env_reward_alone_matches_in_the_trainers_thread(tmp_path):
    """The pool and reward.workers=0 (in the trainer's thread) give the same run."""
    _, pooled = run_steps(tmp_path, "run.steps=2", name="a")
    _, inline = run_steps(tmp_path, "run.steps=2", "reward.workers=0", name="b")
    keys = ("reward_mean", "reward_std", "accuracy", "reward_env_mean", "logprob_delta_mean")
    assert [[r[k] for k in keys] for r in pooled] == [[r[k] for k in keys] for r in inline]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_failing_reward_is_one_line_and_the_run_resumes(tmp_path, fault):
    bad = json.dumps(["env", f"tests.rewards.faulty:{fault}"])
    sets = (f"reward.funcs={bad}", "reward.timeout_s=3", "run.eval_every=0")
    with pytest.raises(RewardError) as e:
        run_steps(tmp_path, *sets)
    msg = str(e.value)
    assert "\n" not in msg and WHAT[fault] in msg
    assert f"tests.rewards.faulty:{fault}" in msg and "prompt row 'train/" in msg
    assert "no checkpoint yet" in msg  # the first step failed: a resume starts from step 0
    run = tmp_path / "run"
    assert (run / "config.toml").is_file()
    assert not (run / "metrics.jsonl").exists() or not rows(run)
    # the user fixes the reward; the run resumes from its directory and completes
    from specrl.config import load_run_config

    fixed = load_run_config(run / "config.toml", ['reward.funcs=["env"]'])
    parts = tiny_parts(fixed)
    try:
        out = train(parts, str(run), resume=True, progress=False)
    finally:
        parts.close()
    assert [r["step"] for r in rows(run)] == [0, 1, 2, 3] == [r["step"] for r in out]


@pytest.mark.parametrize("fault", ["raises", "returns_nan", "kills_worker"])
def test_on_error_zero_counts_the_rows_and_goes_on(tmp_path, fault):
    bad = json.dumps([f"tests.rewards.faulty:{fault}", "env"])
    _, out = run_steps(tmp_path, f"reward.funcs={bad}", "reward.on_error=zero", "run.steps=2")
    assert [r["reward_errors"] for r in out] == [16, 16]  # 4 prompts x 4 completions
    assert all(r["reward_mean"] == 0.0 and r["accuracy"] == 0.0 for r in out)


def test_a_callable_that_cannot_reach_the_workers_is_refused_before_work():
    from specrl.envs.synthetic import IdCodec, ModFourEnv
    from specrl.pipelines.build import build_run
    from tests.conftest import make_tiny

    def local(prompts, completions, **kwargs):  # a closure: not picklable by name
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match="cannot be sent to the reward worker processes"):
        build_run(tiny_config(), model=make_tiny(0), codec=IdCodec(), env=ModFourEnv(),
                  rewards=[lambda p, c, **k: [0.0] * len(c)])  # fmt: skip
    parts = build_run(tiny_config("reward.workers=0", "run.steps=1"), model=make_tiny(0),
                      codec=IdCodec(), env=ModFourEnv(), rewards=[local])  # fmt: skip
    try:
        from specrl.pipelines.step import collect
        from tests.pipelines.pipeline_fakes import draw_prompts

        batch = collect(parts, draw_prompts(parts, 0), 0)
    finally:
        parts.close()
    assert batch.metrics["reward_local_mean"] == 1.0 and float(batch.rewards.mean()) == 1.0


def test_a_group_is_scored_while_the_rest_still_generates(tmp_path):
    """A backend with GROUP_DONE announces group 0, then keeps 'generating' until group 0's
    reward calls have finished in the workers: that reward time lies before generation's end
    (``reward_overlap_s`` > 0), and the scores equal scoring after the call."""
    import time

    from specrl.backends import GROUP_DONE
    from specrl.pipelines.step import collect
    from tests.pipelines.pipeline_fakes import FakeBackend, draw_prompts, fake_parts

    class Announcing(FakeBackend):
        features = frozenset({GROUP_DONE})

        def generate(self, requests, spec=None, on_done=None):
            out = super().generate(requests, spec)
            groups = [[c for c in out.completions if c.request_index == i]
                      for i in range(len(requests))]  # fmt: skip
            on_done(0, groups[0])
            scorer, deadline = on_done.__self__, time.monotonic() + 120
            while not all(p.done() for p in scorer.pending[0]) and time.monotonic() < deadline:
                time.sleep(0.01)  # the rest of the batch "generates" meanwhile
            for i in range(1, len(requests)):
                on_done(i, groups[i])
            return out

    cfg = tiny_config('reward.funcs=["env", "tests.rewards.faulty:sleeps_50ms"]',
                      "reward.weights=[1, 0]")  # fmt: skip
    batches = []
    for backend in (Announcing(), FakeBackend()):
        parts = fake_parts(cfg, backend)
        try:
            batches.append(collect(parts, draw_prompts(parts, 0), 0))
        finally:
            parts.close()
    streamed, after = batches
    assert streamed.metrics["reward_overlap_s"] > 0 and after.metrics["reward_overlap_s"] == 0
    assert torch.equal(streamed.rewards, after.rewards)
    assert streamed.metrics["reward_sleeps_50ms_mean"] == 1.0


def test_config_toml_names_every_callable_the_api_is_given(tmp_path):
    """A package function by module, a plain file's function by its absolute path (a resume
    finds it from any directory), anything else by a placeholder a resume refuses in one line
    (never a silent fallback to the default reward)."""
    from specrl.envs.synthetic import ModFourEnv
    from specrl.pipelines.api import reward_spec
    from specrl.pipelines.scoring import Rewards
    from specrl.rewards import resolve_reward
    from tests.rewards import faulty

    assert reward_spec(faulty.length_reward) == "tests.rewards.faulty:length_reward"
    path = tmp_path / "mine.py"
    path.write_text(textwrap.dedent(TRL_STYLE))
    loaded = resolve_reward(f"{path}:divisible")
    assert reward_spec(loaded) == f"{path.resolve()}:divisible"
    assert reward_spec(lambda prompts, completions, **k: []) == "python:lambda"
    cfg = tiny_config('reward.funcs=["python:lambda"]').reward
    with pytest.raises(RewardError, match="'python:lambda' was a Python callable .* pass it again"):
        Rewards.build(cfg, ModFourEnv())
