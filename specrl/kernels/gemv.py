"""Native bf16 kernels on AVX512-BF16 (and AMX) CPUs, built on first use, batch-invariant.

``gemv_kernel()`` returns a ``GemvKernel`` or ``None`` where it cannot run (no such CPU, no
compiler, a failed build or cache, ``SPECRL_NATIVE_KERNELS=0``); callers then use PyTorch's ops.
It never raises and is cached per process. ``GemvKernel`` offers ``pack`` / ``matmul``
(x @ weight.T, any rows), ``attention`` over the KV cache, the per-token elementwise ops,
``sample_t1`` and ``layers`` (a whole decoder stack in one call); ``native_bf16(*xs)`` is the
check before any of them. Every output element is computed in one fixed order, so results do
not depend on the batch, bit for bit. Details (layouts, AMX, measurements): docs/internals.md.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
from pathlib import Path

import torch

from specrl.kernels.build import open_library, unavailable
from specrl.kernels.hugepages import huge_zeros

MAX_ROWS = 4  # rows the GEMV path multiplies in one pass over the weight (more: tiled GEMM)
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
AMX_FLAGS = ("amx_tile", "amx_bf16")
ENV_SWITCH = "SPECRL_NATIVE_KERNELS"
AMX_SWITCH = "SPECRL_NATIVE_AMX"


class GemvKernel:
    """The loaded library's products (``specrl_gemm_bf16``) and attention
    (``specrl_attention_bf16``), with packing and shape checks."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.specrl_gemm_bf16
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn
        self.amx = amx_usable(lib)  # products through AMX tiles (see docs/internals.md)
        if self.amx:
            args = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
            self._amx = _bind(lib.specrl_gemm_amx_bf16, args)
        att = lib.specrl_attention_bf16
        att.argtypes = (
            [ctypes.c_void_p] * 6
            + [ctypes.c_int64, ctypes.c_void_p]
            + [ctypes.c_int64] * 6
            + [ctypes.c_float, ctypes.c_int]
        )
        att.restype = ctypes.c_int
        self._attention = att
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._rmsnorm = _bind(lib.specrl_rmsnorm_bf16, [ptr] * 5 + [i64] * 2 + [ctypes.c_float])
        self._silu_mul = _bind(lib.specrl_silu_mul_bf16, [ptr] * 2 + [i64] * 2)
        self._rope = _bind(lib.specrl_rope_bf16, [ptr, i64, ptr, ptr, ptr] + [i64] * 3)
        self._cache_write = lib.specrl_cache_write_bf16
        self._cache_write.argtypes = [ptr, i64, ptr, ptr, ptr] + [i64] * 5
        self._cache_write.restype = ctypes.c_int
        self._sample = _bind(lib.specrl_sample_t1, [ptr, ctypes.c_int, i64, i64, ptr, ptr, ptr])
        f32 = ctypes.c_float
        self._layers = _bind(
            lib.specrl_layers_bf16, [ptr, i64] + [ptr] * 11 + [f32, f32, ctypes.c_int]
        )

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether a [N, K] weight can be packed: bf16 on the CPU, N % 16 == 0, K % 4 == 0."""
        n, k = weight.shape
        return (
            weight.dtype == torch.bfloat16
            and weight.device.type == "cpu"
            and n % 16 == 0
            and k % 4 == 0
        )

    @staticmethod
    def packed_shape(weight: torch.Tensor) -> tuple[int, int, int, int]:
        """The shape ``pack`` gives ``weight`` [N, K]: [N/16, K/2, 16, 2]."""
        n, k = weight.shape
        return (n // 16, k // 2, 16, 2)

    @staticmethod
    def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] bf16 -> [N/16, K/2, 16, 2]: 16 output rows x 2 consecutive ks per 64 bytes,
        written into ``out`` (a contiguous tensor of that shape: a repack in place) or into a
        new tensor (on huge pages where it is large enough: decoding streams it)."""
        n, k = weight.shape
        src = weight.detach().view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3)
        if out is None:
            out = huge_zeros(src.shape, weight.dtype)
        elif out.shape != src.shape or not out.is_contiguous():
            raise ValueError(f"cannot pack a [{n}, {k}] weight into {tuple(out.shape)}")
        return out.copy_(src)

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] bf16 (any M) times the packed [N, K] weight transposed -> [M, N]; each
        output element is the same whatever M and the other rows are (batch-invariant)."""
        m, k = x.shape
        if packed.shape[0] * 16 != n or packed.shape[1] * 2 != k:
            raise ValueError(
                f"x [{m}, {k}] does not match a packed [{n}, ...] weight {packed.shape}"
            )
        if m == 0:  # nothing to multiply; the library refuses M < 1
            return torch.empty(0, n, dtype=torch.bfloat16)
        x = x.contiguous()
        y = torch.empty(m, n, dtype=torch.bfloat16)
        fn = self._amx if self.amx and k % 32 == 0 else self._fn  # by the weight's shape only
        if fn(packed.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads()):
            raise ValueError(f"gemv kernel refused shapes M={m}, N={n}, K={k}")
        return y

    @staticmethod
    def attention_fits(q: torch.Tensor, cache_k: torch.Tensor) -> bool:
        """Whether ``attention`` takes these: bf16 on the CPU, head_dim % 32 == 0 and <= 256."""
        d = q.shape[-1]
        return (
            q.dtype == cache_k.dtype == torch.bfloat16
            and q.device.type == cache_k.device.type == "cpu"
            and d % 32 == 0
            and d <= 256
        )

    def attention(
        self,
        q: torch.Tensor,  # [B, T, H, D] bf16
        cache_k: torch.Tensor,  # [slots, KV, Lmax, D] bf16, one layer's keys
        cache_v: torch.Tensor,  # [slots, KV, Lmax, D] bf16
        slots: torch.Tensor,  # [B] int64 cache slot of each row
        lens: torch.Tensor,  # [B, T] int32 keys j < lens[b, t] considered
        mask: torch.Tensor | None,  # [B, T, L] bool, True = visible; None = all j < lens
    ) -> torch.Tensor:
        """Attention output [B, T, H, D] (bf16): query (b, t) over the visible keys of slot
        ``slots[b]``, float32 scores/softmax/sum in one fixed order per query, so the result
        depends on that query and those keys only (not on B, T or the other rows)."""
        b, t, h, d = q.shape
        kv, lmax = cache_k.shape[1], cache_k.shape[2]
        q, cache_k, cache_v = q.contiguous(), cache_k.contiguous(), cache_v.contiguous()
        slots = slots.to(torch.int64).contiguous()
        lens = lens.to(torch.int32).contiguous()
        m = None if mask is None else mask.to(torch.uint8).contiguous()
        out = torch.empty_like(q)
        rc = self._attention(
            q.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), slots.data_ptr(),
            lens.data_ptr(), None if m is None else m.data_ptr(),
            0 if m is None else m.shape[-1], out.data_ptr(),
            b, t, h, kv, d, lmax, d**-0.5, torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(
                f"attention kernel refused q {tuple(q.shape)}, cache {tuple(cache_k.shape)}"
                f" (code {rc})"
            )
        return out

    def rmsnorm(
        self,
        x: torch.Tensor,  # [..., H] bf16
        weight: torch.Tensor,  # [H] bf16
        eps: float,
        delta: torch.Tensor | None = None,  # [..., H] bf16, added to x first
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of x [..., H] -> [..., H]; with ``delta``: (x + delta, its RMSNorm)."""
        h = x.shape[-1]
        x = x.contiguous()
        out = torch.empty_like(x)
        total = None if delta is None else torch.empty_like(x)
        d = None if delta is None else delta.contiguous()
        rows = x.numel() // h
        rc = self._rmsnorm(x.data_ptr(), None if d is None else d.data_ptr(),
                           weight.contiguous().data_ptr(), out.data_ptr(),
                           None if total is None else total.data_ptr(), rows, h, eps,
                           torch.get_num_threads())  # fmt: skip
        _check(rc, "rmsnorm", x.shape)
        return out if total is None else (total, out)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [..., 2I] bf16 (gate | up) -> silu(gate) * up [..., I]."""
        two_i = gate_up.shape[-1]
        gu = gate_up.contiguous()
        out = gu.new_empty(*gu.shape[:-1], two_i // 2)
        rc = self._silu_mul(gu.data_ptr(), out.data_ptr(), gu.numel() // two_i, two_i // 2,
                            torch.get_num_threads())  # fmt: skip
        _check(rc, "silu_mul", gu.shape)
        return out

    def rope(
        self,
        qk: torch.Tensor,  # [B, T, heads, D] bf16, each token's heads contiguous (a view is fine)
        cos: torch.Tensor,  # [B, T, 1, D] bf16
        sin: torch.Tensor,  # [B, T, 1, D] bf16
    ) -> torch.Tensor:
        """Rotary embedding -> a new contiguous [B, T, heads, D]."""
        b, t, nh, d = qk.shape
        if qk.stride(3) != 1 or qk.stride(2) != d or qk.stride(0) != t * qk.stride(1):
            qk = qk.contiguous()
        cos, sin = cos.expand(b, t, 1, d).contiguous(), sin.expand(b, t, 1, d).contiguous()
        out = torch.empty(b, t, nh, d, dtype=qk.dtype)
        rc = self._rope(qk.data_ptr(), qk.stride(1), cos.data_ptr(), sin.data_ptr(),
                        out.data_ptr(), b * t, nh, d, torch.get_num_threads())  # fmt: skip
        _check(rc, "rope", qk.shape)
        return out

    def cache_write(
        self,
        cache: torch.Tensor,  # [slots, KV, Lmax, D] bf16, contiguous (one layer)
        rows: torch.Tensor,  # [B, T] slot per token (broadcast with positions)
        positions: torch.Tensor,  # [B, T] position per token
        new: torch.Tensor,  # [B, T, KV, D] bf16, each token's heads contiguous (a view is fine)
    ) -> None:
        """cache[rows, :, positions] = new, as one copy per token and head; refuses (ValueError,
        nothing written) a slot or position outside the cache."""
        b, t, kv, d = new.shape
        if new.stride(3) != 1 or new.stride(2) != d or new.stride(0) != t * new.stride(1):
            new = new.contiguous()
        flat = rows.dim() == positions.dim() == 1 and rows.dtype == positions.dtype == torch.int64
        if not (flat and rows.is_contiguous() and positions.is_contiguous()):
            rows, positions = torch.broadcast_tensors(rows, positions)
            rows = rows.reshape(-1).to(torch.int64).contiguous()
            positions = positions.reshape(-1).to(torch.int64).contiguous()
        slots, _, lmax, _ = cache.shape
        rc = self._cache_write(new.data_ptr(), new.stride(1), cache.data_ptr(), rows.data_ptr(),
                               positions.data_ptr(), b * t, kv, d, slots, lmax)  # fmt: skip
        _check(rc, "cache write", new.shape)

    def sample_t1(
        self,
        logits: torch.Tensor,  # [N, V] bf16 or float32
        u: torch.Tensor,  # [N] uniforms in [0, 1)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse-CDF samples at temperature 1, untruncated: (tokens [N] int64, their
        logprobs [N] float32), one pass over each row's logits (see the C source)."""
        n, v = logits.shape
        logits = logits.contiguous()
        u = u.to(torch.float64).contiguous()
        tokens = torch.empty(n, dtype=torch.int64)
        logprobs = torch.empty(n, dtype=torch.float32)
        rc = self._sample(logits.data_ptr(), int(logits.dtype == torch.bfloat16), n, v,
                          u.data_ptr(), tokens.data_ptr(), logprobs.data_ptr(),
                          torch.get_num_threads())  # fmt: skip
        _check(rc, "sampling", logits.shape)
        return tokens, logprobs

    def layers(
        self,
        table: ctypes.Array,  # [L] LayerPtrs
        final_norm: torch.Tensor,  # [Hd] bf16
        x: torch.Tensor,  # [N, Hd] bf16, the residual stream (updated in place)
        h_out: torch.Tensor,  # [N, Hd] bf16, gets the final normed hidden state
        cos: torch.Tensor,  # [N, D] bf16
        sin: torch.Tensor,  # [N, D] bf16
        written: tuple[torch.Tensor, torch.Tensor],  # [N] int64 cache slots, positions
        visible: tuple,  # slots [B] int64, lens [B, T] int32, mask [B, T, L] uint8 or None
        dims: tuple[int, ...],  # B, T, Hd, heads, kv_heads, head_dim, intermediate, slots, Lmax
        eps: float,
    ) -> None:
        """``len(table)`` decoder layers over the cache in one call (see the C source)."""
        slots, lens, mask = visible
        mask_len = 0 if mask is None else mask.shape[-1]
        dims_t = (ctypes.c_int64 * 10)(*dims, mask_len)
        rc = self._layers(
            ctypes.addressof(table), len(table), final_norm.data_ptr(), x.data_ptr(),
            h_out.data_ptr(), cos.data_ptr(), sin.data_ptr(), written[0].data_ptr(),
            written[1].data_ptr(), slots.data_ptr(), lens.data_ptr(),
            None if mask is None else mask.data_ptr(), ctypes.addressof(dims_t), eps,
            dims[5] ** -0.5, int(self.amx), torch.get_num_threads(),
        )  # fmt: skip
        _check(rc, "decoder layers", x.shape)


