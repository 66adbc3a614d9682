"""A model this user may not read is one line naming the path and "permission denied", exit 2:
a directory (``generate --model D``, ``train --set model.name=D``: a ~50-line PermissionError
before) and a weights file (called "corrupt ... No such file" before, though it exists).

chmod denies nothing to root, so each case runs twice: with real modes where modes deny (a
non-root user; as root, ``test_the_real_mode_cases_as_root_without_dac_override`` reruns them in
a child process without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, where modes bind root too), and
everywhere with ``pathlib`` patched to deny what those modes would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specrl.cli import app
from specrl.models import checkpoints as ck
from tests.models.test_model_load_errors import one_error_line, save_model_dir


def modes_deny() -> bool:
    """Whether file modes bind this process (not root, or root without the DAC capabilities)."""
    with tempfile.TemporaryDirectory() as tmp:
        locked = Path(tmp) / "locked"
        locked.write_text("x")
        locked.chmod(0)
        try:
            locked.read_text()
        except PermissionError:
            return True
        return False


NOT_ROOT = pytest.mark.skipif(not modes_deny(), reason="chmod denies nothing to root")
DROP_DAC = ["--bounding-set", "-dac_override,-dac_read_search",
            "--inh-caps", "-dac_override,-dac_read_search"]  # fmt: skip


@pytest.mark.skipif(modes_deny(), reason="the real-mode cases run in this process")
def test_the_real_mode_cases_as_root_without_dac_override(tmp_path):
    """Root: the real-mode cases in a child without the capabilities that let root ignore
    modes (the rest of the child's rights are root's: it reads the interpreter and the tree)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("no setpriv to drop CAP_DAC_OVERRIDE (the patched cases still run)")
    root = Path(__file__).resolve().parents[2]
    cmd = [setpriv, *DROP_DAC, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-p", "no:randomly", "--basetemp", str(tmp_path / "bt"), "-k", "not patched and not "
           "without_dac", str(Path(__file__).relative_to(root))]  # fmt: skip
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600,
                          env=os.environ | {"PYTHONPATH": str(root)})  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary, summary


def deny_under(monkeypatch, locked: Path) -> None:
    """Act as if ``locked`` had mode 000: its entries cannot be looked up, opened or listed."""
    real_stat, real_open, real_iterdir = Path.stat, Path.open, Path.iterdir

    def check(path: Path) -> None:
        if locked in Path(path).parents:
            raise PermissionError(13, "Permission denied", str(path))

    def stat(self, *, follow_symlinks=True):
        check(self)
        return real_stat(self, follow_symlinks=follow_symlinks)

    def open_(self, *args, **kwargs):
        check(self)
        return real_open(self, *args, **kwargs)

    def iterdir(self):
        check(self / "x")
        return real_iterdir(self)

    monkeypatch.setattr(Path, "stat", stat)
    monkeypatch.setattr(Path, "open", open_)
    monkeypatch.setattr(Path, "iterdir", iterdir)


def deny_file(monkeypatch, locked: Path) -> None:
    """Act as if the file ``locked`` had mode 000 (it can still be looked up)."""
    real_open = Path.open

    def open_(self, *args, **kwargs):
        if self == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)


@pytest.fixture
def model_dir(tmp_path):
    d = save_model_dir(tmp_path / "model")
    yield d
    d.chmod(0o755)  # pytest removes it afterwards
    for f in d.iterdir():
        f.chmod(0o644)


def generate(model: Path):
    return CliRunner().invoke(app, ["generate", "--no-chat-template", "--model", str(model), "w1"])


def train(model: Path, run_dir: Path):
    args = ["train", "--set", f"model.name={model}", "--run-dir", str(run_dir), "--no-compare"]
    return CliRunner().invoke(app, [*args, "--no-progress"])


def check_directory_denied(model_dir: Path, tmp_path: Path) -> None:
    want = f"error: cannot read model directory {model_dir}: permission denied"
    assert one_error_line(generate(model_dir)) == want
    assert one_error_line(train(model_dir, tmp_path / "run")) == want
    with pytest.raises(ck.CheckpointError, match="permission denied"):
        ck.load_model(model_dir)


def check_weights_denied(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    assert one_error_line(generate(model_dir)) == f"error: cannot read {weights}: permission denied"


@NOT_ROOT
def test_an_unreadable_model_directory_is_one_line(model_dir, tmp_path):
    model_dir.chmod(0)
    check_directory_denied(model_dir, tmp_path)


def test_an_unreadable_model_directory_is_one_line_patched(model_dir, tmp_path, monkeypatch):
    deny_under(monkeypatch, model_dir)
    check_directory_denied(model_dir, tmp_path)


@NOT_ROOT
def test_an_unreadable_weights_file_is_denied_not_corrupt(model_dir):
    (model_dir / "model.safetensors").chmod(0)
    check_weights_denied(model_dir)


def test_an_unreadable_weights_file_is_denied_not_corrupt_patched(model_dir, monkeypatch):
    deny_file(monkeypatch, model_dir / "model.safetensors")
    check_weights_denied(model_dir)


@NOT_ROOT
def test_an_unreadable_config_json_is_one_line(model_dir):
    (model_dir / "config.json").chmod(0)
    want = f"error: cannot read {model_dir / 'config.json'}: permission denied"
    assert one_error_line(generate(model_dir)) == want


@NOT_ROOT
def test_a_model_directory_that_cannot_be_listed_is_not_called_empty(model_dir):
    """Mode 0o111: its files open by name (``model.safetensors`` is found so), but weights under
    another name are found only by listing it, which ``glob`` skipped without a word."""
    model_dir.chmod(0o111)
    assert ck.read_safetensors(model_dir)  # model.safetensors, opened by its name
    model_dir.chmod(0o755)
    (model_dir / "model.safetensors").rename(model_dir / "weights.safetensors")
    model_dir.chmod(0o111)
    with pytest.raises(ck.CheckpointError) as e:
        ck.read_safetensors(model_dir)
    assert str(e.value) == f"cannot read model directory {model_dir}: permission denied"


@NOT_ROOT
def test_an_unreadable_gguf_file_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    gguf.chmod(0)
    with pytest.raises(ck.CheckpointError) as e:
        ck.resolve_model(gguf)
    assert str(e.value) == f"cannot read GGUF {gguf}: permission denied"
