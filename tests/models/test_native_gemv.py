"""The native bf16 kernels (products of any row count, attention over the cache) and the
Linear/Attention paths that use them (specrl.kernels.gemv)."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from specrl.kernels import gemv
from specrl.models import linear, transformer
from specrl.models.linear import Linear, onednn_packs
from specrl.models.transformer import set_native_kernels
from tests.conftest import make_tiny

KERNEL = gemv.gemv_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="native GEMV kernel cannot run here")


def within_bf16_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b=None) -> bool:
    """y == x @ w.T (+ b) up to bf16 rounding of the product (and of the sum with the bias) plus
    float32 accumulation error: |y - exact| <= eps_bf16 * (|x @ w.T| + |exact| if b) + 2^-20 *
    (|x| @ |w|.T)."""
    x, w = x.detach().double(), w.detach().double()
    product = x @ w.T
    exact = product + (0.0 if b is None else b.detach().double())
    eps = torch.finfo(torch.bfloat16).eps
    bound = eps * product.abs() + 2.0**-20 * (x.abs() @ w.abs().T)
    if b is not None:
        bound = bound + eps * exact.abs()
    return bool(((y.double() - exact).abs() <= bound).all())


def test_kernel_is_available_where_the_cpu_and_a_compiler_allow():
    """On a machine with the CPU flags and gcc (this project's), the kernel must build: a test
    that silently skipped everywhere would prove nothing."""
    if gemv.cpu_supported() and shutil.which("gcc"):
        assert KERNEL is not None


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 64])
@pytest.mark.parametrize("n,k", [(16, 4), (48, 36), (960, 576), (576, 1536)])
def test_kernel_matches_float32_reference_to_bf16_rounding(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    y = KERNEL.matmul(x, KERNEL.pack(w), n)  # [rows, n]
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    assert within_bf16_rounding(y, x, w)


@needs_kernel
def test_kernel_results_do_not_depend_on_the_thread_count():
    """Rows are split over threads, never a row's sum: bit-identical for 1 and 2 threads."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(1024, 64, generator=gen).to(torch.bfloat16)  # N >= the split threshold
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    packed, before = KERNEL.pack(w), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNEL.matmul(x, packed, 1024)
        torch.set_num_threads(2)
        two = KERNEL.matmul(x, packed, 1024)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two) and within_bf16_rounding(two, x, w)


@needs_kernel
@pytest.mark.parametrize("n,k", [(48, 36), (1024, 64), (576, 1536)])
def test_a_rows_product_does_not_depend_on_the_other_rows(n, k):
    """Batch invariance: each row of a 64-row product is bit-identical to that row multiplied
    alone and inside products of 3 (the GEMV path), 5 to 8 (the one-pass tiles) and 9 and 14
    rows (the tiled path)."""
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(64, k, generator=gen).to(torch.bfloat16)
    packed = KERNEL.pack(w)
    full = KERNEL.matmul(x, packed, n)
    for start, stop in ((5, 6), (3, 6), (10, 15), (20, 26), (30, 37), (40, 48), (0, 9), (50, 64)):
        assert torch.equal(KERNEL.matmul(x[start:stop], packed, n), full[start:stop])
    assert within_bf16_rounding(full, x, w)


@needs_kernel
def test_kernel_refuses_shapes_it_cannot_take():
    w = torch.randn(32, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="does not match"):  # K of x != K of the weight
        KERNEL.matmul(torch.randn(1, 4).to(torch.bfloat16), KERNEL.pack(w), 32)
    assert not KERNEL.fits(torch.zeros(20, 8, dtype=torch.bfloat16))  # N % 16
    assert not KERNEL.fits(torch.zeros(32, 6, dtype=torch.bfloat16))  # K % 4
    assert not KERNEL.fits(torch.zeros(32, 8))  # float32


