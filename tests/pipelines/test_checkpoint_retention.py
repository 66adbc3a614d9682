"""Checkpoint retention (``run.keep_checkpoints``, ``RunDir.prune``): a 10-step run that
checkpoints every step keeps only the configured number, resumes from the newest, and falls back
past a damaged one to the one before it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specrl.pipelines.rundir import RunDir
from specrl.pipelines.train import train
from tests.pipelines.pipeline_fakes import tiny_config, tiny_parts

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = ("run.steps=12", "run.checkpoint_every=1", "run.keep_checkpoints=3",
            "run.eval_every=0", "rollout.max_new_tokens=6")  # fmt: skip


def parts(seed: int = 0):
    return tiny_parts(tiny_config(*SETTINGS), model_seed=seed, num_train=2)


def kept(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def steps(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ten_steps(tmp_path_factory) -> Path:
    """Ten of twelve steps, a checkpoint after each: only the newest three stay."""
    run = tmp_path_factory.mktemp("retention") / "run"
    train(parts(), str(run), progress=False, stop_after=10)
    return run


def resume(run: Path) -> tuple[list[int], list[str]]:
    """Resume to the end with another init; (steps it ran, console lines but step lines)."""
    said: list[str] = []
    rows = train(parts(seed=7), str(run), resume=True, progress=False, echo=said.append)
    return [r["step"] for r in rows], [s for s in said if not s.startswith("step ")]


def test_only_the_configured_number_of_checkpoints_is_kept(ten_steps):
    assert kept(ten_steps) == ["step_000008", "step_000009", "step_000010"]


def test_a_run_with_few_checkpoints_resumes_from_the_newest(ten_steps, tmp_path):
    run = Path(shutil.copytree(ten_steps, tmp_path / "run"))
    ran, said = resume(run)
    assert ran == [10, 11] and said == []
    assert steps(run) == list(range(12))
    assert kept(run) == ["step_000010", "step_000011", "step_000012"]


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(ten_steps, tmp_path):
    run = Path(shutil.copytree(ten_steps, tmp_path / "run"))
    (run / "checkpoints/step_000010/policy.safetensors").unlink()
    ran, said = resume(run)
    assert ran == [9, 10, 11]
    assert said == ["checkpoint step_000010 is damaged (policy.safetensors: missing); "
                    "resuming from step_000009"]  # fmt: skip
    assert kept(run) == ["step_000010", "step_000011", "step_000012"]  # step 10 written anew


def fake_checkpoints(tmp_path: Path, *names: str) -> RunDir:
    run = RunDir(tmp_path)
    for name in names:
        (run.checkpoints / name).mkdir(parents=True)
    return run


def test_prune_keeps_the_latest_and_leaves_newer_ones_alone(tmp_path):
    run = fake_checkpoints(tmp_path, "step_000001", "step_000002", "step_000003", "step_000009")
    removed = run.prune(run.checkpoint_dir(3), keep=2)
    assert [p.name for p in removed] == ["step_000001"]
    assert [p.name for p in run.checkpoints_newest_first()] == [
        "step_000009", "step_000003", "step_000002"]  # fmt: skip
    assert run.prune(run.checkpoint_dir(3), keep=1)[0].name == "step_000002"


def test_a_removal_cut_short_is_never_taken_back_for_a_checkpoint(tmp_path):
    run = fake_checkpoints(tmp_path, "step_000001.del", "step_000002")
    assert run.recover_interrupted() == []
    run.clear_interrupted()
    assert kept(tmp_path) == ["step_000002"]