class LayerPtrs(ctypes.Structure):
    """One decoder layer's buffers for ``GemvKernel.layers``: norm weights [Hd] bf16, packed
    products, this layer's KV cache [slots, KV, Lmax, D] and an optional capture [N, Hd]."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")
        + ("cache_k", "cache_v", "capture")
    ]


def _bind(fn, argtypes: list) -> object:
    """A library function with its argument types (and a trailing thread count) and int result."""
    fn.argtypes = argtypes + [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _check(rc: int, name: str, shape: torch.Size) -> None:
    if rc != 0:
        raise ValueError(f"{name} kernel refused shape {tuple(shape)} (code {rc})")


def native_bf16(*xs: torch.Tensor) -> GemvKernel | None:
    """The kernel for inference work on ``xs``, or None: autograd on, not all non-empty bf16
    CPU tensors, or no kernel here."""
    if torch.is_grad_enabled():
        return None
    for x in xs:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or not x.numel():
            return None
    return gemv_kernel()


@functools.cache
def gemv_kernel() -> GemvKernel | None:
    """The kernel, built and loaded on first call; None where it cannot run (see module)."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not cpu_supported():
        return None
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        return None
    lib = open_library(compiler)
    if lib is None:
        return None
    try:
        return GemvKernel(lib)
    except AttributeError as e:  # a library without the symbol
        unavailable(e)
        return None


def amx_usable(lib) -> bool:
    """Whether products go through AMX: the CPU lists ``AMX_FLAGS``, ``SPECRL_NATIVE_AMX`` is
    not 0, and Linux granted this process the tile state (``specrl_amx_init``)."""
    if os.environ.get(AMX_SWITCH, "1") == "0" or not cpu_lists(AMX_FLAGS):
        return False
    init = getattr(lib, "specrl_amx_init", None)
    return init is not None and init() == 0


def cpu_supported() -> bool:
    """Linux on x86-64 whose /proc/cpuinfo lists every flag in ``CPU_FLAGS``."""
    return cpu_lists(CPU_FLAGS)


def cpu_lists(flags: tuple[str, ...]) -> bool:
    """Linux on x86-64 whose /proc/cpuinfo lists every flag in ``flags``."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    listed = set(line.split(":", 1)[-1].split())
    return all(f in listed for f in flags)
