"""Requests into live rows: validation, seeds, the queue, prefill and each row's first token.

Contract: ``plan`` makes ``n`` completion records per request, in request order, and queues the
valid requests as (request, [samples]) groups; a bad request (``rollout_types.request_problem``)
gets records with ``finish_reason == "error"`` and a one-line message. A sample's seed is
``sample_seed(seed, index)``, or drawn from the engine's seeded generator for an unseeded request.
``admit`` fills the call's free slots from the queue: a prompt is prefilled once per call and its
cache copied to its GRPO siblings, also to siblings admitted later when the batch is smaller than
the group (``PromptStash``, in the cache's last slot); separate requests with the same prompt
admitted together share one prefill row too. Each new row's first token is sampled at once.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass

import torch

from specrl.engine.call import Call
from specrl.engine.kv import KVSpace
from specrl.engine.rows import Kept, RowTensors, Seq, sample_rows
from specrl.rollout_types import Completion, Request, request_problem, sample_seed
from specrl.sampling import SamplingParams


@dataclass
class PromptStash:
    """The prefill of a request whose samples still wait in the queue (batch smaller than its
    group); its prompt cache is in the engine cache's last slot (``Admission._prefill``)."""

    req: Request
    logits: torch.Tensor  # [V] float32 at the last prompt position
    kept: Kept  # [n, ...] what the prompt positions keep (drafter features, MoE experts)


class Admission:
    """Planning and admitting an engine's requests (module docstring)."""

    def __init__(self, kv: KVSpace, vocab: int, seed: int) -> None:
        self._kv = kv
        self.vocab = vocab
        self._rng = random.Random(seed)
        self._next_row_id = 0  # row ids stay unique across calls (drafters key state on them)
        self.stash: PromptStash | None = None  # prefill of a request whose samples still wait

    def plan(self, requests: list[Request], version: int) -> tuple[list[Completion], deque]:
        """Validate requests; make completion records; queue (request, [samples]) groups."""
        completions: list[Completion] = []
        pending: deque = deque()
        for i, req in enumerate(requests):
            error = request_problem(req, self._kv.max_context, self.vocab)
            n = req.sampling.n if req.sampling.n >= 1 else 1
            comps = [
                Completion(i, j, list(req.prompt_ids), policy_version=version) for j in range(n)
            ]
            for c in comps:
                c.seed = self._seed(req.sampling, c.sample_index)
                if error:
                    c.finish_reason, c.error = "error", error
            completions += comps
            if not error:
                pending.append((req, comps))
        return completions, pending

    def _seed(self, params: SamplingParams, index: int) -> int:
        if params.seed is None:
            return self._rng.getrandbits(63)
        return sample_seed(params.seed, index)

    def admit(self, call: Call, rows: list[Seq], pending: deque, start: float) -> None:
        """Fill free slots from the queue; prefill each admitted prompt once per call."""
        groups: list[tuple[Request, list[Completion]]] = []
        free = self._kv.batch_cap - len(rows)
        while pending and free > 0:
            req, comps = pending[0]
            take, rest = comps[:free], comps[free:]
            groups.append((req, take))
            free -= len(take)
            if rest:
                pending[0] = (req, rest)
            else:
                pending.popleft()
        if groups:
            t0 = time.perf_counter()
            split = bool(pending) and pending[0][0] is groups[-1][0]  # its other samples wait
            ran = self._prefill(call, rows, groups, start, split)
            elapsed = time.perf_counter() - t0
            call.stats.prefill_s += elapsed
            if call.record_steps and ran:
                call.record("prefill", elapsed)

    def _prefill(
        self, call: Call, rows: list[Seq], groups: list, start: float, split: bool
    ) -> bool:
        """Prefill the groups' prompts, fork them, sample each new row's first token. With
        ``split`` the last group's request has samples left in the queue: its prompt cache goes
        to the cache's last slot (never a live row's: the cache has one more slot than the
        batch when groups can split) and its last-position logits and features to a
        ``PromptStash``; its later samples copy those instead of prefilling again. Returns
        whether a forward ran."""
        lens = [len(req.prompt_ids) for req, _ in groups]
        first_slot, slot = [], len(rows)
        for _, comps in groups:
            first_slot.append(slot)
            slot += len(comps)
        cache = self._kv.cache
        stash, stash_slot = self.stash, cache.slots - 1
        stashed = [stash is not None and req is stash.req for req, _ in groups]
        fresh = [g for g, hit in enumerate(stashed) if not hit]
        logits: list[torch.Tensor | None] = [None] * len(groups)  # [V] each
        kept: list[Kept] = [Kept()] * len(groups)  # [n, ...] each
        if fresh:
            prompts = [groups[g][0].prompt_ids for g in fresh]
            out, k = call.prefill(prompts, [first_slot[g] for g in fresh])
            for i, g in enumerate(fresh):
                logits[g], kept[g] = out[i], k[i]
        for g, hit in enumerate(stashed):
            if hit:
                cache.copy_slot(stash_slot, first_slot[g], lens[g])
                logits[g], kept[g] = stash.logits, stash.kept
        if split and (stash is None or groups[-1][0] is not stash.req):
            cache.copy_slot(first_slot[-1], stash_slot, lens[-1])
            self.stash = PromptStash(groups[-1][0], logits[-1], kept[-1])
        self._start_rows(call, rows, groups, first_slot, lens, torch.stack(logits), kept, start)
        return bool(fresh)

    def _start_rows(
        self,
        call: Call,
        rows: list[Seq],
        groups: list,
        first_slot: list[int],
        lens: list[int],
        logits: torch.Tensor,  # [G, V] last prompt position of each group
        kept: list[Kept],  # per group: [n, ...] what its prompt positions keep
        start: float,
    ) -> None:
        """Fork the groups into new rows and sample each row's first token."""
        new_rows = self._fork(groups, first_slot, lens)
        call.rows_changed()
        group_rows = [g for g, (_, c) in enumerate(groups) for _ in c]
        for seq, g in zip(new_rows, group_rows, strict=True):
            seq.keep(kept[g])
        t = RowTensors.of(new_rows, call.device)
        counters = torch.zeros(len(new_rows), dtype=torch.int64, device=call.device)
        s = sample_rows(logits[group_rows], t, counters)
        base = len(rows)
        rows += new_rows
        done = call.emit_sampled(new_rows, s, start, first=True)
        call.retire(rows, [base + i for i in done])  # a stop or the limit at the first token

    def _fork(self, groups: list, first_slot: list[int], lens: list[int]) -> list[Seq]:
        """Make Seq records; copy each prompt's cache to its siblings' slots."""
        new_rows = []
        for (req, comps), slot0, n in zip(groups, first_slot, lens, strict=True):
            key = hash(tuple(req.prompt_ids))
            for j, comp in enumerate(comps):
                if j:
                    self._kv.cache.copy_slot(slot0, slot0 + j, n)
                limit = min(n + req.sampling.max_new_tokens, self._kv.max_context)
                stop = frozenset(req.sampling.stop_token_ids)
                row_id, self._next_row_id = self._next_row_id, self._next_row_id + 1
                new_rows.append(
                    Seq(comp, req.sampling, list(req.prompt_ids), limit, key, row_id, stop)
                )
        return new_rows
