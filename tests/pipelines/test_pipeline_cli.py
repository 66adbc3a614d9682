"""``specrl train`` / ``specrl report`` through a Typer app with ``pipelines.cli.register``:
bad input fails with one line before any work; report writes the plots and summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from specrl.config import ConfigError, load_config
from specrl.pipelines.cli import register
from specrl.pipelines.report import samples_axis, summarize, summary_text
from specrl.pipelines.runconfig import free_run_dir, resolve_config
from specrl.pipelines.train import run_training
from tests.pipelines.pipeline_fakes import tiny_config, tiny_parts


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer(no_args_is_help=True, rich_markup_mode=None)
    register(app)
    return app


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--set", "rollout.temperature=abc"], "rollout.temperature"),
        (["--set", "learner.lr=-1"], "learner.lr"),
        (["--set", "run.stepz=3"], "unknown config key"),
        (["--set", "env.task=basic_arithmetc"], "unknown reasoning-gym task"),
        (["--set", "model.name=no-such-model"], "unknown model"),
        (["--set", "rollout.drafter_path=/no/such/drafter"], "drafter file not found"),
        (["--set", "rollout.spec=draft", "--set", "drafter.mode=frozen"], "drafter_path"),
        (["--set", "rollout.spec=suffx"], "did you mean suffix"),
        (["--config", "/no/such.toml"], "cannot read config file"),
        (["--resume", "/no/such/run"], "cannot resume"),
        (["--preset", "reasonin"], "unknown preset 'reasonin' (presets: dapo-math, reasoning)"),
        (["--resume", "/no/such/run", "--preset", "reasoning"], "--resume reads RUN_DIR"),
        # issue 42: bounded where parsed, and nothing set where it cannot apply
        (["--set", "rollout.top_k=9223372036854775808"], "rollout.top_k: Input should be less"),
        (
            ["--set", "pipeline.max_staleness=1"],
            "pipeline.max_staleness=1 needs pipeline.mode='async'",
        ),
        (["--set", "rollout.spec_siblings=3"], "not to rollout.spec 'suffix'"),
        (["--set", 'cluster.address="10.9.9.9:6379"'], "needs cluster.rollout_workers > 0"),
        (
            ["--set", "rollout.spec=none", "--set", "rollout.num_spec_tokens=7"],
            "rollout.num_spec_tokens=7 needs rollout.spec other than 'none'",
        ),
    ],
)
def test_bad_input_is_one_line_before_work(app, tmp_path, monkeypatch, args, match):
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))  # no cached drafters
    result = CliRunner().invoke(app, ["train", "--run-dir", str(tmp_path / "run"), *args])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], lines
    assert not (tmp_path / "run").exists()  # no work started


@pytest.fixture
def four_steps(tmp_path) -> Path:
    """A run dir that ran 4 steps, its config.toml written whole, as an older specrl did
    (pipeline.max_staleness is there in a sync run)."""
    run = tmp_path / "done"
    run.mkdir()
    text = load_config(None, ["run.steps=4"]).to_toml()
    text = text.replace("[pipeline]", "[pipeline]\nmax_staleness = 1\nupdate = 'between_steps'")
    (run / "config.toml").write_text(text.replace("[cluster]", "[cluster]\nmax_restarts = 3"))
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {i}}}\n' for i in range(4)))
    return run


def test_a_resume_reads_a_config_written_whole(four_steps):
    assert "max_staleness = 1" in (four_steps / "config.toml").read_text()
    cfg, target = resolve_config(None, ["run.steps=6"], None, four_steps)
    assert target == four_steps and cfg.run.steps == 6 and cfg.pipeline.max_staleness == 1
    with pytest.raises(ConfigError, match="pipeline.max_staleness=2 needs pipeline.mode"):
        resolve_config(None, ["pipeline.max_staleness=2"], None, four_steps)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--run-dir", "other"], "--run-dir other with --resume"),
        (["--set", "run.run_dir=other"], "--set run.run_dir with --resume"),
        (["--set", "run.steps=2"], "run.steps=2 with --resume"),
    ],
)
def test_a_resume_refuses_what_it_would_ignore(app, four_steps, args, match):
    before = sorted(p.name for p in four_steps.iterdir())
    result = CliRunner().invoke(app, ["train", "--resume", str(four_steps), *args])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], lines
    assert sorted(p.name for p in four_steps.iterdir()) == before


def test_report_of_a_file_names_run_dir_not_out(app, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    result = CliRunner().invoke(app, ["report", str(afile)])
    assert result.exit_code == 2 and result.output.startswith(f"error: RUN_DIR {afile} is not")


def test_used_run_dir_gets_a_fresh_sibling(tmp_path):
    (tmp_path / "run").mkdir()
    assert free_run_dir(tmp_path / "run") == tmp_path / "run"
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    (tmp_path / "run-1").mkdir()
    (tmp_path / "run-1" / "x").write_text("")
    assert free_run_dir(tmp_path / "run") == tmp_path / "run-2"


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_report_writes_plots_and_summary(app, tmp_path):
    torch.set_num_threads(1)
    run = tmp_path / "run"
    summary = run_training(tiny_parts(tiny_config("rollout.spec=suffix")), str(run),
                           progress=False)  # fmt: skip
    assert "rollout speedup" in summary_text(summary)
    result = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    names = {"reward_accuracy.png", "rollout_throughput.png", "acceptance_length.png",
             "step_time.png", "pipeline.png", "summary.md"}  # fmt: skip
    assert {p.name for p in (tmp_path / "out").iterdir()} == names
    for name in names - {"summary.md"}:
        assert (tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG"
    assert "reward_first" in (tmp_path / "out" / "summary.md").read_text()
    bad = CliRunner().invoke(app, ["report", str(tmp_path / "empty")])
    assert bad.exit_code == 2 and "error: no metrics" in bad.output
    other = tmp_path / "async"
    run_training(tiny_parts(tiny_config("pipeline.mode=async")), str(other), progress=False,
                 compare_plain=False)  # fmt: skip
    both = CliRunner().invoke(app, ["report", str(run), "--compare", str(other)])
    assert both.exit_code == 0, both.output
    assert (run / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert samples_axis(_rows(run / "metrics.jsonl")) == [16, 32, 48, 64]  # 4 prompts x G=4
    bad = CliRunner().invoke(app, ["report", str(run), "--compare", str(tmp_path / "empty")])
    assert bad.exit_code == 2 and "error: no metrics" in bad.output


def test_summary_windows():
    base = {"accuracy": 0.0, "response_length": 1.0, "rollout_tokens_per_s": 1.0,
            "acceptance_length": 1.0, "logprob_delta_mean": 0.0, "step_time_s": 2.0,
            "gen_time_s": 1.0, "train_time_s": 0.5}  # fmt: skip
    rows = [{"step": i, "reward_mean": float(i)} | base for i in range(9)]
    s = summarize(rows)
    assert s["window"] == 3 and s["reward_first"] == 1.0 and s["reward_last"] == 7.0
    assert s["time_other_s"] == pytest.approx(0.5)


def test_summary_says_what_speculation_did_and_why_not():
    """The console summary reports the share of drafting steps; when speculation barely ran it
    says why and what would change it."""
    pairs = [(1.0, 0.0), (1.02, 0.01)]  # (acceptance length, share of drafting steps)
    rows = [{"step": i, "reward_mean": 0.0, "step_time_s": 1.0, "acceptance_length": a,
             "spec_step_share": s} for i, (a, s) in enumerate(pairs)]  # fmt: skip
    idle = summary_text(summarize(rows))
    assert "drafted in 0% of decode steps" in idle and "--preset reasoning" in idle
    rows[1]["spec_step_share"] = 0.5
    busy = summary_text(summarize(rows))
    assert "drafted in 25% of decode steps" in busy and "--preset" not in busy
    old = [{k: v for k, v in r.items() if k != "spec_step_share"} for r in rows]
    assert "drafted in" not in summary_text(summarize(old))


def test_damage_notes_and_warnings_go_to_stderr(capsys):
    """Issue 42: "checkpoint ... is damaged" was printed on stdout with the step rows."""
    from specrl.pipelines.cli import console_line

    console_line("checkpoint step_000003 is damaged (x); resuming from step_000002")
    console_line("warning: acceptance collapsed")
    console_line("step   0 reward 0.5")
    out, err = capsys.readouterr()
    assert out == "step   0 reward 0.5\n"
    assert err.splitlines() == ["checkpoint step_000003 is damaged (x); resuming from step_000002",
                                "warning: acceptance collapsed"]  # fmt: skip


def test_the_run_directory_named_twice_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="--run-dir .* with --set run.run_dir: name the run"):
        resolve_config(None, [f'run.run_dir="{tmp_path / "x"}"'], tmp_path / "y", None)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_resume_refuses_a_setting_its_steps_were_made_with(app, four_steps):
    """On 54e03a2 this exited 0 and rewrote config.toml to temperature 0.3 although no step
    was made with it."""
    record = (four_steps / "config.toml").read_bytes()
    result = CliRunner().invoke(
        app, ["train", "--resume", str(four_steps), "--set", "rollout.temperature=0.3"]
    )
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert "--set rollout.temperature=0.3 with --resume" in lines[0]
    assert "made with rollout.temperature=1.0" in lines[0]
    assert (four_steps / "config.toml").read_bytes() == record
    assert not (four_steps / "changes.jsonl").exists()


@pytest.mark.parametrize(
    "item", ["run.steps=6", "cluster.train_workers=2", "reward.workers=0", "model.device=cpu"]
)
def test_a_resume_may_change_how_long_and_where(four_steps, item):
    cfg, _ = resolve_config(None, [item], None, four_steps)
    key, value = item.split("=")
    section, name = key.split(".")
    assert str(getattr(getattr(cfg, section), name)) == value


def test_a_resume_records_what_it_changed_with_its_step(tmp_path):
    torch.set_num_threads(1)
    run = tmp_path / "run"
    parts = tiny_parts(tiny_config("run.steps=1", "run.eval_every=0"))
    try:
        run_training(parts, str(run), progress=False, compare_plain=False)
    finally:
        parts.close()
    parts = tiny_parts(tiny_config("run.steps=2", "run.eval_every=0", "run.keep_checkpoints=5"))
    try:
        run_training(parts, str(run), resume=True, progress=False, compare_plain=False)
    finally:
        parts.close()
    assert _rows(run / "changes.jsonl") == [
        {
            "step": 1,
            "changed": {
                "run.steps": {"from": 1, "to": 2},
                "run.keep_checkpoints": {"from": 3, "to": 5},
            },
        }  # fmt: skip
    ]
    assert "steps = 2" in (run / "config.toml").read_text()
    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [0, 1]
