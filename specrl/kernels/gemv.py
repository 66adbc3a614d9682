"""Native bf16 kernels on AVX512-BF16 CPUs, built on first use: matrix products for any
number of rows and attention over the KV cache, both batch-invariant.

Contract. ``gemv_kernel()`` returns a ``GemvKernel`` or ``None`` when it cannot run here: not
Linux/x86 with the ``avx512f avx512bw avx512vl avx512_bf16`` flags, no C compiler (``$CC`` or
``gcc``), a failed build, an unusable cache (a warning says why), or ``SPECRL_NATIVE_KERNELS=0``
in the environment. Callers then use PyTorch's ops; nothing else changes. It never raises. The
result is cached per process (``functools.cache``).

``GemvKernel.pack(weight [N, K] bf16) -> [N/16, K/2, 16, 2]`` lays the weight out once;
``GemvKernel.matmul(x [M, K] bf16, packed, n) -> [M, N] bf16`` computes ``x @ weight.T`` with
float32 accumulation for any M >= 0 (M = 0 returns an empty [0, N] without calling the
library). Up to ``MAX_ROWS`` rows it reads the weight once per call (the GEMV path: decoding is
weight streaming); more rows run as a tiled GEMM (4 rows x 32 columns in registers, a weight
tile reused from cache by every row). ``GemvKernel.attention(q, cache_k, cache_v, slots, lens,
mask)`` attends each query to its visible cached keys (float32 scores, softmax and sum).
The per-token elementwise work of a decoder layer has one call each: ``rmsnorm(x, w, eps,
delta=None)`` (with ``delta``: the residual sum x + delta, rounded to bf16, and its norm),
``silu_mul(gate_up)`` (SwiGLU's silu(gate) * up), ``rope(qk, cos, sin)`` (rotary embedding
of q and k heads read from the fused projection's output in place) and ``cache_write`` (new
keys or values into a KV cache layer at their slots and positions), each with the bf16
roundings of the PyTorch ops it replaces (results agree with them to a rounding flip).
``native_bf16(*xs)`` is the one check callers make before any of these: the kernel for
inference (no autograd) on non-empty bf16 CPU tensors, else None.
``sample_t1(logits, u)`` samples at temperature 1 without truncation in one pass over the
logits (``specrl.sampling.sample_logits`` uses it for plain rows on the CPU).
``layers(table, ...)`` runs a whole stack of decoder layers over the cache in one call (the
same kernels in the per-module order, so the same bits; ``specrl.models.fused`` builds the
``LayerPtrs`` table): one call per forward instead of ~10 per layer.
On CPUs with AMX (``amx_tile amx_bf16``; ``SPECRL_NATIVE_AMX=0`` turns it off) every product
with K % 32 == 0 runs on AMX tiles instead, for any M (the packed layout is AMX's B tile):
~8x the AVX512 path's rate at 64 rows, the same at 1 row; other sums than the AVX512 path's,
so a machine uses one path per weight shape, never one per row count.
Batch invariance: every output element is computed by one thread in one fixed order that does
not depend on M, on the other rows, on how many queries share a forward or on the thread
count, so a position's logits are the same bit for bit whether it is decoded alone, in a batch
of 64 or verified among k+1 drafted positions (the premise of speculation that changes nothing).
Why: one core streams small-batch products at ~25-28 GB/s against ~12-16 GB/s for oneDNN's
prepacked bf16 linear on this project's (non-AMX) CPU, the tiled GEMM keeps up with oneDNN at
64 rows, and one packed copy of each weight serves every batch size.
The sum order differs from oneDNN's, so results agree with it to bf16 rounding, not bit for bit.

Kernel cache (``open_library``). The library is compiled from ``gemv_bf16.c`` (shipped with the
package) into ``$SPECRL_CACHE/kernels/`` (~0.3 s) and loaded with ctypes (no torch headers).
- Key (``build_key``): sha256 of the source, the flags and the compiler's identity (the path
  ``$CC``/``gcc`` resolves to, its real path and its ``--version`` output), so another compiler
  builds anew. The compiler named by ``$CC`` is run (``--version``, then the build) on first use.
- Build (``build_library``): compiled in a private temporary directory, then published as
  ``gemv_bf16-<key>-<sha16>.so`` (sha16: the start of the library's own sha256, so a library
  file never changes once written), then the record ``gemv_bf16-<key>.json`` = {"format":
  "specrl-kernel-build", "version": 1, "key", "source_sha256", "flags", "compiler": {"path",
  "realpath", "version"}, "library": file name, "sha256"}; each with ``specrl.fsutil.atomic_write``
  (temporary file, fsync, rename, directory fsync; no temporary left on failure), mode 0755/0644.
  The directory is created 0700.
- Load (``verified_library``, then ctypes): nothing is dlopen'ed before these checks pass: the
  cache directory is a real directory (not a symlink) owned by the current user and not writable
  by group or others, and none of its parents up to ``/`` is writable by others without the
  sticky bit (``ensure_safe_directory``); the record and the library are regular files (symlinks
  refused) owned by the current user and not writable by group or others; the record equals the
  current key field by field and names the library file the key and its digest give; and the
  library's sha256, read through the descriptor that was checked, equals the record's. That
  descriptor is what ctypes loads (``/proc/self/fd/N``, kept open afterwards so that the number
  never names another file), so the file cannot be swapped between the check and the load. A
  record or library that fails is refused with a warning naming the file and rebuilt into its
  own content-addressed file (the rebuilt library is checked and loaded the same way); an unsafe
  directory, an unwritable cache, a full disk or a failed build give a warning and ``None``.
Residual risk: the digest proves that the library is the one recorded, not who built it. Whoever
can write the cache directory or its files as the current user (or as root) can plant a library
with a matching record, or rewrite the checked file in place; the ownership and mode checks only
keep other users out, and a parent directory writable by a group (not by others) is not refused.
Such a writer already runs code as this user.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from specrl.fsutil import atomic_write
from specrl.paths import cache_dir

MAX_ROWS = 4  # rows the GEMV path multiplies in one pass over the weight (more: tiled GEMM)
SOURCE = Path(__file__).with_name("gemv_bf16.c")
FLAGS = (
    "-O3",
    "-fopenmp",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-mamx-tile",
    "-mamx-bf16",
    "-shared",
    "-fPIC",
)
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
AMX_FLAGS = ("amx_tile", "amx_bf16")
ENV_SWITCH = "SPECRL_NATIVE_KERNELS"
AMX_SWITCH = "SPECRL_NATIVE_AMX"
STEM = "gemv_bf16"
RECORD_FORMAT = "specrl-kernel-build"
RECORD_VERSION = 1
COMPILE_TIMEOUT_S = 120


class GemvKernel:
    """The loaded library's products (``specrl_gemm_bf16``) and attention
    (``specrl_attention_bf16``), with packing and shape checks."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.specrl_gemm_bf16
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn
        self.amx = amx_usable(lib)  # products through AMX tiles (see the module docstring)
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
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """[N, K] bf16 -> [N/16, K/2, 16, 2]: 16 output rows x 2 consecutive ks per 64 bytes."""
        n, k = weight.shape
        return weight.detach().view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()

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
        _unavailable(e)
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


