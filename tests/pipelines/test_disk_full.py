"""A full disk anywhere a run writes is one line naming the path, and nothing half-made is left.

Each case runs on a real small tmpfs where this process can mount one (root with CAP_SYS_ADMIN),
and with a writer patched to fail as a full disk does (an ``OSError(ENOSPC)``, or safetensors'
own error carrying ``os error 28``) everywhere. Cases: writing config.toml (no run directory
left), saving a checkpoint (its ``.tmp`` removed, one line with what it needed), the room check
before a step that ends with a checkpoint (refused before the step's work), and
``specrl export`` (checked against the weights' size before a byte is written; nothing left).
"""

from __future__ import annotations

import errno
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from specrl.cli import app
from specrl.fsutil import tree_bytes
from specrl.pipelines.build import build_run
from specrl.pipelines.manifest import RunDirError
from specrl.pipelines.rundir import RunDir
from specrl.pipelines.train import train
from tests.pipelines.pipeline_fakes import IdCodec, ModFourEnv
from tests.pipelines.test_export_model import model_dir, run_config

ENOSPC_TEXT = "Error while serializing: I/O error: No space left on device (os error 28)"


def mounted_tmpfs(where: Path, size: int) -> Path | None:
    """A tmpfs of ``size`` bytes mounted at ``where``, or ``None`` where this process cannot
    mount one."""
    where.mkdir(parents=True, exist_ok=True)
    mount = shutil.which("mount")
    if mount is None:
        return None
    done = subprocess.run([mount, "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True)  # fmt: skip
    return where if done.returncode == 0 else None


@pytest.fixture
def small_disk(tmp_path) -> Iterator:
    """``small_disk(size)``: a mounted tmpfs of ``size`` bytes (skips the test where none can
    be mounted); unmounted after the test."""
    mounted: list[Path] = []

    def make(size: int) -> Path:
        where = mounted_tmpfs(tmp_path / f"disk-{uuid.uuid4().hex[:6]}", size)
        if where is None:
            pytest.skip("cannot mount a tmpfs here (the patched-writer cases still run)")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return model_dir(tmp_path_factory.mktemp("disk") / "model")


def one_line(result) -> str:
    """The one stderr line of a command that failed with exit code 2."""
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: "), lines
    return lines[0]


def cli_train(model: Path, run: Path, *sets: str):
    args = [a for s in ("run.steps=1", "run.eval_every=0", *sets) for a in ("--set", s)]
    head = ["train", "--run-dir", str(run), "--no-progress", "--no-compare"]
    return CliRunner().invoke(app, [*head, "--set", f"model.name={model}", *args])


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def safetensors_enospc(*args, **kwargs):
    raise RuntimeError(ENOSPC_TEXT)  # what safetensors raises is no OSError


# --------------------------------------------------------------------------- config.toml


def test_full_disk_at_config_is_one_line_and_leaves_no_run_dir_patched(model, tmp_path,
                                                                       monkeypatch):  # fmt: skip
    from specrl import fsutil

    real = fsutil.atomic_writer

    def full(path, mode=0o644):
        if Path(path).name == "config.toml":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, mode)

    monkeypatch.setattr(fsutil, "atomic_writer", full)
    run = tmp_path / "run"
    line = one_line(cli_train(model, run))
    assert line == f"error: no space left on device: {run / 'config.toml'}"
    assert not run.exists()  # no empty run directory left behind


def test_full_disk_at_config_on_a_tmpfs(model, small_disk):
    disk = small_disk(4096)  # one page: the lock file takes it, config.toml finds none
    line = one_line(cli_train(model, disk / "run"))
    assert line.startswith("error: no space left on device: ") and "config.toml" in line, line
    assert not (disk / "run").exists()


# --------------------------------------------------------------------------- checkpoints


def tiny_run(model: Path, run: Path, *sets: str) -> None:
    torch.manual_seed(0)
    parts = build_run(run_config(model, "run.steps=1", *sets), codec=IdCodec(), env=ModFourEnv())
    try:
        train(parts, str(run), progress=False, resume=RunDir(run).holds_work())
    finally:
        parts.close()


def steps(run: Path) -> list[int]:
    return [r["step"] for r in RunDir(run).rows(RunDir(run).metrics)]


@pytest.mark.parametrize("raise_", [enospc, safetensors_enospc], ids=["oserror", "safetensors"])
def test_full_disk_in_a_checkpoint_save_is_one_line_and_keeps_the_run(
    model, tmp_path, monkeypatch, raise_
):
    from specrl.pipelines import checkpoint

    run = tmp_path / "run"
    tiny_run(model, run, "run.steps=1")
    monkeypatch.setattr(checkpoint, "save_file", raise_)
    with pytest.raises(RunDirError) as e:
        tiny_run(model, run, "run.steps=2")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"cannot save checkpoint {run}/checkpoints/step_000002: "
                              "no space left on device: ")  # fmt: skip
    assert "(the last one, step_000001, took " in message and "specrl train --resume" in message
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]  # no .tmp
    assert steps(run) == [0, 1]  # the step is logged; resume redoes it from step_000001
    monkeypatch.undo()
    tiny_run(model, run, "run.steps=2")
    assert steps(run) == [0, 1]
    assert (run / "checkpoints/step_000002/manifest.json").is_file()


