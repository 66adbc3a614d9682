"""Static-shape steps replayed per key: captured CUDA graphs, or the same steps run eagerly.

``StepGraphs(device, capture)``: ``run(key, fn, inputs)`` calls ``fn(static)`` on static copies of
``inputs`` (a dict of tensors whose shapes the key fixes). The first call with a key allocates
the static inputs; with ``capture`` (CUDA only) it warms ``fn`` up on a side stream, captures it
into a CUDA graph (one memory pool shared by all of this object's graphs) and replays it; later
calls copy the inputs in and replay. Without ``capture`` the same static buffers are filled and
``fn`` runs eagerly: the static path's semantics on any device (tests, CPUs). ``fn`` must be
idempotent in its effects (a KV cache write at the given positions is: warm-up and replay write
the same values), must read no device data on the host (no ``bool(t)``, ``.item()``) and must
return tensors only. Its outputs are the graph's own buffers: valid until the next ``run``.
``buckets(limit)`` / ``bucket_for`` give the batch sizes steps are padded to (vLLM's: 1, 2, 4,
then multiples of 8), ``pad_rows`` pads a batch to one. ``clear`` drops every graph (a KV
cache reallocated, weights replaced by new tensors). No module-level state.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

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
        self._pool = None  # the graphs' shared memory pool, made with the first capture
        self.captures = 0  # graphs captured (or static steps built) since the last clear
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
        else:
            step.fill(inputs)
        self.replays += 1
        return step.replay()

    def clear(self) -> None:
        """Drop every step (their buffers and graphs) and the pool they shared."""
        self._steps.clear()
        self._pool = None  # a pool is never reopened once its graphs are gone
        self.captures = 0

    def _build(
        self, fn: Callable[[dict[str, torch.Tensor]], Any], inputs: Mapping[str, torch.Tensor]
    ) -> _Step:
        static = {name: t.to(self.device, copy=True) for name, t in inputs.items()}
        if not self.capture:
            return _Step(static, fn)
        staging = {name: torch.empty_like(t).pin_memory()
                   for name, t in inputs.items() if t.device.type == "cpu"}  # fmt: skip
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP):
                fn(static)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread (the async learner) may allocate while this captures
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = fn(static)
        return _Step(static, fn, graph, out, staging)


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
    ) -> None:
        self.static, self.fn, self.graph, self.out = static, fn, graph, out
        self.staging = staging or {}

    def fill(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Copy ``inputs`` into the static buffers."""
        for name, t in inputs.items():
            pinned = self.staging.get(name)
            if pinned is not None and t.device.type == "cpu":
                t = pinned.copy_(t)
            self.static[name].copy_(t, non_blocking=True)

    def replay(self) -> Any:
        if self.graph is None:
            return self.fn(self.static)
        self.graph.replay()
        return self.out