def _linear(n: int, k: int, bias: bool = False) -> Linear:
    lin = Linear(k, n, bias=bias).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(n + k)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return lin


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [4, 9])
def test_linear_uses_the_kernel_for_any_rows_and_agrees_with_onednn(bias, rows):
    lin = _linear(64, 32, bias)
    x = torch.randn(rows, 2, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        native = lin(x)
        assert lin._native is not None and lin._packed is None  # only the native copy built
        set_native_kernels(lin, False)
        onednn = lin(x)
        assert lin._packed is not None  # oneDNN's copy, only once the kernel is turned off
        set_native_kernels(lin, True)
        lin(x)
        assert lin._packed is None  # and dropped again: one packed copy at a time
    assert native.shape == onednn.shape == (rows, 2, 64)
    flat, w = x.reshape(-1, 32), lin.weight
    assert within_bf16_rounding(native.reshape(-1, 64), flat, w, lin.bias)
    assert within_bf16_rounding(onednn.reshape(-1, 64), flat, w, lin.bias)


@needs_kernel
def test_linear_falls_back_for_shapes_the_kernel_cannot_take():
    lin = _linear(64, 32)
    odd = _linear(20, 32)  # N % 16 != 0
    x = torch.randn(1, 32).to(torch.bfloat16)
    with torch.no_grad():
        y = odd(x)
    assert odd._native is None
    with torch.no_grad(), pytest.raises(RuntimeError):  # a wrong width is refused, as F.linear
        lin(torch.randn(1, 16).to(torch.bfloat16))  # does (16 * 4 rows would fit in numel)
    assert within_bf16_rounding(y, x, odd.weight)


@needs_kernel
def test_linear_repacks_after_the_weight_changes_in_place():
    """A refit writes weights in place; the packed copy must follow (version counter)."""
    lin = _linear(32, 16)
    x = torch.randn(1, 16).to(torch.bfloat16)
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(2)
        after = lin(x)
    assert torch.equal(after, (before.float() * 2).to(torch.bfloat16))


def test_switch_off_by_environment(monkeypatch):
    monkeypatch.setenv(gemv.ENV_SWITCH, "0")
    gemv.gemv_kernel.cache_clear()
    try:
        assert gemv.gemv_kernel() is None
        lin = _linear(32, 16)
        with torch.no_grad():
            lin(torch.randn(1, 16).to(torch.bfloat16))
        assert lin._native is None
        assert (lin._packed is not None) == onednn_packs(torch.bfloat16)  # else F.linear
    finally:
        monkeypatch.undo()
        gemv.gemv_kernel.cache_clear()


def test_build_goes_to_the_cache_directory(monkeypatch, tmp_path):
    if not (gemv.cpu_supported() and shutil.which("gcc")):
        pytest.skip("no AVX512-BF16 CPU or no gcc")
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path))
    gemv.gemv_kernel.cache_clear()
    try:
        assert gemv.gemv_kernel() is not None
        built = list((tmp_path / "kernels").glob("gemv_bf16-*.so"))
        assert len(built) == 1 and not list((tmp_path / "kernels").glob("*.tmp"))
    finally:
        monkeypatch.undo()
        gemv.gemv_kernel.cache_clear()


def test_a_failed_build_warns_and_falls_back(monkeypatch, tmp_path):
    if not gemv.cpu_supported():
        pytest.skip("no AVX512-BF16 CPU")
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'no compiler here' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    gemv.gemv_kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match="native GEMV kernel unavailable"):
            assert gemv.gemv_kernel() is None
    finally:
        monkeypatch.undo()
        gemv.gemv_kernel.cache_clear()


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_bf16_inference_runs_on_any_cpu(rows):
    """Where oneDNN cannot prepack bf16 weights (an AVX2-only CPU) Linear falls back to
    F.linear instead of failing; the result is the same product either way."""
    lin = _linear(48, 32, bias=True)
    x = torch.randn(rows, 32).to(torch.bfloat16)
    with torch.no_grad():
        got = lin(x).float()
        want = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
    torch.testing.assert_close(got, want, atol=0.25, rtol=0.02)  # bf16 output rounding


