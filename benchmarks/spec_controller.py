"""The cost-model speculation controller against no speculation and every fixed k, side by side.

Usage: python benchmarks/spec_controller.py [--method suffix] [--batch-sizes 1,4,16,64]
       [--new-tokens 128] [--tail-batch 32] [--tail-tokens 256] [--repeats 5] [--control]

SmolLM2-135M in bf16, GRPO-like groups of ``--group-size`` samples per chat prompt, T=1, one
drafter (``--method``; suffix by default, the training default) at k = 1..``--k``. Per point,
the contenders are plain decoding, each fixed k (every step drafts k) and the controller
(``max_tokens_per_forward='auto'``: 0..k per step). Every contender verifies with the
sample-exact rule, so all of them emit the same tokens for the same seed (the timing compares
equal work). Points: each batch size with exactly ``--new-tokens`` per sequence, and ``tail``:
``--tail-batch`` sequences that stop at end-of-turn (at most ``--tail-tokens``), whose batch
shrinks as rows finish. Each contender has its own engine, warmed by one untimed run of the same
prompts with other seeds (for the suffix drafter one earlier epoch of rollouts; for the
controller its start-up measurement and a first look at acceptance); timed runs alternate
between contenders in ``--repeats`` rounds (each round: every contender once, in a fresh seeded
random order, on that round's seeds). Per point: tokens/s (best of the rounds), the ratio of
the controller to plain decoding and to the best fixed k (0 included), each as the median over
rounds of the ratio within a round (the headline: the two runs of a round are seconds apart, so
the machine's drift over the minutes of a point cancels, and one disturbed run moves a median
little) and as the ratio of the best runs; and the controller's step-time prediction error
(mean and max absolute relative error of the prediction made before each timed step, against
its measured time).
``--control`` adds a second plain engine (``none-control``) to every point, timed like the
others but outside the fixed-k comparison: its paired ratio to plain decoding
(``control_vs_none``) shows what two identical contenders differ by on this machine in this run.
``--batch-sizes ""`` runs the tail point alone.
The machine's copy bandwidth and GEMM rate are measured in the same run.
Writes benchmarks/results/spec_controller.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from specrl.bench import bench_prompts, measure_machine, run_metadata, write_result
from specrl.engine import Engine
from specrl.models.checkpoints import load_model, load_tokenizer
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig, drafter_spec
from specrl.spec.proposers import proposer_takes

OUT = Path(__file__).parent / "results" / "spec_controller.json"
MODEL = "smollm2-135m-instruct"


CONTROL = "none-control"  # a second plain engine: the noise floor of a paired ratio


def contenders(
    method: str, k_max: int, model, tok, drafter: str | None, control: bool = False
) -> dict[str, tuple]:
    """name -> (SpecConfig, draft model) for plain, fixed k = 1..k_max and the controller
    (and with ``control`` a second plain engine)."""
    if proposer_takes(method, "drafter_path") and drafter is None:
        from specrl.bench import default_drafter_path

        drafter = default_drafter_path(MODEL, method)
    base, draft = drafter_spec(method, k_max, drafter, model, tok)
    out = {"none": (SpecConfig("none", 0), None)}
    for k in range(1, k_max + 1):
        out[f"k={k}"] = (SpecConfig(method, k, options=base.options, exact="sample"), draft)
    out["auto"] = (
        SpecConfig(method, k_max, options=base.options, exact="sample", adaptive=True),
        draft,
    )
    if control:
        out[CONTROL] = (SpecConfig("none", 0), None)
    return out


def point_requests(
    tok, batch: int, group: int, new_tokens: int, stop: bool, seed: int
) -> list[Request]:
    """The point's requests; sample seeds start at ``seed`` (every run draws fresh samples)."""
    prompts = bench_prompts(tok, batch, group)
    params = SamplingParams(
        temperature=1.0,
        max_new_tokens=new_tokens,
        n=min(batch, group),
        stop_token_ids=tuple(tok.stop_token_ids) if stop else (),
    )
    return [Request(p, params.replace(seed=seed + i)) for i, p in enumerate(prompts)]


