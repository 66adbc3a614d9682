"""Wall time of training the default drafter end to end (``specrl train-drafter``, fresh dir).

Runs the command with its defaults (the recipe of the cached default drafter: rollouts, feature
recording, training, held-out acceptance) in a fresh output directory, so nothing cached is
reused, and records the total wall time, the per-phase times the command prints and its
held-out acceptance lengths. Issue target: <= 30 minutes on 2 CPU cores.

    .venv/bin/python benchmarks/train_drafter_time.py --threads 2 [--drafter eagle3] [--keep DIR]

Writes benchmarks/results/train_drafter_time.json (with ``specrl.bench.run_metadata()``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specrl.bench import run_metadata, write_result

OUT = Path(__file__).parent / "results" / "train_drafter_time.json"
PATTERNS = {
    "data_s": r"examples, \d+ tokens in (\d+)s",
    "train_s": r"trained \d+ steps in (\d+)s",
    "tv_s": r"fine-tuned \(total variation\) \d+ steps in (\d+)s",
    "acceptance_t0": r"T=0: untrained [\d.]+\s+trained ([\d.]+)",
    "acceptance_t1": r"T=1: untrained [\d.]+\s+trained ([\d.]+)",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="eagle3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--keep", type=Path, help="copy the trained drafter's directory here")
    args, extra = ap.parse_known_args()  # anything else goes to train-drafter
    specrl = Path(sys.executable).with_name("specrl")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="specrl_drafter_time_") as d:
        cmd = [str(specrl), "train-drafter", "--drafter", args.drafter, "--out", d,
               "--threads", str(args.threads), *extra]  # fmt: skip
        env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        wall = time.perf_counter() - t0
        if args.keep and proc.returncode == 0:
            shutil.copytree(d, args.keep, dirs_exist_ok=True)
    print(proc.stdout)
    if proc.returncode:
        sys.exit(f"train-drafter failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    found = {k: re.search(p, proc.stdout) for k, p in PATTERNS.items()}
    result = {k: float(m.group(1)) for k, m in found.items() if m} | {"wall_s": round(wall, 1)}
    meta = run_metadata("benchmarks/train_drafter_time.py " + " ".join(sys.argv[1:]))
    meta |= {"loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    write_result({"meta": meta, "command": cmd[1:], "result": result}, args.out)
    print(f"wall {wall / 60:.1f} min  {result}")


if __name__ == "__main__":
    main()
