"""Checkpoints that survive interruption and damage, signals that stop a run cleanly, and run
directories that fail in one line.

- A save writes a manifest (size + sha256 of every file) last, fsyncs files and directories, and
  renames; leftovers of an interrupted save (``.tmp``, ``.old``) never block a resume, and a
  replace cut between its two renames loses nothing: resume takes the complete new copy, else
  the old one. A save that fails while writing leaves no ``.tmp``. A stop reuses a complete
  checkpoint of its step and rewrites a damaged one.
- Resume verifies every file it reads: a damaged newest checkpoint is skipped with one line and
  the run continues from the newest one that verifies, to exactly the uninterrupted result;
  none verifying is one ``RunDirError`` line. A checkpoint with the format marker needs its
  manifest; older ones (no marker, no manifest) are read by parsing alone, damage still caught.
- SIGINT/SIGTERM in the sync and async loops: the step in progress is finished and checkpointed,
  ``Stopped`` carries what the CLI prints, and the run resumes exactly. A signal during the last
  step or the speed check (cut short) ends a completed run: final eval and summary written, the
  speed check skipped, exit code 128 + N.
- ``specrl train --run-dir`` / ``specrl report --out`` on a file or under one, and ``--resume``
  of a run whose metrics log has a garbage line: one ``error:`` line before any work.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from specrl import fsutil
from specrl.fsutil import MANIFEST, file_digest
from specrl.pipelines import checkpoint as ckpt_mod
from specrl.pipelines import manifest as manifest_mod
from specrl.pipelines import train as train_mod
from specrl.pipelines.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from specrl.pipelines.cli import register
from specrl.pipelines.loop import TIMING_KEYS, stop_checkpoint
from specrl.pipelines.manifest import RunDirError, is_complete
from specrl.pipelines.rundir import RunDir
from specrl.pipelines.signals import Stopped, stop_on_signals
from specrl.pipelines.state import StepState
from specrl.pipelines.train import run_training, train
from tests.pipelines.pipeline_fakes import SPECULATING, TINY_OVERRIDES, tiny_config, tiny_parts

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = ("rollout.spec=suffix", "run.steps=4", "run.checkpoint_every=1", "run.eval_every=2",
            "rollout.temperature=0.7", "rollout.max_new_tokens=12",
            "run.keep_checkpoints=4")  # all kept (retention has its own tests) # fmt: skip


def parts(*overrides: str, seed: int = 0):
    return tiny_parts(tiny_config(*SETTINGS, *overrides), model_seed=seed, num_train=2)


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def untimed(rs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rs]


def assert_same_run(run: Path, reference: Path) -> None:
    assert untimed(rows(run / "metrics.jsonl")) == untimed(rows(reference / "metrics.jsonl"))
    assert untimed(rows(run / "eval.jsonl")) == untimed(rows(reference / "eval.jsonl"))
    last = "checkpoints/step_000004/policy.safetensors"
    assert (run / last).read_bytes() == (reference / last).read_bytes()


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    """Four uninterrupted steps."""
    run = tmp_path_factory.mktemp("full") / "run"
    train(parts(), str(run), progress=False)
    return run


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> Path:
    """The same run stopped after 3 updates: checkpoints step_000001 .. step_000003."""
    run = tmp_path_factory.mktemp("interrupted") / "run"
    train(parts(), str(run), progress=False, stop_after=3)
    return run


@pytest.fixture
def run(interrupted, tmp_path) -> Path:
    """A copy of the interrupted run to damage."""
    return Path(shutil.copytree(interrupted, tmp_path / "run"))


def resume(run: Path, seed: int = 7) -> list[str]:
    """Resume ``run`` to the end, by default with a different init (everything must come from
    disk); the console lines it printed other than step and eval lines."""
    said: list[str] = []
    train(parts(seed=seed), str(run), resume=True, progress=False, echo=said.append)
    return [line for line in said if not line.startswith(("step ", "eval "))]


# --------------------------------------------------------------------------- saving


def test_save_writes_a_manifest_last_and_fsyncs_before_and_after_the_rename(tmp_path, monkeypatch):
    p = parts()
    ckpt, synced = tmp_path / "checkpoints" / "step_000001", []
    real = manifest_mod.fsync_path

    def record(path: Path) -> None:
        synced.append((path, (path.parent / MANIFEST).exists(), ckpt.exists()))
        real(path)

    monkeypatch.setattr(manifest_mod, "fsync_path", record)
    monkeypatch.setattr(fsutil, "fsync_path", record)  # the manifest writer and directory swap
    model, opt = p.learner.model, p.learner.optimizer
    save_checkpoint(ckpt, model, opt, {"step": 1, "policy_version": 1}, {"x": 1})
    tmp = ckpt.with_name("step_000001.tmp")
    files = ["policy.safetensors", "optimizer.safetensors", "optimizer.json", "state.json",
             "backend.json"]  # fmt: skip
    # every file fsynced before the manifest exists, then the temp dir, then (after the
    # rename) the checkpoints directory
    assert synced == [(tmp / f, False, False) for f in files] + [
        (tmp, False, False),
        (ckpt.parent, False, True),
    ]
    manifest = json.loads((ckpt / MANIFEST).read_text())["files"]
    assert manifest == {f: file_digest(ckpt / f) for f in files}
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["step_000001"]
    read_checkpoint(ckpt)  # verifies


def replace_cut_between_renames(run: Path, monkeypatch) -> Path:
    """Save step 3 again over the existing step_000003 (same weights, optimizer, state and
    backend state, read back from it) and die between the two renames, as a kill there would:
    no step_000003, its old copy in ``.old`` and the new complete one in ``.tmp``."""
    p, target = parts(), run / "checkpoints" / "step_000003"
    state, backend_state = load_checkpoint(target, p.learner.model, p.learner.optimizer)
    real_rename, calls = Path.rename, []

    def dying_rename(self: Path, to: Path) -> Path:
        calls.append(self.name)
        if len(calls) == 2:  # step_000003.tmp -> step_000003
            raise OSError("killed")
        return real_rename(self, to)

    monkeypatch.setattr(Path, "rename", dying_rename)
    with pytest.raises(OSError, match="killed"):
        save_checkpoint(target, p.learner.model, p.learner.optimizer, state, backend_state)
    monkeypatch.undo()
    names = sorted(x.name for x in target.parent.iterdir())
    assert names == ["step_000001", "step_000002", "step_000003.old", "step_000003.tmp"]
    assert RunDir(run).latest_checkpoint() == target.with_name("step_000002")
    return target


def inode(path: Path) -> int:
    return (path / "policy.safetensors").stat().st_ino


def resumed_steps(run: Path) -> list[int]:
    """Resume ``run`` to the end (with a different init); the steps this call ran."""
    said: list[str] = []
    ran = train(parts(seed=7), str(run), resume=True, progress=False, echo=said.append)
    assert [line for line in said if not line.startswith(("step ", "eval "))] == []
    return [r["step"] for r in ran]


def test_a_replace_cut_between_its_renames_resumes_from_the_new_copy(run, full, monkeypatch):
    target = replace_cut_between_renames(run, monkeypatch)
    new_copy = inode(target.with_name("step_000003.tmp"))
    assert resumed_steps(run) == [3]  # from step_000003: nothing lost, nothing said
    assert inode(target) == new_copy
    assert_same_run(run, full)
    assert sorted(x.name for x in target.parent.iterdir()) == [
        f"step_00000{i}" for i in (1, 2, 3, 4)
    ]


def test_a_replace_cut_between_its_renames_falls_back_to_the_old_copy(run, full, monkeypatch):
    target = replace_cut_between_renames(run, monkeypatch)
    flip_a_byte(target.with_name("step_000003.tmp") / "optimizer.safetensors")
    old_copy = inode(target.with_name("step_000003.old"))
    assert resumed_steps(run) == [3]
    assert inode(target) == old_copy
    assert_same_run(run, full)
    assert not [x for x in target.parent.iterdir() if not x.name[5:].isdigit()]


def test_recovery_never_replaces_a_committed_checkpoint(run):
    ckpts = RunDir(run).checkpoints
    shutil.copytree(ckpts / "step_000002", ckpts / "step_000003.tmp")
    committed = inode(ckpts / "step_000003")
    assert RunDir(run).recover_interrupted() == []
    assert inode(ckpts / "step_000003") == committed


def test_a_save_that_fails_while_writing_leaves_no_tmp_dir(run, monkeypatch):
    p, target = parts(), run / "checkpoints" / "step_000003"
    before = {f.name: f.read_bytes() for f in target.iterdir()}

    def full_disk(*args, **kwargs) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_mod, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(target, p.learner.model, p.learner.optimizer, {"step": 3})
    assert sorted(x.name for x in target.parent.iterdir()) == [f"step_00000{i}" for i in (1, 2, 3)]
    assert {f.name: f.read_bytes() for f in target.iterdir()} == before


def test_a_stop_reuses_a_complete_checkpoint_and_rewrites_a_damaged_one(run):
    p, rd = parts("run.checkpoint_every=100"), RunDir(run)
    ckpt = rd.checkpoint_dir(3)
    kept = inode(ckpt)
    assert stop_checkpoint(p, StepState(3), rd) == ckpt and inode(ckpt) == kept
    flip_a_byte(ckpt / "state.json")
    assert not is_complete(ckpt)
    assert stop_checkpoint(p, StepState(3), rd) == ckpt and is_complete(ckpt)
    assert inode(ckpt) != kept


def test_a_leftover_tmp_dir_of_an_interrupted_save_is_ignored(run, full):
    ckpts = run / "checkpoints"
    half = ckpts / "step_000004.tmp"
    shutil.copytree(ckpts / "step_000003", half)
    (half / MANIFEST).unlink()
    (half / "state.json").write_text('{"step": 4')
    stray = run / ".metrics.jsonl.k1ll3d.tmp"  # an atomic rewrite's temporary, killed
    stray.write_text("{}")
    assert RunDir(run).latest_checkpoint() == ckpts / "step_000003"
    assert resume(run) == []
    assert_same_run(run, full)
    assert not half.exists() and not stray.exists()


# --------------------------------------------------------------------------- damage


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor / before the closing brace: still parses
    path.write_bytes(bytes(data))


def garbage(path: Path) -> None:
    path.write_bytes(b"{not json")


DAMAGE = [
    ("policy.safetensors", truncate, "policy.safetensors: {size} bytes, the manifest says"),
    ("policy.safetensors", flip_a_byte, "policy.safetensors: sha256 mismatch"),
    ("state.json", truncate, "state.json: {size} bytes, the manifest says"),
    ("optimizer.json", garbage, "optimizer.json: 9 bytes, the manifest says"),
    ("optimizer.safetensors", Path.unlink, "optimizer.safetensors: missing"),
    ("backend.json", Path.unlink, "backend.json: missing"),
    ("manifest.json", garbage, "manifest.json: unreadable"),
    ("manifest.json", Path.unlink, "manifest.json: missing"),
]


@pytest.mark.parametrize(("name", "damage", "reason"), DAMAGE,
                         ids=[f"{n}-{d.__name__}" for n, d, _ in DAMAGE])  # fmt: skip
def test_a_damaged_checkpoint_is_skipped_with_one_line(run, full, name, damage, reason):
    path = run / "checkpoints" / "step_000003" / name
    damage(path)
    size = path.stat().st_size if path.exists() else 0
    said = resume(run)
    expected = f"checkpoint step_000003 is damaged ({reason.format(size=size)}"
    assert len(said) == 1 and said[0].startswith(expected), said
    assert said[0].endswith("); resuming from step_000002")
    assert_same_run(run, full)  # steps 2 and 3 were run again


def test_a_deleted_manifest_does_not_switch_off_the_hash_checks(run, full):
    ckpt = run / "checkpoints" / "step_000003"
    assert json.loads((ckpt / "state.json").read_text())["format"] == 2
    (ckpt / MANIFEST).unlink()
    flip_a_byte(ckpt / "policy.safetensors")  # still parses: only its hash tells
    assert resume(run) == [
        "checkpoint step_000003 is damaged (manifest.json: missing); resuming from step_000002"
    ]
    assert_same_run(run, full)


def test_several_damaged_checkpoints_are_named_in_one_line(run, full):
    truncate(run / "checkpoints/step_000003/state.json")
    (run / "checkpoints/step_000002/policy.safetensors").unlink()
    said = resume(run)
    assert len(said) == 1 and said[0].startswith("checkpoints step_000003 (state.json: ")
    assert said[0].endswith(
        "), step_000002 (policy.safetensors: missing) are damaged; resuming from step_000001"
    )
    assert_same_run(run, full)


def test_no_checkpoint_verifies_is_one_line(run):
    for ckpt in RunDir(run).checkpoints_newest_first():
        flip_a_byte(ckpt / "policy.safetensors")
    with pytest.raises(RunDirError) as e:
        resume(run)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"cannot resume {run}: no checkpoint ")
    for step in (3, 2, 1):
        assert f"step_00000{step} (policy.safetensors: sha256 mismatch)" in message


def test_a_run_killed_before_its_first_checkpoint_resumes_from_the_start(run, full):
    shutil.rmtree(run / "checkpoints")
    said = resume(run, seed=0)  # the initial weights come from the model, as in a fresh run
    assert said == [f"{run} holds no checkpoint yet: starting from step 0"]
    assert_same_run(run, full)


@pytest.fixture
def legacy(run) -> Path:
    """The interrupted run as an older specrl wrote it: no manifests, no format marker."""
    for ckpt in RunDir(run).checkpoints_newest_first():
        (ckpt / MANIFEST).unlink()
        state = json.loads((ckpt / "state.json").read_text())
        del state["format"]
        (ckpt / "state.json").write_text(json.dumps(state))
    return run


def test_a_checkpoint_without_manifest_still_resumes(legacy, full):
    assert resume(legacy) == []
    assert_same_run(legacy, full)


LEGACY_DAMAGE = [
    ("policy.safetensors", truncate, "policy.safetensors: SafetensorError: "),
    ("state.json", truncate, "state.json: JSONDecodeError: "),
    ("optimizer.json", garbage, "optimizer.json: JSONDecodeError: "),
    ("optimizer.json", lambda p: p.write_text("[]"), "optimizer.json: TypeError: "),
    ("optimizer.safetensors", Path.unlink, "optimizer.safetensors: missing"),
]


@pytest.mark.parametrize(("name", "damage", "reason"), LEGACY_DAMAGE,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(LEGACY_DAMAGE)])  # fmt: skip
def test_damage_in_a_checkpoint_without_manifest_is_caught_by_parsing(
    legacy, full, name, damage, reason
):
    damage(legacy / "checkpoints" / "step_000003" / name)
    said = resume(legacy)
    assert len(said) == 1 and said[0].startswith(f"checkpoint step_000003 is damaged ({reason}")
    assert "\n" not in said[0] and said[0].endswith("); resuming from step_000002")
    assert_same_run(legacy, full)


# --------------------------------------------------------------------------- logs


def test_a_metrics_line_cut_mid_write_is_dropped(run, full):
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward_me')
    assert resume(run) == []
    assert_same_run(run, full)


@pytest.mark.parametrize("bad", [b"garbage", b"\xff\xfe\x00", b"[1, 2]", b'{"no_step": 1}'])
def test_a_garbage_metrics_line_names_file_and_line(run, bad):
    lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (run / "metrics.jsonl").write_bytes(lines[0] + bad + b"\n" + b"".join(lines[1:]))
    with pytest.raises(RunDirError, match=r"metrics.jsonl: line 2 is not a JSON row"):
        resume(run)


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer(no_args_is_help=True, rich_markup_mode=None)
    register(app)
    return app


def one_error_line(result) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_resume_with_a_garbage_metrics_line_fails_before_loading_the_model(app, run):
    with (run / "metrics.jsonl").open("ab") as f:
        f.write(b"garbage\n" + b'{"step": 9}\n')
    # the run's config names the default model: the error comes before it would be loaded
    line = one_error_line(CliRunner().invoke(app, ["train", "--resume", str(run)]))
    assert line == f"error: {run / 'metrics.jsonl'}: line 4 is not a JSON row with a 'step'"


# --------------------------------------------------------------------------- run dirs


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("file", "error: run dir {file} is not a directory"),
        ("file/sub", "error: run dir {file}/sub cannot be created: {file} is a file"),
    ],
)
def test_a_run_dir_that_cannot_be_written_fails_before_work(app, tmp_path, where, message):
    file = tmp_path / "file"
    file.write_text("not a directory")
    target = tmp_path / where
    line = one_error_line(CliRunner().invoke(app, ["train", "--run-dir", str(target)]))
    assert line == message.format(file=file)
    assert file.read_text() == "not a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_run_dir_in_a_read_only_parent_fails_before_work(app, tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o555)
    line = one_error_line(CliRunner().invoke(app, ["train", "--run-dir", str(parent / "run")]))
    assert line == f"error: run dir {parent / 'run'}: no permission to write in {parent}"


@pytest.mark.parametrize("where", ["file", "file/sub"])
def test_report_out_that_cannot_be_written_is_one_line(app, full, tmp_path, where):
    (tmp_path / "file").write_text("")
    out = tmp_path / where
    line = one_error_line(CliRunner().invoke(app, ["report", str(full), "--out", str(out)]))
    assert line.startswith(f"error: --out {out} ")


# --------------------------------------------------------------------------- signals


def signal_at_step(step: int, sig: int):
    """An echo that sends ``sig`` to this process when the row of ``step`` is printed."""

    def echo(line: str) -> None:
        if line.startswith(f"step {step:3d} "):
            os.kill(os.getpid(), sig)

    return echo


STOP_MODES = [
    ("sync", signal.SIGINT, ()),
    ("async-0", signal.SIGTERM, ("pipeline.mode=async", "pipeline.max_staleness=0")),
]


@pytest.mark.parametrize(("mode", "sig", "extra"), STOP_MODES, ids=[m for m, _, _ in STOP_MODES])
def test_a_signal_checkpoints_the_step_in_progress_and_resumes_exactly(
    full, tmp_path, mode, sig, extra
):
    run, overrides = tmp_path / "run", (*extra, "run.checkpoint_every=100")
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(Stopped) as e:
        train(parts(*overrides), str(run), progress=False, echo=signal_at_step(1, sig))
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored
    stopped = e.value
    assert (stopped.exit_code, stopped.updates) == (128 + sig, 2)
    assert stopped.checkpoint == run / "checkpoints" / "step_000002"
    assert str(stopped) == (f"stopped by {signal.Signals(sig).name} after 2 steps; "
                            f"checkpoint saved: {stopped.checkpoint}")  # fmt: skip
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]
    assert [r["step"] for r in rows(run / "metrics.jsonl")] == [0, 1]
    assert not [t for t in threading.enumerate() if t.name == "specrl-producer"]
    train(parts(*extra, seed=7), str(run), resume=True, progress=False)
    assert_same_run(run, full)


def test_a_signal_stops_an_async_run_with_an_engine_worker(tmp_path):
    run = tmp_path / "run"
    overrides = ("pipeline.mode=async", "pipeline.max_staleness=1", "rollout.placement=process",
                 "run.checkpoint_every=100", "run.steps=6")  # fmt: skip
    p = parts(*overrides)
    try:
        with pytest.raises(Stopped) as e:
            train(p, str(run), progress=False, echo=signal_at_step(2, signal.SIGINT))
        assert e.value.updates == 3 and e.value.checkpoint.is_dir()
        assert not [t for t in threading.enumerate() if t.name == "specrl-producer"]
    finally:
        p.backend.close()
    assert not Path(f"/proc/{p.backend.pid}").exists()  # the worker exited and was reaped
    p = parts(*overrides, seed=7)
    try:
        train(p, str(run), resume=True, progress=False)
    finally:
        p.backend.close()
    assert [r["step"] for r in rows(run / "metrics.jsonl")] == list(range(6))


def test_a_stopped_run_training_writes_no_summary(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(Stopped) as e:
        run_training(parts(), str(run), progress=False, echo=signal_at_step(0, signal.SIGINT))
    assert e.value.updates == 1 and not (run / "summary.json").exists()


def summary_file(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_a_signal_in_the_last_step_completes_the_run_and_skips_the_speed_check(full, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(Stopped) as e:
        run_training(parts(), str(run), progress=False, echo=signal_at_step(3, signal.SIGINT))
    stopped = e.value
    assert (stopped.complete, stopped.exit_code, stopped.updates) == (True, 130, 4)
    assert str(stopped) == (
        "stopped by SIGINT after the run completed all 4 steps (the speed check was skipped); "
        f"summary written: {run / 'summary.json'}"
    )
    assert_same_run(run, full)  # every step, its checkpoint and the final eval
    assert summary_file(run) == {"summary": stopped.summary, "speed": None}


def slow_speed_check(finished: list[int]):
    """A ``measure_speedup`` that gets Ctrl-C at its start and would take a minute."""

    def measure(parts, step: int) -> dict:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)
        finished.append(step)
        return {}

    return measure


def test_a_signal_during_the_speed_check_cuts_it_short(full, tmp_path, monkeypatch):
    finished: list[int] = []
    monkeypatch.setattr(train_mod, "measure_speedup", slow_speed_check(finished))
    run = tmp_path / "run"
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(Stopped) as e:
        run_training(parts(), str(run), progress=False)
    assert {s: signal.getsignal(s) for s in before} == before
    assert finished == []  # interrupted, not waited for
    assert (e.value.complete, e.value.skipped, e.value.exit_code) == (True, "the speed check", 130)
    assert summary_file(run)["speed"] is None
    assert_same_run(run, full)


def test_train_alone_reports_a_signal_in_the_last_step_as_complete(full, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(Stopped) as e:
        train(parts(), str(run), progress=False, echo=signal_at_step(3, signal.SIGTERM))
    assert (e.value.complete, e.value.exit_code, e.value.summary) == (True, 143, None)
    assert str(e.value) == "stopped by SIGTERM after the run completed all 4 steps"
    assert_same_run(run, full)


def test_the_cli_ends_a_completed_run_with_its_summary_and_one_line(app, full, tmp_path,
                                                                    monkeypatch):  # fmt: skip
    from specrl.pipelines import build

    monkeypatch.setattr(build, "build_run", lambda cfg: tiny_parts(cfg, num_train=2))
    monkeypatch.setattr(train_mod, "measure_speedup", slow_speed_check([]))
    run = tmp_path / "run"
    sets = [a for s in (*TINY_OVERRIDES, *SPECULATING, *SETTINGS) for a in ("--set", s)]
    result = CliRunner().invoke(app, ["train", "--run-dir", str(run), "--no-progress", *sets])
    assert result.exit_code == 130, result.output
    err = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert err[-1] == (
        "stopped by SIGINT after the run completed all 4 steps (the speed check was skipped); "
        f"summary written: {run / 'summary.json'}"
    )
    assert "resume" not in result.stderr and "Traceback" not in result.output
    assert any(ln.startswith("reward: ") for ln in result.stdout.splitlines())  # the summary
    assert_same_run(run, full)


def test_signal_handlers_are_only_installed_in_the_main_thread():
    seen = []

    def body() -> None:
        with stop_on_signals() as stop:
            seen.append((signal.getsignal(signal.SIGINT), stop.requested))

    before = signal.getsignal(signal.SIGINT)
    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert seen == [(before, False)]
