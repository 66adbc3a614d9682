"""This tree's native products against the kernel source of an earlier git revision.

Usage: OMP_NUM_THREADS=2 python tools/kernel_revisions.py [--base HEAD~1]
       [--rows 1,4,5,6,8,12,16] [--rounds 7] [--out runs/kernel_revisions.json]

SmolLM2-135M's own bf16 weights, packed once, multiplied as a decode forward multiplies them:
every layer's qkv, o, gate_up and down products and the LM head, M rows at a time, so the
weights (~270 MB, far more than the caches) stream from memory at every pass, as in decoding.
Contenders, each ``specrl/kernels/gemv_bf16.c`` built with the same flags and compiler: ``tree``
(the working tree) and ``base`` (the file at ``--base``). Per M, the two are first checked to
give equal bits for every product (a kernel change must not move a number), then timed in
``--rounds`` rounds, each running both once in a random order; reported: the median ms of all
products of one forward, GFLOP/s, base / tree, and the floors of the same run: the weights at
the read bandwidth measured in the run (a float32 sum over 1 GiB) and the FLOPs at the measured
GEMM rate.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specrl.bench import measure_machine, run_metadata, write_result
from specrl.kernels import build, gemv
from specrl.models.checkpoints import load_model

OUT = Path(__file__).resolve().parents[1] / "runs" / "kernel_revisions.json"
MODEL = "smollm2-135m-instruct"


def kernel_at(source: Path) -> gemv.GemvKernel:
    """The library built from ``source`` (cached by its hash like the default one)."""
    lib = build.open_library(shutil.which("gcc") or "gcc", source=source)
    if lib is None:
        raise SystemExit(f"could not build the native library from {source}")
    return gemv.GemvKernel(lib)


def base_source(rev: str, directory: Path) -> Path:
    """The kernel source as it was at git revision ``rev``, written under ``directory``."""
    text = subprocess.run(
        ["git", "show", f"{rev}:specrl/kernels/gemv_bf16.c"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parent,
    ).stdout  # fmt: skip
    path = directory / "gemv_bf16.c"
    path.write_text(text)
    return path


def products(model) -> list[tuple[torch.Tensor, int, int]]:
    """(packed weight, N, K) of every product of a decode forward, in order."""
    kernel = gemv.gemv_kernel()
    out = []
    for layer in model.layers:
        for lin in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down):
            out.append((kernel.pack(lin.weight.detach()), *lin.weight.shape))
    head = model.lm_head.weight.detach()
    return out + [(kernel.pack(head), *head.shape)]


def read_bandwidth() -> float:
    """Bytes/s of reading 1 GiB (far more than the caches): the best of 5 float32 sums."""
    buf = torch.ones(256 * 2**20)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def forward(kernel: gemv.GemvKernel, prods, xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    return [kernel.matmul(xs[k], p, n) for p, n, k in prods]


def time_rows(kernels: dict, prods, m: int, rounds: int) -> dict[str, float]:
    """Median seconds per forward's products at ``m`` rows, per contender (bits checked)."""
    xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {k for _, _, k in prods}}
    outs = {name: forward(kn, prods, xs) for name, kn in kernels.items()}
    for a, b in zip(outs["tree"], outs["base"], strict=True):
        if not torch.equal(a, b):
            raise SystemExit(f"M={m}: this tree's products differ from the base's")
    times = {name: [] for name in kernels}
    for _ in range(rounds):
        for name in random.sample(list(kernels), len(kernels)):
            t0 = time.perf_counter()
            forward(kernels[name], prods, xs)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD~1", help="git revision of the other kernel source")
    ap.add_argument("--rows", default="1,4,5,6,8,12,16", help="M values, comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if gemv.gemv_kernel() is None:
        raise SystemExit("the native kernels cannot run on this machine: nothing to compare")
    torch.manual_seed(0)
    random.seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {
            "tree": kernel_at(build.SOURCE),
            "base": kernel_at(base_source(args.base, Path(tmp))),
        }
    for kn in kernels.values():
        kn.amx = False  # the AVX512-BF16 products on every machine (AMX has its own path)
    prods = products(load_model(MODEL, dtype=torch.bfloat16))
    weight_bytes = sum(p.numel() * p.element_size() for p, _, _ in prods)
    machine = measure_machine(torch.bfloat16) | {"read_bandwidth_bytes_s": read_bandwidth()}
    points = []
    for m in (int(r) for r in args.rows.split(",")):
        s = time_rows(kernels, prods, m, args.rounds)
        flops = 2 * m * sum(n * k for _, n, k in prods)
        floors = {"weights_ms": weight_bytes / machine["read_bandwidth_bytes_s"] * 1e3,
                  "flops_ms": flops / machine["gemm_flops"] * 1e3}  # fmt: skip
        row = {"rows": m, "ms": {k: v * 1e3 for k, v in s.items()},
               "gflops": {k: flops / v / 1e9 for k, v in s.items()},
               "base_over_tree": s["base"] / s["tree"], "floor_ms": floors}  # fmt: skip
        points.append(row)
        print(f"M={m}: tree {row['ms']['tree']:.1f} ms, base {row['ms']['base']:.1f} ms, "
              f"base/tree {row['base_over_tree']:.2f}x (floor {max(floors.values()):.1f} ms)",
              flush=True)  # fmt: skip
    meta = run_metadata() | {"args": {k: str(v) for k, v in vars(args).items()},
                             "machine_measured": machine, "model": MODEL,
                             "weight_bytes": weight_bytes}  # fmt: skip
    write_result({"meta": meta, "points": points}, args.out)


if __name__ == "__main__":
    main()
