"""Static-shape steps replayed per key: captured CUDA graphs, or the same steps run eagerly.

``StepGraphs(device, capture)``: ``run(key, fn, inputs)`` calls ``fn(static)`` on static copies of
``inputs`` (a dict of tensors whose shapes the key fixes). The first call with a key allocates
the static inputs; with ``capture`` (CUDA only) it warms ``fn`` up on a side stream, captures it
into a CUDA graph (one memory pool shared by all of this object's graphs) and replays it; later
calls copy the inputs in and replay. Without ``capture`` the same static buffers are filled and
``fn`` runs eagerly: the static path's semantics on any device (tests, CPUs). ``fn`` must be
idempotent in its effects (a KV cache write at the given positions is: warm-up and replay write
the same values), must read no device data on the host (no ``bool(t)``, ``.item()``) and must
return tensors only (a tensor, or a tuple / list of tensors and None). Static inputs and outputs
are views of flat buffers shared by every key of the object (``_Arena``: one per input name or
output index and dtype, as large as the largest key's), so the memory a key holds does not grow
with the number of keys; a captured step copies its outputs into them at the end of the graph
(the outputs ``fn`` allocated are the pool's again for the next capture). Outputs are valid
until the next ``run`` of any key.
``buckets(limit)`` / ``bucket_for`` give the batch sizes steps are padded to (vLLM's: 1, 2, 4,
then multiples of 8), ``pad_rows`` pads a batch to one, ``span_for`` the cache span a step
reads. ``clear`` drops every graph (a KV
cache reallocated, weights replaced by new tensors). No module-level state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

SPAN_MIN = 256  # the shortest cache span a static step reads (``span_for``)
WARMUP = 2  # eager runs on a side stream before a capture (lazy inits, cuBLAS workspaces)


def buckets(limit: int) -> tuple[int, ...]:
    """Batch sizes up to ``limit`` (inclusive, always present): 1, 2, 4, then multiples of 8."""
    if limit < 1:
        raise ValueError(f"bucket limit must be >= 1, got {limit}")
    sizes = [b for b in (1, 2, 4) if b < limit] + list(range(8, limit, 8))
    return (*sizes, limit)


def bucket_for(rows: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size in ``sizes`` holding ``rows`` rows, None when none does."""
    return next((b for b in sizes if b >= rows), None)


def span_for(need: int, limit: int) -> int:
    """The cache positions a static step reads when its rows reach position ``need - 1``: the
    smallest of 256, 384, 512, 768, 1024, ... (2^i and 1.5 * 2^i, two spans per doubling, at
    most a third of them unused) holding ``need``, at most ``limit`` (the cache's length)."""
    length = SPAN_MIN
    while length < need:
        length = length // 2 * 3 if length & (length - 1) == 0 else length // 3 * 4
    return min(length, limit)


def pad_rows(t: torch.Tensor, width: int, value: float = 0) -> torch.Tensor:
    """``t`` [B, ...] with rows of ``value`` appended up to ``width`` rows (where it lives)."""
    pad = width - t.shape[0]
    return t if pad == 0 else torch.cat([t, t.new_full((pad, *t.shape[1:]), value)])


class StepGraphs:
    """Static buffers and (with ``capture``) a CUDA graph per key (module docstring)."""

    def __init__(self, device: torch.device, capture: bool) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.device = device
        self.capture = capture
        self._steps: dict[Hashable, _Step] = {}
        self._arena = _Arena(device)
        self._pool = None  # the graphs' shared memory pool, made with the first capture
        self.captures = 0  # graphs captured (or static steps built) since the last clear
        self.built = 0  # static steps built since this object was made (never reset)
        self.replays = 0  # runs

    def __len__(self) -> int:
        return len(self._steps)

    def run(
        self,
        key: Hashable,
        fn: Callable[[dict[str, torch.Tensor]], Any],
        inputs: Mapping[str, torch.Tensor],
    ) -> Any:
        """``fn``'s outputs for ``inputs`` through the static step of ``key``."""
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = self._build(fn, inputs)
            self.captures += 1
            self.built += 1
        else:
            step.fill(inputs)
        self.replays += 1
        return step.replay()

    @property
    def nbytes(self) -> int:
        """Bytes of the static buffers every step shares (their graphs' pool not included)."""
        return self._arena.nbytes

    def clear(self) -> None:
        """Drop every step (their buffers and graphs) and the pool they shared."""
        self._steps.clear()
        self._arena = _Arena(self.device)
        self._pool = None  # a pool is never reopened once its graphs are gone
        self.captures = 0

    def _build(
        self, fn: Callable[[dict[str, torch.Tensor]], Any], inputs: Mapping[str, torch.Tensor]
    ) -> _Step:
        static = {name: self._arena.view(("in", name), t.shape, t.dtype).copy_(t)
                  for name, t in inputs.items()}  # fmt: skip
        if not self.capture:
            return _Step(static, fn, arena=self._arena)
        staging = {name: torch.empty_like(t).pin_memory()
                   for name, t in inputs.items() if t.device.type == "cpu"}  # fmt: skip
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP):
                out = fn(static)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        shared = self._arena.like(out)
        del out
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread (the async learner) may allocate while this captures
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            _copy_outputs(shared, fn(static))
        return _Step(static, fn, graph, shared, staging)


