"""Training-side phases of an RL step: policy update and logprob passes from FLOPs and MFU.

``train_seconds`` and ``logprob_seconds`` price one RL step's trainer work on ``gpus`` GPUs of
``hw`` for ``tokens`` tokens in sequences of mean length ``seq_len``: forward FLOPs (x3 for
training) over GPUs x bf16 peak x the model class's MFU (``data/training.toml``, each value
naming its published source; a scenario may override it), plus the layout's collectives.
The formulas: docs/internals.md.
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from specrl.costmodel.cost import all_reduce_time, all_to_all_time
from specrl.costmodel.errors import SimInputError
from specrl.costmodel.specs import DTYPE_BYTES, HardwareSpec, ModelSpec, Spec, build_spec
from specrl.settings import AppliesOnly, Coverage, errors_as, read_toml

MODEL_CLASSES = ("dense", "moe")


class TrainingEfficiency(Spec):
    """Measured RL-training efficiency of one model class, with where it comes from."""

    model_class: str
    train_mfu: float
    logprob_mfu: float
    expert_parallel: int = 1  # EP degree of the class's training layout (1 for dense)
    sources: tuple[str, ...] = Field((), strict=False)  # a TOML list; each item a strict string

    coverage: ClassVar[Coverage] = Coverage(  # a dense model's layout has no experts to spread
        rules=(AppliesOnly("expert_parallel", "model_class", lambda c: c == "moe", "='moe'"),),
        always=("model_class", "train_mfu", "logprob_mfu", "sources"),
    )


def model_class(model: ModelSpec) -> str:
    return "moe" if model.is_moe else "dense"


def _table_path() -> Path:
    return Path(str(resources.files("specrl.sim") / "data" / "training.toml"))


def load_efficiency(model: ModelSpec, path: Path | None = None) -> TrainingEfficiency:
    """The efficiency row of ``model``'s class from the training table."""
    path = path or _table_path()
    with errors_as(SimInputError):
        table = read_toml(path, "training table")
    cls = model_class(model)
    if not isinstance(row := table.get(cls), dict):
        raise SimInputError(f"{path}: bad training table (no [{cls}] table)")
    data = {**row, "model_class": cls}
    return build_spec(TrainingEfficiency, data, "training table", f"{path} [{cls}]")


def forward_flops(model: ModelSpec, tokens: float, seq_len: float) -> float:
    """One forward over ``tokens`` tokens in causal sequences of mean length ``seq_len``."""
    attention = 2.0 * model.layers * model.heads * model.head_dim * seq_len
    return tokens * (2.0 * model.params_active + attention)


def parallel_seconds(
    model: ModelSpec, hw: HardwareSpec, gpus: int, tokens: float, passes: int, ep: int
) -> float:
    """Expert-parallel all-to-alls of ``passes`` passes over the tokens (MoE only)."""
    if not model.is_moe or ep <= 1:
        return 0.0
    per_gpu = tokens / gpus * model.experts_per_token * model.hidden * DTYPE_BYTES
    return passes * model.moe_layers * 2 * all_to_all_time(hw, min(ep, gpus), per_gpu)


TRAIN_BYTES_PER_PARAM = 16  # bf16 weights and grads, fp32 master weights and two Adam moments
TRAIN_MEMORY_FRACTION = 0.8  # of HBM for model state (the rest: activations, buffers)


def model_parallel_shards(model: ModelSpec, hw: HardwareSpec, gpus: int, ep: int) -> int:
    """GPUs one copy of the model state is split over: at least the class's EP degree (MoE) and
    enough GPUs to hold 16 bytes per parameter in 80% of their HBM; at most all of them."""
    needed = math.ceil(
        model.params_total * TRAIN_BYTES_PER_PARAM / (hw.hbm_bytes * TRAIN_MEMORY_FRACTION)
    )
    return max(1, min(gpus, max(needed, ep if model.is_moe else 1)))


def gradient_sync_seconds(model: ModelSpec, hw: HardwareSpec, gpus: int, shards: int) -> float:
    """One all-reduce of the bf16 gradients, each GPU holding 1/``shards`` of them, across the
    gpus / shards data-parallel copies (the link of the whole pool)."""
    shards = max(1, min(shards, gpus))
    grads = model.params_total * DTYPE_BYTES / shards
    return all_reduce_time(hw, gpus // shards, grads, span=gpus)


def train_seconds(
    model: ModelSpec,
    hw: HardwareSpec,
    gpus: int,
    tokens: float,
    seq_len: float,
    eff: TrainingEfficiency,
    mfu: float = 0.0,
) -> float:
    """Seconds of the policy update (forward + backward = 3 forwards) on ``gpus`` GPUs."""
    rate = gpus * hw.peak_flops * (mfu or eff.train_mfu)
    compute = 3.0 * forward_flops(model, tokens, seq_len) / rate
    comm = parallel_seconds(model, hw, gpus, tokens, 3, eff.expert_parallel)
    shards = model_parallel_shards(model, hw, gpus, eff.expert_parallel)
    return compute + comm + gradient_sync_seconds(model, hw, gpus, shards)


def logprob_seconds(
    model: ModelSpec,
    hw: HardwareSpec,
    gpus: int,
    tokens: float,
    seq_len: float,
    passes: int,
    eff: TrainingEfficiency,
    mfu: float = 0.0,
) -> float:
    """Seconds of ``passes`` logprob forwards (old policy, reference) on ``gpus`` GPUs."""
    rate = gpus * hw.peak_flops * (mfu or eff.logprob_mfu)
    one = forward_flops(model, tokens, seq_len) / rate
    one += parallel_seconds(model, hw, gpus, tokens, 1, eff.expert_parallel)
    return passes * one
