"""The learner sharded over the ranks of a torch.distributed process group with FSDP2.

Every rank builds ``ShardedLearner(model, cfg, mesh=..., ...)`` with the same arguments and calls
the same methods with the same samples (collectives). ``shard_model`` shards each decoder block and
the root (~1/N of parameters, gradients and AdamW state per rank); ``train_step`` splits the
samples by tokens (``split_by_tokens``) under whole-batch normalisers and sums the gradients, so
the step is the single-process one; its ``StepResult`` has the whole batch's metrics and (asked
for) logprobs on every rank, and this rank's share's features. ``iter_full_state`` yields full
weights block by block; ``learner_bytes`` measures a rank; ``init_distributed`` joins a group
(gloo CPU, NCCL CUDA).
Details: docs/internals.md, docs/training.md.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from specrl.models.moe import Routing
from specrl.rl.learner import (
    Captured,
    Learner,
    PackedBatch,
    StepResult,
    TrainSample,
    batch_norm,
    check_bf16_mode,
    micro_batches,
    nonempty,
    pack_sequences,
)

if TYPE_CHECKING:
    from specrl.config_training import LearnerCfg

SUMMED = ("loss", "tokens", "forward_tokens", "micro_batches", "sequences")  # added over ranks
BLOCK = re.compile(r"^layers\.\d+\.")


def backend_for(device: torch.device) -> str:
    """The collective backend for ``device``: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(
    rank: int, world_size: int, address: str, port: int, device: torch.device,
    timeout_s: float = 300.0,
) -> DeviceMesh:  # fmt: skip
    """Join the default process group at ``address:port`` and return its 1-D device mesh."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device), init_method=f"tcp://{address}:{port}", rank=rank,
        world_size=world_size, timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip
    return init_device_mesh(device.type, (world_size,))


def shard_model(
    model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None
) -> nn.Module:
    """``fully_shard`` each of ``model.layers`` and the root over ``mesh`` (in place), with
    gradients summed over ranks (the loss is normalised over the whole batch) and
    ``hidden_states`` a forward; ``param_dtype`` (bf16) gathers float32 shards in that dtype
    and reduces gradients in float32."""
    reduce = torch.float32 if param_dtype is not None else None
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    register_fsdp_forward_method(model, "hidden_states")
    for m in (*model.layers, model):
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    return model


def split_by_tokens(samples: Sequence[TrainSample], parts: int) -> list[range]:
    """``parts`` contiguous index ranges covering ``samples`` whose tokens (prompt +
    completion) are as even as whole samples allow: cut k sits where the running total is
    nearest k/parts of the whole (ties: the earlier index). Deterministic."""
    prefix = [0]
    for s in samples:
        prefix.append(prefix[-1] + len(s.prompt_ids) + len(s.completion_ids))
    scaled = [p * parts for p in prefix]  # k/parts of the whole is prefix[-1] * k: integers
    cuts = [0]
    for k in range(1, parts):
        target = prefix[-1] * k
        j = bisect.bisect_left(scaled, target)  # scaled[j] >= target; j <= len(samples)
        if j > 0 and target - scaled[j - 1] <= scaled[j] - target:
            j -= 1
        cuts.append(max(j, cuts[-1]))
    cuts.append(len(samples))
    return [range(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]


class ShardedLearner(Learner):
    """``Learner`` whose model (and reference model) are sharded over ``mesh``'s ranks (default:
    the whole default process group); the rest as ``Learner``."""

    def __init__(
        self,
        model: nn.Module,
        cfg: LearnerCfg,
        *,
        mesh: DeviceMesh | None = None,
        ref_model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """``Learner(model, cfg, ref_model=..., **kwargs)`` sharded over ``mesh``."""
        if mesh is None:  # the default group's, on its backend's device type
            kind = "cuda" if dist.get_backend() == "nccl" else "cpu"
            mesh = init_device_mesh(kind, (dist.get_world_size(),))
        self.mesh, self.group = mesh, mesh.get_group()
        self.rank, self.world = dist.get_rank(self.group), mesh.size()
        self.devices = self.world  # mfu against the peak of all ranks' devices
        if ref_model is not None:
            shard_model(ref_model, mesh)
        super().__init__(model, cfg, ref_model=ref_model, **kwargs)

    def _for_training(
        self, model: nn.Module, dtype: str, bf16_mode: str
    ) -> tuple[list[torch.Tensor], None]:
        """Float32 shards ('params' mode: gathered as bf16, no separate masters)."""
        check_bf16_mode(dtype, bf16_mode)
        bf16_params = dtype == "bf16" and bf16_mode == "params"
        model.float().requires_grad_(True)
        shard_model(model, self.mesh, torch.bfloat16 if bf16_params else None)
        return list(model.parameters()), None

    def _logprobs(
        self,
        model: nn.Module,
        batch: PackedBatch,
        capture: tuple[int, ...] | None = None,
        routing: Routing | None = None,
    ) -> tuple[torch.Tensor, list[Captured]]:  # [M], one per sequence with ``capture``
        out = super()._logprobs(model, batch, capture, routing)
        if not torch.is_grad_enabled():  # no backward will reshard the root (reference model)
            model.reshard()
        return out

    @torch.no_grad()
    def raw_logprobs(
        self,
        sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
        routings: Sequence[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        out = super().raw_logprobs(sequences, routings)
        self.model.reshard()
        return out

    def accumulate_gradients(
        self,
        samples: Sequence[TrainSample],
        *,
        keep_logprobs: bool = False,
        capture: tuple[int, ...] | None = None,
    ) -> StepResult:
        """This rank's share of the batch's gradient, summed over ranks into the sharded
        ``.grad``; metrics of the whole batch; with ``keep_logprobs`` every sample's logprobs
        (gathered from all ranks, a collective); with ``capture`` this rank's share's
        features."""
        samples = nonempty(samples)
        shares = [[samples[i] for i in r] for r in split_by_tokens(samples, self.world)]
        budget = self.micro_batch_tokens
        counts = [len(micro_batches(s, budget, self.share_prompts)) for s in shares]
        mine = self.accumulate_share(shares[self.rank], batch_norm(samples), capture)
        for _ in range(max(counts) - counts[self.rank]):  # every rank runs as many passes
            self._idle_pass()
        logprobs = self._gathered(mine.logprobs) if keep_logprobs else None
        return StepResult(self._reduced(mine.metrics), logprobs, mine.features)

    def _idle_pass(self) -> None:
        """A micro-step's collectives (forward, reference forward, backward), zero gradient."""
        batch = pack_sequences([([0], [0])], self.row_len).to(self.device)
        logprobs, _ = self._logprobs(self.model, batch)
        if self.ref_model is not None:
            with torch.no_grad():
                self._logprobs(self.ref_model, batch)
        (logprobs.sum() * 0.0).backward()

    def _gathered(self, local: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's ``local`` tensors, in rank order (= sample order), on this device."""
        parts: list[list[torch.Tensor] | None] = [None] * self.world
        dist.all_gather_object(parts, [t.cpu() for t in local], group=self.group)
        return [t.to(self.device) for part in parts for t in part]

    def _reduced(self, metrics: dict[str, float]) -> dict[str, float]:
        """Sums over ranks of ``SUMMED``; token-weighted means of ``token_means``."""
        means = self.token_means
        weighted = [metrics[k] * metrics["tokens"] for k in means]
        values = [metrics[k] for k in SUMMED] + weighted
        total = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.group)
        sums = dict(zip(SUMMED + means, total.tolist(), strict=True))
        tokens = max(sums["tokens"], 1.0)
        return {k: sums[k] / tokens if k in means else sums[k] for k in metrics}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def learner_bytes(learner: Learner) -> dict[str, int]:
    """Bytes this process holds of the learner's parameters (and masters), gradients and
    optimizer state (local shards of DTensors), and their total."""
    params = [*learner.model.parameters(), *(learner.masters or [])]
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in learner.optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]  # fmt: skip
    out = {"params": _nbytes(params), "grads": _nbytes(grads), "optimizer": _nbytes(state)}
    return out | {"total": sum(out.values())}


@torch.no_grad()
def iter_full_state(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """The full state dict of a (sharded) model, one group at a time: the root's entries
    (embedding, final norm, LM head), then each decoder block's, under the model's own names,
    optionally cast to ``dtype``. A collective: every rank iterates it to the end; each group is
    gathered when it is reached, so a rank holds one group's full tensors besides its shards."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors |= dict(model.named_buffers(remove_duplicate=False))
    groups: dict[str, list[str]] = {}
    for name in model.state_dict():
        block = BLOCK.match(name)
        groups.setdefault(block.group(0) if block else "", []).append(name)
    for names in groups.values():
        full: dict[int, torch.Tensor] = {}  # tied entries gathered once
        for name in names:
            t = tensors[name]
            if id(t) not in full:
                whole = t.full_tensor() if isinstance(t, DTensor) else t
                full[id(t)] = whole if dtype is None else whole.to(dtype)
        yield {name: full[id(tensors[name])] for name in names}
