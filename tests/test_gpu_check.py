"""`specrl bench gpu --smoke` (the GPU check's whole path, tiny, on the CPU) end to end through
the CLI in a fresh interpreter, and the engine section's parts (``specrl.gpubench``). No timing
thresholds: the numbers are the GPU run's (benchmarks/results/gpu_check.json)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

from specrl.config_gpubench import SECTIONS, load_gpubench
from specrl.engine import Engine
from specrl.gpubench.common import inference_model
from specrl.gpubench.engine import CONTENDERS, ENGINE_KEYS
from specrl.gpubench.oracle import book_of, solve_alpha
from specrl.gpubench.rollouts import book_spec, requests, settle_book, warm_seconds
from specrl.gpubench.sizes import ENGINE_SMOKE, TINY
from tests.test_bench_gpu_cli import run_cli

REPO = Path(__file__).resolve().parents[1]
SUMMARY_KEYS = {"gpu", "learner_mfu_1b", "learner_over_transformers", "grpo_generation_share",
                "grpo_spec_step_speedup", "exactness_tests_passed", *ENGINE_KEYS}  # fmt: skip


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str, str]:
    """The smoke check's JSON, its path, the command's stdout and stderr."""
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    proc = run_cli("--smoke", "--device", "cpu", "--out", str(out), timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), out, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def smoke(smoke_run) -> dict:
    return smoke_run[0]


def test_the_cli_prints_the_summary_and_records_its_settings(smoke_run) -> None:
    """The summary is stdout's one line; ``meta.settings`` is TOML that ``--config`` reads back
    (defaults resolved: the budget, the result path, the engine's step graphs)."""
    result, out, stdout, stderr = smoke_run
    assert json.loads(stdout) == result["summary"]
    assert f"wrote {out}" in stderr
    assert result["meta"]["command"].startswith("specrl bench gpu --smoke")
    cfg = load_gpubench(tomllib.loads(result["meta"]["settings"]))
    assert (cfg.run.mode, cfg.run.smoke, cfg.run.device) == ("check", True, "cpu")
    assert (cfg.run.budget_s, cfg.check.step_graphs) == (300.0, "static")
    assert cfg.run.out == str(out.resolve()) and cfg.check.sections == list(SECTIONS)


def test_summary_holds_every_key(smoke: dict) -> None:
    s = smoke["summary"]
    assert set(s) == SUMMARY_KEYS
    assert s["gpu"] == "cpu (smoke)"
    assert s["learner_mfu_1b"] is None  # no datasheet peak on a CPU
    assert s["learner_over_transformers"] > 0
    assert 0 < s["grpo_generation_share"] < 1
    assert s["grpo_spec_step_speedup"] > 0
    assert s["exactness_tests_passed"] is True
    for key in ENGINE_KEYS:
        assert isinstance(s[key], float) and s[key] > 0, (key, s[key])


def test_every_section_ran_without_error(smoke: dict) -> None:
    sections = ("floors", "engine", "learner", "grpo", "exactness")
    assert smoke["meta"]["sections_done"] == ["floors", "exactness", "engine", "learner", "grpo"]
    for name in sections:
        assert "error" not in smoke[name], (name, smoke[name].get("traceback"))
    for row in smoke["learner"]["rows"]:
        assert "error" not in row, row.get("traceback")
    assert smoke["meta"]["smoke"] is True


def test_floors_are_positive(smoke: dict) -> None:
    f = smoke["floors"]
    assert f["copy_bandwidth_bytes_s"] > 0
    assert f["gemm_bf16_flops"] > 0


def test_learner_rows_train_the_same_tokens(smoke: dict) -> None:
    rows = {(r["learner"], r.get("bf16_mode")): r for r in smoke["learner"]["rows"]}
    assert set(rows) == {("specrl", "autocast"), ("specrl", "params"), ("transformers", None)}
    tokens = {r["forward_tokens"] for r in rows.values()}
    assert len(tokens) == 1 and tokens.pop() > 0
    for row in rows.values():
        assert row["tokens_per_s"] > 0
        assert row["time_s"] > 0
        assert row["timed_steps"] >= 1


def test_grpo_steps_time_generation_and_learning(smoke: dict) -> None:
    grpo = smoke["grpo"]
    assert grpo["steps"]
    for step in grpo["steps"]:
        assert 0 < step["gen_share_of_plain_step"] < 1
        for key in ("plain_step_s", "oracle_step_s", "head_step_s", "learn_s"):
            assert step[key] > 0
        # sample-exact verification: every variant emits the plain rollout's tokens
        assert step["oracle_same_tokens"] and step["head_same_tokens"]
        assert step["oracle_acceptance_length"] >= 1
    assert grpo["summary"]["same_tokens"] is True


def engine_points(engine: dict) -> list[dict]:
    """Every point of the engine section: decode contenders, verify and rollout rows."""
    decode = [row[name] for row in engine["decode"] for name in CONTENDERS if name in row]
    return decode + engine["verify"] + engine["rollouts"] + [engine["transformers"]]


def test_engine_points_ran_side_by_side(smoke: dict) -> None:
    engine = smoke["engine"]
    assert engine["step_graphs"] == "static" and engine["skipped"] == []
    for point in engine_points(engine):
        assert "error" not in point and "skipped" not in point, point
    rows = {r["batch_size"]: r for r in engine["decode"]}
    assert set(rows) == {1, 64}
    assert "transformers" in rows[64]
    for b, row in rows.items():
        assert row["specrl"]["step_graphs"] == "static"
        assert row["specrl_off"]["step_graphs"] == "off"
        for name in CONTENDERS:
            if name in row:
                assert row[name]["step_s"] > 0
        assert row["specrl"]["record_batch_sizes"] == [b]  # every step decoded all B rows
    (verify,) = engine["verify"]
    assert (verify["batch_size"], verify["k"]) == (1, 3)
    assert verify["verify_s"] > 0 and verify["verify_steps"] > 0
    assert engine["floor"]["floor_s"] > 0


def test_engine_trace_calibrates_the_simulator(smoke: dict) -> None:
    """The trace parses, names a model spec the simulator loads, and fits on one batch size's
    records while predicting the other's."""
    from specrl.costmodel.specs import load_hardware, load_model
    from specrl.sim.calibrate import fit_trace, parse_trace

    trace = parse_trace(smoke["engine"]["trace"])
    assert {r.kind for r in trace.records} == {"decode", "verify"}
    assert all(r.config == f"bs{r.batch_size}" for r in trace.records)
    assert {r.batch_size for r in trace.records if r.kind == "decode"} == {1, 64}
    assert load_model(trace.model).layers == 2
    report = fit_trace(trace, load_hardware(trace.hardware), heldout_configs=("bs64",))
    assert report.n_heldout == sum(r.batch_size == 64 for r in trace.records)


def test_specrl_simulate_calibrate_reads_the_result(smoke: dict, tmp_path: Path) -> None:
    """`specrl simulate calibrate RESULT --fit-configs bs1` fits the smoke run's own trace,
    reports the held-out batch size and predicts every measured rollout (no error bound: a
    2-layer model on 2 CPU cores; the GPU run's figures are the issue's)."""
    result = tmp_path / "gpu_check.json"
    result.write_text(json.dumps(smoke))
    cmd = [sys.executable, "-m", "specrl.cli", "simulate", "calibrate", str(result),
           "--fit-configs", "bs1", "--out", str(tmp_path / "fit.toml"), "--json"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out["heldout_configs"]) == {"bs64"}
    done = [r for r in smoke["engine"]["rollouts"] if "speedup" in r]
    predicted = out["rollouts"]["rollouts"]
    assert [r["config"] for r in predicted] == [r["config"] for r in done] and predicted
    assert all(r["predicted_plain_s"] > 0 and r["predicted_spec_s"] > 0 for r in predicted)


def test_engine_oracle_rollouts_emit_plain_tokens_at_their_acceptance(smoke: dict) -> None:
    rows = smoke["engine"]["rollouts"]
    assert {(r["batch_size"], r["acceptance_length"]) for r in rows} == {
        (b, al) for b in (1, 8) for al in (2.0, 2.8, 3.3)
    }
    for r in rows:
        assert r["same_tokens"] is True, r["config"]
        assert r["same_as_book"] is True and r["book_rounds"] == 0, r  # the CPU rounds alike
        assert r["book_settled"] is True and r["spec_runs"] in (1, 2), r
        assert r["speedup"] == pytest.approx(r["plain_s"] / r["spec_s"])
        assert r["spec_tokens_per_s"] > 0 and r["plain_tokens_per_s"] > 0
        # the acceptance pattern depends on the seeds only: 8 rows x 64 tokens measure it to
        # within ~0.1 (alpha from the untruncated 1 / (1 - alpha) misses 2.8 and 3.3 by ~0.5, ~0.8)
        if r["batch_size"] == 8:
            assert abs(r["measured_acceptance_length"] - r["acceptance_length"]) < 0.15, r


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the random weights (inference_model draws from the global generator)
    return inference_model(TINY, torch.device("cpu"), torch.bfloat16)


def test_settle_book_moves_past_a_flipped_token() -> None:
    """A book that leaves the engine's own rollout (as a token flipped by a verify step's
    rounding on a GPU would) is replaced by the rollout the oracle reproduces: one round to
    find the rollout, a second that reproduces it; the settled book drafts every token again."""
    engine = Engine(tiny_model(), max_batch=4, max_context=96)
    reqs = requests(list(range(3, 19)), 4, 40)
    plain = book_of(engine.generate(reqs))
    assert settle_book(engine, reqs, plain, ENGINE_SMOKE) == (plain, 0, True)
    damaged = {s: t[:30] + [t[30] + 1] + t[31:] for s, t in plain.items()}  # a flip at 30
    assert settle_book(engine, reqs, damaged, ENGINE_SMOKE, deadline=0.0) == (plain, 1, False)
    book, rounds, settled = settle_book(engine, reqs, damaged, ENGINE_SMOKE)
    assert (book, rounds, settled) == (plain, 1, True)  # sample-exact: past the flip, plain's
    accepted = {}
    for name, b in (("plain", plain), ("damaged", damaged), ("settled", book)):
        engine.generate(reqs, spec=book_spec(ENGINE_SMOKE, b, 1.0))
        accepted[name] = engine.stats.acceptance_length
    assert accepted["settled"] == accepted["plain"] > accepted["damaged"]  # none past 30


@pytest.mark.parametrize("batch", [1, 8])
def test_settle_book_under_shape_dependent_rounding(
    monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    """A stand-in for a GPU's rounding: forwards of one token per row (plain steps) shift the
    logits a little, so plain sampling and verify steps (k + 1 tokens) draw different tokens
    at many positions (random weights give near-uniform logits). The plain book is off at
    once; drafting wrong tokens past a row's flip, the oracle's first rollout is made of verify
    steps only and the second reproduces it; a timed run at alpha < 1 keeps to the settled
    book at about its target acceptance length."""
    model = tiny_model()
    forward = model.forward

    def shifted(ids: torch.Tensor, positions: torch.Tensor, *args, **kwargs):
        out = forward(ids, positions, *args, **kwargs)
        if ids.shape[1] != 1:
            return out
        vocab = torch.arange(out.logits.shape[-1], device=ids.device)
        shift = 0.05 * torch.cos(positions[..., None] * 0.7 + vocab)  # [B, 1, V]
        return replace(out, logits=out.logits + shift.to(out.logits.dtype))

    monkeypatch.setattr(model, "forward", shifted)
    engine = Engine(model, max_batch=8, max_context=128)
    reqs = requests(list(range(3, 19)), batch, 64)
    plain = book_of(engine.generate(reqs))
    book, rounds, settled = settle_book(engine, reqs, plain, ENGINE_SMOKE)
    assert book != plain and rounds == 1 and settled
    target = 2.8
    alpha = solve_alpha(target, ENGINE_SMOKE.rollout_k)
    out = engine.generate(reqs, spec=book_spec(ENGINE_SMOKE, book, alpha))
    assert book_of(out) == book
    assert abs(engine.stats.acceptance_length - target) < (0.3 if batch == 8 else 0.8)


def test_a_timed_run_that_built_steps_is_run_again() -> None:
    """``warm_seconds``: a call that built static steps (a new batch bucket) is timed again,
    one that built none once; an engine without static steps never runs twice."""
    model = tiny_model()
    runs = {}
    for mode in ("static", "off"):
        engine = Engine(model, max_batch=8, max_context=96, step_graphs=mode)
        for b in (1, 1, 4):
            calls = []
            generate = partial(engine.generate, requests([3, 4, 5], b, 8))
            _, out, n = warm_seconds(engine, partial(counted, calls, generate))
            assert len(out) == b and len(calls) == n
            runs[mode, b] = [*runs.get((mode, b), []), n]
    assert runs == {("static", 1): [2, 1], ("static", 4): [2], ("off", 1): [1, 1], ("off", 4): [1]}


def counted(calls: list, fn):
    """``fn()``, its call noted in ``calls``."""
    calls.append(1)
    return fn()


@pytest.mark.parametrize("k", [1, 3, 5, 7])
@pytest.mark.parametrize("target", [1.5, 2.0, 2.8, 3.3])
def test_solve_alpha_gives_the_acceptance_length(k: int, target: float) -> None:
    if target >= k + 1:
        with pytest.raises(ValueError, match="outside"):
            solve_alpha(target, k)
        return
    alpha = solve_alpha(target, k)
    assert 0 < alpha < 1
    assert (1 - alpha ** (k + 1)) / (1 - alpha) == pytest.approx(target, abs=1e-9)


def test_exactness_tests_ran_and_passed(smoke: dict) -> None:
    e = smoke["exactness"]
    assert e["passed"] > 0
    assert e["failed"] == e["errors"] == 0
    assert e["all_passed"] is True


def test_nothing_missing_on_the_gpu_machine_is_imported(smoke: dict) -> None:
    """reasoning-gym, gguf, vllm and ray are not on the GPU machine (docs/gpu.md): neither the
    main CLI (``python3 -m specrl.cli bench gpu`` there) nor any section imports them."""
    assert smoke["meta"]["imported_absent_on_gpu"] == []
