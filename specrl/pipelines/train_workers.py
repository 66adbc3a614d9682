"""Training over N processes: the sharded learner's ranks as Ray actors, driven from this one.

``TrainGroup.start(cfg, model, device, ...)`` places ``cluster.train_workers`` ranks (a Ray
placement group on this node, whose run dir takes their checkpoint shards, in the run's Ray
session; a local Ray binds 127.0.0.1), each a ``TrainRank``
holding a ``rl.sharded.ShardedLearner`` over its copy of ``model`` in one torch.distributed
group (gloo on CPU, NCCL on CUDA). The group stands in for the one-process ``Learner`` in
``RunParts``: ``train_step`` / ``raw_logprobs`` run on every rank (the same samples; each takes
its token share); ``model`` is this process's full copy, which ``pull_weights`` refreshes one
block at a time (rank 0 sends a gathered block, every rank frees it) for ``RunParts.push_weights``
to send through the guard. ``save`` / ``load`` write and read the ranks' DCP checkpoint
(``rl.sharded_checkpoint``). Any failure kills every rank (nothing waits on a collective that
cannot finish) and is raised in one line: a dead rank as ``TrainWorkerDied`` naming it, a
rank's own error as itself.
Details: docs/training.md.
"""

from __future__ import annotations

import copy
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specrl.backends.ray_session import (
    RaySession,
    actor_threads,
    death_line,
    import_ray,
    task_error,
)
from specrl.config import Config, ConfigError
from specrl.config_training import LearnerCfg
from specrl.rl import TrainSample
from specrl.rl.learner import Learner, StepResult
from specrl.rl.sharded import ShardedLearner, init_distributed, iter_full_state, learner_bytes
from specrl.rl.sharded_checkpoint import load_learner, save_learner

POLL_S = 1.0  # how often the driver looks for a dead rank while the others work
GRACE_S = 5.0  # after a rank's error, how long a peer's death may take to show (the cause)
PLACE_S = 120.0  # how long the ranks' placement may take before it is a ConfigError


class TrainWorkerDied(RuntimeError):
    """A train worker's process died; the run cannot go on (the message is one line)."""


