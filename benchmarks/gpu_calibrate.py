"""Time the native engine's forward on one GPU over a grid of shapes; write a calibration trace.

Usage: python benchmarks/gpu_calibrate.py [--out benchmarks/results/gpu_calibrate_trace.json]
       specrl simulate calibrate benchmarks/results/gpu_calibrate_trace.json --out fitted.toml
Smoke test anywhere (seconds): python benchmarks/gpu_calibrate.py --device cpu --tiny --out T.json

Contract: needs only torch and specrl. Builds a randomly initialised specrl ``Transformer`` with
Llama-3.1-8B's shapes (32 layers, hidden 4096, 32/8 heads of 128, MLP 14336, vocabulary 128256,
untied head) in bf16 on the device, and for every grid point (kind, batch B, tokens per sequence
T, context C) allocates the engine's KV cache for B sequences of C + T positions and times the
engine's forward: B x T new tokens at positions C..C+T-1 (kv_len C + T), logits at every position
(``decode``: T = 1; ``verify``: T = k+1 for each k of ``--ks``) or, for ``prefill`` (C = 0), at the
last one, exactly as ``specrl.engine`` calls it. Each point reports the median of ``--repeats``
synchronised forwards after ``--warmup`` untimed ones. Only the forward is timed (no sampling,
no engine bookkeeping: on GPUs the fitted step overhead covers those). Writes the trace JSON that
``specrl simulate calibrate`` reads (format in specrl/sim/calibrate.py): model ``llama-3.1-8b``,
hardware guessed from the device name (h100 / h200 / b200 / gb200), one record per grid point.
``--tiny`` swaps in a 2-layer model and a small grid, and writes the matching model spec TOML
next to the trace (the trace's ``model`` is its path), so the whole path runs on a CPU in tests.

Default grid and time budget on one H100/H200: contexts 512, 1024, 2048, 4096, 8192; decode
B = 1, 2, 4, ..., 512 and verify (k = 3, T = 4) B = 1, ..., 256, keeping points whose KV cache
B * (C + T) fits ``--max-kv-tokens`` (300k tokens = 39 GB of bf16 KV, beside 16 GB of weights): 40
decode + 39 verify points, so 1..1024 tokens in a forward; plus prefill of 128, 512 and 1024
tokens. 82 points x (2 warm-up + 5 timed) forwards = 574 forwards. A forward costs ~5-8 ms at a
few tokens (16 GB of weights at 3.35 TB/s plus launch overhead), ~30 ms at 1024 tokens
(16 TFLOP) and up to ~100 ms at the largest KV caches; at a 25 ms mean that is ~15 s of
forwards, plus ~20 ms to zero each cache and ~30 s for start-up and the random initialisation:
about one minute, well inside 5 minutes. ``--budget-s`` (default 270) stops the grid early,
keeping what was measured, should a device be far slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specrl.models.config import ModelConfig
from specrl.models.rope import rope_inv_freq
from specrl.models.transformer import Transformer

OUT = Path(__file__).parent / "results" / "gpu_calibrate_trace.json"
LLAMA_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rope_theta=500000.0,
)
TINY = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)
HARDWARE_BY_NAME = (("GB200", "gb200"), ("B200", "b200"), ("H200", "h200"), ("H100", "h100"))


@dataclass(frozen=True)
class Point:
    """One grid point: ``batch`` sequences, ``tokens`` new tokens each, ``context`` cached."""

    kind: str  # "decode" | "verify" | "prefill"
    batch: int
    tokens: int
    context: int


@dataclass(frozen=True)
class Grid:
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


def build_model(config: ModelConfig, device: str, dtype: torch.dtype) -> Transformer:
    """A randomly initialised model allocated directly on ``device`` in ``dtype``."""
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(dtype).to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        model.inv_freq.copy_(rope_inv_freq(config))
    return model.eval().requires_grad_(False)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def time_point(model: Transformer, pt: Point, warmup: int, repeats: int, device: str) -> float:
    """Median seconds of the engine's forward at one grid point."""
    b, t, c = pt.batch, pt.tokens, pt.context
    cache = model.new_cache(b, c + t)
    ids = torch.randint(0, model.config.vocab_size, (b, t), device=device)  # [B, T]
    positions = (torch.arange(t, device=device) + c).expand(b, t)  # [B, T]
    if pt.kind == "prefill":
        last = torch.full((b, 1), t - 1, device=device)  # [B, 1]
        kwargs = {"prefill": True, "logits_at": last}
    else:
        kwargs = {"kv_len": c + t}
    times = []
    for i in range(warmup + repeats):
        synchronize(device)
        t0 = time.perf_counter()
        model(ids, positions, cache, **kwargs)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    del cache
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the next point's cache may differ in size: no fragmentation
    return statistics.median(times)