def run_point(name: str, engines: dict[str, Engine], make_reqs, repeats: int) -> dict:
    """Warm every engine once, then alternate timed runs (round r: every contender in a
    fresh random order, the same seeds for every contender, fresh ones for each r)."""
    for engine in engines.values():
        engine.generate(make_reqs(10_000))
    seconds: dict[tuple[str, int], float] = {}
    tokens, spec_share, accept = {}, {}, {}
    errors: list[float] = []
    order = np.random.default_rng(0)
    for r in range(repeats):
        reqs = make_reqs(1000 * r)
        for n in map(str, order.permutation(list(engines))):  # a fresh order every round
            engine = engines[n]
            ctl = engine.controller
            if ctl is not None:
                ctl.predictions.clear()
            t0 = time.perf_counter()
            out = engine.generate(reqs)
            seconds[n, r] = time.perf_counter() - t0
            tokens[n, r] = [c.token_ids for c in out]
            st = engine.stats
            spec_share[n] = st.spec_steps / max(st.steps, 1)
            accept[n] = st.acceptance_length
            if ctl is not None:
                errors += [abs(p - m) / m for _, _, p, m in ctl.predictions]
    same = all(t == tokens["none", r] for (_, r), t in tokens.items())
    count = [sum(len(t) for t in tokens["none", r]) for r in range(repeats)]
    rates = {n: max(count[r] / seconds[n, r] for r in range(repeats)) for n in engines}
    fixed = {n: r for n, r in rates.items() if n not in ("auto", CONTROL)}  # none: k = 0
    best_fixed = max(fixed, key=fixed.get)

    def paired(a: str, b: str) -> float:  # median over rounds of a's speed over b's
        return float(np.median([seconds[b, r] / seconds[a, r] for r in range(repeats)]))

    fixed_paired = {n: paired(n, "none") for n in fixed}
    best_paired = max(fixed_paired, key=fixed_paired.get)
    row = {
        "point": name,
        "tokens_per_run": count,
        "same_tokens_everywhere": same,
        "tokens_per_s": rates,
        "seconds_per_round": {n: [seconds[n, r] for r in range(repeats)] for n in engines},
        "acceptance_length": accept,
        "spec_step_share": spec_share,
        "best_fixed": best_paired,
        "auto_vs_none": paired("auto", "none"),
        "auto_vs_best_fixed": paired("auto", best_paired),
        "best_fixed_vs_none": fixed_paired[best_paired],
        "fixed_vs_none": fixed_paired,
        "best_runs": {
            "best_fixed": best_fixed,
            "auto_vs_none": rates["auto"] / rates["none"],
            "auto_vs_best_fixed": rates["auto"] / fixed[best_fixed],
            "best_fixed_vs_none": fixed[best_fixed] / rates["none"],
        },
        "control_vs_none": paired(CONTROL, "none") if CONTROL in engines else None,
        "prediction_error_mean": float(np.mean(errors)) if errors else None,
        "prediction_error_max": float(np.max(errors)) if errors else None,
    }
    print(
        f"{name:>8}: " + "  ".join(f"{n} {r:7.1f}" for n, r in rates.items())
        + f" tok/s | median over rounds: auto/none {row['auto_vs_none']:.2f}x, auto/{best_paired} "
        f"{row['auto_vs_best_fixed']:.2f}x, prediction error {row['prediction_error_mean']:.1%}"
        f" mean, {row['prediction_error_max']:.1%} max | same tokens: {same}"
        + (f" | control/none {row['control_vs_none']:.2f}x" if row["control_vs_none"] else ""),
        flush=True,
    )  # fmt: skip
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="suffix")
    ap.add_argument("--drafter", default=None, help="a learned drafter's directory")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--tail-tokens", type=int, default=256)
    ap.add_argument("--tail-batch", type=int, default=32, help="rows of the tail point (0: none)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds of timed runs")
    ap.add_argument("--control", action="store_true", help="add a second plain engine")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = load_tokenizer(MODEL)
    model = load_model(MODEL, dtype=torch.bfloat16)
    machine = measure_machine(torch.bfloat16)
    specs = contenders(args.method, args.k, model, tok, args.drafter, args.control)
    rows = []
    sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    points = [(str(b), b, args.new_tokens, False) for b in sizes]
    if args.tail_batch:
        points.append(("tail", args.tail_batch, args.tail_tokens, True))
    for name, batch, new, stop in points:
        engines = {n: Engine(model, max_batch=batch, spec=s, draft_model=d)
                   for n, (s, d) in specs.items()}  # fmt: skip

        def make_reqs(seed, batch=batch, new=new, stop=stop):
            return point_requests(tok, batch, args.group_size, new, stop, seed)

        row = run_point(name, engines, make_reqs, args.repeats)
        rows.append(row | {"batch_size": batch, "new_tokens": new, "stops": stop})
    meta = run_metadata() | {"args": {k: str(v) for k, v in vars(args).items()},
                             "machine_measured": machine, "model": MODEL}  # fmt: skip
    targets = {
        "auto_vs_none_min": min(r["auto_vs_none"] for r in rows),
        "auto_vs_best_fixed_min": min(r["auto_vs_best_fixed"] for r in rows),
    }
    print(f"worst point: auto/none {targets['auto_vs_none_min']:.2f}x (target >= 0.97), "
          f"auto/best fixed {targets['auto_vs_best_fixed_min']:.2f}x (target >= 0.95)")  # fmt: skip
    write_result({"meta": meta, "points": rows, "summary": targets}, args.out)


if __name__ == "__main__":
    main()
