"""What the weight-sync guard costs per update on SmolLM2-135M (CPU).

Measured, the fastest of ``--repeats`` calls (seconds; their median as ``*_median_s``): the
learner-side fingerprint of the float32 master weights cast to the engine's dtype
(``fingerprint``), the backend-side one (``served()`` of an inline ``NativeBackend``: the
engine's own tensors), a plain ``update_weights``, and the whole guarded push
(``WeightGuard.push``: learner fingerprint + update + ``served()`` + compare), so the guard's
overhead is ``push - update``. With ``--process`` also ``served()`` of a worker
process (pipe round trip included). Writes JSON with ``specrl.bench.run_metadata()``.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/weight_guard_cost.py --process \\
        --out benchmarks/results/weight_guard_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specrl.backends import plan_rollout
from specrl.backends.native import build_native
from specrl.bench import run_metadata, write_result
from specrl.config import load_config
from specrl.models.checkpoints import load_model
from specrl.models.fingerprint import fingerprint
from specrl.models.precision import torch_dtype
from specrl.pipelines.guard import WeightGuard

OUT = Path(__file__).parent / "results" / "weight_guard_cost.json"


def timed(name: str, fn: Callable[[], object], repeats: int) -> dict[str, float]:
    """``{name_s: fastest, name_median_s: median}`` of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {f"{name}_s": min(times), f"{name}_median_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="engine dtype")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--process", action="store_true", help="also a worker process's served()")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    cfg = load_config(None, [f"model.dtype={args.dtype}", "rollout.spec=none",
                             "rollout.placement=inline"])  # fmt: skip
    dtype = torch_dtype(cfg.model.dtype)
    policy = load_model(cfg.model.name, dtype=torch.float32)
    named = dict(policy.named_parameters())
    backend = build_native(plan_rollout(cfg), policy)
    guard = WeightGuard(dtype)
    version = iter(range(1, 10_000))
    result = {
        "params": sum(t.numel() for t in named.values()),
        "tensors": len(named),
        "engine_dtype": str(dtype),
    }
    result |= timed("learner_fingerprint", lambda: fingerprint(named, dtype), args.repeats)
    result |= timed("backend_served", backend.served, args.repeats)
    result |= timed("update_weights", lambda: backend.update_weights(named, next(version)),
                    args.repeats)  # fmt: skip
    result |= timed("guarded_push", lambda: guard.push(backend, named, next(version)),
                    args.repeats)  # fmt: skip
    if args.process:
        from specrl.backends.process import build_process

        sets = [f"model.dtype={args.dtype}", "rollout.spec=none", "rollout.placement=process"]
        plan = plan_rollout(load_config(None, [*sets, "rollout.threads=1"]))
        with build_process(plan, policy) as worker:
            result |= timed("process_served", worker.served, args.repeats)
    for key, value in result.items():
        print(f"{key}: {value * 1e3:.1f} ms" if key.endswith("_s") else f"{key}: {value}")
    command = " ".join([Path(sys.executable).name, *sys.argv])
    write_result({"meta": run_metadata(command), "result": result}, args.out)


if __name__ == "__main__":
    main()