# --------------------------------------------------------------------------- the kernel cache


class UnsafeCacheError(OSError):
    """A cache directory or file that another user could have written."""


@dataclass(frozen=True)
class BuildKey:
    """What a built library depends on: source, flags and compiler identity."""

    source_sha256: str
    flags: tuple[str, ...]
    compiler: str  # the path $CC (or gcc) resolves to on PATH
    compiler_realpath: str
    compiler_version: str  # its --version output

    @property
    def digest(self) -> str:
        """16 hex digits of the sha256 of every field (the cache key)."""
        fields = [self.source_sha256, list(self.flags), self.compiler, self.compiler_realpath,
                  self.compiler_version]  # fmt: skip
        return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]

    def record_name(self) -> str:
        return f"{STEM}-{self.digest}.json"

    def library_name(self, sha256: str) -> str:
        return f"{STEM}-{self.digest}-{sha256[:16]}.so"

    def record(self, sha256: str) -> dict:
        """The build record of the library whose sha256 is ``sha256``."""
        return {
            "format": RECORD_FORMAT,
            "version": RECORD_VERSION,
            "key": self.digest,
            "source_sha256": self.source_sha256,
            "flags": list(self.flags),
            "compiler": {
                "path": self.compiler,
                "realpath": self.compiler_realpath,
                "version": self.compiler_version,
            },
            "library": self.library_name(sha256),
            "sha256": sha256,
        }


