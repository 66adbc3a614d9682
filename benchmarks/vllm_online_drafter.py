"""vLLM rollouts with an EAGLE-3 head trained during RL: acceptance per step, and the guard.

Usage: python benchmarks/vllm_online_drafter.py --head DIR [--steps 40] [--native-steps 0]
    [--threads 2] [--out benchmarks/results/vllm_online_drafter.json]

Each run is a real ``specrl train`` (``online_drafter.run``: a subprocess, the same task,
sizes and k = 3 at every step as ``benchmarks/online_drafter.py``) with ``rollout.backend=vllm``
and ``drafter.mode=online``: (a) "vllm cached online" from ``--head`` and (b) "vllm cold
start" from nothing (an empty cache: vLLM starts from a random head seeded by run.seed, the
trainer's start). With ``--native-steps N`` > 0 the same two runs on ``rollout.backend=native``
for N steps, side by side. Every drafter update is pushed into the running vLLM engine and its
fingerprint checked against what vLLM serves (``pipelines.guard``): a mismatch ends the run, so
``served_matched_every_update`` is whether the run finished, with the count of checked updates
(steps whose drafter was pushed). Compare with ``benchmarks/results/online_drafter.json``'s
"in-domain online" and "cold start" runs (native; its head was a ``proj``-layout head and its
cold start ran drafter.mode auto = refresh), whose acceptance first -> last 5 steps are copied
into the result.

The head (``--head``): vLLM serves only the ``eagle3`` layout, so train the in-domain head as
online_drafter.py's was, with ``--head-arch eagle3``:
    specrl train-drafter --drafter eagle3 --head-arch eagle3 --num-prompts 80 --steps 250 \\
        --tv-steps 0 --out /tmp/heads/indomain-eagle3
``--head`` takes that specrl head directory (the vLLM backend exports it at start) or its
export (``specrl export-drafter --from /tmp/heads/indomain-eagle3 --out /tmp/heads/vllm``).
Writes the per-step series, the drafter pushes per run and ``run_metadata()``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from online_drafter import REPO, run  # noqa: E402

from specrl.bench import run_metadata, write_result  # noqa: E402

REFERENCE = REPO / "benchmarks/results/online_drafter.json"
REFERENCE_RUNS = ("in-domain online", "cold start")


def guarded_run(name: str, sets: list[str], steps: int, threads: int, env: dict) -> dict:
    """``online_drafter.run`` plus the drafter versions pushed per step and whether every push
    matched what the engine serves (the run ends at the first mismatch)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        try:
            out = run(name, sets, steps, threads, env, keep=run_dir)
        except SystemExit as e:  # the run failed: a weight-sync error, or another
            return {"sets": sets, "served_matched_every_update": False, "error": str(e)[-2000:]}
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pushed = [r.get("drafter_sync_s") is not None for r in rows]
    out |= {
        "drafter_version": [r.get("drafter_version") for r in rows],
        "checked_updates": sum(pushed),
        "served_matched_every_update": True,
    }
    print(f"[{name}] {sum(pushed)} drafter updates pushed, every one served as trained",
          flush=True)  # fmt: skip
    return out


def reference() -> dict:
    """The native runs of online_drafter.json to compare with (acceptance first/last 5)."""
    if not REFERENCE.is_file():
        return {}
    runs = json.loads(REFERENCE.read_text())["runs"]
    keys = ("sets", "acceptance_first5", "acceptance_last5", "reward_first5", "reward_last5")
    return {n: {k: runs[n].get(k) for k in keys} for n in REFERENCE_RUNS if n in runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True, help="a cached EAGLE-3 head (see the docstring)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--native-steps", type=int, default=0, help="native side by side (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/vllm_online_drafter.json"))
    a = ap.parse_args()
    online = ["drafter.mode=online"]
    starts = {"cached online": [f"rollout.drafter_path={a.head}", *online], "cold start": online}
    backends = [("vllm", a.steps)] + ([("native", a.native_steps)] if a.native_steps else [])
    results = {}
    with tempfile.TemporaryDirectory() as empty:
        env = dict(os.environ)
        for backend, steps in backends:
            for start, sets in starts.items():
                name = f"{backend} {start}"
                run_env = env | {"SPECRL_CACHE": empty} if start == "cold start" else env
                sets = [f"rollout.backend={backend}", *sets]
                results[name] = guarded_run(name, sets, steps, a.threads, run_env)
    doc = {
        "command": " ".join(sys.argv),
        "metadata": run_metadata(" ".join(sys.argv)),
        "steps": a.steps,
        "native_steps": a.native_steps,
        "runs": results,
        "reference_native": reference(),
        "served_matched_every_update": {
            n: r["served_matched_every_update"] for n, r in results.items()
        },
    }
    write_result(doc, Path(a.out))
    summary = {n: {k: r.get(k) for k in ("acceptance_first5", "acceptance_last5",
                                         "checked_updates", "served_matched_every_update")}
               for n, r in results.items()}  # fmt: skip
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