# ------------------------------------------------- no rows (M = 0), on any CPU, with a fake kernel


class StrictFakeKernel:
    """Stands in for the native kernel where it cannot run (the dispatch is the same): the real
    ``fits``/``pack``, a correct product, and the library's refusal of M < 1 (as ``matmul``
    raised it before it guarded M = 0); no attention (``attention_fits`` is False, so the model
    attends with PyTorch). ``rows`` records M of every call."""

    fits = staticmethod(gemv.GemvKernel.fits)
    pack = staticmethod(gemv.GemvKernel.pack)

    def __init__(self) -> None:
        self.rows: list[int] = []

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        m, k = x.shape
        self.rows.append(m)
        if m < 1:
            raise ValueError(f"gemv kernel refused shapes M={m}, N={n}, K={k}")
        w = packed.permute(0, 2, 1, 3).reshape(n, k)  # undo pack
        return (x.float() @ w.float().T).to(torch.bfloat16)

    @staticmethod
    def attention_fits(q: torch.Tensor, cache_k: torch.Tensor) -> bool:
        return False


@pytest.fixture
def fake_kernel(monkeypatch) -> StrictFakeKernel:
    """Linear dispatches to a ``StrictFakeKernel``: ``gemv_kernel()`` returns it and the packed
    path is taken as on a CPU where oneDNN packs bf16 (inputs for weights the kernel fits
    never reach oneDNN); norms and SwiGLU use PyTorch's ops."""
    kernel = StrictFakeKernel()
    monkeypatch.setattr(gemv, "gemv_kernel", lambda: kernel)
    monkeypatch.setattr(linear, "onednn_packs", lambda dtype: True)
    for module in (transformer.RMSNorm, transformer.MLP):  # the fake has products only
        monkeypatch.setattr(module, "native", False)
    return kernel


@pytest.mark.parametrize("bias", [False, True])
def test_linear_never_sends_an_empty_batch_to_the_kernel(fake_kernel, bias):
    """Issue 20: ``logits_at=ids[:, :0]`` sent M = 0 to the kernel, which refuses it. Both
    dispatch paths (before and after the packed copy exists) must answer an empty product."""
    lin = _linear(64, 32, bias)
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        first = lin(torch.zeros(0, 32, dtype=torch.bfloat16))  # no packed copy yet
        y = lin(x)  # the kernel's path: packs the weight
        assert lin._native is not None and fake_kernel.rows == [2]
        again = lin(torch.zeros(3, 0, 32, dtype=torch.bfloat16))  # the fast path
    assert first.shape == (0, 64) and again.shape == (3, 0, 64)
    assert fake_kernel.rows == [2]
    assert within_bf16_rounding(y, x, lin.weight, lin.bias)


def test_lm_head_on_no_positions_with_the_kernel(fake_kernel):
    """A forward asking for logits at no position returns [B, 0, V] through the kernel's
    dispatch; the other linears still use the kernel."""
    model = make_tiny(seed=1).to(torch.bfloat16)
    ids = torch.tensor([[3, 1, 4]])
    positions = torch.arange(3)[None]
    with torch.no_grad():
        out = model(ids, positions, logits_at=ids[:, :0])
        full = model(ids, positions)
    assert out.logits.shape == (1, 0, 32) and full.logits.shape == (1, 3, 32)
    assert fake_kernel.rows and 0 not in fake_kernel.rows


class FakeLibraryFunction:
    """``specrl_gemm_bf16`` as ctypes exposes it: returns 1 (refused) like the C code for
    M < 1, N % 16 or K % 4; records M of each call."""

    argtypes = restype = None

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, w, x, y, m, n, k, threads) -> int:
        self.rows.append(m)
        return 0 if m >= 1 and n % 16 == 0 and k % 4 == 0 else 1


