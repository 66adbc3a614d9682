"""The engine's KV cache, sized per call and bounded by the device memory it may use.

Contract: ``ensure`` readies the cache for a call: a slot per concurrent row (``batch_cap``:
``max_batch``, or with ``memory_fraction`` (a GPU) as many rows as their full-length cache fits
in the memory left under that share of the device, ``models.device.memory_budget``; with static
steps rounded down to a batch bucket, with slots for the bucket's padding rows) plus one for a
stashed prompt, and room for the call's longest prompt plus ``chunk`` positions. The cache is
not reserved for prompt + ``max_new_tokens`` up front: ``reserve`` doubles it, up to the longest
the call can need (``limit``), only when a row outgrows it (static steps read only the span
of it their rows reach). ``cache`` is None before the first call and after its owner
frees it (``free``). ``on_replace`` (a constructor argument) runs before a cache is replaced
by a new one or freed (the engine's static steps drop what holds the old one, so it is freed
before the new one is made); ``sizes`` are the static steps' batch buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specrl.engine.rows import Seq
from specrl.models.cache import KVCache
from specrl.models.device import memory_budget
from specrl.models.graphs import bucket_for
from specrl.models.transformer import Transformer
from specrl.rollout_types import Completion, Request


class KVSpace:
    """The KV cache of an engine's model on ``device`` (module docstring)."""

    def __init__(
        self,
        model: Transformer,
        device: torch.device,
        max_context: int,
        memory_fraction: float | None = None,
        sizes: tuple[int, ...] | None = None,
        on_replace: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.device = device  # where the cache and every forward's tensors live
        self.max_context = max_context
        self.memory_fraction = memory_fraction  # device memory share bounding the cache
        # bytes of one cache slot per position (the budget's unit), measured once
        self.position_bytes = model.new_cache(1, 1).nbytes if memory_fraction else 0
        self.cache: KVCache | None = None
        self.batch_cap = 0  # concurrent rows of the running call (memory permitting)
        self.limit = 0  # the longest cache the running call can need
        self.margin = 0  # positions a speculative forward writes past a row's last token
        # batch buckets of static steps (``specrl.engine.static``): a call's rows are at most a
        # bucket and the cache has slots for its bucket's padding rows; None: no static steps
        self.sizes = sizes
        self.on_replace: Callable[[], None] = on_replace or (lambda: None)  # before a cache goes

    def ensure(
        self,
        pending: Sequence[tuple[Request, list[Completion]]],  # the call's queue
        margin: int,
        max_batch: int,
        chunk: int,
    ) -> None:
        """A cache with a slot per concurrent row and room for the longest prompt plus
        ``chunk`` positions; ``reserve`` grows it up to ``limit`` later."""
        if not pending:
            return
        self.margin = margin
        self.limit = (
            margin
            + 1
            + max(
                min(len(r.prompt_ids) + r.sampling.max_new_tokens, self.max_context)
                for r, _ in pending
            )
        )
        longest_prompt = max(len(r.prompt_ids) for r, _ in pending)
        need_len = min(longest_prompt + margin + 1 + chunk, self.limit)
        total = sum(len(c) for _, c in pending)
        self.batch_cap = cap = self._rows_that_fit(self.limit, max_batch)
        rows = min(cap, total)
        if self.sizes is not None:  # padding rows of a static step take slots too
            self.batch_cap = cap = max(b for b in self.sizes if b <= cap)
            rows = bucket_for(min(cap, total), self.sizes)
        slots = rows + (total > cap)  # + the stash slot
        cache = self.cache
        # under a memory budget a cache with more slots than this call may use is made anew:
        # growing it (``reserve``) would lengthen the extra slots too
        extra = self.memory_fraction is not None and cache is not None and cache.slots > slots
        if cache is None or cache.slots < slots or cache.max_len < need_len or extra:
            keep = cache is not None and not extra
            slots = max(slots, cache.slots if keep else 0)
            need_len = max(need_len, cache.max_len if keep else 0)
            del cache
            self.on_replace()  # nothing else holds the old one ...
            self.cache = None  # ... so it is freed first
            self.cache = self.model.new_cache(slots, need_len)

    def free(self) -> None:
        """Let go of the cache (``on_replace`` first); the next ``ensure`` makes a new one."""
        self.on_replace()
        self.cache = None

    def _rows_that_fit(self, limit: int, max_batch: int) -> int:
        """Concurrent rows for a call whose rows may reach ``limit`` cache positions: max_batch,
        or under ``memory_fraction`` (a GPU) as many as the memory left then holds at full
        length, with a slot for a stashed prompt (``MemoryError`` naming both when not one)."""
        if self.memory_fraction is None:
            return max_batch
        held = 0 if self.cache is None else self.cache.nbytes
        budget = memory_budget(self.device, self.memory_fraction, held)
        if budget is None:
            return max_batch
        per_row = self.position_bytes * limit  # bytes of one row at full length
        fit = budget // per_row - 1
        if fit < 1:
            raise MemoryError(
                f"the KV cache of one row ({per_row} bytes for {limit} positions) does not fit "
                f"the {budget} bytes left under memory_fraction={self.memory_fraction}"
            )
        return min(max_batch, fit)

    def reserve(self, rows: list[Seq]) -> None:
        """Grow the cache (doubling, at most to ``limit``) so that the next forward of every
        row fits: positions up to len(history) - 1 + margin, and one spare (re-verification
        pads at the last position, which must lie past every history)."""
        if not rows:
            return
        need = max(len(s.history) for s in rows) + self.margin + 1
        cache = self.cache
        if need > cache.max_len:
            cache.grow(max(need, min(2 * cache.max_len, self.limit)))
