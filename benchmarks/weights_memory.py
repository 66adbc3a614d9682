"""Resident weight memory of SmolLM2 in bf16 after decoding at batch 1 and 64: this tree
against another revision, side by side.

Usage: python benchmarks/weights_memory.py [--compare-rev REV] [--out PATH]

Each side runs in a fresh subprocess (``--compare-rev`` in a temporary ``git worktree`` of REV,
default 71f1ac3: before the tiled GEMM, when a Linear held its weight, oneDNN's packed copy for
more than 4 rows and the native kernel's for up to 4): load the model, decode one step at
batch 1 and one at batch 64 (context 64), then report the bytes of every Linear's weight and of
each packed copy it holds, and the process's resident set size (VmRSS) at each point. Writes
benchmarks/results/weights_memory.json (command, date, machine, versions).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).parent / "results" / "weights_memory.json"
ROOT = Path(__file__).resolve().parent.parent


def rss_bytes() -> int:
    """This process's resident set size (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def packed_bytes(t) -> int:
    """Bytes of a packed copy (a oneDNN tensor reports its logical size, dense in bf16)."""
    return 0 if t is None else t.numel() * t.element_size()


def measure() -> dict:
    """Load, decode at batch 1 and 64, count weight and packed bytes (the child's work)."""
    import torch

    from specrl.models.checkpoints import load_model
    from specrl.models.linear import Linear

    out = {"rss_start": rss_bytes()}
    model = load_model(dtype=torch.bfloat16)
    out["rss_loaded"] = rss_bytes()
    cache = model.new_cache(64, 80)
    with torch.no_grad():
        for batch in (1, 64):
            ids = torch.randint(0, 1000, (batch, 64))
            model(ids, torch.arange(64).expand(batch, 64), cache, prefill=True)
            step = torch.randint(0, 1000, (batch, 1))
            model(step, torch.full((batch, 1), 64), cache, kv_len=65)
            out[f"rss_after_batch_{batch}"] = rss_bytes()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    seen = {id(m.weight): m.weight for m in linears}
    out["linear_weight_bytes"] = sum(w.numel() * w.element_size() for w in seen.values())
    out["onednn_packed_bytes"] = sum(packed_bytes(m._packed) for m in linears)
    native = [m._native[0] if m._native is not None else None for m in linears]
    out["native_packed_bytes"] = sum(packed_bytes(t) for t in native)
    out["copies_of_the_weights"] = 1 + sum(
        x / out["linear_weight_bytes"]
        for x in (out["onednn_packed_bytes"], out["native_packed_bytes"])
    )
    return out


def run_side(tree: Path) -> dict:
    """``measure`` in a fresh interpreter importing specrl from ``tree``."""
    env = os.environ | {"PYTHONPATH": str(tree)}
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); " + (
        "import json, weights_memory; print(json.dumps(weights_memory.measure()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare-rev", default="71f1ac3", help="the revision to compare against")
    ap.add_argument("--out", default=str(OUT), help="where to write the JSON")
    args = ap.parse_args()
    from specrl.bench import run_metadata, write_result

    rows = {"this tree": run_side(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(old),
                        args.compare_rev], check=True)  # fmt: skip
        try:
            rows[args.compare_rev] = run_side(old)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                           check=True)  # fmt: skip
    for name, r in rows.items():
        print(f"{name:>10}: weights {r['linear_weight_bytes'] / 2**20:.0f} MiB, oneDNN packed "
              f"{r['onednn_packed_bytes'] / 2**20:.0f} MiB, native packed "
              f"{r['native_packed_bytes'] / 2**20:.0f} MiB ({r['copies_of_the_weights']:.2f} "
              f"copies); RSS after batch 64 {r['rss_after_batch_64'] / 2**20:.0f} MiB")  # fmt: skip
    meta = run_metadata() | {"compare_rev": args.compare_rev}
    write_result({"meta": meta, "results": rows}, args.out)


if __name__ == "__main__":
    main()
