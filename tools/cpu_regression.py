"""Did a change slow the engine on the CPU? This checkout against an earlier commit, interleaved.

Usage: python tools/cpu_regression.py --base COMMIT [--rounds 2] [--batch-sizes 1,8,32]
    [--new-tokens 64] [--spec suffix] [--out runs/cpu_regression.json]

The earlier commit is checked out into a temporary git worktree; both trees run the same
``specrl bench generate`` command (the bundled SmolLM2, the same prompts, the default dtype for
this CPU, plain decoding and each ``--spec`` drafter, the in-run roofline) with the same
virtual environment, the tree's own ``specrl`` first on ``PYTHONPATH``. Rounds alternate the
order (base, head; head, base; ...) so drift on the machine falls on both. Per batch size and
engine: the best and the median tokens/s of each tree over the rounds and head / base, and the
median share of each run's own measured roofline (the machine's bandwidth drifts between runs,
by up to 1.6x here: the share takes that out). Writes one JSON with
both trees' raw results, the ratios, and the machine's metadata (CPU flags included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specrl.bench import run_metadata, write_result  # noqa: E402

OUT = REPO / "runs" / "cpu_regression.json"  # a maintainer's check, not a result of record


def bench(tree: Path, args: argparse.Namespace, out: Path) -> dict:
    """One ``specrl bench generate`` run of ``tree``'s code; its JSON."""
    cmd = [sys.executable, "-m", "specrl.cli", "bench", "generate", "--batch-sizes",
           args.batch_sizes, "--new-tokens", str(args.new_tokens), "--json", str(out)]  # fmt: skip
    if args.spec:
        cmd += ["--spec", args.spec]
    env = os.environ | {"PYTHONPATH": str(tree)}
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def rates(
    runs: list[dict], pick: Callable[[list[float]], float], field: str = "tokens_per_s"
) -> dict[str, float]:
    """'engine@batch' -> ``pick`` of its ``field`` over ``runs`` (``bench generate`` JSONs)."""
    seen: dict[str, list[float]] = {}
    for run in runs:
        for row in run["results"]:
            key = f"{row['spec'] or row['engine']}@{row['batch_size']}"
            seen.setdefault(key, []).append(row[field])
    return {k: pick(v) for k, v in seen.items()}


def interleaved(
    commit: str, rounds: int, run: Callable[[Path, Path], dict]
) -> dict[str, list[dict]]:
    """``run(tree, json_path)`` on ``commit`` (a temporary git worktree) and on this checkout,
    ``rounds`` times, the order alternating (base, head; head, base; ...) so drift on the
    machine falls on both: {"base": [...], "head": [...]}."""
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), commit], cwd=REPO,
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        try:
            for r in range(rounds):
                for name in ["base", "head"] if r % 2 == 0 else ["head", "base"]:
                    print(f"round {r + 1}: {name}", file=sys.stderr)
                    tree = base if name == "base" else REPO
                    runs[name].append(run(tree, Path(tmp) / f"{name}{r}.json"))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO)
    return runs


VIEWS = {  # name -> (pick over rounds, field of each row)
    "max": (max, "tokens_per_s"),
    "median": (statistics.median, "tokens_per_s"),
    "median_of_roofline": (statistics.median, "fraction_of_measured_roofline"),
}


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
    runs = interleaved(args.base, args.rounds, lambda tree, out: bench(tree, args, out))
    summary = {}
    for view, (pick, field) in VIEWS.items():
        head, old = rates(runs["head"], pick, field), rates(runs["base"], pick, field)
        ratios = {k: head[k] / old[k] for k in sorted(head) if old.get(k)}
        summary[view] = {"head": head, "base": old, "ratios": ratios}
        for k, v in ratios.items():
            print(f"{view:>18} {k:>12}: head {head[k]:8.3f}, base {old[k]:8.3f}, {v:.3f}x")
    meta = run_metadata(" ".join(sys.argv))
    result = meta | {"base": args.base, "summary": summary}
    write_result(result | {"runs": runs}, args.out)


if __name__ == "__main__":
    main()