def test_kernel_wrapper_answers_no_rows_without_calling_the_library():
    fn = FakeLibraryFunction()
    names = [
        f"specrl_{n}_bf16"
        for n in ("attention", "rmsnorm", "silu_mul", "rope", "cache_write", "layers")
    ]
    lib = SimpleNamespace(specrl_gemm_bf16=fn, specrl_sample_t1=FakeLibraryFunction(),
                          **{n: FakeLibraryFunction() for n in names})  # fmt: skip
    kernel = gemv.GemvKernel(lib)
    packed = kernel.pack(torch.randn(32, 8).to(torch.bfloat16))
    y = kernel.matmul(torch.zeros(0, 8, dtype=torch.bfloat16), packed, 32)
    assert y.shape == (0, 32) and y.dtype == torch.bfloat16 and fn.rows == []
    kernel.matmul(torch.zeros(5, 8, dtype=torch.bfloat16), packed, 32)
    kernel.matmul(torch.zeros(2, 8, dtype=torch.bfloat16), packed, 32)
    assert fn.rows == [5, 2]


# ------------------------------------------------------------------- attention over the cache


def attention_reference(q, cache_k, cache_v, slots, lens, mask=None) -> torch.Tensor:
    """float64 attention, query by query: q [B, T, H, D] over slot slots[b]'s keys j < lens[b, t]
    with mask[b, t, j] (or all of them) -> [B, T, H, D]."""
    b, t, h, d = q.shape
    g = h // cache_k.shape[1]
    out = torch.zeros(b, t, h, d, dtype=torch.float64)
    for i in range(b):
        for j in range(t):
            n = int(lens[i, j])
            seen = torch.arange(n) if mask is None else torch.nonzero(mask[i, j, :n])[:, 0]
            for head in range(h):
                keys = cache_k[slots[i], head // g, seen].double()  # [n, D]
                values = cache_v[slots[i], head // g, seen].double()
                p = torch.softmax(keys @ q[i, j, head].double() * d**-0.5, 0)
                out[i, j, head] = p @ values
    return out


def random_attention_case(seed: int, b: int, t: int, d: int = 64, slots_n: int = 8):
    gen = torch.Generator().manual_seed(seed)
    h, kv, lmax = 6, 2, 40
    q = torch.randn(b, t, h, d, generator=gen).to(torch.bfloat16)
    cache_k = torch.randn(slots_n, kv, lmax, d, generator=gen).to(torch.bfloat16)
    cache_v = torch.randn(slots_n, kv, lmax, d, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(slots_n, generator=gen)[:b]
    start = torch.randint(1, lmax - t, (b, 1), generator=gen)
    lens = start + torch.arange(t) + 1  # [B, T] causal: position + 1
    return q, cache_k, cache_v, slots, lens


@needs_kernel
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b,t", [(1, 1), (3, 4), (5, 1)])
def test_attention_matches_a_float64_reference(b, t, d):
    q, ck, cv, slots, lens = random_attention_case(b * 10 + t + d, b, t, d)
    out = KERNEL.attention(q, ck, cv, slots, lens, None)
    want = attention_reference(q, ck, cv, slots, lens)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)  # bf16 output


@needs_kernel
def test_attention_with_a_mask_sees_only_the_marked_keys():
    q, ck, cv, slots, lens = random_attention_case(3, 3, 4)
    lens = torch.full_like(lens, 40)
    mask = torch.rand(3, 4, 40, generator=torch.Generator().manual_seed(1)) < 0.5
    mask[..., 0] = True  # at least one key each
    out = KERNEL.attention(q, ck, cv, slots, lens, mask)
    torch.testing.assert_close(
        out.double(), attention_reference(q, ck, cv, slots, lens, mask), atol=2e-2, rtol=2e-2
    )


@needs_kernel
def test_a_querys_attention_depends_only_on_that_query_and_its_keys():
    """Invariance: a query's output is bit-identical alone, inside a batch of other rows, as one
    of several queries of its row (a verify pass) and with its visible keys picked by a mask
    over a longer range (a draft tree's), whatever the thread count."""
    q, ck, cv, slots, lens = random_attention_case(5, 4, 3)
    full = KERNEL.attention(q, ck, cv, slots, lens, None)  # [4, 3, H, D]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for i in range(4):
            for j in range(3):
                alone = KERNEL.attention(
                    q[i : i + 1, j : j + 1], ck, cv, slots[i : i + 1], lens[i : i + 1, j : j + 1],
                    None,
                )  # fmt: skip
                assert torch.equal(alone[0, 0], full[i, j])
    finally:
        torch.set_num_threads(before)
    mask = torch.arange(40)[None, None, :] < lens[:, :, None]  # the same keys, by mask
    masked = KERNEL.attention(q, ck, cv, slots, torch.full_like(lens, 40), mask)
    assert torch.equal(masked, full)


@needs_kernel
def test_attention_refuses_what_it_cannot_take():
    q, ck, cv, slots, lens = random_attention_case(1, 1, 1)
    with pytest.raises(ValueError, match="attention kernel refused"):
        KERNEL.attention(q, ck, cv, slots, lens + 100, None)  # past the cache
    assert not KERNEL.attention_fits(q[..., :16], ck[..., :16])  # head_dim % 32
    assert not KERNEL.attention_fits(q.float(), ck.float())


@needs_kernel
def test_model_with_native_attention_matches_pytorch_attention():
    """A bf16 model whose head_dim the kernel takes gives (up to bf16 rounding) the logits of
    PyTorch's attention path, prefill then cached decode steps of several rows."""
    model = make_tiny(seed=2, head_dim=32, vocab_size=64).to(torch.bfloat16)
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(0))
    outs = {}
    for native in (True, False):
        set_native_kernels(model, native)
        cache = model.new_cache(3, 16)
        with torch.no_grad():
            model(ids[:, :4], torch.arange(4).expand(3, 4), cache, prefill=True)
            step = model(ids[:, 4:], torch.arange(4, 7).expand(3, 3), cache, kv_len=7)
        outs[native] = step.logits.float()
    set_native_kernels(model, True)
    torch.testing.assert_close(outs[True], outs[False], atol=0.1, rtol=0.05)


# ------------------------------------------------------------------- AMX products


def test_amx_is_used_where_the_cpu_has_it_and_can_be_turned_off(monkeypatch):
    lib = SimpleNamespace(specrl_amx_init=lambda: 0)
    if KERNEL is not None and gemv.cpu_lists(gemv.AMX_FLAGS):
        assert KERNEL.amx  # a CPU with AMX whose kernel does not use it: init failed
    monkeypatch.setenv("SPECRL_NATIVE_AMX", "0")
    assert not gemv.amx_usable(lib)
    monkeypatch.setenv("SPECRL_NATIVE_AMX", "1")
    monkeypatch.setattr(gemv, "cpu_lists", lambda flags: True)
    assert gemv.amx_usable(lib)
    assert not gemv.amx_usable(SimpleNamespace(specrl_amx_init=lambda: 1))  # Linux said no


@pytest.mark.skipif(KERNEL is None or not KERNEL.amx, reason="no AMX here")
@pytest.mark.parametrize("rows", [1, 17, 64])
def test_amx_and_avx512_products_both_match_the_reference(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    packed = KERNEL.pack(w)
    amx = KERNEL.matmul(x, packed, 96)
    avx = torch.empty_like(amx)
    assert KERNEL._fn(packed.data_ptr(), x.data_ptr(), avx.data_ptr(), rows, 96, 64, 1) == 0
    assert within_bf16_rounding(amx, x, w) and within_bf16_rounding(avx, x, w)
