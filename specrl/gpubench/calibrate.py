"""The calibration grid (``specrl bench gpu --calibrate``): the engine's forward over shapes.

Contract: ``run_calibrate(cfg, target)`` builds a random bf16 model of Llama-3.1-8B's shapes
(``run.smoke``: ``sizes.TINY`` and a small grid) on ``target.device`` and, for every grid point
(kind, batch B, tokens per sequence T, context C), allocates the engine's KV cache for B
sequences of C + T positions and times the engine's forward: B x T new tokens at positions
C..C+T-1 (kv_len C + T), logits at every position (``decode``: T = 1; ``verify``: T = k + 1 for
each k of ``calibrate.ks``) or, for ``prefill`` (C = 0), at the last one, exactly as
``specrl.engine`` calls it; the median of ``calibrate.repeats`` synchronised forwards after
``calibrate.warmup`` untimed ones. Only the forward is timed (no sampling, no engine
bookkeeping: on GPUs the fitted step overhead covers those). Writes the trace that ``specrl
simulate calibrate`` reads (``trace.trace_document``: model ``llama-3.1-8b``, or the tiny
model's spec beside the trace), one record per point; points stop at the time budget
(``run.budget_s``, default 270 s), keeping what was measured.

The default grid on one H100/H200: contexts 512 to 8192, decode B = 1, 2, 4, ..., 512 and verify
(k = 3) B = 1, ..., 256, keeping points whose KV cache B * (C + T) fits
``calibrate.max_kv_tokens`` (300k tokens: 39 GB of bf16 KV beside 16 GB of weights): 40 decode
+ 39 verify points, plus prefills of 128, 512 and 1024 tokens; 82 points x (2 + 5) forwards,
estimated at about one minute.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import torch

from specrl.bench import run_metadata
from specrl.config_gpubench import GpuBenchCfg
from specrl.fsutil import atomic_write
from specrl.gpubench.common import Target, inference_model, settings_record, timed
from specrl.gpubench.sizes import LLAMA_8B, TINY
from specrl.gpubench.trace import trace_document
from specrl.models.device import synchronize
from specrl.models.transformer import Transformer

BUDGET_S = 270.0  # run.budget_s unset
MODEL_NAME = "llama-3.1-8b"  # the simulator's bundled spec of LLAMA_8B


@dataclass(frozen=True)
class Point:
    """One grid point: ``batch`` sequences, ``tokens`` new tokens each, ``context`` cached."""

    kind: str  # "decode" | "verify" | "prefill"
    batch: int
    tokens: int
    context: int


@dataclass(frozen=True)
class Grid:
    """The shapes timed: decode (T = 1) and verify (T = k + 1 for each of ``ks``) at every
    context and batch whose KV cache fits ``max_kv_tokens``, and prefills (C = 0)."""

    contexts: tuple[int, ...]
    decode_batches: tuple[int, ...]
    verify_batches: tuple[int, ...]
    ks: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    max_kv_tokens: int

    def points(self) -> list[Point]:
        """Decode and verify points whose KV cache fits, then the prefill points."""
        pts = [
            Point(kind, b, t, c)
            for c in self.contexts
            for kind, batches, ts in (
                ("decode", self.decode_batches, (1,)),
                ("verify", self.verify_batches, tuple(k + 1 for k in self.ks)),
            )
            for t in ts
            for b in batches
            if b * (c + t) <= self.max_kv_tokens
        ]
        return pts + [Point("prefill", 1, t, 0) for t in self.prefill_tokens]


def powers_of_two(top: int) -> tuple[int, ...]:
    return tuple(2**i for i in range(top.bit_length()) if 2**i <= top)


def default_grid(ks: tuple[int, ...], max_kv_tokens: int) -> Grid:
    return Grid(
        (512, 1024, 2048, 4096, 8192),
        powers_of_two(512),
        powers_of_two(256),
        ks,
        (128, 512, 1024),
        max_kv_tokens,
    )


def tiny_grid(ks: tuple[int, ...]) -> Grid:
    return Grid((16, 64), (1, 2, 4, 8), (1, 2, 4), ks, (16, 32), 4096)


def grid_of(cfg: GpuBenchCfg) -> Grid:
    """The run's grid: ``tiny_grid`` with ``run.smoke``, else ``default_grid``."""
    ks = tuple(cfg.calibrate.ks)
    return tiny_grid(ks) if cfg.run.smoke else default_grid(ks, cfg.calibrate.max_kv_tokens)


