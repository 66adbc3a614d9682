"""What huge pages buy a decode forward: packed weights and KV cache on 2 MiB pages vs 4 KiB.

Usage: OMP_NUM_THREADS=2 python benchmarks/hugepages.py [--shapes 1x1,8x1,64x1,64x4]
       [--context 128] [--rounds 7] [--out benchmarks/results/hugepages.json]

SmolLM2-135M in bf16, two copies in one process: ``huge`` as specrl builds it (``prepack`` puts
the packed weights in one buffer and ``new_cache`` the KV cache, both advised MADV_HUGEPAGE:
``specrl.kernels.hugepages``) and ``small`` built the same way with that advice off (every
buffer on ordinary 4 KiB pages). Per shape B x T (B rows, T tokens each over a cache of
``--context`` tokens): ms per forward of each, interleaved round by round (median of
``--rounds``, each the mean of several forwards), and small / huge. Both compute the same
logits (checked). Also recorded: the machine's copy bandwidth and GEMM rate measured in the same
run, the transparent huge page mode and how much of this process is on huge pages.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specrl.bench import measure_machine, run_metadata, write_result
from specrl.kernels import hugepages
from specrl.models.checkpoints import load_model
from specrl.models.linear import prepack

OUT = Path(__file__).parent / "results" / "hugepages.json"
MODEL = "smollm2-135m-instruct"
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def build(huge: bool, rows: int, context: int, width: int):
    """(model, cache with ``context`` tokens prefilled) with huge pages on or off."""
    saved = hugepages.HUGE_MIN_BYTES
    hugepages.HUGE_MIN_BYTES = saved if huge else 1 << 62
    try:
        model = load_model(MODEL, dtype=torch.bfloat16)
        prepack(model)
        cache = model.new_cache(rows, context + width)
    finally:
        hugepages.HUGE_MIN_BYTES = saved
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1000, (rows, context), generator=g)
    with torch.inference_mode():
        model(prompt, torch.arange(context).expand(rows, context), cache, kv_len=context,
              prefill=True)  # fmt: skip
    return model, cache


def forward(model, cache, b: int, t: int, context: int) -> torch.Tensor:
    ids = torch.arange(b * t).view(b, t) % 997
    pos = torch.arange(context, context + t).expand(b, t)
    with torch.inference_mode():
        return model(ids, pos, cache, kv_len=context + t).logits


def timed(model, cache, b: int, t: int, context: int, repeats: int) -> float:
    forward(model, cache, b, t, context)  # warm
    t0 = time.perf_counter()
    for _ in range(repeats):
        forward(model, cache, b, t, context)
    return (time.perf_counter() - t0) / repeats


def anon_huge_mib() -> float | None:
    """MiB of this process on transparent huge pages (None where Linux does not say)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return None
    kib = [int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("AnonHugePages:")]
    return kib[0] / 1024 if kib else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x1,8x1,64x1,64x4", help="BxT forwards")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    rows, width = max(b for b, _ in shapes), max(t for _, t in shapes)
    contenders = {name: build(name == "huge", rows, args.context, width)
                  for name in ("huge", "small")}  # fmt: skip
    huge_mib = anon_huge_mib()
    for b, t in shapes:
        a, c = (forward(*contenders[n], b, t, args.context) for n in ("huge", "small"))
        if not torch.equal(a, c):
            raise SystemExit(f"huge and small pages gave different logits at {b}x{t}")
    machine = measure_machine(torch.bfloat16)
    samples = {(n, s): [] for n in contenders for s in shapes}
    for r in range(args.rounds):
        for name in list(contenders) if r % 2 == 0 else list(contenders)[::-1]:
            for b, t in shapes:
                repeats = max(3, 32 // b)
                samples[(name, (b, t))].append(timed(*contenders[name], b, t, args.context,
                                                     repeats))  # fmt: skip
        print(f"round {r + 1}/{args.rounds}", flush=True)
    points = []
    for b, t in shapes:
        ms = {n: statistics.median(samples[(n, (b, t))]) * 1e3 for n in contenders}
        ratio = ms["small"] / ms["huge"]
        points.append({"batch": b, "tokens": t, "ms": ms, "small_over_huge": ratio})
        print(f"B{b} T{t}: huge {ms['huge']:.2f} ms  small {ms['small']:.2f} ms  "
              f"small/huge {ms['small'] / ms['huge']:.3f}")  # fmt: skip
    meta = run_metadata() | {"args": {k: str(v) for k, v in vars(args).items()},
                             "machine_measured": machine, "model": MODEL,
                             "thp_mode": THP.read_text().strip() if THP.exists() else None,
                             "process_huge_pages_mib": huge_mib}  # fmt: skip
    write_result({"meta": meta, "points": points}, args.out)


if __name__ == "__main__":
    main()
