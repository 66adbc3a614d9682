"""Saved drafters carry a manifest (sha256 of each file) that every loader checks (issue 56).

A flipped byte in a head's or a draft model's weights is one line naming the file and "sha256
mismatch" (``generate --spec``, ``export-drafter``, a run's drafter), never weights passed on;
a drafter written before manifests loads with one ``notice:`` line; ``export-drafter`` on a full
disk leaves no output directory. All on tiny random models (a word-level tokenizer).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from specrl.cli import app
from specrl.config import ConfigError
from specrl.drafters.distill import init_draft, save_draft_model
from specrl.drafters.export import ExportError, export_eagle3
from specrl.fsutil import MANIFEST, manifest_problem
from specrl.models.head_kinds import load_head
from specrl.models.heads import DrafterDamaged, DraftHead, save_head
from specrl.pipelines.drafter import build_drafter_side
from specrl.spec.config import load_drafter_head
from tests.conftest import make_tiny
from tests.models.test_model_load_errors import save_model_dir

torch.set_num_threads(1)

OLD_HEAD = "has no manifest.json (made before checksums); its files are not verified"


model_dir = save_model_dir  # a loadable tiny model directory (word-level tokenizer)


def head_dir(path: Path, arch: str = "eagle3") -> Path:
    """A random eagle3 head for ``make_tiny()`` saved in ``path`` (with its manifest)."""
    torch.manual_seed(0)
    return save_head(DraftHead(make_tiny(), "eagle3", arch=arch).eval(), path)


def draft_dir(path: Path, tokenizer: Path) -> Path:
    return save_draft_model(init_draft(make_tiny(), 1), path, make_tiny().config, tokenizer)


def flip_last_byte(path: Path) -> None:
    """Flip a bit of the file's last byte: tensor data, so the file still parses."""
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))


def made_before_checksums(path: Path, record: str = "head.json") -> None:
    """Make ``path`` as an older specrl left it: no manifest, no ``checksums`` mark."""
    (path / MANIFEST).unlink()
    cfg = json.loads((path / record).read_text())
    cfg.pop("checksums")
    (path / record).write_text(json.dumps(cfg))


def one_error_line(result) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def generate(model: Path, spec: str, drafter: Path):
    args = ["generate", "--no-chat-template", "--model", str(model), "--spec", spec,
            "--drafter", str(drafter), "--num-spec-tokens", "2", "--max-new-tokens", "3",
            "--temperature", "0", "w1 w2"]  # fmt: skip
    return CliRunner().invoke(app, args)


def export_drafter(model: Path, source: Path, out: Path, drafter: str = "eagle3"):
    args = ["export-drafter", "--drafter", drafter, "--model", str(model), "--from", str(source),
            "--out", str(out)]  # fmt: skip
    return CliRunner().invoke(app, args)


# ----------------------------------------------------------------------------- written


def test_saved_drafters_have_a_manifest_that_checks_out(tmp_path):
    head = head_dir(tmp_path / "head")
    draft = draft_dir(tmp_path / "draft", model_dir(tmp_path / "model"))
    out = export_eagle3(head, make_tiny(), tmp_path / "vllm")
    for path in (head, draft, out):
        assert (path / MANIFEST).is_file() and manifest_problem(path) is None, path
    listed = set(json.loads((draft / MANIFEST).read_text())["files"])
    assert {"model.safetensors", "config.json", "distill.json", "tokenizer.json"} <= listed


# ----------------------------------------------------------------------------- damaged


def test_a_flipped_byte_in_a_head_is_refused_by_generate(tmp_path):
    model, head = model_dir(tmp_path / "model"), head_dir(tmp_path / "head")
    assert generate(model, "eagle3", head).exit_code == 0  # control
    flip_last_byte(head / "head.safetensors")
    line = one_error_line(generate(model, "eagle3", head))
    want = f"{head}/head.safetensors: sha256 mismatch"
    assert line == f"error: cannot load the eagle3 drafter: {want}"
    with pytest.raises(ValueError, match="head.safetensors: sha256 mismatch"):
        load_drafter_head(str(head), make_tiny(), "eagle3")


def test_a_flipped_byte_in_a_head_is_refused_by_export_drafter(tmp_path):
    model, head = model_dir(tmp_path / "model"), head_dir(tmp_path / "head")
    flip_last_byte(head / "head.safetensors")
    line = one_error_line(export_drafter(model, head, tmp_path / "out"))
    assert line == f"error: cannot export the drafter: {head}/head.safetensors: sha256 mismatch"
    assert not (tmp_path / "out").exists()
    with pytest.raises(ExportError, match="sha256 mismatch"):  # vLLM's export of a run's head
        export_eagle3(head, make_tiny(), tmp_path / "out")