def hardware_name(device: str) -> tuple[str, str]:
    """(machine description, bundled hardware profile to scale) for the device."""
    if not device.startswith("cuda"):
        return f"cpu ({torch.get_num_threads()} threads)", "cpu-2core"
    name = torch.cuda.get_device_name(torch.device(device))
    profile = next((p for key, p in HARDWARE_BY_NAME if key in name), "h100")
    return f"1x {name}", profile


def model_spec_toml(config: ModelConfig, name: str) -> str:
    """A simulator model spec (specrl/sim/data/models layout) for ``config``."""
    params = float(config.num_parameters())
    fields = {
        "name": f'"{name}"',
        "layers": config.num_layers,
        "hidden": config.hidden_size,
        "heads": config.num_heads,
        "kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab": config.vocab_size,
        "intermediate": config.intermediate_size,
        "params_total": params,
        "params_active": params,
    }
    return "".join(f"{k} = {v}\n" for k, v in fields.items())


def run_grid(model: Transformer, grid: Grid, args: argparse.Namespace) -> list[dict]:
    """Time every point (stopping at the time budget); one trace record per point."""
    records, start = [], time.perf_counter()
    points = grid.points()
    for i, pt in enumerate(points):
        if time.perf_counter() - start > args.budget_s:
            print(f"time budget {args.budget_s} s reached: {len(points) - i} points skipped")
            break
        seconds = time_point(model, pt, args.warmup, args.repeats, args.device)
        records.append(
            {
                "kind": pt.kind,
                "batch_size": pt.batch,
                "tokens_per_seq": pt.tokens,
                "context_len": pt.context,
                "step_time_s": seconds,
            }
        )
        shape = f"{pt.kind:>7} B={pt.batch:<4} T={pt.tokens:<5} C={pt.context:<5}"
        print(f"{shape} {seconds * 1e3:8.2f} ms", flush=True)
    return records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="2-layer model, small grid (tests)")
    ap.add_argument("--ks", default="3", help="draft lengths k of the verify shapes (T = k+1)")
    ap.add_argument("--max-kv-tokens", type=int, default=300_000)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=270.0, help="stop the grid after this")
    ap.add_argument("--out", type=Path, default=OUT)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from specrl.bench import run_metadata

    ks = tuple(int(k) for k in args.ks.split(","))
    config, grid = (
        (TINY, tiny_grid(ks)) if args.tiny else (LLAMA_8B, default_grid(ks, args.max_kv_tokens))
    )
    t0 = time.perf_counter()
    model = build_model(config, args.device, torch.bfloat16)
    synchronize(args.device)
    size = f"{config.num_parameters() / 1e9:.2f}B"
    print(f"random {size} model on {args.device} in {time.perf_counter() - t0:.1f} s")
    records = run_grid(model, grid, args)
    machine, hardware = hardware_name(args.device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model_name = "llama-3.1-8b"
    if args.tiny:
        spec = args.out.with_suffix(".model.toml")
        spec.write_text(model_spec_toml(config, "tiny-llama"))
        model_name = str(spec.resolve())
    trace = {
        "machine": machine,
        "model": model_name,
        "dtype": "bf16",
        "hardware": hardware,
        "records": records,
        "meta": run_metadata() | {"total_s": time.perf_counter() - t0},
    }
    args.out.write_text(json.dumps(trace, indent=1))
    print(f"wrote {args.out} ({len(records)} records in {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