@torch.inference_mode()
def time_point(
    model: Transformer, pt: Point, warmup: int, repeats: int, device: torch.device
) -> float:
    """Median seconds of the engine's forward at one grid point."""
    times = forward_times(model, pt, warmup, repeats, device)  # its KV cache freed on return
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next point's cache may differ in size: no fragmentation
    return statistics.median(times)


def forward_times(
    model: Transformer, pt: Point, warmup: int, repeats: int, device: torch.device
) -> list[float]:
    """Seconds of each timed forward at ``pt`` over a KV cache of its own."""
    b, t, c = pt.batch, pt.tokens, pt.context
    cache = model.new_cache(b, c + t)
    ids = torch.randint(0, model.config.vocab_size, (b, t), device=device)  # [B, T]
    positions = (torch.arange(t, device=device) + c).expand(b, t)  # [B, T]
    if pt.kind == "prefill":
        last = torch.full((b, 1), t - 1, device=device)  # [B, 1]
        kwargs = {"prefill": True, "logits_at": last}
    else:
        kwargs = {"kv_len": c + t}
    return timed(lambda: model(ids, positions, cache, **kwargs), device, repeats, warmup)


def run_grid(
    model: Transformer, cfg: GpuBenchCfg, device: torch.device, budget_s: float
) -> list[dict]:
    """Time every point (stopping at the time budget); one trace record per point."""
    records, start = [], time.perf_counter()
    points = grid_of(cfg).points()
    for i, pt in enumerate(points):
        if time.perf_counter() - start > budget_s:
            print(f"time budget {budget_s} s reached: {len(points) - i} points skipped")
            break
        seconds = time_point(model, pt, cfg.calibrate.warmup, cfg.calibrate.repeats, device)
        records.append({"kind": pt.kind, "batch_size": pt.batch, "tokens_per_seq": pt.tokens,
                        "context_len": pt.context, "step_time_s": seconds})  # fmt: skip
        shape = f"{pt.kind:>7} B={pt.batch:<4} T={pt.tokens:<5} C={pt.context:<5}"
        print(f"{shape} {seconds * 1e3:8.2f} ms", flush=True)
    return records


def run_calibrate(cfg: GpuBenchCfg, target: Target, command: str | None = None) -> dict:
    """The grid's trace (module docstring), written to ``target.out``; the trace."""
    device, config = target.device, TINY if cfg.run.smoke else LLAMA_8B
    budget_s = float(cfg.run.budget_s or BUDGET_S)
    t0 = time.perf_counter()
    model = inference_model(config, device, torch.bfloat16)
    synchronize(device)
    size = f"{config.num_parameters() / 1e9:.2f}B"
    print(f"random {size} model on {device} in {time.perf_counter() - t0:.1f} s")
    records = run_grid(model, cfg, device, budget_s)
    target.out.parent.mkdir(parents=True, exist_ok=True)
    settings = settings_record(cfg, target, budget_s)
    meta = run_metadata(command) | {"settings": settings, "total_s": time.perf_counter() - t0}
    name = "" if cfg.run.smoke else MODEL_NAME
    trace = trace_document(records, device, config, name, target.out, meta)
    atomic_write(target.out, json.dumps(trace, indent=1))
    print(f"wrote {target.out} ({len(records)} records in {time.perf_counter() - t0:.0f} s)")
    return trace
