"""fsutil: atomic writes leave the old content or the new, never a part; path checks."""

from __future__ import annotations

import os

import pytest

from specrl.errors import did_you_mean, one_line, unknown
from specrl.fsutil import atomic_write, atomic_writer, writable_problem


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path):
    f = tmp_path / "a.json"
    atomic_write(f, "old")
    atomic_write(f, b"new")
    assert f.read_text() == "new" and sorted(os.listdir(tmp_path)) == ["a.json"]


def test_a_failed_write_keeps_the_old_content_and_no_temporary(tmp_path):
    f = tmp_path / "a.json"
    atomic_write(f, "old")
    with pytest.raises(RuntimeError), atomic_writer(f) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert f.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["a.json"]


def test_mode_is_set(tmp_path):
    atomic_write(tmp_path / "x", "1", mode=0o600)
    assert (tmp_path / "x").stat().st_mode & 0o777 == 0o600


def test_writable_problem(tmp_path):
    (tmp_path / "file").write_text("")
    (tmp_path / "dir").mkdir()
    assert writable_problem(tmp_path / "new" / "deeper.json", "file") is None
    assert writable_problem(tmp_path / "new" / "run", "dir") is None
    assert writable_problem(tmp_path / "dir", "dir") is None
    assert "is a directory" in writable_problem(tmp_path / "dir", "file")
    assert "is not a directory" in writable_problem(tmp_path / "file", "dir")
    assert "is a file" in writable_problem(tmp_path / "file" / "sub" / "x.json", "file")
    assert "is a file" in writable_problem(tmp_path / "file" / "run", "dir")


def test_error_lines():
    assert one_line(ValueError("bad\n  more\nlines")) == "ValueError: bad"
    assert one_line(ValueError("  a   b ")) == "ValueError: a b"
    assert one_line(KeyError()) == "KeyError"
    assert did_you_mean("eagel3", ["eagle3", "mtp"]) == " (did you mean eagle3?)"
    assert did_you_mean("zzz", ["eagle3"]) == ""
    assert unknown("drafter", "eagel3", ["mtp", "eagle3"]) == (
        "unknown drafter 'eagel3' (did you mean eagle3?); valid: eagle3, mtp"
    )
