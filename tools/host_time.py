"""Host time per engine step and of the rollout -> learner hand-off, this checkout against a commit.

Usage: python tools/host_time.py --base COMMIT [--rounds 3] [--batch 64] [--new-tokens 256]
    [--out runs/host_time.json]
       python tools/host_time.py --measure OUT.json [--batch 64] [--new-tokens 256]

A tiny random model (forwards of tens of microseconds), so an engine step at batch 64 is host
work: per step the wall time of the whole step and of its bookkeeping (``Call.emit``: a step's
tokens into the rows' records and finished completions), plain decoding and ngram speculation
(k=3); then the learner hand-off of the same completions (``train_samples``, the behaviour
logprobs the learner builds from them, the engine's raw logprobs the mismatch metric reads).
One thread, the best of ``--repeats`` calls per tree. With ``--base`` both trees run
interleaved (``cpu_regression.interleaved``) and the JSON holds both, the best over the rounds
and head / base. Reads private engine internals: a maintainer's tool, not a user benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "runs" / "host_time.json"  # a maintainer's check
FIELDS = ("step_ms", "emit_ms_per_step", "handoff_ms")


def measure(batch: int, new_tokens: int, repeats: int) -> list[dict]:
    """This tree's figures: one row per decoding mode (run inside the tree's interpreter)."""
    import torch

    from specrl.models.config import tiny_config
    from specrl.models.transformer import Transformer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=256, max_position_embeddings=1024))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    model = model.eval().requires_grad_(False)
    rows = []
    for spec in ("none", "ngram"):
        row, comps = generate(model, spec, batch, new_tokens, repeats)
        rows.append(row | {"handoff_ms": handoff(comps, repeats)})
    return rows


def generate(model, spec: str, batch: int, new_tokens: int, repeats: int) -> tuple[dict, list]:
    """The best of ``repeats`` calls: ms per step, ms of ``Call.emit`` per step."""
    from specrl.engine.call import Call
    from specrl.engine.engine import Engine
    from specrl.rollout_types import Request
    from specrl.sampling import SamplingParams
    from specrl.spec.config import SpecConfig

    spent: list[float] = []
    emit = Call.emit

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return emit(self, *a, **kw)
        finally:
            spent.append(time.perf_counter() - t0)

    Call.emit = timed
    engine = Engine(model, max_batch=batch, spec=SpecConfig(spec, 3 if spec != "none" else 0))
    sampling = [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i)
                for i in range(batch)]  # fmt: skip
    reqs = [Request([1 + i % 7, 2, 3, 4, 5], s) for i, s in enumerate(sampling)]
    best: dict | None = None
    for _ in range(repeats):
        spent.clear()
        t0 = time.perf_counter()
        comps = engine.generate(reqs)
        wall, steps = time.perf_counter() - t0, engine.stats.steps
        row = {"spec": spec, "batch": batch, "steps": steps, "step_ms": 1e3 * wall / steps,
               "emit_ms_per_step": 1e3 * sum(spent) / steps,
               "tokens": sum(len(c.token_ids) for c in comps)}  # fmt: skip
        best = row if best is None or row["step_ms"] < best["step_ms"] else best
    Call.emit = emit
    return best, comps


def handoff(comps: list, repeats: int) -> float:
    """Median ms from completions to the learner's tensors (samples, behaviour, raw)."""
    import torch

    from specrl.pipelines.step import train_samples
    from specrl.rl.learner import Learner

    advantages = torch.zeros(1, len(comps))
    width = max(len(c.token_ids) for c in comps)
    times = []
    for _ in range(max(repeats, 5)):
        t0 = time.perf_counter()
        samples = train_samples(comps, advantages, True)
        Learner._behaviour(samples, torch.zeros(len(comps), width))
        if hasattr(comps[0], "token_raw_logprobs"):  # tensors
            torch.cat([c.token_raw_logprobs for c in comps])
        else:  # lists (before the tensor hand-off)
            torch.tensor([x for c in comps for x in c.raw_logprobs], dtype=torch.float32)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def run_tree(tree: Path, args: argparse.Namespace, out: Path) -> dict:
    """This script's ``--measure`` in ``tree``'s code (its own ``specrl`` first on the path)."""
    cmd = [sys.executable, __file__, "--measure", str(out), "--batch", str(args.batch),
           "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(tree)}
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return {"rows": json.loads(out.read_text())}


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per mode and field: the best (lowest) of each tree over the rounds, and head / base."""
    out: dict = {}
    for name in ("base", "head"):
        for run in runs[name]:
            for row in run["rows"]:
                mode = out.setdefault(row["spec"], {})
                for f in FIELDS:
                    mode.setdefault(f, {}).setdefault(name, []).append(row[f])
    for mode in out.values():
        for f, seen in mode.items():
            mode[f] = {k: min(v) for k, v in seen.items()}
            mode[f]["head_over_base"] = mode[f]["head"] / mode[f]["base"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="the earlier commit to compare with")
    p.add_argument("--measure", type=Path, help="measure this tree only, JSON rows to this path")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 1)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="calls per tree and round (>= 1)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if (args.base is None) == (args.measure is None):
        p.error("give --base COMMIT (compare) or --measure OUT.json (this tree only)")
    if min(args.rounds, args.repeats, args.batch, args.new_tokens) < 1:
        p.error("--rounds, --repeats, --batch and --new-tokens must be >= 1")
    if args.measure is not None:
        args.measure.write_text(json.dumps(measure(args.batch, args.new_tokens, args.repeats)))
        return
    sys.path[:0] = [str(REPO), str(REPO / "tools")]
    from cpu_regression import interleaved

    from specrl.bench import run_metadata, write_result

    runs = interleaved(args.base, args.rounds, lambda tree, out: run_tree(tree, args, out))
    summary = summarize(runs)
    for mode, fields in summary.items():
        for f, v in fields.items():
            print(f"{mode:>6} {f:>17}: head {v['head']:8.3f}, base {v['base']:8.3f}, "
                  f"{v['head_over_base']:.3f}x")  # fmt: skip
    meta = run_metadata(" ".join(sys.argv))
    write_result(meta | {"base": args.base, "summary": summary, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
