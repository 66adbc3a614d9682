"""Bytes per checkpoint of the default run's policy (the bundled SmolLM2-135M) and what a user
can turn down: the learner's precision, ``run.final_checkpoint = 'weights'``,
``run.keep_checkpoints``.

Usage: python benchmarks/checkpoint_size.py [--out PATH]

For each learner setting (the default ``learner.dtype`` / ``bf16_mode``, and ``bf16_mode =
'params'``) the learner is built over the bundled model as ``specrl train`` builds it, takes one
AdamW step on zero gradients (AdamW makes its moments on the first step, as the first real step
does), and ``save_checkpoint`` writes a full and a weights-only checkpoint into a temporary
directory; each file's bytes are reported. What the default run keeps on disk follows from
those sizes and ``run.keep_checkpoints`` (at a save, the new checkpoint is written before the
oldest is removed: one more than kept, for a moment). The backend's and a drafter's state are
not included (the default run's ``rollout.spec`` trains no drafter). Writes
benchmarks/results/checkpoint_size.json (command, date, git commit, CPU flags, versions).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from specrl.bench import run_metadata, write_result
from specrl.config import load_config
from specrl.fsutil import tree_bytes
from specrl.models.checkpoints import load_model
from specrl.pipelines.checkpoint import save_checkpoint
from specrl.rl.learner import Learner

OUT = Path(__file__).parent / "results" / "checkpoint_size.json"
SETTINGS = {"default": [], "bf16_params": ["learner.dtype=bf16", "learner.bf16_mode=params"]}


def stepped_learner(sets: list[str]) -> tuple[Learner, dict]:
    """The default run's learner (with ``sets``) after one AdamW step on zero gradients."""
    cfg = load_config(None, sets)
    learner = Learner(load_model(cfg.model.name), cfg.learner, max_len=cfg.rollout.max_new_tokens)
    params = [p for g in learner.optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    learner.optimizer.step()
    info = {"learner_dtype": cfg.learner.dtype, "bf16_mode": cfg.learner.bf16_mode,
            "policy_parameters": sum(p.numel() for p in learner.model.parameters()),
            "policy_dtype": str(next(learner.model.parameters()).dtype)}  # fmt: skip
    return learner, info


def sizes(learner: Learner, weights_only: bool) -> dict:
    """Bytes of each file of a checkpoint of ``learner`` and their total."""
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        ckpt = save_checkpoint(Path(tmp) / "step_000001", learner.model, learner.optimizer,
                               {"step": 1, "policy_version": 1},
                               weights_only=weights_only)  # fmt: skip
        files = {p.name: p.stat().st_size for p in sorted(ckpt.iterdir())}
        return {"files": files, "bytes": tree_bytes(ckpt)}


def on_disk(full: int, weights: int, keep: int, final_weights: bool) -> dict:
    """What a run keeps at its end and at most during it, from the checkpoint sizes."""
    end = (keep - 1) * full + (weights if final_weights else full)
    return {
        "keep_checkpoints": keep,
        "final_checkpoint": "weights" if final_weights else "full",
        "bytes_at_end": end,
        "bytes_at_most": max(end, (keep + 1) * full if keep else full),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = {}
    for name, sets in SETTINGS.items():
        learner, info = stepped_learner(sets)
        full, weights = sizes(learner, False), sizes(learner, True)
        n = info["policy_parameters"]
        rows[name] = info | {"full": full, "weights_only": weights,
                             "full_bytes_per_parameter": full["bytes"] / n,
                             "weights_bytes_per_parameter": weights["bytes"] / n}  # fmt: skip
        print(f"{name}: full {full['bytes'] / 1e9:.3f} GB ({full['bytes'] / n:.2f} B/param), "
              f"weights only {weights['bytes'] / 1e9:.3f} GB", flush=True)  # fmt: skip
        del learner
    full, weights = rows["default"]["full"]["bytes"], rows["default"]["weights_only"]["bytes"]
    cfg = load_config(None, [])
    disk = [on_disk(full, weights, keep, final)
            for keep in (cfg.run.keep_checkpoints, 1) for final in (False, True)]  # fmt: skip
    for d in disk:
        print(f"keep_checkpoints={d['keep_checkpoints']} final={d['final_checkpoint']}: "
              f"{d['bytes_at_end'] / 1e9:.2f} GB at the end, "
              f"{d['bytes_at_most'] / 1e9:.2f} GB at most")  # fmt: skip
    meta = run_metadata(" ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]))
    write_result(meta | {"settings": rows, "default_run_on_disk": disk}, args.out)


if __name__ == "__main__":
    main()
