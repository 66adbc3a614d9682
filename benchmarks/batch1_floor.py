"""Where a batch-1 decode step goes: the weight GEMVs alone vs our engine step vs transformers.

At batch 1 a decode step must stream every weight once. This times, in one process and
interleaved rounds (median of ``--rounds``): the model's own 121 bf16 Linear calls (every
layer's qkv/o/gate_up/down and the LM head) fed batch-1 inputs back to back, i.e. the step with
zero non-GEMV work, once with our native GEMV kernel (``specrl.kernels.gemv``) and once with
oneDNN's prepacked linear; a full engine decode step at batch 1 (``--new-tokens`` sampled
tokens, prefill excluded) with each of the two; and transformers' ``generate`` per token at
batch 1. It reports ``hf_ms / gemv_ms``, the most any engine built on those GEMVs could be faster
than transformers at batch 1, next to the ratio the engine reaches, the bandwidth the GEMVs
achieve against the machine's measured copy bandwidth, and the engine step against the
reference floor (270 MB of bf16 weights at the 25 GB/s of ``specrl.bench``'s fixed roofline =
10.8 ms per token).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/batch1_floor.py --threads 1

Writes benchmarks/results/batch1_floor[_<threads>threads].json (``specrl.bench.run_metadata()``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from specrl.bench import bench_prompts, hf_runner, measure_machine, run_metadata, write_result
from specrl.engine import Engine
from specrl.models.checkpoints import load_model, load_tokenizer, resolve_model
from specrl.models.linear import Linear
from specrl.models.transformer import set_native_kernels
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams

MODEL = "smollm2-135m-instruct"
REFERENCE_FLOOR_MS = 10.8  # 270 MB of bf16 weights at specrl.bench.CPU_BANDWIDTH_BYTES_S (25 GB/s)
PATHS = {"": True, "_onednn": False}  # key suffix -> Linear.native (our kernel or oneDNN)


def gemv_step(model) -> callable:
    """Every Linear of the model once, batch 1, in layer order (the LM head last)."""
    lins = [m for m in model.modules() if isinstance(m, Linear)]
    inputs = [torch.randn(1, 1, m.in_features, dtype=m.weight.dtype) for m in lins]

    def run() -> None:
        with torch.inference_mode():
            for m, x in zip(lins, inputs, strict=True):
                m(x)

    return run


def engine_step(model, prompt: list[int], new_tokens: int) -> callable:
    """Seconds per decode step of one batch-1 sampled generation (prefill excluded)."""
    engine = Engine(model, max_batch=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=())

    def run() -> float:
        engine.generate([Request(prompt, params.replace(seed=1))])
        return engine.stats.decode_s / engine.stats.steps

    return run


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(MODEL, dtype=torch.bfloat16)
    prompt = bench_prompts(load_tokenizer(MODEL), 1)[0]
    weight_bytes = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, Linear))
    gemv, step = gemv_step(model), engine_step(model, prompt, args.new_tokens)
    hf = hf_runner(resolve_model(MODEL), torch.bfloat16, [prompt], args.new_tokens)
    ms: dict[str, list[float]] = {k: [] for k in ("gemv", "gemv_onednn", "engine",
                                                   "engine_onednn", "hf")}  # fmt: skip
    for _ in range(args.rounds + 1):  # the first round warms up and is dropped
        for suffix, native in PATHS.items():
            set_native_kernels(model, native)
            ms["gemv" + suffix].append(1e3 * statistics.median(timed(gemv) for _ in range(10)))
            ms["engine" + suffix].append(1e3 * step())
        full, one = timed(hf), timed(lambda: hf(1))  # per token: (full - prefill) / (n - 1)
        ms["hf"].append(1e3 * (full - one) / (args.new_tokens - 1))
    med = {k: statistics.median(v[1:]) for k, v in ms.items()}
    copy = measure_machine()["copy_bandwidth_bytes_s"]
    result = {
        "ms_per_step": {k: round(v, 3) for k, v in med.items()},
        "linear_weight_bytes": weight_bytes,
        "gemv_share_of_engine_step": round(med["gemv"] / med["engine"], 3),
        "engine_vs_hf": round(med["hf"] / med["engine"], 3),
        "engine_onednn_vs_hf": round(med["hf"] / med["engine_onednn"], 3),
        "engine_native_vs_onednn": round(med["engine_onednn"] / med["engine"], 3),
        "max_possible_vs_hf_with_these_gemvs": round(med["hf"] / med["gemv"], 3),
        "gemv_bandwidth_gb_s": round(weight_bytes / med["gemv"] / 1e6, 2),
        "gemv_onednn_bandwidth_gb_s": round(weight_bytes / med["gemv_onednn"] / 1e6, 2),
        "engine_share_of_reference_floor": round(REFERENCE_FLOOR_MS / med["engine"], 3),
        "machine_copy_bandwidth_gb_s": round(copy / 1e9, 2),
    }
    print(result)
    out = args.out or Path(__file__).parent / "results" / (
        "batch1_floor.json" if args.threads == 1 else f"batch1_floor_{args.threads}threads.json"
    )
    meta = run_metadata("benchmarks/batch1_floor.py " + " ".join(sys.argv[1:]))
    write_result({"meta": meta, "args": vars(args) | {"out": str(out)}, "rounds_ms": ms,
                  "result": result}, out)  # fmt: skip


if __name__ == "__main__":
    main()
