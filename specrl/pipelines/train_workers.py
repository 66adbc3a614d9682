"""Training over N processes: the sharded learner's ranks as Ray actors, driven from this one.

``TrainGroup.start(cfg, model, device, ...)`` places ``cluster.train_workers`` ranks (a Ray
placement group, ``cluster.placement``: packed or spread over the nodes, in the run's Ray
session; a local Ray binds 127.0.0.1), each a ``TrainRank`` holding a
``rl.sharded.ShardedLearner`` over its copy of ``model`` in one torch.distributed group (gloo on
CPU, NCCL on CUDA) formed at rank 0's node; ``nodes``: each rank's node id. ``check_storage(path)``
proves every rank sees the run directory (a marker read and answered; else
``SharedStorageError``, one line naming rank and node). The group stands in for the one-process
``Learner`` in ``RunParts``: ``train_step`` / ``raw_logprobs`` run on every rank (the same
samples; each takes its token share); ``model`` is this process's full copy, which
``pull_weights`` refreshes one block at a time (rank 0 sends a gathered block, every rank frees
it); ``weight_blocks(dtype)`` instead leaves the gathered blocks in Ray's object store on rank
0's node (``RemoteWeights``, fingerprinted) for the Ray rollout workers to fetch. ``save`` /
``load`` write and read the ranks' DCP checkpoint (``rl.sharded_checkpoint``). Any failure kills
every rank (nothing waits on a collective that cannot finish) and is raised in one line: a dead
rank as ``TrainWorkerDied`` naming it and its node, a rank's own error as itself.
Details: docs/training.md.
"""

from __future__ import annotations

import copy
import os
import secrets
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specrl.backends.ray_ import RemoteWeights
from specrl.backends.ray_session import (
    RaySession,
    actor_threads,
    death_line,
    import_ray,
    task_error,
)
from specrl.config import Config, ConfigError
from specrl.config_training import LearnerCfg
from specrl.fsutil import atomic_write
from specrl.models.fingerprint import combine, fingerprint_parts
from specrl.pipelines.rundir import RunDirError
from specrl.rl import TrainSample
from specrl.rl.learner import Learner, StepResult
from specrl.rl.sharded import ShardedLearner, init_distributed, iter_full_state, learner_bytes
from specrl.rl.sharded_checkpoint import load_learner, save_learner

POLL_S = 1.0  # how often the driver looks for a dead rank while the others work
GRACE_S = 5.0  # after a rank's error, how long a peer's death may take to show (the cause)
PLACE_S = 120.0  # how long the ranks' placement may take before it is a ConfigError
PLACEMENTS = {"pack": "PACK", "spread": "SPREAD"}  # cluster.placement -> Ray's strategy


class TrainWorkerDied(RuntimeError):
    """A train worker's process died; the run cannot go on (the message is one line)."""


class SharedStorageError(RunDirError):
    """A train worker's node does not see the run directory (one line naming rank and node)."""


