"""Training entry points: run the configured loop (sync or async) and summarise the run.

Contract:
- ``train(parts, run_dir, resume=False, progress=True, stop_after=None, echo=None)`` runs (or
  continues, ``resume``) ``run.steps`` steps with the loop ``pipeline.mode`` names
  (``sync.train_sync`` or ``async_.train_async``); ``stop_after`` ends the call after that many
  updates in total (an interruption, for tests). Evaluates after the last step when due.
  Returns this call's metric rows.
- ``run_training(...)``: ``train``, then (speculation on, ``compare_plain``) the speed check
  ``speed.measure_speedup`` on the next step's prompts; writes and returns the run summary
  (``summary.json``).
"""

from __future__ import annotations

import json
import time
from typing import Any

from tqdm import tqdm

from specrl.pipelines.async_ import train_async
from specrl.pipelines.build import RunParts
from specrl.pipelines.checkpoint import RunDir
from specrl.pipelines.evaluate import eval_due
from specrl.pipelines.loop import Echo, Log, log_eval, open_run
from specrl.pipelines.speed import measure_speedup
from specrl.pipelines.sync import train_sync

LOOPS = {"sync": train_sync, "async": train_async}


def train(
    parts: RunParts,
    run_dir: str,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    echo: Echo | None = None,
) -> list[dict[str, Any]]:
    """See the module docstring."""
    cfg, run = parts.cfg, RunDir(run_dir)
    start = open_run(parts, run, resume)
    end = min(cfg.run.steps, stop_after if stop_after is not None else cfg.run.steps)
    bar = tqdm(disable=not progress, desc=f"train ({cfg.pipeline.mode})", unit="step",
               initial=start, total=cfg.run.steps)  # fmt: skip
    log = Log(bar, echo)
    rows = LOOPS[cfg.pipeline.mode](parts, run, start, end, log)
    bar.close()
    if end == cfg.run.steps and eval_due(cfg, end):
        log_eval(parts, run, end, log)
    return rows


def run_training(
    parts: RunParts,
    run_dir: str,
    resume: bool = False,
    compare_plain: bool = True,
    progress: bool = True,
    echo: Echo | None = None,
) -> dict[str, Any]:
    """See the module docstring."""
    from specrl.pipelines.report import summarize

    t0 = time.perf_counter()
    train(parts, run_dir, resume=resume, progress=progress, echo=echo)
    speed = None
    if compare_plain and parts.backend.spec.enabled:
        speed = measure_speedup(parts, parts.cfg.run.steps)
    run = RunDir(run_dir)
    summary = summarize(run.rows(run.metrics), run.rows(run.evals), speed)
    summary["wall_s"] = time.perf_counter() - t0
    run.summary.write_text(json.dumps({"summary": summary, "speed": speed}, indent=1))
    return summary
