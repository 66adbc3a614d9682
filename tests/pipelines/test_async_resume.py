"""Kill-and-resume of an asynchronous run: a process killed with SIGKILL while the producer runs
ahead, then resumed, trains on every step's prompt groups exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specrl.pipelines.train import train
from tests.pipelines.pipeline_fakes import draw_prompts, tiny_config, tiny_parts

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10
OVERRIDES = ("pipeline.mode=async", "pipeline.max_staleness=2", f"run.steps={STEPS}",
             "run.checkpoint_every=1", "run.eval_every=0", "rollout.spec=suffix",
             "rollout.max_new_tokens=24")  # fmt: skip
SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from specrl.pipelines.train import train
from tests.pipelines.pipeline_fakes import tiny_config, tiny_parts
train(tiny_parts(tiny_config(*sys.argv[2:]), num_train=5), sys.argv[1], progress=False)
"""


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def _kill_after(run: Path, rows: int, overrides: tuple[str, ...], timeout: float = 120.0) -> None:
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(run), *overrides], cwd=ROOT,
                            env=env, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while len(_rows(run / "metrics.jsonl")) < rows:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.usefixtures("one_thread")
def test_killed_on_policy_async_run_resumes_exactly(tmp_path):
    """At staleness 0 the run is deterministic: killed and resumed, its final weights equal an
    uninterrupted run's byte for byte (a step learned twice or skipped would change them)."""
    overrides = (*OVERRIDES, "rollout.placement=inline", "pipeline.max_staleness=0")
    full, run = tmp_path / "full", tmp_path / "run"
    train(tiny_parts(tiny_config(*overrides), num_train=5), str(full), progress=False)
    _kill_after(run, rows=4, overrides=overrides)
    assert len(_rows(run / "metrics.jsonl")) < STEPS
    train(tiny_parts(tiny_config(*overrides), model_seed=3, num_train=5), str(run), resume=True,
          progress=False)  # fmt: skip
    last = f"checkpoints/step_{STEPS:06d}/policy.safetensors"
    assert (run / last).read_bytes() == (full / last).read_bytes()
    assert [r["prompts"] for r in _rows(run / "metrics.jsonl")] == [
        r["prompts"] for r in _rows(full / "metrics.jsonl")
    ]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("placement", ["inline", "process"])
def test_killed_async_run_resumes_without_losing_or_repeating_groups(tmp_path, placement):
    run, overrides = tmp_path / "run", (*OVERRIDES, f"rollout.placement={placement}")
    _kill_after(run, rows=4, overrides=overrides)
    assert len(_rows(run / "metrics.jsonl")) < STEPS  # killed mid-run
    parts = tiny_parts(tiny_config(*overrides), model_seed=3, num_train=5)
    try:
        train(parts, str(run), resume=True, progress=False)
    finally:
        parts.backend.close()
    rows = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    expected = [[p.id for p in draw_prompts(parts, s)] for s in range(STEPS)]
    assert [r["prompts"] for r in rows] == expected
    assert [r["policy_version"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["staleness_max"] <= 2 for r in rows)