def build_key(compiler: str, source: Path = SOURCE, flags: tuple[str, ...] = FLAGS) -> BuildKey:
    """The key of building ``source`` with ``flags`` by ``compiler`` (which is run: --version)."""
    done = subprocess.run(
        [compiler, "--version"],
        capture_output=True,
        timeout=60,
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return BuildKey(
        source_sha256=hashlib.sha256(Path(source).read_bytes()).hexdigest(),
        flags=tuple(flags),
        compiler=str(compiler),
        compiler_realpath=os.path.realpath(compiler),
        compiler_version=done.stdout.decode(errors="replace").strip(),
    )


def open_library(
    compiler: str,
    directory: Path | None = None,
    source: Path = SOURCE,
    flags: tuple[str, ...] = FLAGS,
) -> ctypes.CDLL | None:
    """The verified library of this key from ``directory`` (default ``cache_dir()/kernels``),
    built there first when missing or refused; ``None`` with a warning when that fails. The
    library is loaded through the descriptor its checks read (``/proc/self/fd/N``)."""
    directory = Path(directory) if directory is not None else cache_dir() / "kernels"
    try:
        key = build_key(compiler, source, flags)
        ensure_safe_directory(directory)
        fd = verified_library(key, directory)
        if fd is None:
            built = build_library(key, directory, compiler, source)
            fd = verified_library(key, directory)
            if fd is None:
                raise UnsafeCacheError(f"the library just built, {built}, failed its checks")
        try:
            return _load_descriptor(fd)
        except OSError:
            os.close(fd)
            raise
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        _unavailable(e)
        return None


def _load_descriptor(fd: int) -> ctypes.CDLL:
    """dlopen the file open at ``fd`` through ``/proc/self/fd/N``. On success ``fd`` stays open
    for the life of the process, on purpose: glibc answers a later dlopen of the same name with
    the library it already loaded, so the number must never name another file."""
    return ctypes.CDLL(f"/proc/self/fd/{fd}")


def ensure_safe_directory(directory: Path) -> None:
    """Create ``directory`` (mode 0700) if missing; ``UnsafeCacheError`` unless it is a
    directory, not a symlink, owned by the current user and not writable by group or others,
    and no parent up to ``/`` is writable by others without the sticky bit."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCacheError(f"{directory} is a symlink; point SPECRL_CACHE at a real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheError(f"{directory} is not a directory")
    _check_owner_and_mode(st, directory)
    for parent in _parents(directory):
        pst = os.stat(parent)
        if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
            raise UnsafeCacheError(
                f"{parent}, a parent of the kernel cache {directory}, is writable by others "
                f"without the sticky bit (mode {stat.S_IMODE(pst.st_mode):o}); point "
                "SPECRL_CACHE elsewhere"
            )


def _parents(directory: Path) -> list[Path]:
    """Every directory above ``directory`` up to ``/``: along its path as written (a symlinked
    parent stands for its target) and along its real path (where the targets live)."""
    lexical = Path(os.path.abspath(directory)).parents
    real = Path(os.path.realpath(directory))
    return sorted({*lexical, *real.parents}, key=lambda p: (len(p.parts), str(p)))


def verified_library(key: BuildKey, directory: Path) -> int | None:
    """An open read-only descriptor of the recorded library of ``key`` in ``directory`` if every
    check of the module docstring passes (the caller closes it); ``None`` when there is none, or
    (with a warning naming the file) when one fails."""
    record_path = directory / key.record_name()
    if not os.path.lexists(record_path):
        return None
    try:
        fd = _open_safe_file(record_path)
        try:
            record = json.loads(_read_all(fd))
        finally:
            os.close(fd)
    except (OSError, ValueError) as e:
        return _refuse(record_path, str(e))
    problem = _record_mismatch(record, key)
    if problem:
        return _refuse(record_path, problem)
    lib = directory / record["library"]
    try:
        fd = _open_safe_file(lib)
    except OSError as e:
        return _refuse(lib, str(e))
    try:
        digest = hashlib.sha256(_read_all(fd)).hexdigest()
    except OSError as e:
        os.close(fd)
        return _refuse(lib, str(e))
    if digest != record["sha256"]:
        os.close(fd)
        return _refuse(lib, "its sha256 differs from the one recorded when it was built")
    return fd


def build_library(key: BuildKey, directory: Path, compiler: str, source: Path = SOURCE) -> Path:
    """Compile ``source`` and publish it and its record in ``directory`` (see the module
    docstring); returns the library path."""
    with tempfile.TemporaryDirectory(prefix=f".{STEM}-build-", dir=directory) as work:
        out = Path(work) / f"{STEM}.so"
        _compile(compiler, key.flags, Path(source), out)
        data = out.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    lib = directory / key.library_name(digest)
    atomic_write(lib, data, mode=0o755)
    atomic_write(directory / key.record_name(), json.dumps(key.record(digest), indent=1))
    return lib


def _compile(compiler: str, flags: tuple[str, ...], source: Path, out: Path) -> None:
    cmd = [compiler, *flags, str(source), "-o", str(out)]
    done = subprocess.run(
        cmd, capture_output=True, timeout=COMPILE_TIMEOUT_S, stdin=subprocess.DEVNULL
    )
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines() or ["no message"]
        raise subprocess.SubprocessError(
            f"{compiler} exited with status {done.returncode}: {lines[0]}"
        )


def _record_mismatch(record: object, key: BuildKey) -> str | None:
    """Why ``record`` is not the record of ``key`` (None: it is)."""
    if not isinstance(record, dict):
        return "not a JSON object"
    sha = record.get("sha256")
    if not isinstance(sha, str) or len(sha) != 64 or not all(c in "0123456789abcdef" for c in sha):
        return "no valid sha256"
    expected = key.record(sha)
    for field, want in expected.items():
        if record.get(field) != want:
            return f"its {field!r} does not match this build (source, flags, compiler)"
    if set(record) != set(expected):
        return f"unexpected fields {sorted(set(record) - set(expected))}"
    return None


def _open_safe_file(path: Path) -> int:
    """A read-only descriptor of ``path``, opened without following symlinks, after checking
    that it is a regular file owned by the current user and not group/world-writable."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCacheError(f"{path} is not a regular file")
        _check_owner_and_mode(st, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_all(fd: int) -> bytes:
    """Every byte of the file open at ``fd``, from its start (the offset is left unchanged)."""
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _check_owner_and_mode(st: os.stat_result, path: Path) -> None:
    if st.st_uid != os.getuid():
        raise UnsafeCacheError(f"{path} is owned by uid {st.st_uid}, not by you ({os.getuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheError(
            f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
            "run chmod go-w on it or point SPECRL_CACHE elsewhere"
        )


def _refuse(path: Path, why: str) -> None:
    warnings.warn(f"specrl: refusing kernel library file {path}: {why}; rebuilding", stacklevel=3)
    return None


def _unavailable(e: BaseException) -> None:
    warnings.warn(f"specrl: native GEMV kernel unavailable ({e}); using PyTorch ops", stacklevel=3)
