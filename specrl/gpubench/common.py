"""What every part of ``specrl bench gpu`` shares: the target, the clock, timing, random models.

Contract: ``prepare(cfg)`` resolves the run's device and result path (``Target``) or raises
``GpuBenchError`` with one line, before any work and creating nothing. ``Clock`` holds the time
budget and prints progress lines to stderr; ``guarded(clock, name, fn)`` records ``fn``'s error
instead of raising, so one failed section or row never stops the others. ``timed`` / ``seconds``
time synchronised calls. ``random_model`` (float32, trainable) and ``inference_model`` (any
dtype, allocated directly on the device, eval) build random models of a shape (``sizes``).
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from specrl.config_gpubench import GpuBenchCfg
from specrl.errors import one_line
from specrl.fsutil import result_file_problem
from specrl.models.config import ModelConfig
from specrl.models.device import DeviceError, resolve_device, synchronize
from specrl.models.rope import rope_inv_freq
from specrl.models.transformer import Transformer

REPO = Path(__file__).resolve().parents[2]  # the checkout (the exactness tests, the results)
# The committed GPU results, per run.mode: a smoke run never writes them (it writes SMOKE_FILES
# in the temporary directory by default).
RESULTS = MappingProxyType({
    "check": REPO / "benchmarks" / "results" / "gpu_check.json",
    "calibrate": REPO / "benchmarks" / "results" / "gpu_calibrate_trace.json",
})  # fmt: skip
SMOKE_FILES = MappingProxyType(
    {"check": "gpu_check_smoke.json", "calibrate": "gpu_calibrate_smoke.json"}
)


class GpuBenchError(ValueError):
    """A run that cannot start here; the message is one line."""


@dataclass(frozen=True)
class Target:
    """Where a run goes: its device and its result file."""

    device: torch.device
    out: Path


def prepare(cfg: GpuBenchCfg) -> Target:
    """The run's device and result path: a device that is not here, no CUDA without
    ``run.smoke``, a smoke run aimed at a committed result and an unwritable path are refused
    (``GpuBenchError``); nothing is created."""
    run = cfg.run
    try:
        device = resolve_device(run.device)
    except DeviceError as e:
        raise GpuBenchError(str(e)) from None
    if device.type != "cuda" and not run.smoke:
        raise GpuBenchError(f"needs a CUDA GPU (device {run.device!r} is {device}); use --smoke "
                            "(run.smoke=true) for the CPU smoke test")  # fmt: skip
    committed = RESULTS[run.mode]
    smoke_out = Path(tempfile.gettempdir()) / SMOKE_FILES[run.mode]
    out = Path(run.out).expanduser() if run.out else smoke_out if run.smoke else committed
    if run.smoke and out.resolve() == committed.resolve():
        raise GpuBenchError(f"--smoke does not write the committed GPU result {out}")
    if problem := result_file_problem(out):
        raise GpuBenchError(problem)
    return Target(device, out)


def settings_record(
    cfg: GpuBenchCfg, target: Target, budget_s: float, step_graphs: str | None = None
) -> str:
    """The settings a run used as TOML that ``--config`` reads back (its JSON's
    ``meta.settings``): ``cfg`` with the result path, the budget and the engine section's
    ``step_graphs`` resolved; a field that cannot apply only as a comment."""
    run = cfg.run.model_copy(update={"out": str(target.out.resolve()), "budget_s": budget_s})
    check = cfg.check.model_copy(update={"step_graphs": step_graphs or cfg.check.step_graphs})
    return cfg.model_copy(update={"run": run, "check": check}).to_toml()


class Clock:
    """The run's time budget and its progress lines (stderr)."""

    def __init__(self, budget_s: float) -> None:
        self.start, self.budget_s = time.perf_counter(), budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def deadline(self, share: float, reserve: float = 0.0) -> float:
        """A ``perf_counter`` deadline ``share`` of what is left after ``reserve`` seconds."""
        return time.perf_counter() + max(0.0, self.left() - reserve) * share

    def log(self, msg: str) -> None:
        print(f"[bench gpu {self.elapsed():6.1f}s] {msg}", file=sys.stderr, flush=True)


def guarded(clock: Clock, name: str, fn: Callable[[], dict]) -> dict:
    """``fn()``'s result with its seconds, or its error (one line and the traceback's tail):
    one failed section or row never stops the others."""
    clock.log(f"{name} ...")
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 (recorded, and the run goes on)
        out = {
            "error": f"{type(e).__name__}: {one_line(e)}",
            "traceback": traceback.format_exc()[-3000:],
        }
    out["seconds"] = time.perf_counter() - t0
    clock.log(f"{name}: {out.get('error', 'done')} ({out['seconds']:.1f}s)")
    free_memory()
    return out


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed(
    fn: Callable[[], object],
    device: torch.device,
    repeats: int,
    warmup: int = 1,
    deadline: float = math.inf,
) -> list[float]:
    """Seconds of each timed call of ``fn`` (synchronised), after ``warmup`` untimed ones;
    repeats stop at ``deadline`` once one call is timed."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: list[float] = []
    while len(times) < repeats and (not times or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def seconds(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Wall seconds of ``fn()`` (synchronised) and its result."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def median_of(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return float(statistics.median(values)) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def random_model(config: ModelConfig, device: torch.device, seed: int = 0) -> Transformer:
    """A float32 ``Transformer`` built on ``device``, to train: matrices ~ N(0, 0.02)
    (transformers' initializer_range), norms 1."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    return model


def inference_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> Transformer:
    """A random model allocated directly on ``device`` in ``dtype`` (no float32 copy first:
    an 8B model fits where its float32 copy would not), every parameter ~ N(0, 0.02) from the
    global generator; eval mode, no grad."""
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(dtype).to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        model.inv_freq.copy_(rope_inv_freq(config))
    return model.eval().requires_grad_(False)


def model_flops(config: ModelConfig, tokens: int, positions: int) -> float:
    """``specrl.models.flops.train_flops`` from the shapes alone (for the transformers row)."""
    head = config.vocab_size * config.hidden_size
    trunk = config.num_parameters() - head * (1 if config.tie_word_embeddings else 2)
    return 6.0 * trunk * tokens + 6.0 * head * positions