class _Arena:
    """Flat buffers on ``device`` shared by the steps of one ``StepGraphs``, one per slot (an
    input's name, an output's index) and dtype; a step's static tensor is a view of a buffer's
    first elements. Steps run one at a time, so keys may share them. A buffer too small for a
    new key is replaced (at least doubled) for later keys; steps built on the old one keep it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._flat: dict[tuple[Hashable, torch.dtype], torch.Tensor] = {}
        self.nbytes = 0  # every buffer made, replaced ones included (kept by earlier steps)

    def view(self, slot: Hashable, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A ``shape`` view of slot ``slot``'s ``dtype`` buffer (its first elements)."""
        numel = math.prod(shape)
        flat = self._flat.get((slot, dtype))
        if flat is None or flat.numel() < numel:
            size = max(numel, 0 if flat is None else 2 * flat.numel())
            flat = self._flat[slot, dtype] = torch.empty(size, dtype=dtype, device=self.device)
            self.nbytes += flat.nbytes
        return flat[:numel].view(shape)

    def like(self, out: Any) -> Any:
        """Output views shaped like ``out`` (a tensor, or a tuple / list of tensors and None),
        holding its values."""
        if isinstance(out, torch.Tensor):
            return self.view(("out", 0), out.shape, out.dtype).copy_(out)
        if not isinstance(out, (tuple, list)):
            raise TypeError(f"a static step returns tensors, got {type(out).__name__}")
        views = [None if t is None else self.view(("out", i), t.shape, t.dtype).copy_(t)
                 for i, t in enumerate(out)]  # fmt: skip
        return type(out)(views)


def _copy_outputs(shared: Any, out: Any) -> Any:
    """``out``'s tensors copied into ``shared`` (``_Arena.like``'s views of it); ``shared``."""
    if isinstance(shared, torch.Tensor):
        return shared.copy_(out)
    for view, t in zip(shared, out, strict=True):
        if view is not None:
            view.copy_(t)
    return shared


class _Step:
    """One key's static inputs and its graph (None: run ``fn`` eagerly on them); a captured
    step's host inputs pass through pinned staging buffers (asynchronous copies; the caller
    waits for a step's results (the engine copies them to the host) before it runs the same
    key again, so a staging buffer is never rewritten while its copy is pending)."""

    def __init__(
        self,
        static: dict[str, torch.Tensor],
        fn: Callable[[dict[str, torch.Tensor]], Any],
        graph: torch.cuda.CUDAGraph | None = None,
        out: Any = None,
        staging: dict[str, torch.Tensor] | None = None,
        arena: _Arena | None = None,
    ) -> None:
        self.static, self.fn, self.graph, self.out = static, fn, graph, out
        self.staging = staging or {}
        self.arena = arena  # an eager step's, for its output views at its first run

    def fill(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Copy ``inputs`` into the static buffers."""
        for name, t in inputs.items():
            pinned = self.staging.get(name)
            if pinned is not None and t.device.type == "cpu":
                t = pinned.copy_(t)
            self.static[name].copy_(t, non_blocking=True)

    def replay(self) -> Any:
        if self.graph is not None:
            self.graph.replay()
        elif self.out is None:  # an eager step's first run: its output views
            self.out = self.arena.like(self.fn(self.static))
        else:
            _copy_outputs(self.out, self.fn(self.static))
        return self.out
