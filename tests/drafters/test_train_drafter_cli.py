"""``specrl train-drafter``: settings through ``specrl.config_drafter`` (``--config``, ``--set``,
options that are fields), bad values refused with one ``error:`` line before any work, the
settings recorded in the output directory."""

from __future__ import annotations

import errno
import json
import tomllib

import pytest
import typer
from typer.testing import CliRunner

from specrl import settings
from specrl.config_drafter import (
    COVERAGE,
    MAX_SEED,
    RECORD_FILE,
    TrainDrafterCfg,
    load_train_drafter,
)
from specrl.drafters import cli, data
from specrl.drafters.cli import register


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer(no_args_is_help=True, rich_markup_mode=None)
    app.callback()(lambda: None)  # a group, as in ``specrl``, even with one command
    register(app)
    return app


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--set", "drafter.draft_vocab=-1"], "bad value for drafter.draft_vocab: Input should "
         "be greater than or equal to 0 (got -1)"),
        (["--set", "train.steps=0"], "bad value for train.steps: Input should be greater than "
         "or equal to 1 (got 0)"),
        (["--set", "train.tv_steps=-5"], "bad value for train.tv_steps"),
        (["--set", "data.temperatures=[1, 'x']"], "bad value for data.temperatures[1]: "
         "expected a number"),
        (["--set", "data.temperatures=[-1]"], "bad value for data.temperatures[0]"),
        (["--set", "data.temperatures=[]"], "bad value for data.temperatures"),
        (["--set", "data.temperatures=1,0"], "bad value for data.temperatures: expected a list"),
        (["--drafter", "medusa"], "bad value for drafter.kind: Input should be 'eagle3', 'mtp', "
         "'block' or 'draft' (got \"medusa\")"),
        (["--set", "drafter.block_size=4"], "drafter.block_size=4 needs drafter.kind='block'"),
        (["--drafter", "block", "--set", "train.unroll=2"], "train.unroll=2 needs drafter.kind "
         "other than 'block'"),
        (["--set", f"run.seed={2**63}"], "bad value for run.seed: Input should be less than or "
         "equal to 9223372036854775807 (got 9223372036854775808)"),
        (["--set", "run.seed=-1"], "bad value for run.seed"),
        # issue 42: every option bounded, learning rates finite and > 0, the task checked
        (["--set", "train.tv_lr=inf"], "bad value for train.tv_lr: expected a finite number"),
        (["--set", "train.lr=nan"], "bad value for train.lr: expected a finite number (got nan)"),
        (["--set", "train.lr=-1"], "bad value for train.lr: Input should be greater than 0"),
        (["--set", "train.batch_size=0"], "bad value for train.batch_size"),
        (["--set", "model.threads=-1"], "bad value for model.threads"),
        (["--set", f"data.num_prompts={10**30}"], "bad value for data.num_prompts"),
        (["--set", "train.ckpt_every=0"], "bad value for train.ckpt_every"),
        (["--set", "eval.num_spec_tokens=17"], "bad value for eval.num_spec_tokens"),
        (["--set", "model.device=tpu"], "bad value for model.device"),
        (["--task", "no_such_task"], "data.task: unknown reasoning-gym task 'no_such_task'"),
        (["--task", "basic_arithmetc"], "did you mean basic_arithmetic"),
        # a field set where it cannot apply (``config_drafter.APPLIES_ONLY``), both fields named
        (["--set", "drafter.draft_layers=2"], "drafter.draft_layers=2 needs drafter.kind='draft' "
         "(it is set, and drafter.kind is 'eagle3')"),
        (["--drafter", "draft", "--set", "drafter.draft_vocab=0"], "drafter.draft_vocab=0 needs "
         "drafter.kind other than 'draft'"),
        (["--drafter", "draft", "--set", "train.tv_steps=5"], "train.tv_steps=5 needs "
         "drafter.kind other than 'draft'"),
        (["--drafter", "mtp", "--set", "drafter.head_arch=eagle3"], "drafter.head_arch='eagle3' "
         "needs drafter.kind='eagle3'"),
        # unknown keys: did-you-mean and the valid keys of the table
        (["--set", "train.stepz=3"], "unknown train-drafter key 'train.stepz' (did you mean "
         "train.steps?); valid keys in [train]: train.steps, train.lr"),
        (["--set", "trian.steps=3"], "unknown train-drafter key 'trian'"),
        (["--set", "steps"], "bad override 'steps': expected section.key=value"),
        # an option and a --set of the same field in one line
        (["--drafter", "mtp", "--set", "drafter.kind=eagle3"], "--drafter and --set "
         "drafter.kind both set drafter.kind: give one"),
        (["--set", "run.out=x"], "--out and --set run.out both set run.out: give one"),
    ],
)  # fmt: skip
def test_bad_values_fail_before_work(app, tmp_path, args, match):
    result = CliRunner().invoke(app, ["train-drafter", "--out", str(tmp_path / "d"), *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert match in result.output
    assert not (tmp_path / "d").exists()  # nothing was written


def test_a_prompts_directory_fails_before_work(app, tmp_path):
    args = ["train-drafter", "--out", str(tmp_path / "d"), "--prompts", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "is not a file" in result.output and not (tmp_path / "d").exists()


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_out_that_cannot_be_a_directory_fails_before_work(app, tmp_path, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = blocker if where == "a file" else blocker / "d"
    result = CliRunner().invoke(app, ["train-drafter", "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot use run.out: "), lines
    assert blocker.read_text() == "x"


def _full_disk(monkeypatch, where):
    """``load_model`` (the first work after --out is made and the settings recorded) fails as a
    full disk does."""
    from specrl.models import checkpoints

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(where))

    monkeypatch.setattr(checkpoints, "load_model", full)


def test_an_os_error_during_the_work_is_one_line(app, tmp_path, monkeypatch):
    """A full disk (here while loading the model, after --out was made): one ``error:`` line."""
    _full_disk(monkeypatch, tmp_path / "d" / "x")
    result = CliRunner().invoke(app, ["train-drafter", "--out", str(tmp_path / "d")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: No space left on device: ")


@pytest.fixture
def ran(monkeypatch):
    """The settings ``train-drafter`` would train with (the work replaced by recording them)."""
    seen: list[TrainDrafterCfg] = []
    monkeypatch.setattr(cli, "train_drafter", seen.append)
    return seen


def test_config_file_options_and_sets_layer_in_order(app, tmp_path, ran):
    path = tmp_path / "td.toml"
    path.write_text('[drafter]\nkind = "mtp"\n[train]\nsteps = 7\nlr = 0.01\n'
                    "[data]\ntemperatures = [0.5]\n")  # fmt: skip
    args = ["train-drafter", "--config", str(path), "--task", "chain_sum", "--out", "o",
            "--set", "train.steps=200", "--set", "eval.num_spec_tokens=2"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (cfg,) = ran
    assert (cfg.drafter.kind, cfg.train.steps, cfg.train.lr) == ("mtp", 200, 0.01)
    assert (cfg.data.temperatures, cfg.data.task, cfg.run.out) == ([0.5], "chain_sum", "o")
    assert cfg.eval.num_spec_tokens == 2 and cfg.train.batch_size == 8  # a default
    sets = ["data.task='chain_sum'", "run.out='o'", "train.steps=200", "eval.num_spec_tokens=2"]
    assert cfg == load_train_drafter(path, sets)


def test_an_option_wins_over_the_config_file(app, tmp_path, ran):
    path = tmp_path / "td.toml"
    path.write_text('[drafter]\nkind = "mtp"\n')
    result = CliRunner().invoke(app, ["train-drafter", "--config", str(path), "--drafter", "draft"])
    assert result.exit_code == 0, result.output
    assert ran[0].drafter.kind == "draft"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[train]\nsteps = 0\n", "{path}: bad value for train.steps"),
        ("[train]\nstepz = 3\n", "{path}: unknown train-drafter key 'train.stepz' (did you mean"),
        ("[train\n", "invalid TOML in {path}"),
        (None, "cannot read train-drafter config {path}"),
    ],
)
def test_a_bad_config_file_is_one_line_naming_it(app, tmp_path, text, match):
    path = tmp_path / "td.toml"
    if text is not None:
        path.write_text(text)
    args = ["train-drafter", "--config", str(path), "--out", str(tmp_path / "d")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and match.format(path=path) in lines[0], lines
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("drafter", ["eagle3", "draft"])
def test_the_output_directory_records_its_settings(app, tmp_path, monkeypatch, drafter):
    """``OUT/train_drafter.toml``: the settings, defaults that depend on others resolved and
    paths absolute; ``--config`` on it gives them back (written before the model loads)."""
    _full_disk(monkeypatch, tmp_path / "elsewhere")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "one"}\n')
    out = tmp_path / "d"
    args = ["train-drafter", "--drafter", drafter, "--out", str(out), "--prompts", str(prompts),
            "--set", "train.steps=200", "--set", "data.temperatures=[0]"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "No space left" in result.output, result.output
    recorded = load_train_drafter(out / RECORD_FILE)
    assert recorded.train.steps == 200 and recorded.data.temperatures == [0.0]
    assert recorded.run.out == str(out.resolve()) and recorded.data.prompts == str(prompts)
    if drafter == "draft":
        assert (recorded.drafter.draft_vocab, recorded.drafter.draft_layers) == (None, 4)
        assert "# tv_steps:" in (out / RECORD_FILE).read_text()  # only a comment there
    else:
        assert (recorded.drafter.draft_vocab, recorded.drafter.draft_layers) == (4096, None)
    assert recorded.to_toml() == (out / RECORD_FILE).read_text()  # reads back equal


def test_the_settings_model_classifies_every_field_and_reads_back():
    assert settings.coverage_problems(TrainDrafterCfg, COVERAGE) == []
    cfg = load_train_drafter(None, ["drafter.kind='draft'", "drafter.draft_layers=3"])
    assert load_train_drafter(tomllib.loads(cfg.to_toml())) == cfg
    assert tomllib.loads(TrainDrafterCfg().to_toml())["train"]["steps"] == 1500


def test_the_seed_bound_is_the_samplers():
    from specrl.sampling import MAX_SEED as SAMPLING_MAX_SEED

    assert MAX_SEED == SAMPLING_MAX_SEED


class WordTokenizer:
    """Just what ``jsonl_prompt_ids`` uses of a tokenizer."""

    def chat_prompt(self, messages: list[dict]) -> str:
        return " ".join(m["content"] for m in messages)

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", "not JSON"),
        ("42", "expected"),
        ('{"prompt": 42}', "expected"),
        ('{"messages": "hi"}', "expected"),
        ('{"messages": [{"role": "user"}]}', "expected"),
        ('{"messages": []}', "expected"),
    ],
)
def test_a_bad_prompts_line_is_one_value_error_naming_it(tmp_path, line, match):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one two"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=f"{path}:3: {match}"):
        data.jsonl_prompt_ids(WordTokenizer(), path)


def test_prompts_files_that_are_fine(tmp_path):
    """The format ``specrl generate --prompts-file`` reads too (``specrl.jsonl_prompts``)."""
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "one two"}, {"messages": [{"role": "user", "content": "three"}]}, "four"]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert data.jsonl_prompt_ids(WordTokenizer(), path) == [[3, 3], [5], [4]]
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="not UTF-8"):
        data.jsonl_prompt_ids(WordTokenizer(), path)


def test_a_prompts_file_over_the_cap_is_refused_unread(tmp_path, monkeypatch):
    """``train-drafter --prompts`` reads through ``jsonl_prompts.read_capped`` as ``generate``
    does (it read without bound before)."""
    from specrl import jsonl_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one two"}\n' * 64)
    monkeypatch.setattr(jsonl_prompts, "MAX_PROMPTS_BYTES", 100)
    with pytest.raises(ValueError, match=f"{path} is larger than"):
        data.jsonl_prompt_ids(WordTokenizer(), path)
    monkeypatch.setattr(jsonl_prompts, "MAX_PROMPTS_BYTES", 1 << 20)
    assert len(data.jsonl_prompt_ids(WordTokenizer(), path)) == 64
