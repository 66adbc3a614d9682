"""No file of the project cites a file outside the repository (``../shared/...``, the notes
beside a working copy that a clone does not have): a fact names its public source instead (the
paper, the issue, the datasheet) or the project's own measurement."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = ("../shared", "shared/REFERENCE", "shared/DESIGN")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()  # fmt: skip
    return [ROOT / n for n in names if not n.endswith((".png", ".safetensors", ".gguf"))]


def test_no_tracked_file_cites_a_file_outside_the_repository():
    found = []
    for path in tracked_text_files():
        if path == Path(__file__) or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        found += [f"{path.relative_to(ROOT)}: {ref}" for ref in OUTSIDE if ref in text]
    assert not found, found
