"""``generate``, ``export``, ``export-drafter``, ``report`` and ``simulate validate|calibrate`` read
their settings as ``train`` and ``train-drafter`` do (``config_commands``, ``cli_util.Shortcuts``).

Contract checked, for each command: ``--config FILE`` and ``--set section.key=value`` are applied
(an effect seen in what the command does); defaults <- file <- options <- ``--set``: an option
beats the file, an option and a ``--set`` of the same key in one command line are refused in one
line; an unknown key is one ``error:`` line with a did-you-mean and the valid keys of its table;
a bad value is one line naming the key; a field set where it cannot apply is refused naming both
(in the options' words when an option gave it); every number a ``--set`` takes is bounded; the
record an export writes (``OUT/specrl_export.toml``, ``OUT/export_drafter.toml``) reads back with
``--config`` and makes the same export, and the directory still loads. Every field of every
settings class is classified (``settings.Coverage``). Tiny random models only.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import get_args

import pytest
import torch
from pydantic import BaseModel
from typer.testing import CliRunner

from specrl import settings
from specrl.cli import app
from specrl.cli_util import Shortcuts
from specrl.config_commands import (
    COMMANDS,
    MAX_TOP_K,
    CalibrateCfg,
    ExportCfg,
    ExportDrafterCfg,
    GenerateCfg,
    ReportCfg,
)
from specrl.models import checkpoints
from tests.pipelines.test_report_inputs import make_run
from tests.test_cli_edges import answered, write_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_error(result, *words: str) -> str:
    """Exit code 2 and exactly one line, ``error: ...``, holding every one of ``words``."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture
def no_work(monkeypatch):
    """Any model load, export or report fails the test: the error must come first."""

    import specrl.drafters.export
    import specrl.pipelines.export
    import specrl.pipelines.report  # noqa: F401 - imported before the patches (no boom bound)

    def boom(*args, **kwargs):
        raise AssertionError("work started before the input was checked")

    for target in (
        "specrl.models.checkpoints.load_model",
        "specrl.models.checkpoints.load_tokenizer",
        "specrl.pipelines.export.resolve_export",
        "specrl.drafters.export.export_eagle3",
        "specrl.pipelines.report.read_runs",
    ):
        monkeypatch.setattr(target, boom)  # fmt: skip


# --------------------------------------------------------------------------- the classes


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_field_is_classified_and_the_defaults_write_and_read_back(command):
    model, coverage = COMMANDS[command]
    assert settings.coverage_problems(model, coverage) == []
    assert set(coverage.rules) == set(model.RULES)
    text = model().to_toml()
    assert model.load(tomllib.loads(text)) == model()


def test_the_bounds_are_the_config_s():
    from specrl import config

    assert MAX_TOP_K == config.MAX_TOP_K


def test_a_multi_line_docstring_writes_valid_toml():
    """``settings.toml_document`` comments every line of a settings class's docstring."""

    class Two(ReportCfg):
        """First line.

        Second line."""

    assert tomllib.loads(Two().to_toml()) == {"report": {"compare": []}}


