"""What the one-call decoder, the per-token kernels and the weight prefetch buy a decode forward.

Usage: OMP_NUM_THREADS=2 python benchmarks/decode_overheads.py [--shapes 1x1,1x2,1x4,8x1,8x4,64x1]
       [--rounds 5] [--out benchmarks/results/decode_overheads.json]

SmolLM2-135M in bf16, one target forward over a KV cache of 128 tokens per row: B rows x T
tokens each (T = 1: a decode step; T = k + 1: a verify pass of k drafts). Contenders, in one
process, interleaved round by round (median of ``--rounds``, each the mean of a few forwards):
- ``native``: the default (all decoder layers in one native call, ``specrl.models.fused``;
  native products: AMX tiles where the CPU has them, else AVX512 with the weight prefetch;
  native attention; native RMSNorm / residual add / SwiGLU / RoPE);
- ``per_module``: the same kernels called module by module from Python (~10 calls per layer);
- ``avx512``: ``native`` with AMX off (the AVX512-BF16 products, as on a CPU without AMX);
- ``no_prefetch``: ``avx512`` module by module, with the library built with ``-DPREFETCH=0``
  (prefetch distance 0: the products' loads wait on memory as before the prefetch);
- ``torch_elementwise``: native products and attention, PyTorch's ops for norms, SwiGLU, RoPE;
- ``torch``: no native kernels (oneDNN's prepacked products, PyTorch's attention and ops).
Per shape: ms per forward, each contender's time over ``native``'s, and T-token forwards over the
1-token forward of the same B (what verifying k drafts costs over a plain step). The machine's
copy bandwidth and GEMM rate are measured in the same run, with the weight-streaming floor per
forward (bf16 weights once at the measured copy bandwidth, read share).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch

from specrl.bench import measure_machine, run_metadata, write_result
from specrl.kernels import build, gemv
from specrl.models.checkpoints import load_model
from specrl.models.transformer import set_native_elementwise, set_native_kernels

OUT = Path(__file__).parent / "results" / "decode_overheads.json"
MODEL = "smollm2-135m-instruct"
CONTEXT = 128
CONTENDERS = ("native", "per_module", "avx512", "no_prefetch", "torch_elementwise", "torch")


def no_prefetch_kernel() -> gemv.GemvKernel:
    """The library built from the same source with prefetch distance 0 (cached like the default)."""
    flags = (*build.FLAGS, "-DPREFETCH=0")
    lib = build.open_library(shutil.which("gcc") or "gcc", flags=flags)
    if lib is None:
        raise SystemExit("could not build the no-prefetch variant of the native library")
    return gemv.GemvKernel(lib)


def configure(model, name: str, kernel: gemv.GemvKernel, fns: dict) -> None:
    """Set the model and the shared kernel object up as contender ``name``."""
    src = fns["no_prefetch" if name == "no_prefetch" else "native"]
    for attr, fn in src.items():
        setattr(kernel, attr, fn)
    kernel.amx = fns["amx"] and name in ("native", "per_module", "torch_elementwise")
    model.native_layers = name in ("native", "avx512")
    set_native_kernels(model, name != "torch")
    set_native_elementwise(model, name in ("native", "avx512", "no_prefetch"))


def timer(model, cache, b: int, t: int, repeats: int):
    ids = torch.randint(0, 1000, (b, t))
    pos = (torch.arange(CONTEXT, CONTEXT + t)[None]).expand(b, t)

    def run() -> float:
        with torch.inference_mode():
            model(ids, pos, cache, kv_len=CONTEXT + t)  # warm the path
            t0 = time.perf_counter()
            for _ in range(repeats):
                model(ids, pos, cache, kv_len=CONTEXT + t)
            return (time.perf_counter() - t0) / repeats

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x1,1x2,1x4,8x1,8x4,64x1", help="BxT forwards")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    kernel = gemv.gemv_kernel()
    if kernel is None:
        raise SystemExit("the native kernels cannot run on this machine: nothing to compare")
    torch.manual_seed(0)
    model = load_model(MODEL, dtype=torch.bfloat16)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    cache = model.new_cache(max(b for b, _ in shapes), CONTEXT + 16)
    with torch.inference_mode():
        rows = max(b for b, _ in shapes)
        prompt = torch.randint(0, 1000, (rows, CONTEXT))
        model(prompt, torch.arange(CONTEXT).expand(rows, CONTEXT), cache, kv_len=CONTEXT,
              prefill=True)  # fmt: skip
    machine = measure_machine(torch.bfloat16)
    other = no_prefetch_kernel()
    fns = {"native": {"_fn": kernel._fn, "_attention": kernel._attention},
           "no_prefetch": {"_fn": other._fn, "_attention": other._attention},
           "amx": kernel.amx}  # fmt: skip
    samples = {(n, b, t): [] for n in CONTENDERS for b, t in shapes}
    for r in range(args.rounds):
        for name in CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]:
            configure(model, name, kernel, fns)
            for b, t in shapes:
                repeats = max(3, 24 // b)
                samples[(name, b, t)].append(timer(model, cache, b, t, repeats)())
        print(f"round {r + 1}/{args.rounds}", flush=True)
    configure(model, "native", kernel, fns)
    ms = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    floor_ms = weight_bytes / (machine["copy_bandwidth_bytes_s"] / 2) * 1e3
    points = []
    for b, t in shapes:
        row = {"batch": b, "tokens": t, "ms": {n: ms[(n, b, t)] for n in CONTENDERS}}
        row["vs_native"] = {n: ms[(n, b, t)] / ms[("native", b, t)] for n in CONTENDERS}
        if (b, 1) in shapes:
            row["over_one_token"] = {n: ms[(n, b, t)] / ms[(n, b, 1)] for n in CONTENDERS}
        row["weight_floor_ms"] = floor_ms
        points.append(row)
        print(f"B{b} T{t}: " + "  ".join(f"{n} {ms[(n, b, t)]:.2f} ms" for n in CONTENDERS))
    meta = run_metadata() | {"args": {k: str(v) for k, v in vars(args).items()},
                             "machine_measured": machine, "model": MODEL, "amx": fns["amx"],
                             "context": CONTEXT, "weight_bytes": weight_bytes}  # fmt: skip
    write_result({"meta": meta, "points": points}, args.out)


if __name__ == "__main__":
    main()
