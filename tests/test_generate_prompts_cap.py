"""Prompt files are read with a size cap (``jsonl_prompts.MAX_PROMPTS_BYTES``, 256 MiB):
``generate --prompts-file /dev/zero`` read without bound before (a MemoryError under a memory
limit); now it, or any larger file, is one ``error: prompts file PATH is larger than N MiB ...``
line and exit 2, reading at most one byte past the cap (a regular file: nothing, by its size).
The prompts are read before any model is loaded, so nothing here needs one."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specrl import jsonl_prompts
from specrl.cli import app
from specrl.jsonl_prompts import MAX_PROMPTS_BYTES, read_capped

ZERO = Path("/dev/zero")
needs_dev_zero = pytest.mark.skipif(not ZERO.exists(), reason="no /dev/zero")


def one_error_line(result) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def generate(prompts_file: Path):
    return CliRunner().invoke(app, ["generate", "--prompts-file", str(prompts_file)])


# ``specrl generate --prompts-file /dev/zero`` in a child whose address space is capped at what
# it has mapped after its imports + 1 GiB: the old unbounded read ended in a MemoryError there
# (and would take the whole machine's memory without the cap), the capped one reads 256 MiB + 1.
UNDER_A_MEMORY_LIMIT = """
import re, resource, sys
from specrl.cli import app
mapped = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) << 10
resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30),) * 2)
sys.argv = ["specrl", "generate", "--prompts-file", "/dev/zero"]
app()
"""


@needs_dev_zero
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_dev_zero_under_a_memory_limit_is_one_line():
    child = subprocess.run([sys.executable, "-c", UNDER_A_MEMORY_LIMIT], capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert child.returncode == 2, child.stderr[-2000:]
    assert child.stdout == "" and child.stderr == (
        "error: prompts file /dev/zero is larger than 256 MiB (prompts files are read whole "
        "into memory): split it\n"
    )


def test_a_regular_file_over_the_cap_is_refused_by_its_size(tmp_path):
    big = tmp_path / "big.jsonl"
    with big.open("wb") as f:  # sparse: no disk used
        f.truncate(MAX_PROMPTS_BYTES + 1)
    line = one_error_line(generate(big))
    assert line.startswith(f"error: prompts file {big} is larger than 256 MiB")


def test_the_cap_is_read_at_call_time(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl_prompts, "MAX_PROMPTS_BYTES", 1 << 20)
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'"a"\n' * ((1 << 18) + 1))  # 1 MiB + 4 bytes
    line = one_error_line(generate(f))
    assert line.startswith(f"error: prompts file {f} is larger than 1 MiB")


@pytest.mark.parametrize("size", [0, 1, 15, 16])
def test_a_file_of_at_most_the_cap_is_read_whole(tmp_path, size):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b"x" * size)
    assert read_capped(f, cap=16) == b"x" * size


def test_a_file_one_byte_over_the_cap_is_refused(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b"x" * 17)
    with pytest.raises(ValueError, match=r"p\.jsonl is larger than 1\.52588e-05 MiB"):
        read_capped(f, cap=16)


def test_a_pipe_is_read_only_one_byte_past_the_cap():
    """At most cap + 1 bytes are kept; the buffered read takes at most one buffer more."""
    r, w = os.pipe()
    os.write(w, b"x" * 60_000)  # fits the pipe's buffer: no writer thread needed
    os.close(w)
    try:
        with pytest.raises(ValueError, match=f"/dev/fd/{r} is larger than"):
            read_capped(f"/dev/fd/{r}", cap=1000)
        left = len(os.read(r, 65_536))
        assert left >= 60_000 - 1001 - io.DEFAULT_BUFFER_SIZE
    finally:
        os.close(r)


def test_a_pipe_within_the_cap_is_read(tmp_path):
    r, w = os.pipe()
    os.write(w, b'"hi"\n')
    os.close(w)
    try:
        assert read_capped(f"/dev/fd/{r}", cap=16) == b'"hi"\n'
    finally:
        os.close(r)
