"""benchmarks/gpu_check.py: its ``--smoke`` run (the GPU check's whole path, tiny, on the CPU) and
its refusal to run the full check without CUDA. No timing thresholds: the numbers are the GPU
run's (benchmarks/results/gpu_check.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
SUMMARY_KEYS = {"gpu", "learner_mfu_1b", "learner_over_transformers", "grpo_generation_share",
                "grpo_spec_step_speedup", "exactness_tests_passed"}  # fmt: skip


def run_script(*args: str, timeout: float = 420) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    proc = run_script("--smoke", "--device", "cpu", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_summary_holds_every_key(smoke: dict) -> None:
    s = smoke["summary"]
    assert set(s) == SUMMARY_KEYS
    assert s["gpu"] == "cpu (smoke)"
    assert s["learner_mfu_1b"] is None  # no datasheet peak on a CPU
    assert s["learner_over_transformers"] > 0
    assert 0 < s["grpo_generation_share"] < 1
    assert s["grpo_spec_step_speedup"] > 0
    assert s["exactness_tests_passed"] is True


def test_every_section_ran_without_error(smoke: dict) -> None:
    sections = ("floors", "learner", "grpo", "exactness")
    assert smoke["meta"]["sections_done"] == ["floors", "exactness", "learner", "grpo"]
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


def test_exactness_tests_ran_and_passed(smoke: dict) -> None:
    e = smoke["exactness"]
    assert e["passed"] > 0
    assert e["failed"] == e["errors"] == 0
    assert e["all_passed"] is True


def test_nothing_missing_on_the_gpu_machine_is_imported(smoke: dict) -> None:
    """reasoning-gym, gguf, vllm and ray are not on the GPU machine (docs/gpu.md)."""
    assert smoke["meta"]["imported_absent_on_gpu"] == []


def test_without_cuda_the_full_check_exits_2_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    devices = ["cpu"] + ([] if torch.cuda.is_available() else ["auto"])
    for device in devices:
        proc = run_script("--device", device, "--out", str(out), timeout=60)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "--smoke" in lines[0]
        assert not out.exists()


def test_smoke_never_writes_the_committed_gpu_result() -> None:
    committed = REPO / "benchmarks" / "results" / "gpu_check.json"
    before = committed.read_bytes() if committed.exists() else None
    proc = run_script("--smoke", "--device", "cpu", "--out", str(committed), timeout=60)
    assert proc.returncode == 2
    assert (committed.read_bytes() if committed.exists() else None) == before