class TrainRank:
    """The body of one train worker (a Ray actor): a ``ShardedLearner`` rank."""

    def __init__(self, rank: int, world: int, threads: int) -> None:
        torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        self.learner: ShardedLearner | None = None
        self.blocks: Any = None  # the weight iterator of a pull in progress

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the group's rendezvous: its node's address, a free port."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def setup(
        self, host: str, port: int, model: nn.Module, cfg: LearnerCfg, max_len: int,
        temperature: float, device: str,
    ) -> int:  # fmt: skip
        """Join the group and shard ``model``; this process's pid."""
        where = torch.device(device)
        if where.type == "cuda":
            where = torch.device("cuda", torch.cuda.current_device())
        init_distributed(self.rank, self.world, host, port, where)
        model = model.to(where)
        self.learner = ShardedLearner(model, cfg, max_len=max_len, temperature=temperature)
        return os.getpid()

    def train_step(
        self, samples: list[TrainSample], keep_logprobs: bool, capture: tuple[int, ...] | None
    ) -> StepResult:
        """One step (``ShardedLearner.train_step``): the batch's logprobs on rank 0 only (on
        the CPU; other ranks: None), this rank's captured features with ``capture``."""
        result = self.learner.train_step(samples, keep_logprobs=keep_logprobs, capture=capture)
        if result.logprobs is not None:
            result.logprobs = [t.cpu() for t in result.logprobs] if self.rank == 0 else None
        return result

    def raw_logprobs(
        self,
        sequences: list[tuple[list[int], list[int]]],
        routings: list[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """The learner's raw logprobs of ``sequences`` (rank 0 returns them; others ``[]``),
        ``routings``: each one's experts to replay."""
        out = self.learner.raw_logprobs(sequences, routings)
        return [t.cpu() for t in out] if self.rank == 0 else []

    def next_block(self) -> dict[str, torch.Tensor] | None:
        """The next gathered block of full weights (rank 0; others ``{}``), ``None`` at the
        end: a collective, every rank is called as often."""
        if self.blocks is None:
            self.blocks = iter_full_state(self.learner.model)
        block = next(self.blocks, None)
        if block is None:
            self.blocks = None
            return None
        if self.rank != 0:
            return {}
        moved: dict[int, torch.Tensor] = {}  # a tied weight moved (and sent) once
        for v in block.values():
            if id(v) not in moved:
                moved[id(v)] = v.cpu()
        return {k: moved[id(v)] for k, v in block.items()}

    def save(self, path: str) -> None:
        """This rank's part of the group's DCP checkpoint (a collective)."""
        save_learner(self.learner, path)

    def load(self, path: str) -> None:
        """This rank's shards from a DCP checkpoint of any number of ranks (a collective)."""
        load_learner(self.learner, path)

    def memory(self) -> dict[str, int]:
        """This rank's learner bytes (``rl.sharded.learner_bytes``)."""
        return learner_bytes(self.learner)


class TrainGroup:
    """The driver's handle on the ranks (see the module docstring)."""

    def __init__(
        self, cfg: Config, model: nn.Module, session: RaySession, max_len: int, temperature: float
    ) -> None:
        self.cfg, self.model, self.session = cfg, model, session
        self.max_len, self.temperature = max_len, temperature
        self.ray = import_ray()
        self.actors: list[Any] = []
        self.pids: list[int | None] = []
        self.group: Any = None  # the placement group

    @classmethod
    def start(
        cls, cfg: Config, model: nn.Module, device: torch.device, max_len: int, temperature: float
    ) -> TrainGroup:
        """Place and join ``cfg.cluster.train_workers`` ranks over copies of ``model`` on
        ``device``'s kind (``max_len``, ``temperature``: as ``Learner``'s); the
        driver's copy stays whole, in float32, here."""
        session = RaySession.open(cfg.cluster.address, need="cluster.train_workers > 1")
        group = cls(cfg, model.float(), session, max_len, temperature)
        try:
            group._place(device)
        except BaseException:
            group.close()
            raise
        return group

    def _place(self, device: torch.device) -> None:
        """The ranks on this node (the run dir, where DCP writes, is this node's), then joined."""
        ray, c = self.ray, self.cfg.cluster
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = 1.0 if device.type == "cuda" else 0.0
        if gpu:
            self._check_gpus()
        here = f"node:{ray.util.get_node_ip_address()}"
        bundle = {"CPU": 0.01, here: 0.001} | ({"GPU": gpu} if gpu else {})
        self.group = placement_group([bundle] * c.train_workers, strategy="STRICT_PACK")
        try:
            ray.get(self.group.ready(), timeout=PLACE_S)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(
                f"bad value for cluster.train_workers: the Ray cluster did not place "
                f"{c.train_workers} train workers ({bundle} each) on this node in {PLACE_S:g} s"
            ) from None
        threads = actor_threads(c.threads, c.rollout_workers + c.train_workers - 1)
        remote = ray.remote(TrainRank)
        for rank in range(c.train_workers):
            where = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)
            options = {"num_cpus": 0.01, "num_gpus": gpu, "max_restarts": 0,
                       "scheduling_strategy": where}  # fmt: skip
            self.actors.append(remote.options(**options).remote(rank, c.train_workers, threads))
        self.pids = [None] * len(self.actors)
        host, port = self._wait([self.actors[0].address.remote()])[0]
        ref = ray.put(self.model)
        args = (host, port, ref, self.cfg.learner, self.max_len, self.temperature, device.type)
        self.pids = self._all("setup", *args)

    def _check_gpus(self) -> None:
        """``ConfigError`` unless the cluster has a GPU for each rank besides the rollout
        workers' (a rank that cannot be placed would wait)."""
        c = self.cfg.cluster
        have = float(self.ray.cluster_resources().get("GPU", 0.0))
        need = c.train_workers + c.rollout_workers * c.worker_gpus
        if have < need:
            raise ConfigError(
                f"bad value for cluster.train_workers: {c.train_workers} train workers on CUDA "
                f"need a GPU each ({need:g} with the rollout workers'), the Ray cluster has "
                f"{have:g}"
            )

    # ----------------------------------------------------------------- calls and faults

    def _all(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every rank at once; their results in rank order."""
        if not self.actors:
            raise TrainWorkerDied("the train workers were closed after an earlier failure")
        return self._wait([getattr(a, method).remote(*args) for a in self.actors])

    def _wait(self, refs: list[Any]) -> list[Any]:
        """Results of ``refs`` (one per rank, in order); any failure closes the group and is
        raised (``_fail``)."""
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = self.ray.wait(pending, num_returns=1, timeout=POLL_S)
            for ref in ready:
                rank = refs.index(ref)
                failure, results[rank] = self._outcome(rank, ref)
                if failure is not None:
                    raise self._fail(failure, refs) from None
        return [results[rank] for rank in range(len(refs))]

    def _outcome(self, rank: int, ref: Any) -> tuple[Exception | None, Any]:
        """(None, the result) of rank ``rank``'s finished ``ref``; else (``TrainWorkerDied``
        for a dead process or the rank's own exception (``ray_session.task_error``), None)."""
        ex = self.ray.exceptions
        try:
            return None, self.ray.get(ref)
        except ex.RayActorError as e:
            pid = self.pids[rank] if rank < len(self.pids) else None
            where = f" (pid {pid})" if pid else ""
            return TrainWorkerDied(f"train worker {rank}{where} died: {death_line(e)}"), None
        except ex.RayTaskError as e:
            return task_error(e, f"train worker {rank}"), None

    def _fail(self, first: Exception, refs: list[Any]) -> Exception:
        """Close the group; the failure to raise: ``first``, unless it is a rank's own error
        and another rank's death shows up within ``GRACE_S`` (a peer's death fails the
        survivors' collectives, and their error may arrive first)."""
        if not isinstance(first, TrainWorkerDied):
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=GRACE_S)
            deaths = [self._outcome(refs.index(r), r)[0] for r in ready]
            first = next((d for d in deaths if isinstance(d, TrainWorkerDied)), first)
        self.close()
        return first

    # ----------------------------------------------------------------- the learner's face

    def train_step(
        self,
        samples: Sequence[TrainSample],
        *,
        keep_logprobs: bool = False,
        capture: tuple[int, ...] | None = None,
    ) -> StepResult:
        """``Learner.train_step`` over the ranks: rank 0's metrics and logprobs, every rank's
        features (ranks' shares in rank order: sample order)."""
        ref = self.ray.put(list(samples))
        layers = None if capture is None else tuple(capture)
        out: list[StepResult] = self._all("train_step", ref, keep_logprobs, layers)
        features = [c for result in out for c in result.features]
        return StepResult(out[0].metrics, out[0].logprobs, features)

    def raw_logprobs(
        self,
        sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
        routings: Sequence[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """``Learner.raw_logprobs`` (every rank computes all of them; rank 0's come back)."""
        seqs = [(list(p), list(c)) for p, c in sequences]
        given = None if routings is None else list(routings)
        return self._all("raw_logprobs", self.ray.put(seqs), given)[0]

    @torch.no_grad()
    def pull_weights(self) -> None:
        """Refresh ``model`` from the ranks' shards, one gathered block at a time."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params |= dict(self.model.named_buffers(remove_duplicate=False))
        while (blocks := self._all("next_block"))[0] is not None:
            done: set[int] = set()  # a tied weight is copied once
            for name, value in blocks[0].items():
                if id(params[name]) not in done:
                    params[name].copy_(value)
                    done.add(id(params[name]))
            del blocks

    def save(self, path: Path) -> None:
        """The ranks' DCP checkpoint in ``path`` (atomic, verified; see
        ``rl.sharded_checkpoint``)."""
        self._all("save", str(path))

    def load(self, path: Path) -> None:
        """Load the DCP checkpoint in ``path`` (any number of ranks wrote it) into the ranks
        (``model`` follows at the next ``pull_weights``)."""
        self._all("load", str(path))

    def one_process(self) -> Learner:
        """A one-process ``Learner`` over a copy of ``model`` with this run's settings (to turn a
        one-worker checkpoint into one the ranks load)."""
        return Learner(copy.deepcopy(self.model), self.cfg.learner, max_len=self.max_len,
                       temperature=self.temperature)  # fmt: skip

    def memory(self) -> list[dict[str, int]]:
        """Each rank's learner bytes (``rl.sharded.learner_bytes``), in rank order."""
        return self._all("memory")

    @property
    def world(self) -> int:
        return len(self.actors)

    def close(self) -> None:
        """Kill the ranks, remove the placement group, release the Ray session (idempotent)."""
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        self.actors = []
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None
        self.session.close()


__all__ = ["TrainGroup", "TrainRank", "TrainWorkerDied"]
