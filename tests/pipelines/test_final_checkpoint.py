"""``run.final_checkpoint = 'weights'``: the run's last checkpoint holds the policy without AdamW
state (a third of a float32 learner's checkpoint), verified like any checkpoint; it exports but
never continues a run: a resume takes the newest full checkpoint kept before it (saying so) or,
with none kept, is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specrl.fsutil import MANIFEST, tree_bytes
from specrl.pipelines.checkpoint import read_checkpoint
from specrl.pipelines.manifest import CheckpointDamaged, RunDirError
from specrl.pipelines.rundir import RunDir
from specrl.pipelines.train import train
from tests.pipelines.pipeline_fakes import tiny_config, tiny_parts

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = ("rollout.spec=suffix", "run.checkpoint_every=1", "run.eval_every=0",
            "run.keep_checkpoints=3", "learner.dtype=fp32")  # fmt: skip


def tiny_train(run: Path, *sets: str, resume: bool = False, say=None) -> None:
    parts = tiny_parts(tiny_config(*SETTINGS, *sets), num_train=2)
    try:
        train(parts, str(run), progress=False, resume=resume, echo=say)
    finally:
        parts.close()


def steps(run: Path) -> list[int]:
    return [r["step"] for r in RunDir(run).rows(RunDir(run).metrics)]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("final") / "full"
    tiny_train(run, "run.steps=2")
    return run


@pytest.fixture(scope="module")
def weights_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("final") / "weights"
    tiny_train(run, "run.steps=2", "run.final_checkpoint=weights")
    return run


def test_the_final_checkpoint_holds_the_same_policy_without_optimizer_state(full_run, weights_run):
    last, before = weights_run / "checkpoints/step_000002", weights_run / "checkpoints/step_000001"
    assert sorted(p.name for p in last.iterdir()) == sorted(
        ["policy.safetensors", "state.json", MANIFEST, "backend.json"]
    )
    assert "optimizer.safetensors" in {p.name for p in before.iterdir()}  # not the final one
    same = full_run / "checkpoints/step_000002/policy.safetensors"
    assert (last / "policy.safetensors").read_bytes() == same.read_bytes()
    data = read_checkpoint(last)
    assert data.weights_only and data.optimizer == {} and data.state["step"] == 2
    assert not read_checkpoint(full_run / "checkpoints/step_000002").weights_only
    # a float32 policy and two float32 AdamW moments: the weights are about a third
    ratio = tree_bytes(last) / tree_bytes(full_run / "checkpoints/step_000002")
    assert 0.3 < ratio < 0.37, ratio


def test_a_flag_flipped_in_state_json_is_damage(weights_run, tmp_path):
    import shutil

    ckpt = tmp_path / "step_000002"
    shutil.copytree(weights_run / "checkpoints/step_000002", ckpt)
    state = json.loads((ckpt / "state.json").read_text()) | {"weights_only": False}
    (ckpt / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointDamaged, match="does not list optimizer.safetensors"):
        read_checkpoint(ckpt)


def test_a_resume_goes_back_to_the_newest_full_checkpoint_saying_so(weights_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(weights_run, run)
    said: list[str] = []
    tiny_train(run, "run.steps=3", "run.final_checkpoint=weights", resume=True, say=said.append)
    assert any("step_000002 holds the policy without optimizer state" in line
               and "resuming from step_000001" in line for line in said), said  # fmt: skip
    assert steps(run) == [0, 1, 2]
    assert not read_checkpoint(run / "checkpoints/step_000002").weights_only  # rewritten whole
    assert read_checkpoint(run / "checkpoints/step_000003").weights_only


def test_with_no_full_checkpoint_kept_a_resume_is_one_line(tmp_path):
    run = tmp_path / "run"
    tiny_train(run, "run.steps=2", "run.final_checkpoint=weights", "run.keep_checkpoints=1")
    assert [p.name for p in RunDir(run).checkpoints_newest_first()] == ["step_000002"]
    with pytest.raises(RunDirError) as e:
        tiny_train(run, "run.steps=3", "run.final_checkpoint=weights",
                   "run.keep_checkpoints=1", resume=True)  # fmt: skip
    assert str(e.value) == (
        f"cannot resume {run}: step_000002 holds the policy without optimizer state "
        "(run.final_checkpoint='weights'): it cannot continue a run and no earlier checkpoint "
        "is kept (export it: specrl export)"
    )
    assert steps(run) == [0, 1]


def test_the_room_check_goes_by_the_largest_kept_checkpoint(weights_run, tmp_path, monkeypatch):
    """After a weights-only final checkpoint, a resume with more steps saves full checkpoints:
    the room check before its step goes by the full one kept, not the small newest one."""
    import shutil

    from specrl import fsutil

    run = tmp_path / "run"
    shutil.copytree(weights_run, run)
    full = tree_bytes(run / "checkpoints/step_000001")
    assert full > 2 * tree_bytes(run / "checkpoints/step_000002")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(fsutil.shutil, "disk_usage", lambda p: usage._replace(free=full - 1))
    with pytest.raises(RunDirError, match=r"cannot be saved: .*\(the size of step_000001\)"):
        tiny_train(run, "run.steps=3", resume=True)
    assert steps(run) == [0]  # resumed at step_000001 (its rows kept), refused before step 1
