"""Did a change slow the engine on the CPU? This checkout against an earlier commit, interleaved.

Usage: python benchmarks/cpu_regression.py --base COMMIT [--rounds 2] [--batch-sizes 1,8,32]
    [--new-tokens 64] [--spec suffix] [--out benchmarks/results/cpu_regression.json]

The earlier commit is checked out into a temporary git worktree; both trees run the same
``specrl bench generate`` command (the bundled SmolLM2, the same prompts, the default dtype for
this CPU, plain decoding and each ``--spec`` drafter, the in-run roofline) with the same
virtual environment, the tree's own ``specrl`` first on ``PYTHONPATH``. Rounds alternate the
order (base, head; head, base; ...) so drift on the machine falls on both. Per batch size and
engine: the best tokens/s of each tree over the rounds and head / base. Writes one JSON with
both trees' raw results, the ratios, and the machine's metadata (CPU flags included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specrl.bench import run_metadata, write_result  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "cpu_regression.json"


def bench(tree: Path, args: argparse.Namespace, out: Path) -> dict:
    """One ``specrl bench generate`` run of ``tree``'s code; its JSON."""
    cmd = [sys.executable, "-m", "specrl.cli", "bench", "generate", "--batch-sizes",
           args.batch_sizes, "--new-tokens", str(args.new_tokens), "--json", str(out)]  # fmt: skip
    if args.spec:
        cmd += ["--spec", args.spec]
    env = os.environ | {"PYTHONPATH": str(tree)}
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def best_rates(runs: list[dict]) -> dict[str, float]:
    """'engine@batch' -> the best tokens/s over ``runs`` (``bench generate`` JSONs)."""
    best: dict[str, float] = {}
    for run in runs:
        for row in run["results"]:
            key = f"{row['spec'] or row['engine']}@{row['batch_size']}"
            best[key] = max(best.get(key, 0.0), row["tokens_per_s"])
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the earlier commit to compare with")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (>= 1)")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--spec", default="suffix", help="drafters besides plain ('' for none)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=REPO,
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        try:
            for r in range(args.rounds):
                order = ["base", "head"] if r % 2 == 0 else ["head", "base"]
                for name in order:
                    tree = base if name == "base" else REPO
                    print(f"round {r + 1}: {name}", file=sys.stderr)
                    runs[name].append(bench(tree, args, Path(tmp) / f"{name}{r}.json"))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO)
    head, old = best_rates(runs["head"]), best_rates(runs["base"])
    ratios = {k: head[k] / old[k] for k in sorted(head) if old.get(k)}
    for k, v in ratios.items():
        print(f"{k:>20}: head {head[k]:8.1f} tok/s, base {old[k]:8.1f} tok/s, {v:.3f}x")
    meta = run_metadata(" ".join(sys.argv))
    result = meta | {"base": args.base, "ratios": ratios, "best": {"head": head, "base": old}}
    write_result(result | {"runs": runs}, args.out)


if __name__ == "__main__":
    main()