def test_a_step_whose_checkpoint_cannot_fit_is_refused_before_its_work(model, tmp_path,
                                                                       monkeypatch):  # fmt: skip
    from specrl import fsutil

    run = tmp_path / "run"
    tiny_run(model, run)
    size = tree_bytes(run / "checkpoints/step_000001")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(fsutil.shutil, "disk_usage",
                        lambda p: usage._replace(free=size - 1))  # fmt: skip
    with pytest.raises(RunDirError) as e:
        tiny_run(model, run, "run.steps=2")
    assert str(e.value).startswith("the checkpoint after step 2 cannot be saved: not enough "
                                   f"space for {run}/checkpoints: needs ~")  # fmt: skip
    assert "(the size of step_000001)" in str(e.value)
    assert steps(run) == [0]  # refused before the step's work: nothing rolled out or logged


def test_checkpoint_room_on_a_tmpfs(model, tmp_path, small_disk):
    """A real disk that holds one checkpoint and the logs but not a second: the first run
    succeeds, the next step is refused before its work, and the refused run loses nothing."""
    probe = tmp_path / "probe"
    tiny_run(model, probe)
    size = tree_bytes(probe)
    disk = small_disk(size + size // 2 + (64 << 10))
    run = disk / "run"
    tiny_run(model, run)
    with pytest.raises(RunDirError, match="the checkpoint after step 2 cannot be saved"):
        tiny_run(model, run, "run.steps=2", "run.keep_checkpoints=2")
    assert steps(run) == [0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]


# --------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def trained(model, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("disk") / "run"
    tiny_run(model, run)
    return run


def test_export_on_a_full_disk_is_refused_before_writing(trained, tmp_path, monkeypatch):
    from specrl import fsutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(fsutil.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    out = tmp_path / "hf"
    line = one_line(CliRunner().invoke(app, ["export", str(trained), str(out)]))
    assert line.startswith(f"error: not enough space for {out}: needs ~"), line
    assert line.endswith(", 1.0 KB free")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_export_when_the_disk_fills_while_writing(trained, tmp_path, monkeypatch):
    monkeypatch.setattr("safetensors.torch.save_file", safetensors_enospc)
    out = tmp_path / "hf"
    line = one_line(CliRunner().invoke(app, ["export", str(trained), str(out)]))
    assert "No space left on device" in line and "model.safetensors" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no OUT, no staged .tmp


def test_export_on_a_tmpfs_too_small(trained, small_disk):
    disk = small_disk(64 << 10)
    out = disk / "hf"
    line = one_line(CliRunner().invoke(app, ["export", str(trained), str(out)]))
    assert line.startswith(f"error: not enough space for {out}: needs ~"), line
    assert list(disk.iterdir()) == []


def test_disk_problem_lines():
    from specrl.fsutil import disk_problem, naming

    assert disk_problem(OSError(errno.EROFS, "x", "/a")) == "read-only file system: /a"
    assert disk_problem(OSError(errno.EDQUOT, "x", "/a")) == "disk quota exceeded: /a"
    assert disk_problem(OSError(errno.EACCES, "x", "/a")) == "permission denied: /a"
    assert disk_problem(OSError(errno.ENOENT, "x", "/a")) is None
    assert disk_problem(ValueError("x")) is None
    with pytest.raises(OSError) as e, naming("/p/f"):
        raise RuntimeError(ENOSPC_TEXT)
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, "/p/f")
    with pytest.raises(RuntimeError), naming("/p/f"):
        raise RuntimeError("not an os error")
    assert disk_problem(OSError(errno.ENOSPC, "x")) == "no space left on device"  # no path