# --------------------------------------------------------------------------- unknown keys, values


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["generate", "hi", "--set", "sampling.temprature=0"],
         ["unknown generate key 'sampling.temprature' (did you mean sampling.temperature?); "
          "valid keys in [sampling]: sampling.temperature, sampling.top_p"]),
        (["generate", "hi", "--set", "samplng.n=2"], ["unknown generate key 'samplng'",
                                                       "did you mean sampling?"]),
        (["export", "RUN", "OUT", "--set", "export.stpe=1"],
         ["unknown export key 'export.stpe' (did you mean export.step?); valid keys in "
          "[export]: export.step, export.merge_drafter, export.shard_size"]),
        (["export-drafter", "--set", "export.dtyp='float32'"],
         ["unknown export-drafter key 'export.dtyp' (did you mean export.dtype?)"]),
        (["report", "RUN", "--set", "report.comapre=[]"],
         ["unknown report key 'report.comapre' (did you mean report.compare?)"]),
        # a bad value names its key
        (["generate", "hi", "--set", "sampling.temperature='hot'"],
         ['bad value for sampling.temperature: expected a number (got "hot")']),
        (["generate", "hi", "--set", "output.jsonl=1"],
         ["bad value for output.jsonl: expected true or false (got 1)"]),
        (["generate", "hi", "--set", f"engine.max_batch={10**30}"],
         ["bad value for engine.max_batch: Input should be less than or equal to 4096"]),
        (["generate", "hi", "--set", "sampling.temperature=-1"], ["temperature must be >= 0"]),
        (["generate", "hi", "--set", "engine.max_batch=0"], ["engine.max_batch must be >= 1"]),
        (["export", "RUN", "OUT", "--set", "export.step='last'"],
         ['bad value for export.step: expected an integer (got "last")']),
        (["export", "RUN", "OUT", "--set", "export.step=-1"],
         ["export.step must be in [0, 1000000], got -1"]),
        (["export", "RUN", "OUT", "--set", "export.shard_size='lots'"],
         ["export.shard_size: not a size: 'lots'"]),
        (["export-drafter", "--out", "o", "--set", "drafter.kind='medusa'"],
         ["unknown drafter.kind 'medusa'; valid: block, draft, eagle3"]),
        (["export-drafter", "--out", "o", "--set", "export.dtype='int8'"],
         ["export.dtype must be one of float32, bfloat16, float16 (eagle3 and block only), "
          "got 'int8'"]),
        (["report", "RUN", "--set", "report.compare='b'"],
         ['bad value for report.compare: expected a list (got "b")']),
        # a field where it cannot apply: both named, in the words it was given in
        (["generate", "hi", "--set", "speculation.num_spec_tokens=5"],
         ["speculation.num_spec_tokens=5 needs speculation.method other than 'none' (it is set, "
          "and speculation.method is 'none')"]),
        (["generate", "hi", "--spec-exact", "sample"],
         ["--spec-exact applies only with --spec other than 'none'"]),
        (["generate", "hi", "--set", "speculation.method='ngram'", "--set",
          "speculation.drafter='d'"],
         ["speculation.drafter applies only with a speculation.method that loads a drafter"]),
        # an option and a --set of the same key in one command line
        (["generate", "hi", "--n", "2", "--set", "sampling.n=3"],
         ["--n and --set sampling.n both set sampling.n: give one"]),
        (["generate", "hi", "--no-chat-template", "--set", "prompts={chat_template=true}"],
         ["--no-chat-template and --set prompts.chat_template both set"]),
        (["export", "RUN", "OUT", "--step", "1", "--set", "export.step=2"],
         ["--step and --set export.step both set export.step: give one"]),
        (["export-drafter", "--out", "o", "--set", "export.out='p'"],
         ["--out and --set export.out both set export.out: give one"]),
        (["report", "RUN", "--compare", "b", "--set", "report.compare=['c']"],
         ["--compare and --set report.compare both set report.compare: give one"]),
    ],
)  # fmt: skip
def test_bad_settings_are_one_line_before_work(args, words, no_work, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_error(invoke(*args), *words)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_bad_config_file_is_one_line_naming_it(no_work, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[sampling]\nn = 'two'\n")
    one_error(invoke("generate", "hi", "--config", bad), f"{bad}: bad value for sampling.n")
    one_error(invoke("report", "RUN", "--config", tmp_path / "missing.toml"),
              "cannot read report config")  # fmt: skip
    garbled = tmp_path / "garbled.toml"
    garbled.write_text("[export\n")
    one_error(invoke("export", "RUN", "OUT", "--config", garbled), f"invalid TOML in {garbled}")


def number_fields(model: type[BaseModel], prefix: str = ""):
    """(dotted key, "int" | "float") of every field of ``model`` that holds only a number."""
    for key, info in model.model_fields.items():
        sub = settings.submodel(info.annotation)
        kinds = set(get_args(info.annotation) or (info.annotation,)) - {type(None)}
        if sub is not None:
            yield from number_fields(sub, f"{prefix}{key}.")
        elif kinds in ({int}, {float}):
            yield f"{prefix}{key}", "int" if int in kinds else "float"


BASE = {GenerateCfg: ["generate", "hi", "--set", "speculation.method='ngram'"],
        ExportCfg: ["export", "RUN", "OUT"],
        CalibrateCfg: ["simulate", "calibrate", "trace.json"]}  # fmt: skip
NUMBERS = [(m, k, v) for m in BASE for k, kind in number_fields(m)
           for v in ((10**30, -(10**30), 2**63) if kind == "int" else ("nan", "inf"))]  # fmt: skip


def test_the_number_cases_cover_every_kind_of_field():
    keys = {k for _, k, _ in NUMBERS}
    assert {"sampling.top_k", "sampling.temperature", "sampling.seed", "export.step",
            "calibrate.seed", "calibrate.heldout"} <= keys  # fmt: skip


@pytest.mark.parametrize(
    ("model", "key", "value"), NUMBERS, ids=[f"{k}={v}" for _, k, v in NUMBERS]
)
def test_every_number_a_set_takes_is_bounded(model, key, value, no_work, tmp_path, monkeypatch):
    """A number past any bound is refused in one line naming the field, before any work."""
    monkeypatch.chdir(tmp_path)
    line = one_error(invoke(*BASE[model], "--set", f"{key}={value}"))
    assert key.rpartition(".")[2] in line, line


# --------------------------------------------------------------------------- generate


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_model"))


def tokens(result) -> list[list[int]]:
    assert result.exit_code == 0, result.output
    return [json.loads(line)["token_ids"] for line in result.stdout.splitlines()]


def test_generate_applies_the_file_the_options_and_set(tiny_dir, tmp_path):
    cfg = tmp_path / "gen.toml"
    cfg.write_text(f'[model]\nname = "{tiny_dir}"\ndtype = "float32"\n'
                   "[sampling]\ntemperature = 1.0\nmax_new_tokens = 4\nn = 2\nseed = 7\n"
                   "[output]\njsonl = true\n")  # fmt: skip
    by_file = invoke("generate", "hi", "--config", cfg)
    assert answered(by_file) == {0: 2}  # n and jsonl from the file
    same = invoke(
        "generate",
        "hi",
        "--model",
        tiny_dir,
        "--dtype",
        "float32",
        "--json",
        "--temperature",
        "1",
        "--max-new-tokens",
        "4",
        "--n",
        "2",
        "--seed",
        "7",
    )
    assert tokens(by_file) == tokens(same)  # the file's values are the options'
    assert all(len(t) <= 4 for t in tokens(by_file))
    assert answered(invoke("generate", "hi", "--config", cfg, "--n", "3")) == {0: 3}  # option
    assert answered(invoke("generate", "hi", "--config", cfg, "--set", "sampling.n=1")) == {0: 1}
    other_seed = invoke("generate", "hi", "--config", cfg, "--set", "sampling.seed=8")
    assert tokens(other_seed) != tokens(by_file)
    spec = invoke("generate", "hi", "--config", cfg, "--set", "speculation.method='ngram'",
                  "--set", "speculation.exact='sample'")  # fmt: skip
    assert tokens(spec) == tokens(by_file)  # 'sample': plain sampling's tokens, so applied


def test_the_generate_options_are_shortcuts_of_keys_that_exist():
    from specrl.cli_generate import GENERATE

    check_shortcuts(GENERATE, GenerateCfg)


def check_shortcuts(shortcuts: Shortcuts, model: type[BaseModel]) -> None:
    keys = set(settings.leaf_keys(model))
    assert {key for _, key in shortcuts.options.values()} <= keys


# --------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    from tests.pipelines.test_export_model import model_dir, train_run

    base = tmp_path_factory.mktemp("export")
    return train_run(model_dir(base / "model"), base / "run")


def test_export_records_its_settings_and_the_record_exports_the_same(run, tmp_path):
    from transformers import AutoConfig

    out = tmp_path / "hf"
    result = invoke("export", run, out, "--set", "export.step=1", "--shard-size", "40KB")
    assert result.exit_code == 0, result.output
    record = out / ExportCfg.RECORD
    assert tomllib.loads(record.read_text())["export"] == {
        "step": 1, "merge_drafter": False, "shard_size": "40KB"}  # fmt: skip
    assert len(list(out.glob("model-*.safetensors"))) > 1  # the option applied: shards
    AutoConfig.from_pretrained(out)  # the record is no bother to transformers
    assert checkpoints.load_model(out) is not None  # nor to specrl
    again = tmp_path / "again"
    assert invoke("export", run, again, "--config", record).exit_code == 0
    assert record.read_text() == (again / ExportCfg.RECORD).read_text()
    for shard in out.glob("model-*.safetensors"):
        assert shard.read_bytes() == (again / shard.name).read_bytes()
    newest = tmp_path / "newest"
    assert invoke("export", run, newest).exit_code == 0  # the default step, resolved
    assert tomllib.loads((newest / ExportCfg.RECORD).read_text())["export"]["step"] == 2


def test_an_export_whose_record_cannot_be_written_leaves_nothing(run, tmp_path, monkeypatch):
    import specrl.cli_export as cli_export

    def full(path, text):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(cli_export, "atomic_write", full)
    out = tmp_path / "hf"
    one_error(invoke("export", run, out), "No space left on device", "nothing was left")
    assert list(tmp_path.iterdir()) == []


def test_the_export_options_are_shortcuts_of_keys_that_exist():
    from specrl.cli_export import EXPORT, EXPORT_DRAFTER

    check_shortcuts(EXPORT, ExportCfg)
    check_shortcuts(EXPORT_DRAFTER, ExportDrafterCfg)


# --------------------------------------------------------------------------- export-drafter


@pytest.fixture(scope="module")
def head(tmp_path_factory) -> tuple[Path, Path]:
    """(a target model directory, an eagle3-layout head trained for it)."""
    from specrl.models.heads import save_head
    from tests.drafters.test_export import model_dir, random_head, target_of

    base = tmp_path_factory.mktemp("drafter")
    target = target_of()
    return model_dir(target, base / "target"), save_head(random_head(target), base / "head")


def test_export_drafter_applies_set_and_its_record_exports_the_same(head, tmp_path):
    from safetensors.torch import load_file

    from specrl.drafters.export import import_eagle3

    target, source = head
    out = tmp_path / "o"
    result = invoke("export-drafter", "--model", target, "--from", source, "--out", out,
                    "--set", "export.dtype='bfloat16'")  # fmt: skip
    assert result.exit_code == 0, result.output
    written = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in written.values() if t.is_floating_point()} == {torch.bfloat16}
    record = tomllib.loads((out / ExportDrafterCfg.RECORD).read_text())
    assert record == {"drafter": {"kind": "eagle3", "source": str(source.resolve())},
                      "model": {"name": str(target.resolve())},
                      "export": {"out": str(out.resolve()), "dtype": "bfloat16"}}  # fmt: skip
    assert import_eagle3(out, checkpoints.load_model(target)) is not None  # still loads
    again = tmp_path / "again"
    result = invoke("export-drafter", "--config", out / ExportDrafterCfg.RECORD, "--out", again)
    assert result.exit_code == 0, result.output  # the option beats the file's export.out
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert tomllib.loads((again / ExportDrafterCfg.RECORD).read_text())["export"]["out"] == str(
        again.resolve()
    )


def test_export_drafter_names_a_key_as_it_was_given(head, tmp_path):
    target, source = head
    cfg = tmp_path / "x.toml"
    cfg.write_text(f'[drafter]\nsource = "{tmp_path / "missing"}"\n[model]\nname = "{target}"\n')
    line = one_error(invoke("export-drafter", "--config", cfg, "--out", tmp_path / "o"))
    assert line.startswith(f"error: drafter.source {tmp_path / 'missing'} is not a directory")
    line = one_error(invoke("export-drafter", "--config", cfg, "--from", tmp_path / "nope",
                            "--out", tmp_path / "o"))  # fmt: skip
    assert line.startswith(f"error: --from {tmp_path / 'nope'} is not a directory")
    one_error(invoke("export-drafter", "--model", target, "--from", source), "--out is required")
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- report


def test_report_applies_the_file_the_options_and_set(tmp_path):
    run = make_run(tmp_path / "run", [0, 1, 2])
    other = make_run(tmp_path / "other", [0, 1])
    cfg = tmp_path / "report.toml"
    cfg.write_text(f'[report]\nout = "{tmp_path / "by_file"}"\n')
    assert invoke("report", run, "--config", cfg).exit_code == 0
    assert (tmp_path / "by_file" / "summary.md").is_file() and not (run / "summary.md").exists()
    result = invoke("report", run, "--config", cfg, "--out", tmp_path / "by_option")
    assert result.exit_code == 0 and (tmp_path / "by_option" / "summary.md").is_file()
    result = invoke("report", run, "--set", f"report.out='{tmp_path / 'by_set'}'",
                    "--set", f"report.compare=['{other}']")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (tmp_path / "by_set" / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "by_file" / "compare.png").exists()


def test_report_names_a_bad_out_as_it_was_given(tmp_path):
    run = make_run(tmp_path / "run", [0, 1])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    one_error(invoke("report", run, "--out", blocker / "d"), "--out ")
    one_error(invoke("report", run, "--set", f"report.out='{blocker / 'd'}'"), "report.out ")
