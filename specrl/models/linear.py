"""Linear layers that multiply with a packed copy of their weight in inference, and ``prepack``.

Contract: ``Linear`` is an ``nn.Linear`` that, with autograd off and a bf16/fp16 CPU weight,
multiplies with a packed copy of the weight: the native kernel's (``specrl.kernels.gemv``) for
bf16 inputs where it runs, else oneDNN's; one packed copy at a time, rebuilt whenever the weight
tensor changed (its version counter), a native copy in place in its old buffer.
``prepack(model)`` builds every packed copy now (after a weight update, so that the update pays
for it and the next forward does not), the native ones in one buffer per dtype on huge pages
(``specrl.kernels.hugepages``). ``onednn_packs(dtype)`` says whether oneDNN can pack that dtype
here. Numerics are those of the kernel a product runs on, whatever was packed when.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from specrl.kernels import gemv
from specrl.kernels.hugepages import huge_zeros


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack a ``dtype`` linear weight on this CPU (its bf16 path needs
    AVX512 BW/VL/DQ or AVX-NE-CONVERT; on an AVX2-only CPU ``F.linear`` runs instead)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


class Linear(nn.Linear):
    """``nn.Linear`` that, in inference (no grad) with a bf16/fp16 CPU weight, multiplies with a
    prepacked copy of the weight: for bf16 inputs our native kernel (``specrl.kernels.gemv``:
    any number of rows, batch-invariant sums, ~2x oneDNN's speed at batch 1 and on par from
    batch 64 on this project's CPU) when it can run here and ``native`` is True, else oneDNN's
    prepacked linear (no per-call weight reorder; ~10x faster than ``F.linear`` at batch 1).
    Either way one packed copy is held besides the weight.

    An input with no rows (M = 0) gives an empty output through ``F.linear``, never the kernel.
    Each packed copy is built on first use and rebuilt whenever the weight tensor changed (its
    version counter moved), so training in place and refitting weights can never leave a stale
    copy in use.
    """

    native: bool = True  # use the native kernel where it applies (see set_native_kernels)
    _packed: torch.Tensor | None = None
    _packed_key: tuple | None = None
    _native: tuple[torch.Tensor, tuple, gemv.GemvKernel] | None = None  # packed, key, kernel

    def _use_packed(self) -> bool:
        w = self.weight
        return (
            not torch.is_grad_enabled()
            and w.device.type == "cpu"
            and w.dtype in (torch.bfloat16, torch.float16)
            and onednn_packs(w.dtype)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nat = self._native  # the decode hot path: a few checks, then the kernel
        if (
            nat is not None
            and self.native
            and not torch.is_grad_enabled()
            and x.dtype == nat[0].dtype
            and x.shape[-1] == self.in_features
            and x.numel() > 0  # no rows: the kernel refuses M = 0
        ):
            w = self.weight
            if nat[1] == (w.data_ptr(), w._version, w.dtype):
                return self._native_forward(x, nat)
        if not self._use_packed():
            return F.linear(x, self.weight, self.bias)
        return self._forward_packed(x)

    def _forward_packed(self, x: torch.Tensor) -> torch.Tensor:
        """Inference with a packed weight: pick the path for x, (re)pack the weight for it."""
        if x.numel() == 0:  # an empty product: neither the native kernel nor oneDNN is needed
            return F.linear(x, self.weight, self.bias)
        if self.pack(x.dtype if x.shape[-1] == self.in_features else None):
            return self._native_forward(x, self._native)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def pack(self, dtype: torch.dtype | None, out: torch.Tensor | None = None) -> bool:
        """Make the packed copy an inference input of ``dtype`` uses current (None: an input
        the native kernel cannot take); True when it is the native kernel's. ``prepack`` calls
        it after a weight update so that the first forward does not pay for it. A native copy
        is rebuilt in its old buffer (else in ``out``, when given, else in a new one)."""
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype)
        kernel = self._native_kernel(dtype)
        if kernel is not None:
            if self._native is None or self._native[1] != key:
                old = self._native[0] if self._native is not None else None
                if old is None or old.shape != kernel.packed_shape(w):
                    self._native = old = None  # drop the old copy before packing the new one
                self._native = (kernel.pack(w, old if old is not None else out), key, kernel)
            self._packed = self._packed_key = None  # one packed copy, not two
            return True
        if self._packed_key != key:
            self._native = self._packed = None  # one packed copy, not two
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
            self._packed_key = key
        return False

    def _native_kernel(self, dtype: torch.dtype | None) -> gemv.GemvKernel | None:
        """The native kernel when inputs of ``dtype`` would multiply through it, else None."""
        if not self.native or dtype != self.weight.dtype:
            return None
        kernel = gemv.gemv_kernel()
        return kernel if kernel is not None and kernel.fits(self.weight) else None

    def native_buffer_shape(self) -> tuple[int, ...] | None:
        """The shape of a native packed copy this weight needs a new buffer for (None: it is
        not packed natively, or its current buffer already has that shape)."""
        kernel = self._native_kernel(self.weight.dtype) if self._use_packed() else None
        if kernel is None:
            return None
        shape = kernel.packed_shape(self.weight)
        return None if self._native is not None and self._native[0].shape == shape else shape

    def native_weight(self) -> torch.Tensor | None:
        """The native packed weight, if this module would use it now and it is current (native
        on, no bias, packed for the weight's present value); else None."""
        nat = self._native
        if nat is None or not self.native or self.bias is not None:
            return None
        w = self.weight
        return nat[0] if nat[1] == (w.data_ptr(), w._version, w.dtype) else None

    def _native_forward(self, x: torch.Tensor, nat: tuple) -> torch.Tensor:
        """x [..., K] through the native kernel -> [..., N]."""
        packed, _, kernel = nat
        n = self.out_features
        y = kernel.matmul(x.reshape(-1, x.shape[-1]), packed, n).view(*x.shape[:-1], n)
        return y if self.bias is None else y + self.bias


def prepack(model: nn.Module) -> None:
    """Build now the packed weights that ``model``'s inference forwards (inputs in the weights'
    dtype) would build on first use: after a weight update, so that the update pays for them
    and the next forward does not. Modules whose weights no packed path takes (float32, a
    dtype oneDNN cannot pack here) are left alone."""
    with torch.no_grad():
        linears = [m for m in model.modules() if isinstance(m, Linear) and m._use_packed()]
        buffers = _native_buffers(linears)
        for m in linears:
            m.pack(m.weight.dtype, buffers.get(id(m)))


def _native_buffers(linears: list[Linear]) -> dict[int, torch.Tensor]:
    """New buffers for the native packed copies ``linears`` lack, keyed by module id: views of
    ONE zeroed allocation (on huge pages where granted: decoding streams them all every step,
    and most are smaller than a huge page)."""
    needs = [(m, s) for m in linears if (s := m.native_buffer_shape()) is not None]
    views = {}
    for dtype in {m.weight.dtype for m, _ in needs}:
        group = [(id(m), s) for m, s in needs if m.weight.dtype == dtype]
        arena = huge_zeros((sum(math.prod(s) for _, s in group),), dtype)
        start = 0
        for key, shape in group:
            views[key] = arena[start : start + math.prod(shape)].view(shape)
            start += math.prod(shape)
    return views
