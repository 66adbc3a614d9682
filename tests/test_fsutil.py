"""fsutil: atomic writes leave the old content or the new, never a part; path checks;
manifests name the file that does not match; a directory replaced in one rename."""

from __future__ import annotations

import os

import pytest

from specrl.errors import did_you_mean, one_line, unknown
from specrl.fsutil import (
    atomic_write,
    atomic_writer,
    manifest_problem,
    replace_dir,
    writable_problem,
    write_manifest,
)


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


def test_manifest_problem_names_the_first_file_that_does_not_match(tmp_path):
    assert manifest_problem(tmp_path) == "manifest.json: missing"
    (tmp_path / "a").write_bytes(b"abc")
    (tmp_path / "b").write_bytes(b"de")
    write_manifest(tmp_path, ["a", "b"])
    assert manifest_problem(tmp_path, exact=True) is None
    (tmp_path / "c").write_bytes(b"")
    assert manifest_problem(tmp_path) is None
    assert manifest_problem(tmp_path, exact=True) == "c: not in the manifest"
    (tmp_path / "b").write_bytes(b"dE")
    assert manifest_problem(tmp_path) == "b: sha256 mismatch"
    (tmp_path / "b").write_bytes(b"d")
    assert manifest_problem(tmp_path) == "b: 1 bytes, the manifest says 2"
    (tmp_path / "a").unlink()
    assert manifest_problem(tmp_path) == "a: missing"
    (tmp_path / "manifest.json").write_text('{"files": {"../a": {"bytes": 1, "sha256": ""}}}')
    assert manifest_problem(tmp_path) == f"manifest.json: lists a path outside {tmp_path.name}"
    (tmp_path / "manifest.json").write_text("{")
    assert manifest_problem(tmp_path) == "manifest.json: unreadable"


def test_replace_dir_puts_the_new_directory_in_place_of_the_old(tmp_path):
    new, dest = tmp_path / "d.tmp", tmp_path / "d"
    for folder, content in ((dest, "old"), (new, "new")):
        folder.mkdir()
        (folder / "f").write_text(content)
    replace_dir(new, dest)
    assert (dest / "f").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["d"]


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