class TrainRank:
    """The body of one train worker (a Ray actor): a ``ShardedLearner`` rank."""

    def __init__(self, rank: int, world: int, threads: int) -> None:
        torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        self.learner: ShardedLearner | None = None
        self.blocks: Any = None  # the weight iterator of a pull in progress

    def node(self) -> str:
        """The id of the Ray node this rank runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def answer(self, marker: str, token: str) -> str | None:
        """Prove this rank sees the run's storage: read ``marker`` (the trainer wrote
        ``token`` into it) and write ``<marker>.rank<r>`` holding this rank's node id; None, or
        why not (one line)."""
        path = Path(marker)
        try:
            seen = path.read_text()
        except OSError as e:
            return f"cannot read {path.name} there ({e.strerror or e})"
        if seen != token:
            return f"{path.name} there holds other content (another directory of that name)"
        try:
            path.with_name(f"{path.name}.rank{self.rank}").write_text(self.node())
        except OSError as e:
            return f"cannot write beside it ({e.strerror or e})"
        return None

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

    def next_block(self, dtype: torch.dtype | None, put: bool) -> Any:
        """The next gathered block of full weights on rank 0 (others: ``{}``), ``None`` at the
        end: a collective, every rank is called as often. ``put``: rank 0 answers
        ``([ref], parts)`` instead, the block's parameters (cast to ``dtype``) in Ray's object
        store on its node and their ``fingerprint_parts``; else the block's tensors."""
        if self.blocks is None:
            self.blocks = iter_full_state(self.learner.model)
        block = next(self.blocks, None)
        if block is None:
            self.blocks = None
            return None
        if self.rank != 0:
            return {}
        if put:
            return self._put(block, dtype or torch.float32)
        moved: dict[int, torch.Tensor] = {}  # a tied weight moved (and sent) once
        for v in block.values():
            if id(v) not in moved:
                moved[id(v)] = v.cpu()
        return {k: moved[id(v)] for k, v in block.items()}

    def _put(self, block: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[list[Any], Any]:
        """A block's parameters (as ``named_parameters`` names them) in the object store."""
        import ray

        names = self._params()
        ours = {k: v.detach().to("cpu", dtype) for k, v in block.items() if k in names}
        return [ray.put(ours)], fingerprint_parts(ours, dtype)

    def _params(self) -> set[str]:
        return set(dict(self.learner.model.named_parameters()))

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
        self.nodes: list[str] = []  # each rank's Ray node id, in rank order
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
        """The ranks placed as ``cluster.placement`` says (on any nodes: each proves it sees
        the run's storage, ``check_storage``), then joined at rank 0's node."""
        ray, c = self.ray, self.cfg.cluster
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = 1.0 if device.type == "cuda" else 0.0
        if gpu:
            self._check_gpus()
        bundle = {"CPU": 0.01} | ({"GPU": gpu} if gpu else {})
        strategy = PLACEMENTS[c.placement]
        self.group = placement_group([bundle] * c.train_workers, strategy=strategy)
        try:
            ray.get(self.group.ready(), timeout=PLACE_S)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(
                f"bad value for cluster.train_workers: the Ray cluster did not place "
                f"{c.train_workers} train workers ({bundle} each, {strategy}) in {PLACE_S:g} s"
            ) from None
        threads = actor_threads(c.threads, c.rollout_workers + c.train_workers - 1)
        remote = ray.remote(TrainRank)
        for rank in range(c.train_workers):
            where = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)
            options = {"num_cpus": 0.01, "num_gpus": gpu, "max_restarts": 0,
                       "scheduling_strategy": where}  # fmt: skip
            self.actors.append(remote.options(**options).remote(rank, c.train_workers, threads))
        self.pids = [None] * len(self.actors)
        self.nodes = self._all("node")
        host, port = self._wait([self.actors[0].address.remote()])[0]
        ref = ray.put(self.model)
        args = (host, port, ref, self.cfg.learner, self.max_len, self.temperature, device.type)
        self.pids = self._all("setup", *args)

    def check_storage(self, path: Path) -> None:
        """``SharedStorageError`` (one line naming the rank and its node) unless every rank
        reads a marker this process writes in ``path`` and writes an answer this process reads
        (the ranks write their checkpoint shards there)."""
        token = secrets.token_hex(8)
        path = Path(path).absolute()  # a rank on another node has another cwd
        marker = path / f".specrl-storage-{token}"
        atomic_write(marker, token)
        try:
            answers = self._all("answer", str(marker), token)
            for rank, why in enumerate(answers):
                why = why or self._answered(marker, rank)
                if why is not None:
                    raise SharedStorageError(
                        f"train worker {rank} on node {self.nodes[rank]} cannot use the run "
                        f"directory {path}: {why}; every train worker's node must see it "
                        "(shared storage, docs/training.md)"
                    )
        finally:
            for f in path.glob(f"{marker.name}*"):
                f.unlink(missing_ok=True)

    def _answered(self, marker: Path, rank: int) -> str | None:
        """None if rank ``rank``'s answer beside ``marker`` names its node, else why not."""
        back = marker.with_name(f"{marker.name}.rank{rank}")
        seen = back.read_text() if back.is_file() else None
        return None if seen == self.nodes[rank] else f"its answer {back.name} is not seen here"

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
            if rank < len(self.nodes):
                where += f" on node {self.nodes[rank]}"
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
        while (blocks := self._all("next_block", None, False))[0] is not None:
            done: set[int] = set()  # a tied weight is copied once
            for name, value in blocks[0].items():
                if id(params[name]) not in done:
                    params[name].copy_(value)
                    done.add(id(params[name]))
            del blocks

    def weight_blocks(self, dtype: torch.dtype) -> RemoteWeights:
        """The policy's parameters in ``dtype`` as blocks in Ray's object store on rank 0's
        node, with their fingerprint: the rollout workers fetch them from there, not through
        this process (whose ``model`` is not refreshed: ``pull_weights`` does that)."""
        refs: list[Any] = []
        parts: dict[str, bytes] = {}
        while (blocks := self._all("next_block", dtype, True))[0] is not None:
            refs += blocks[0][0]
            parts |= blocks[0][1]
        shapes = {name: tuple(p.shape) for name, p in self.model.named_parameters()}
        return RemoteWeights(refs, combine(parts, dtype), shapes)

    def save(self, path: Path) -> None:
        """The ranks' DCP checkpoint in ``path`` (atomic, verified; see
        ``rl.sharded_checkpoint``); absolute: a rank on another node has another cwd."""
        self._all("save", str(Path(path).absolute()))

    def load(self, path: Path) -> None:
        """Load the DCP checkpoint in ``path`` (any number of ranks wrote it) into the ranks
        (``model`` follows at the next ``pull_weights``)."""
        self._all("load", str(Path(path).absolute()))

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


__all__ = ["SharedStorageError", "TrainGroup", "TrainRank", "TrainWorkerDied"]