def test_a_flipped_byte_in_a_draft_model_is_refused(tmp_path):
    model = model_dir(tmp_path / "model")
    draft = draft_dir(tmp_path / "draft", model)
    assert generate(model, "draft", draft).exit_code == 0  # control
    flip_last_byte(draft / "model.safetensors")
    want = f"{draft}/model.safetensors: sha256 mismatch"
    assert one_error_line(generate(model, "draft", draft)).endswith(want)
    line = one_error_line(export_drafter(model, draft, tmp_path / "out", "draft"))
    assert line == f"error: cannot export the drafter: {want}"
    assert not (tmp_path / "out").exists()


def test_a_damaged_export_is_refused_when_a_run_starts(tmp_path):
    """``train`` with rollout.drafter_path a draft model or a vLLM-layout export: checked as the
    run is built (a head is checked by ``load_head`` wherever it loads)."""
    out = export_eagle3(head_dir(tmp_path / "head"), make_tiny(), tmp_path / "vllm")
    plan = SimpleNamespace(learned_drafter=True, training_mode=None, drafter_dir=str(out))
    assert build_drafter_side(None, plan, make_tiny(), None, None).trainer is None
    flip_last_byte(out / "model.safetensors")
    with pytest.raises(ConfigError, match=f"rollout.drafter_path: {out}/model.safetensors: sha256"):
        build_drafter_side(None, plan, make_tiny(), None, None)


@pytest.mark.parametrize("damage", ["manifest gone", "file not listed", "manifest garbage"])
def test_a_head_written_with_a_manifest_needs_it(tmp_path, damage):
    head = head_dir(tmp_path / "head")
    manifest = json.loads((head / MANIFEST).read_text())
    if damage == "manifest gone":  # head.json says it was written with one
        (head / MANIFEST).unlink()
        match = "manifest.json: missing"
    elif damage == "file not listed":
        del manifest["files"]["head.safetensors"]
        (head / MANIFEST).write_text(json.dumps(manifest))
        match = "manifest.json does not list head.safetensors"
    else:
        (head / MANIFEST).write_text("{")
        match = "manifest.json: unreadable"
    with pytest.raises(DrafterDamaged, match=match):
        load_head(head, make_tiny())


# ----------------------------------------------------------------------------- made before


def test_a_head_made_before_checksums_loads_with_a_notice(tmp_path):
    model, head = model_dir(tmp_path / "model"), head_dir(tmp_path / "head")
    made_before_checksums(head)
    ran = generate(model, "eagle3", head)
    assert ran.exit_code == 0, ran.output
    assert ran.stderr.strip().splitlines() == [f"notice: {head} {OLD_HEAD}"]
    exported = export_drafter(model, head, tmp_path / "out")
    assert exported.exit_code == 0, exported.output
    assert exported.stderr.strip().splitlines() == [f"notice: {head} {OLD_HEAD}"]
    assert manifest_problem(tmp_path / "out") is None  # what it writes has one


def test_a_draft_model_made_before_checksums_loads_with_a_notice(tmp_path):
    model = model_dir(tmp_path / "model")
    draft = draft_dir(tmp_path / "draft", model)
    made_before_checksums(draft, "distill.json")
    ran = generate(model, "draft", draft)
    assert ran.exit_code == 0, ran.output
    assert ran.stderr.strip().splitlines() == [f"notice: {draft} {OLD_HEAD}"]
    ran = generate(model, "draft", model)  # a model specrl did not make: nothing to say
    assert ran.exit_code == 0 and not ran.stderr.strip(), ran.output


# ----------------------------------------------------------------------------- full disk


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", str(args[1]) if len(args) > 1 else None)


@pytest.mark.parametrize("drafter", ["eagle3", "draft"])
def test_export_drafter_on_a_full_disk_leaves_no_output(tmp_path, monkeypatch, drafter):
    import safetensors.torch

    model = model_dir(tmp_path / "model")
    if drafter == "eagle3":
        source = head_dir(tmp_path / "head")
    else:
        source = draft_dir(tmp_path / "d", model)
    monkeypatch.setattr(safetensors.torch, "save_file", no_space)
    out = tmp_path / "new" / "deeper" / "out"
    result = export_drafter(model, source, out, drafter)
    assert not (tmp_path / "new").exists()  # every directory it made is gone
    line = one_error_line(result)
    assert line.startswith("error: No space left on device: ") and "rerun" not in line
    given = tmp_path / "given"
    given.mkdir()
    one_error_line(export_drafter(model, source, given / "out", drafter))
    assert list(given.iterdir()) == []  # no hidden staging directory either


def test_export_drafter_over_an_earlier_export(tmp_path):
    """An --out holding an earlier export (and a file of the user's) is updated in place."""
    model, head = model_dir(tmp_path / "model"), head_dir(tmp_path / "head")
    out = tmp_path / "out"
    assert export_drafter(model, head, out).exit_code == 0
    (out / "notes.txt").write_text("mine")
    again = export_drafter(model, head_dir(tmp_path / "head2"), out)
    assert again.exit_code == 0, again.output
    assert manifest_problem(out) is None and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
