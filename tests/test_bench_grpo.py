"""``specrl bench grpo`` end to end on a tiny random model (``specrl.bench_grpo``): both modes
write the JSON fields the results files and docs cite, every ratio is the one its measured times
give (consistency, never a timing threshold), plain and speculative runs see the same weights,
prompts and seeds, and the settings used are recorded (``meta.settings``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specrl.bench_grpo import summarize, with_ratios
from specrl.cli import app
from specrl.envs.synthetic import IdCodec, ModFourEnv
from specrl.gpubench.oracle import OracleProposer, oracle_spec
from tests.conftest import make_tiny

# The training run: tiny steps, no reward worker processes, speculation at every step.
TRAIN = ['train.model.dtype="fp32"', 'train.learner.dtype="fp32"',
         "train.learner.micro_batch_tokens=256", "train.rollout.group_size=2",
         "train.rollout.prompts_per_step=2", "train.rollout.max_new_tokens=8",
         'train.rollout.placement="inline"', "train.rollout.max_tokens_per_forward=1024",
         "train.reward.workers=0"]  # fmt: skip
# The fields of benchmarks/results/grpo_spec_vs_plain.json and reasoning_spec_vs_plain.json.
RESULT_KEYS = {"spec", "steps_measured", "rollout_tokens_per_s", "gen_time_s", "gen_tokens",
               "acceptance_length", "train_time_s", "step_time_s", "reward_mean",
               "rollout_speedup", "gen_time_ratio", "step_speedup"}  # fmt: skip
SWEEP_KEYS = {"spec", "max_batch", "plain_tokens", "plain_time_s", "plain_tokens_per_s",
              "spec_tokens", "spec_time_s", "spec_tokens_per_s", "spec_acceptance_length",
              "spec_draft_s", "rollout_speedup", "free_draft_speedup"}  # fmt: skip
SUMMARY_KEYS = {"ceilings", "ceiling_rollout_speedup", "ceiling_step_speedup",
                "ceiling_acceptance_length_mean", "ceiling_same_tokens", "steps",
                "rollout_speedup", "step_speedup", "free_drafter_rollout_speedup",
                "free_drafter_step_speedup", "gen_share_of_plain_step",
                "plain_time_share_at_most_4_rows", "all_same_tokens",
                "acceptance_length_mean"}  # fmt: skip
STEP_KEYS = {"step", "plain_gen_s", "spec_gen_s", "learn_s", "spec_draft_s",
             "gen_share_of_plain_step", "same_tokens", "tokens", "length_p10_p50_p90_max",
             "plain_time_share_at_most_4_rows", "acceptance_length", "spec_step_share",
             "reward_mean", "accuracy", "loss", "oracle"}  # fmt: skip
META_KEYS = {"command", "date", "machine", "versions", "settings", "configs"}


@pytest.fixture
def tiny_runs(monkeypatch):
    """``build_run`` with a tiny random model, the id codec and the mod-four task."""
    from specrl.pipelines import build

    real = build.build_run

    def tiny(cfg, **kwargs):
        return real(cfg, model=make_tiny(0), codec=IdCodec(), env=ModFourEnv(num_train=24))

    monkeypatch.setattr(build, "build_run", tiny)


def bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "r.json"
    sets = [a for item in TRAIN for a in ("--set", item)]
    result = CliRunner().invoke(app, ["bench", "grpo", *args, *sets, "--json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


def test_runs_mode_end_to_end(tiny_runs, tmp_path):
    data = bench(tmp_path, "--steps", "2", "--warmup", "1", "--drafters", "ngram",
                 "--batches", "2", "--set", "train.rollout.num_spec_tokens=2")  # fmt: skip
    assert set(data["meta"]) >= META_KEYS and {"results", "batch_sweep"} <= set(data)
    none, ngram = data["results"]
    assert [none["spec"], ngram["spec"]] == ["none", "ngram"]
    for r in (none, ngram):
        assert set(r) == RESULT_KEYS and r["steps_measured"] == 1
        assert close(r["rollout_speedup"], r["rollout_tokens_per_s"] / none["rollout_tokens_per_s"])
        assert close(r["gen_time_ratio"], none["gen_time_s"] / r["gen_time_s"])
        assert close(r["step_speedup"], none["step_time_s"] / r["step_time_s"])
    # the same weights, prompts and seeds; sample-exact verification: the same tokens, rewards
    assert none["reward_mean"] == ngram["reward_mean"] and none["gen_tokens"] == ngram["gen_tokens"]
    (row,) = data["batch_sweep"]
    assert set(row) >= SWEEP_KEYS and (row["spec"], row["max_batch"]) == ("ngram", 2)
    assert close(row["rollout_speedup"], row["spec_tokens_per_s"] / row["plain_tokens_per_s"])
    assert close(row["plain_tokens_per_s"], row["plain_tokens"] / row["plain_time_s"])
    assert row["plain_roofline_tokens_per_s"] > 0
    # the run configs: train.* forwarded; k only where it applies (not to the plain run)
    configs = data["meta"]["configs"]
    assert set(configs) == {"none", "ngram"}
    assert "prompts_per_step = 2" in configs["none"] and "steps = 2" in configs["none"]
    assert "num_spec_tokens = 2" in configs["ngram"]
    assert "\nnum_spec_tokens = " not in configs["none"]


def test_interleaved_mode_with_the_ceiling(tiny_runs, tmp_path):
    data = bench(tmp_path, "--mode", "interleaved", "--steps", "2", "--warmup", "1",
                 "--ceiling", "--ceiling-accept", "1.0,0.5", "--ceiling-k", "4")  # fmt: skip
    assert set(data["meta"]) >= META_KEYS
    steps, summary = data["steps"], data["summary"]
    assert [r["step"] for r in steps] == [0, 1] and all(set(r) == STEP_KEYS for r in steps)
    assert set(summary) == SUMMARY_KEYS and set(summary["ceilings"]) == {"1.0", "0.5"}
    # sample-exact verification (suffix, 'auto'): plain, speculative and oracle tokens agree
    assert summary["all_same_tokens"] and all(r["same_tokens"] for r in steps)
    assert all(o["same"] for r in steps for o in r["oracle"].values())
    kept = steps[1:]  # after the warmup
    plain = sum(r["plain_gen_s"] for r in kept)
    spec = sum(r["spec_gen_s"] for r in kept)
    learn = sum(r["learn_s"] for r in kept)
    assert summary["steps"] == 1 and close(summary["rollout_speedup"], plain / spec)
    assert close(summary["step_speedup"], (plain + learn) / (spec + learn))
    oracle = sum(r["oracle"]["1.0"]["gen_s"] for r in kept)
    assert close(summary["ceiling_rollout_speedup"], plain / oracle)
    assert summary["ceiling_rollout_speedup"] == summary["ceilings"]["1.0"]["rollout_speedup"]
    assert 'mode = "interleaved"' in data["meta"]["settings"]


def test_ratios_come_from_the_means():
    results = with_ratios([
        {"spec": "none", "rollout_tokens_per_s": 50.0, "gen_time_s": 4.0, "step_time_s": 10.0},
        {"spec": "ngram", "rollout_tokens_per_s": 75.0, "gen_time_s": 2.0, "step_time_s": 8.0},
        {"spec": "idle", "rollout_tokens_per_s": 0.0, "gen_time_s": 0.0, "step_time_s": 5.0},
    ])  # fmt: skip
    assert [r["rollout_speedup"] for r in results] == [1.0, 1.5, 0.0]
    assert [r["gen_time_ratio"] for r in results] == [1.0, 2.0, None]  # no time: no ratio
    assert [r["step_speedup"] for r in results] == [1.0, 1.25, 2.0]


def test_summary_sums_the_steps_before_dividing():
    rows = [{"plain_gen_s": p, "spec_gen_s": s, "learn_s": 1.0, "spec_draft_s": 0.5,
             "plain_time_share_at_most_4_rows": 0.5, "same_tokens": True,
             "acceptance_length": 2.0, "oracle": {"1.0": {"gen_s": 1.0, "acceptance_length": 5.0,
                                                           "same": True}}}
            for p, s in ((4.0, 2.0), (2.0, 2.0))]  # fmt: skip
    s = summarize(rows)
    assert s["rollout_speedup"] == 6.0 / 4.0 and s["step_speedup"] == 8.0 / 6.0
    assert s["free_drafter_rollout_speedup"] == 6.0 / 3.0
    assert s["ceilings"]["1.0"]["rollout_speedup"] == 3.0 == s["ceiling_rollout_speedup"]
    assert summarize([{**r, "oracle": {}} for r in rows])["ceilings"] == {}


def test_the_oracle_drafts_its_book_and_spoils_at_its_acceptance():
    spec = oracle_spec({7: [1, 2, 3, 4, 5, 6]}, 3, 0.5)
    assert oracle_spec({}, 2).method == spec.method  # registered once, used again
    assert spec.exact == "sample" and spec.options["accept"] == 0.5
    perfect = OracleProposer({7: [1, 2, 3, 4, 5, 6]})
    assert perfect.spoil([3, 4, 5], 7, 2) == [3, 4, 5]
    spoiled = OracleProposer({7: [1, 2, 3, 4, 5, 6]}, accept=0.5).spoil([3, 4, 5], 7, 2)
    assert len(spoiled) == 3 and sum(a != b for a, b in zip(spoiled, [3, 4, 5], strict=True)) <= 1
