"""fa2cpu.torch: the NumPy API on tensors, custom operators, autograd and SDPA.

Tensors are checked against the NumPy API on the same memory (same kernels: equal results), the
float64 oracle (gradients, TOL table of conftest) and torch's own SDPA and autograd. Skipped
cleanly when torch is not installed.
"""
import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fa2cpu  # noqa: E402
import fa2cpu.torch as ft  # noqa: E402
from conftest import DTYPES, TOL, check_close, rand, ref  # noqa: E402

# fa2cpu.torch runs fa2cpu on the process's OpenMP runtime (torch's threads): test it that way.
PARALLEL_BACKEND = "openmp"

from _torch_helpers import TORCH_DTYPES, N, T, same, torch_sdpa, trand  # noqa: E402,F401


# ------------------------------------------------------------------------------ plumbing

def test_import_fa2cpu_does_not_import_torch():
    code = "import sys, fa2cpu; assert 'torch' not in sys.modules, 'fa2cpu imported torch'"
    # run outside the source tree: `python -c` puts the cwd first on sys.path
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(fa2cpu.__file__).parents[1].parent)


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_views_share_memory_and_strides(rng, dtype):
    base = trand(rng, (3, 5, 8), dtype)
    for t in (base, base.transpose(0, 2), base[:, 1::2, 3:], base.expand(2, 3, 5, 8)):
        a = N(t)
        assert a.dtype == ft._np("x", base).dtype
        assert a.ctypes.data == t.data_ptr()
        assert a.strides == tuple(s * t.element_size() for s in t.stride())
        back = T(np.ascontiguousarray(a))
        assert back.dtype == t.dtype and torch.equal(back, t.contiguous())


def test_registered_operators():
    for name in ("flash_attention", "flash_attention_out", "flash_attention_backward",
                 "flash_attention_varlen", "flash_attention_varlen_out",
                 "flash_attention_varlen_backward", "flash_attention_with_kvcache"):
        assert hasattr(torch.ops.fa2cpu, name), name
    schema = str(torch.ops.fa2cpu.flash_attention_with_kvcache.default._schema)
    assert "Tensor(a!) k_cache" in schema and "Tensor(b!) v_cache" in schema and "Tensor(c!) out" in schema
    assert "Tensor(d!)? k_scale=None" in schema and "Tensor(e!)? v_scale=None" in schema


def test_errors_name_the_argument(rng):
    q = trand(rng, (1, 2, 3, 4))
    for args, name in (((q.to_sparse(), q, q), "q"), ((q, q, q.to_sparse()), "v")):
        with pytest.raises(TypeError, match=f"{name}: expected a dense \\(strided\\) tensor, got layout torch.sparse_coo"):
            ft.flash_attention(*args)
    with pytest.raises(TypeError, match="k: expected a torch.Tensor"):
        ft.flash_attention(q, N(q), q)
    with pytest.raises(TypeError, match="q: dtype float64"):
        ft.flash_attention(q.double(), q.double(), q.double())
    with pytest.raises(ValueError, match="window"):
        ft.flash_attention(q, q, q, window=(1,))
    q.requires_grad_()
    with pytest.raises(RuntimeError, match="out= does not support automatic differentiation"):
        ft.flash_attention(q, q, q, out=torch.empty(1, 2, 3, 4))


def test_meta_tensors_give_shapes():
    q = torch.empty(2, 4, 7, 16, device="meta")
    k = torch.empty(2, 2, 9, 16, device="meta")
    v = torch.empty(2, 2, 9, 8, device="meta")
    out, lse = ft.flash_attention(q, k, v, return_lse=True)
    assert out.shape == (2, 4, 7, 8) and out.device.type == "meta"
    assert lse.shape == (2, 4, 7) and lse.dtype == torch.float32


# ------------------------------------------------------------------------------ flash_attention

# (rank or "bshd", B, Hq, Hk, Nq, Nk, D, Dv): awkward sizes, GQA/MQA, Nq != Nk both ways
FA_CASES = [
    (4, 2, 4, 2, 7, 33, 16, 16),
    (4, 1, 3, 1, 33, 7, 13, 5),
    (3, 1, 2, 2, 1, 31, 32, 32),
    (2, 1, 1, 1, 13, 13, 7, 7),
    ("bshd", 2, 6, 3, 17, 17, 24, 40),
]


def _fa_inputs(rng, case, dtype):
    rank, B, Hq, Hk, Nq, Nk, D, Dv = case
    if rank == "bshd":
        shapes = (B, Nq, Hq, D), (B, Nk, Hk, D), (B, Nk, Hk, Dv)
        return [trand(rng, s, dtype) for s in shapes], "bshd"
    shapes = (B, Hq, Nq, D), (B, Hk, Nk, D), (B, Hk, Nk, Dv)
    cut = 4 - rank
    q, k, v = (trand(rng, s[cut:], dtype) for s in shapes)
    # a non-contiguous k: every other row of a longer buffer
    k = trand(rng, k.shape[:-2] + (2 * k.shape[-2], k.shape[-1]), dtype)[..., ::2, :]
    return [q, k, v], "bhsd"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", FA_CASES, ids=str)
def test_flash_attention_matches_numpy(rng, dtype, case):
    (q, k, v), layout = _fa_inputs(rng, case, dtype)
    opts = dict(causal=True, layout=layout)
    got, lse = ft.flash_attention(q, k, v, return_lse=True, **opts)
    want, want_lse = fa2cpu.flash_attention(N(q), N(k), N(v), return_lse=True, **opts)
    assert isinstance(got, torch.Tensor) and got.dtype == q.dtype and lse.dtype == torch.float32
    same(got, want)
    same(lse, want_lse)
    out = torch.empty_like(got)
    assert ft.flash_attention(q, k, v, out=out, **opts) is out
    same(out, want)
    # the operator (the path torch.compile and autograd take) gives the same numbers
    o2, l2 = torch.ops.fa2cpu.flash_attention(q, k, v, True, None, [-1, -1], None, None, None, layout, None)
    same(o2, want)
    same(l2, want_lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lean_route_gives_the_numpy_bits(rng, dtype, monkeypatch):
    """flash_attention's lean route (plain tensors straight into the kernels, fa2cpu.torch
    _lean_flash_attention) gives the NumPy API's bits for what it covers (4-D, both layouts, GQA,
    Nq != Nk, tile edges, causal / window / softcap / scale, broadcast and sliced K/V, float32
    options normalised the same way) and is not taken for what it does not cover."""
    taken = []
    real = ft._core.run_strided
    monkeypatch.setattr(ft._core, "run_strided", lambda *a, **kw: (taken.append(1), real(*a, **kw))[1])
    for layout in ("bhsd", "bshd"):
        for B, Hq, Hk, Nq, Nk, D, Dv in ((1, 1, 1, 1, 1, 8, 8), (2, 4, 2, 7, 13, 16, 24), (1, 8, 2, 1, 65, 64, 64),
                                         (1, 3, 3, 97, 31, 40, 40), (2, 6, 3, 129, 129, 128, 128)):
            def shape(h, n, d):
                return (B, h, n, d) if layout == "bhsd" else (B, n, h, d)
            q = trand(rng, shape(Hq, Nq, D), dtype)
            k = trand(rng, shape(Hk, 2 * Nk, D), dtype)
            k = k[:, :, ::2] if layout == "bhsd" else k[:, ::2]          # strided rows
            v = trand(rng, (1,) + shape(Hk, Nk, Dv)[1:], dtype).expand(shape(Hk, Nk, Dv))  # zero batch stride
            for opts in (dict(), dict(causal=True), dict(window=(5, 2), softcap=3.0, scale=0.25),
                         dict(window=(Nk + 10, -1), causal=True), dict(num_threads=1)):
                before = len(taken)
                got = ft.flash_attention(q, k, v, layout=layout, **opts)
                assert len(taken) == before + 1, (layout, opts)
                want = fa2cpu.flash_attention(N(q), N(k), N(v), layout=layout, **opts)
                assert got.is_contiguous() and got.dtype == q.dtype
                same(got, want)
    q, k, v = (trand(rng, (1, 2, 5, 8), dtype) for _ in range(3))
    before = len(taken)
    ft.flash_attention(q[0], k[0], v[0])                                 # 3-D: the general path
    ft.flash_attention(q, k, v, return_lse=True)                         # lse: the general path
    ft.flash_attention(q, k, v, scale=np.float32(0.5))                   # a NumPy scalar: the general path
    if dtype == "float32":
        ft.flash_attention(q.requires_grad_(), k, v).sum().backward()   # autograd: the operator
        assert q.grad is not None
    assert len(taken) == before
    with torch.no_grad():
        ft.flash_attention(q, k, v)                                       # no graph to record: lean
    assert len(taken) == before + 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attention_options_and_mask(rng, dtype):
    B, Hq, Hk, Nq, Nk, D = 2, 4, 2, 7, 11, 16
    q, k, v = trand(rng, (B, Hq, Nq, D), dtype), trand(rng, (B, Hk, Nk, D), dtype), trand(rng, (B, Hk, Nk, D), dtype)
    slopes = torch.rand(Hq)
    bmask = torch.rand(B, 1, Nq, Nk) > 0.3
    fmask = torch.randn(1, Hq, 1, Nk).to(TORCH_DTYPES[dtype])
    for opts in (dict(window=(3, 1), softcap=5.0, alibi_slopes=slopes, scale=0.3),
                 dict(mask=bmask), dict(mask=fmask, causal=True)):
        np_opts = {key: (N(val) if isinstance(val, torch.Tensor) else val) for key, val in opts.items()}
        same(ft.flash_attention(q, k, v, **opts), fa2cpu.flash_attention(N(q), N(k), N(v), **np_opts))


@pytest.mark.parametrize("dtype", DTYPES)
def test_autograd_gradients_in_kept_memory_stay_put(rng, dtype):
    """The autograd's gradients wrap fa2cpu's kept gradient memory (backward.py): gradients of an
    earlier backward that are still alive are never written by a later one."""
    q, k, v = (trand(rng, (1, 2, 33, 16), dtype).requires_grad_() for _ in range(3))
    ft.flash_attention(q, k, v, causal=True).sum().backward()
    first = [x.grad for x in (q, k, v)]
    held = [g.clone() for g in first]
    for x in (q, k, v):
        x.grad = None
    (ft.flash_attention(q, k, v, causal=True) * 2).sum().backward()   # dout x 2: gradients x 2 (float16
    # subnormals: to their last bit)
    for a, b, c in zip(first, held, (q.grad, k.grad, v.grad)):
        assert torch.equal(a, b), "a live gradient was overwritten"
        assert a.data_ptr() != c.data_ptr()
        torch.testing.assert_close(c.float(), 2 * b.float(), rtol=0, atol=6e-8)


def test_under_no_grad_and_inference_mode(rng):
    q, k, v = (trand(rng, (1, 2, 5, 8)).requires_grad_() for _ in range(3))
    want = fa2cpu.flash_attention(N(q), N(k), N(v))
    with torch.no_grad():
        same(ft.flash_attention(q, k, v), want)
    with torch.inference_mode():
        same(ft.flash_attention(q, k, v), want)


# ------------------------------------------------------------------------------ varlen

def _varlen_inputs(rng, dtype, Hq=4, Hk=2, D=16, Dv=16, lens_q=(7, 0, 1, 33), lens_k=(13, 5, 1, 33)):
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int64)
    q = trand(rng, (int(cu_q[-1]), Hq, D), dtype)
    k = trand(rng, (int(cu_k[-1]), Hk, D), dtype)
    v = trand(rng, (int(cu_k[-1]), Hk, Dv), dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_matches_numpy(rng, dtype):
    q, k, v, cu_q, cu_k = _varlen_inputs(rng, dtype, D=24, Dv=8)
    opts = dict(causal=True, max_seqlen_q=33, window=(5, 0))
    got, lse = ft.flash_attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **opts)
    want, want_lse = fa2cpu.flash_attention_varlen(N(q), N(k), N(v), N(cu_q), N(cu_k), return_lse=True, **opts)
    same(got, want)
    same(lse, want_lse)
    out = torch.empty_like(got)
    assert ft.flash_attention_varlen(q, k, v, cu_q, cu_k, out=out, **opts) is out
    same(out, want)


# ------------------------------------------------------------------------------ kvcache

def _cache(rng, dtype, paged, layout, B=3, Hq=4, Hk=2, D=16, Dv=8, cap=40, block=8):
    """Random caches (torch tensors) in `layout` and the block table (or None)."""
    if paged:
        nblocks = B * cap // block + 2
        perm = rng.permutation(nblocks)[:B * cap // block].reshape(B, cap // block)
        bt = torch.tensor(perm, dtype=torch.int32)
        lead = (nblocks, block)
    else:
        bt, lead = None, (B, cap)
    kc, vc = trand(rng, lead + (Hk, D), dtype), trand(rng, lead + (Hk, Dv), dtype)
    if layout == "bhsd":
        kc, vc = (x.transpose(1, 2).contiguous() for x in (kc, vc))
    return kc, vc, bt


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("seqlens", ["int", "tensor", "tensor-b1"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_kvcache_appends_in_place(rng, dtype, paged, seqlens, layout):
    B = 1 if seqlens == "tensor-b1" else 3
    Hq, Hk, D, Dv, nnew, Nq = 4, 2, 16, 8, 3, 3
    kc, vc, bt = _cache(rng, dtype, paged, layout, B=B, Hq=Hq, Hk=Hk, D=D, Dv=Dv)
    kc_np, vc_np = N(kc).copy(), N(vc).copy()
    ptrs = kc.data_ptr(), vc.data_ptr()
    versions = kc._version, vc._version
    hs = (lambda *s: (s[0], s[2], s[1], s[3])) if layout == "bhsd" else (lambda *s: s)
    q = trand(rng, hs(B, Nq, Hq, D), dtype)
    k, v = trand(rng, hs(B, nnew, Hk, D), dtype), trand(rng, hs(B, nnew, Hk, Dv), dtype)
    lens = 17 if seqlens == "int" else torch.tensor(rng.integers(0, 37, B), dtype=torch.int32)
    opts = dict(cache_seqlens=lens, block_table=bt, causal=True, layout=layout)
    got, lse = ft.flash_attention_with_kvcache(q, kc, vc, k, v, return_lse=True, **opts)
    np_opts = {key: (N(val) if isinstance(val, torch.Tensor) else val) for key, val in opts.items()}
    want, want_lse = fa2cpu.flash_attention_with_kvcache(N(q), kc_np, vc_np, N(k), N(v), return_lse=True, **np_opts)
    same(got, want)
    same(lse, want_lse)
    same(kc, kc_np)                       # appended in place, exactly where the NumPy API appends
    same(vc, vc_np)
    assert (kc.data_ptr(), vc.data_ptr()) == ptrs
    assert kc._version > versions[0] and vc._version > versions[1]
    # the general path (alibi_slopes forces it) and out= give the same result
    out = torch.empty_like(got)
    kc2, vc2 = kc.clone(), vc.clone()
    r = ft.flash_attention_with_kvcache(q, kc2, vc2, k, v, alibi_slopes=torch.zeros(Hq), out=out, **opts)
    assert r is out
    same(out, want)
    same(kc2, kc)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kvcache_decode_options(rng, dtype):
    """The lean path with each option vs the NumPy API (one token, B = 2, contiguous)."""
    kc, vc, _ = _cache(rng, dtype, False, "bshd", B=2, D=32, Dv=32)
    q = trand(rng, (2, 1, 4, 32), dtype)
    lens = torch.tensor([39, 5], dtype=torch.int64)
    for opts in (dict(), dict(window=(4, 0)), dict(softcap=3.0, scale=0.5), dict(num_splits=3),
                 dict(num_splits=1, num_threads=1), dict(window=(10 ** 12, 0))):
        got = ft.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, **opts)
        same(got, fa2cpu.flash_attention_with_kvcache(N(q), N(kc), N(vc), cache_seqlens=N(lens), **opts))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kvcache_decode_loop_on_the_same_tensors(rng, dtype):
    """Token by token into the same cache tensors (their NumPy views are memoised after the
    first call), then the tensors' storage is swapped: every step equals the NumPy API."""
    B, Hq, Hk, D, cap = 2, 4, 2, 16, 12
    kc, vc = trand(rng, (B, cap, Hk, D), dtype), trand(rng, (B, cap, Hk, D), dtype)
    kc_np, vc_np = N(kc).copy(), N(vc).copy()
    for step in range(6):
        if step == 3:  # new storage behind the same tensor objects
            kc.set_(kc.clone())
            vc.data = vc.data.clone()
        q, k, v = trand(rng, (B, 1, Hq, D), dtype), trand(rng, (B, 1, Hk, D), dtype), trand(rng, (B, 1, Hk, D), dtype)
        got = ft.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=step, causal=True)
        want = fa2cpu.flash_attention_with_kvcache(N(q), kc_np, vc_np, N(k), N(v), cache_seqlens=step, causal=True)
        same(got, want)
        same(kc, kc_np)
        same(vc, vc_np)
    # the appends ran as one prepared core call per cache pair (fa2cpu._torch_ops._kvcache_step)
    assert (id(kc), id(vc)) in fa2cpu._torch_ops._STEPS.steps, "the decode step route was not taken"


@pytest.mark.parametrize("dtype", DTYPES)
def test_kvcache_decode_step_route_is_the_general_call(rng, dtype, monkeypatch):
    """The eager append call on tensors (one prepared DecodeStep) against the general route
    (alibi_slopes of zeros forces it): the same output and cache bits, for GQA, several query
    rows and new tokens, causal or not, a scale, a thread count; the route really ran; a call
    outside its case (n = 0 new tokens, bhsd, a window) and errors take the general route."""
    taken = []
    step = fa2cpu._torch_ops._kvcache_step
    monkeypatch.setattr(ft, "_kvcache_step", lambda *a: taken.append(step(*a)) or taken[-1])
    for B, M, Hq, Hk, D, Dv, n, length, cap in ((1, 1, 8, 8, 64, 64, 1, 100, 256), (2, 4, 8, 2, 128, 96, 3, 37, 64),
                                                (3, 1, 4, 1, 17, 5, 1, 0, 9), (1, 2, 2, 2, 8, 8, 2, 7, 9)):
        for opts in (dict(), dict(causal=True), dict(causal=True, scale=0.3, num_threads=1)):
            q = trand(rng, (B, M, Hq, D), dtype)
            k, v = trand(rng, (B, n, Hk, D), dtype), trand(rng, (B, n, Hk, Dv), dtype)
            kc, vc = trand(rng, (B, cap, Hk, D), dtype), trand(rng, (B, cap, Hk, Dv), dtype)
            kc2, vc2 = kc.clone(), vc.clone()
            got = ft.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=length, **opts)
            assert taken[-1] is got
            want = ft.flash_attention_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=length,
                                                   alibi_slopes=torch.zeros(Hq), **opts)
            same(got, want)
            same(kc, kc2)
            same(vc, vc2)
    assert len(taken) == 12
    kc, vc = trand(rng, (1, 8, 2, 16), dtype), trand(rng, (1, 8, 2, 16), dtype)
    with pytest.raises(ValueError, match="capacity"):  # 8 + 1 > 8: the general route's error, nothing written
        before = kc.clone()
        ft.flash_attention_with_kvcache(trand(rng, (1, 1, 2, 16), dtype), kc, vc, trand(rng, (1, 1, 2, 16), dtype),
                                        trand(rng, (1, 1, 2, 16), dtype), cache_seqlens=8)
    same(kc, before)
    assert taken[-1] is None
    key = (id(kc), id(vc))
    ft.flash_attention_with_kvcache(trand(rng, (1, 1, 2, 16), dtype), kc, vc, trand(rng, (1, 1, 2, 16), dtype),
                                    trand(rng, (1, 1, 2, 16), dtype), cache_seqlens=3)
    assert key in fa2cpu._torch_ops._STEPS.steps
    del kc, vc
    assert key not in fa2cpu._torch_ops._STEPS.steps, "the decode step outlived its cache tensors"


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_errors_leave_the_cache_untouched(rng, paged):
    kc, vc, bt = _cache(rng, "float32", paged, "bshd", B=2)
    before = kc.clone(), vc.clone()
    q, k, v = trand(rng, (2, 1, 4, 16)), trand(rng, (2, 2, 2, 16)), trand(rng, (2, 2, 2, 8))
    with pytest.raises(ValueError, match="cache_seqlens"):
        ft.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=39, block_table=bt)
    with pytest.raises(ValueError, match="out"):
        ft.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, block_table=bt, out=torch.empty(2, 1, 4, 9))
    with pytest.raises(ValueError, match="out: must not overlap"):
        overlapping = kc[:, 5:6].view(2, 1, 4, 8) if bt is None else kc[:2, 5:6].view(2, 1, 4, 8)
        ft.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, block_table=bt, out=overlapping)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


# ------------------------------------------------------------------------------ quantized kvcache

QUANT = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _quant_cache(rng, code, paged, layout, with_scales=True, **kw):
    """Random caches of codes (torch tensors, `code`'s dtype) with float32 scales (or None), the
    block table, and NumPy copies of all four to run the NumPy API on."""
    kc, vc, bt = _cache(rng, "float32", paged, layout, **kw)
    kc, vc = (x.mul(20).clamp(-127, 127).round().to(QUANT[code]) for x in (kc, vc))
    ks = vs = None
    if with_scales:
        ks, vs = (torch.from_numpy(rng.random(x.shape[:-1], dtype=np.float32) / 50) for x in (kc, vc))
    return kc, vc, ks, vs, bt, [None if x is None else N(x).copy() for x in (kc, vc, ks, vs)]


def _bytes(t):
    return N(t).view(np.uint8) if t.dtype is torch.float8_e4m3fn else N(t)


@pytest.mark.parametrize("code,with_scales", [("int8", True), ("fp8", True), ("fp8", False)],
                         ids=["int8", "fp8", "fp8-unscaled"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_kvcache_quantized_appends_in_place(rng, code, with_scales, paged, layout):
    """int8 / float8_e4m3fn cache tensors with float32 scale tensors: zero-copy views, the
    quantizing append writes codes and scales into the tensors exactly as the NumPy API writes
    its arrays, results equal; the operator (compile/autograd path) does the same."""
    B, Hq, Hk, D, Dv, nnew = 3, 4, 2, 16, 8, 2
    kc, vc, ks, vs, bt, before = _quant_cache(rng, code, paged, layout, with_scales)
    kc_np, vc_np, ks_np, vs_np = (None if a is None else a.copy() for a in before)
    hs = (lambda *s: (s[0], s[2], s[1], s[3])) if layout == "bhsd" else (lambda *s: s)
    q = trand(rng, hs(B, 2, Hq, D), "bfloat16")
    k, v = trand(rng, hs(B, nnew, Hk, D), "bfloat16"), trand(rng, hs(B, nnew, Hk, Dv), "bfloat16")
    assert N(kc).ctypes.data == kc.data_ptr()           # zero copy, float8 included
    ptrs = [t.data_ptr() for t in (kc, vc, ks, vs) if t is not None]
    versions = [t._version for t in (kc, vc, ks, vs) if t is not None]
    lens = torch.tensor([0, 17, 38 - nnew], dtype=torch.int32)
    opts = dict(cache_seqlens=lens, block_table=bt, causal=True, layout=layout)
    np_opts = {key: (N(val) if isinstance(val, torch.Tensor) else val) for key, val in opts.items()}
    got, lse = ft.flash_attention_with_kvcache(q, kc, vc, k, v, return_lse=True, k_scale=ks, v_scale=vs, **opts)
    want, want_lse = fa2cpu.flash_attention_with_kvcache(N(q), kc_np, vc_np, N(k), N(v), return_lse=True,
                                                         k_scale=ks_np, v_scale=vs_np, **np_opts)
    same(got, want)
    same(lse, want_lse)
    np.testing.assert_array_equal(_bytes(kc), kc_np.view(np.uint8) if code == "fp8" else kc_np)
    np.testing.assert_array_equal(_bytes(vc), vc_np.view(np.uint8) if code == "fp8" else vc_np)
    if with_scales:
        np.testing.assert_array_equal(N(ks), ks_np)
        np.testing.assert_array_equal(N(vs), vs_np)
        assert not np.array_equal(N(ks), before[2]) and not np.array_equal(N(vs), before[3])  # written
    assert [t.data_ptr() for t in (kc, vc, ks, vs) if t is not None] == ptrs
    assert all(t._version > was for t, was in zip([t for t in (kc, vc, ks, vs) if t is not None], versions))
    # the operator itself (the path of torch.compile, fake tensors, dispatch modes) on clones of
    # the state before the call: the same result, codes and scales
    clones = [None if a is None else ft._tensor(a.copy()) for a in before]
    out = torch.empty_like(got)
    lse2 = torch.ops.fa2cpu.flash_attention_with_kvcache(
        q, clones[0], clones[1], k, v, lens, None, bt, True, None, [-1, -1], None, None, True, 0, None, out,
        layout, None, clones[2], clones[3])
    same(out, got)
    same(lse2, lse)
    for a, b in zip(clones, (kc, vc, ks, vs)):
        if a is not None:
            np.testing.assert_array_equal(_bytes(a), _bytes(b))


class _PassThrough(torch.overrides.TorchFunctionMode):
    """A function mode that changes nothing but sends fa2cpu.torch's calls through the operator."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_quantized_errors_leave_caches_and_scales_untouched(rng, paged):
    """Errors like the NumPy API's (TypeError/ValueError naming the argument), eager and through
    the operator; caches and scales byte-identical afterwards."""
    kc, vc, ks, vs, bt, before = _quant_cache(rng, "int8", paged, "bshd", B=2)
    q, k, v = trand(rng, (2, 1, 4, 16)), trand(rng, (2, 1, 2, 16)), trand(rng, (2, 1, 2, 8))
    nan_k = k.clone()
    nan_k[1, 0, 1, 3] = float("nan")
    f8 = kc.view(torch.float8_e4m3fn)
    cases = [
        (ValueError, "k_scale: an int8 k_cache needs its float32 scales", dict(k_scale=None)),
        (TypeError, "v_scale: dtype float64", dict(v_scale=vs.double())),
        (TypeError, "k_scale: expected a torch.Tensor", dict(k_scale=N(ks))),
        (ValueError, "k_scale: expected shape", dict(k_scale=ks[:, :5])),
        (ValueError, "k_scale: scales go with a quantized", dict(k_cache=kc.float(), v_cache=vc.float())),
        (TypeError, "v_cache: dtype float8_e4m3fn does not match k_cache's int8", dict(v_cache=vc.view(f8.dtype))),
        (TypeError, "k_cache: dtype torch.float8_e5m2 is not supported",
         dict(k_cache=kc.view(torch.float8_e5m2), v_cache=vc.view(torch.float8_e5m2))),
        (ValueError, "k: holds inf or NaN", dict(k=nan_k)),
        (ValueError, "cache_seqlens", dict(cache_seqlens=40)),
    ]
    for compiled in (False, True):
        for error, message, change in cases:
            args = dict(k_cache=kc, v_cache=vc, k=k, k_scale=ks, v_scale=vs, cache_seqlens=3)
            args.update(change)
            call = lambda a: ft.flash_attention_with_kvcache(  # noqa: E731
                q, a["k_cache"], a["v_cache"], a["k"], v, cache_seqlens=a["cache_seqlens"], block_table=bt,
                k_scale=a["k_scale"], v_scale=a["v_scale"])
            with pytest.raises(error, match=message):
                if compiled:  # the operator's path (what torch.compile and dispatch modes take)
                    with _PassThrough():
                        call(args)
                else:
                    call(args)
            for t, was in zip((kc, vc, ks, vs), before):
                np.testing.assert_array_equal(N(t), was, err_msg=f"{message} changed the cache")


# ------------------------------------------------------------------------------ torch.compile

def test_opcheck_every_operator(rng):
    """torch.library.opcheck: schema (mutations declared), fake tensors, autograd registration."""
    q, k, v = trand(rng, (2, 4, 7, 16)), trand(rng, (2, 2, 9, 16)), trand(rng, (2, 2, 9, 8))
    fa_opts = (True, None, [-1, -1], None, None, None, "bhsd", None)
    opcheck = torch.library.opcheck
    opcheck(torch.ops.fa2cpu.flash_attention.default, (q, k, v) + fa_opts)
    opcheck(torch.ops.fa2cpu.flash_attention.default,
            tuple(x.clone().requires_grad_() for x in (q, k, v)) + fa_opts)
    opcheck(torch.ops.fa2cpu.flash_attention_out.default, (q, k, v) + fa_opts + (True, torch.empty(2, 4, 7, 8)))
    out, lse = ft.flash_attention(q, k, v, causal=True, return_lse=True)
    opcheck(torch.ops.fa2cpu.flash_attention_backward.default,
            (torch.randn_like(out), q, k, v, out, lse, torch.randn_like(lse), True, None, [-1, -1], None, None,
             "bhsd", None, False))
    vq, vk, vv, cu_q, cu_k = _varlen_inputs(rng, "float32")
    vl_opts = (None, None, True, None, [-1, -1], None, None, None)
    opcheck(torch.ops.fa2cpu.flash_attention_varlen.default, (vq, vk, vv, cu_q, cu_k) + vl_opts)
    opcheck(torch.ops.fa2cpu.flash_attention_varlen.default,
            tuple(x.clone().requires_grad_() for x in (vq, vk, vv)) + (cu_q, cu_k) + vl_opts)
    opcheck(torch.ops.fa2cpu.flash_attention_varlen_out.default,
            (vq, vk, vv, cu_q, cu_k) + vl_opts + (False, torch.empty_like(vq)))
    kc, vc, bt = _cache(rng, "float32", True, "bshd", B=2)
    opcheck(torch.ops.fa2cpu.flash_attention_with_kvcache.default,
            (trand(rng, (2, 1, 4, 16)), kc, vc, trand(rng, (2, 1, 2, 16)), trand(rng, (2, 1, 2, 8)),
             torch.tensor([3, 9], dtype=torch.int32), None, bt, True, None, [-1, -1], None, None, True, 0, None,
             torch.empty(2, 1, 4, 8), "bshd"))
    # a quantized cache: the scales are mutated too (declared in the schema)
    kc, vc, ks, vs, bt, _ = _quant_cache(rng, "int8", True, "bshd", B=2)
    opcheck(torch.ops.fa2cpu.flash_attention_with_kvcache.default,
            (trand(rng, (2, 1, 4, 16)), kc, vc, trand(rng, (2, 1, 2, 16)), trand(rng, (2, 1, 2, 8)),
             torch.tensor([3, 9], dtype=torch.int32), None, bt, True, None, [-1, -1], None, None, True, 0, None,
             torch.empty(2, 1, 4, 8), "bshd", None, ks, vs))


# inductor itself warns that torch.jit.script_method is deprecated (torch 2.13)
INDUCTOR_WARNING = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@INDUCTOR_WARNING
def test_compile_fullgraph_flash_attention_and_grad(rng):
    q, k, v = trand(rng, (1, 4, 9, 16)), trand(rng, (1, 2, 9, 16)), trand(rng, (1, 2, 9, 16))
    fn = torch.compile(lambda q, k, v: ft.flash_attention(q, k, v, causal=True, return_lse=True), fullgraph=True)
    got, lse = fn(q, k, v)
    want, want_lse = fa2cpu.flash_attention(N(q), N(k), N(v), causal=True, return_lse=True)
    same(got, want)
    same(lse, want_lse)
    # training graph: forward + backward operators traced together
    loss = torch.compile(lambda q, k, v: ft.flash_attention(q, k, v, causal=True).square().sum(),
                         fullgraph=True, backend="aot_eager")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    loss(*leaves).backward()
    eager = [x.clone().requires_grad_() for x in (q, k, v)]
    ft.flash_attention(*eager, causal=True).square().sum().backward()
    for a, b in zip(leaves, eager):
        same(a.grad, b.grad)


def test_compile_fullgraph_varlen_and_out(rng):
    q, k, v, cu_q, cu_k = _varlen_inputs(rng, "float32")
    fn = torch.compile(lambda q, k, v, a, b: ft.flash_attention_varlen(q, k, v, a, b, causal=True),
                       fullgraph=True, backend="aot_eager")
    same(fn(q, k, v, cu_q, cu_k), fa2cpu.flash_attention_varlen(N(q), N(k), N(v), N(cu_q), N(cu_k), causal=True))
    q4, k4 = trand(rng, (1, 2, 5, 8)), trand(rng, (1, 2, 6, 8))
    out = torch.zeros(1, 2, 5, 8)
    fo = torch.compile(lambda q, k, o: ft.flash_attention(q, k, k, out=o), fullgraph=True, backend="aot_eager")
    fo(q4, k4, out)
    same(out, fa2cpu.flash_attention(N(q4), N(k4), N(k4)))


@INDUCTOR_WARNING
@pytest.mark.parametrize("code", [None, "int8", "fp8"], ids=["float32", "int8", "fp8"])
def test_compile_fullgraph_kvcache_mutates_the_cache(rng, code):
    """Inductor, fullgraph: the appended K/V (and, in a quantized cache, their scales) land in
    the caller's tensors, as the NumPy API writes them."""
    if code is None:
        kc, vc, bt = _cache(rng, "float32", True, "bshd", B=2)
        ks = vs = None
        kc_np, vc_np, ks_np, vs_np = N(kc).copy(), N(vc).copy(), None, None
    else:
        kc, vc, ks, vs, bt, (kc_np, vc_np, ks_np, vs_np) = _quant_cache(rng, code, True, "bshd", B=2)
    q, k, v = trand(rng, (2, 1, 4, 16)), trand(rng, (2, 1, 2, 16)), trand(rng, (2, 1, 2, 8))
    lens = torch.tensor([3, 30], dtype=torch.int32)
    fn = torch.compile(lambda q, kc, vc, k, v, lens, bt, ks, vs: ft.flash_attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=lens, block_table=bt, causal=True, k_scale=ks, v_scale=vs), fullgraph=True)
    got = fn(q, kc, vc, k, v, lens, bt, ks, vs)
    want = fa2cpu.flash_attention_with_kvcache(N(q), kc_np, vc_np, N(k), N(v), cache_seqlens=N(lens),
                                               block_table=N(bt), causal=True, k_scale=ks_np, v_scale=vs_np)
    same(got, want)
    np.testing.assert_array_equal(_bytes(kc), kc_np.view(np.uint8) if code == "fp8" else kc_np)
    np.testing.assert_array_equal(_bytes(vc), vc_np.view(np.uint8) if code == "fp8" else vc_np)
    if code is not None:
        np.testing.assert_array_equal(N(ks), ks_np)
        np.testing.assert_array_equal(N(vs), vs_np)


# ------------------------------------------------------------------------------ autograd

def _sdpa_grads(fn, q, k, v, dout, **kw):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, **kw)
    out.backward(dout)
    return out.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("case", ["causal", "gqa", "nq<nk-causal", "nq>nk-causal"])
def test_gradients_match_torch_sdpa(rng, case):
    B, Hq, Hk, Nq, Nk, D = 2, 4, 4, 13, 13, 16
    kw = {}
    if case == "causal":
        kw = dict(is_causal=True)
    elif case == "gqa":
        Hk, kw = 2, dict(is_causal=True, enable_gqa=True)
    elif case == "nq<nk-causal":
        Nq, Nk, kw = 7, 33, dict(scale=0.4, is_causal=True)  # top-left: keys trimmed to Nq
    else:
        Nq, Nk, Hk, kw = 33, 7, 1, dict(is_causal=True, enable_gqa=True)
    q, k, v = trand(rng, (B, Hq, Nq, D)), trand(rng, (B, Hk, Nk, D)), trand(rng, (B, Hk, Nk, D))
    dout = trand(rng, (B, Hq, Nq, D))
    out, grads = _sdpa_grads(ft.scaled_dot_product_attention, q, k, v, dout, **kw)
    want_out, want = _sdpa_grads(torch_sdpa, q, k, v, dout, **kw)
    torch.testing.assert_close(out, want_out, **TOL["float32"])
    for name, g, w in zip("qkv", grads, want):
        torch.testing.assert_close(g, w, **TOL["float32"], msg=lambda m: f"d{name} ({case}): {m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "3d"])
def test_gradients_match_float64_reference(rng, dtype, layout):
    B, Hq, Hk, Nq, Nk, D, Dv = 2, 4, 2, 7, 11, 16, 8
    kw = dict(causal=True, softcap=4.0, alibi_slopes=np.linspace(0.1, 0.5, Hq, dtype=np.float32))
    if layout == "bshd":
        shapes = (B, Nq, Hq, D), (B, Nk, Hk, D), (B, Nk, Hk, Dv), (B, Nq, Hq, Dv)
    elif layout == "bhsd":
        shapes = (B, Hq, Nq, D), (B, Hk, Nk, D), (B, Hk, Nk, Dv), (B, Hq, Nq, Dv)
    else:
        shapes = (Hq, Nq, D), (Hk, Nk, D), (Hk, Nk, Dv), (Hq, Nq, Dv)
    q, k, v, dout = (rand(rng, s, dtype) for s in shapes)
    lay = "bshd" if layout == "bshd" else "bhsd"
    leaves = [T(x.copy()).requires_grad_() for x in (q, k, v)]
    out = ft.flash_attention(*leaves, layout=lay, **dict(kw, alibi_slopes=torch.from_numpy(kw["alibi_slopes"])))
    out.backward(T(dout))
    want = ref.attention_backward_ref(dout, q, k, v, layout=lay, **kw)
    for name, t, w in zip("qkv", leaves, want):
        assert t.grad.dtype == t.dtype
        check_close(N(t.grad), w, dtype, what=f"d{name}")


def test_gradient_through_lse(rng):
    """A loss that uses lse as well as out: compared with torch autograd of a float64 formula."""
    B, Hq, Hk, Nq, Nk, D = 1, 4, 2, 7, 9, 8
    q, k, v = trand(rng, (B, Hq, Nq, D)), trand(rng, (B, Hk, Nk, D)), trand(rng, (B, Hk, Nk, D))
    w_out, w_lse = trand(rng, (B, Hq, Nq, D)), trand(rng, (B, Hq, Nq))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = ft.flash_attention(*leaves, causal=True, softcap=2.0, return_lse=True)
    ((out * w_out).sum() + (lse * w_lse).sum()).backward()

    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    q64, k64, v64 = ref_leaves
    k64, v64 = (x.repeat_interleave(Hq // Hk, dim=1) for x in (k64, v64))
    s = 2.0 * torch.tanh((q64 @ k64.transpose(-1, -2)) / np.sqrt(D) / 2.0)
    vis = torch.from_numpy(ref.visible_band(Nq, Nk, causal=True))
    s = s.masked_fill(~vis, float("-inf"))
    r_lse = torch.logsumexp(s, -1)
    r_out = torch.softmax(s, -1) @ v64
    ((r_out * w_out.double()).sum() + (r_lse * w_lse.double()).sum()).backward()
    for name, a, b in zip("qkv", leaves, ref_leaves):
        check_close(a.grad.numpy(), b.grad.numpy(), "float32", what=f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_gradients_match_float64_reference(rng, dtype):
    q, k, v, cu_q, cu_k = _varlen_inputs(rng, dtype, D=16, Dv=8)
    dout = trand(rng, (q.shape[0], q.shape[1], 8), dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ft.flash_attention_varlen(*leaves, cu_q, cu_k, causal=True, window=(6, 0)).backward(dout)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for name, t, x in zip("qkv", leaves, (q, k, v)):
        assert t.grad.dtype == t.dtype and t.grad.shape == x.shape
    for b in range(len(cq) - 1):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b] == cq[b + 1] or ck[b] == ck[b + 1]:
            assert not leaves[0].grad[sq].any()
            continue
        want = ref.attention_backward_ref(N(dout)[None, sq], N(q)[None, sq], N(k)[None, sk], N(v)[None, sk],
                                          causal=True, window=(6, 0), layout="bshd")
        for name, t, w, rows in zip("qkv", leaves, want, (sq, sk, sk)):
            check_close(N(t.grad)[rows], w[0], dtype, what=f"d{name} sequence {b}")


def test_mask_gradient_is_refused(rng):
    q = trand(rng, (1, 1, 3, 8)).requires_grad_()
    out = ft.flash_attention(q, q, q, mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="mask"):
        out.sum().backward()


# ------------------------------------------------------------------------------ sinks

def test_sinks_forward_matches_numpy_and_gradients_match_reference(rng):
    B, Hq, Hk, Nq, Nk, D = 2, 4, 2, 33, 70, 16
    q, k, v, dout = (rand(rng, s) for s in ((B, Hq, Nq, D), (B, Hk, Nk, D), (B, Hk, Nk, D), (B, Hq, Nq, D)))
    sinks = (rng.standard_normal(Hq) * 2).astype(np.float32)
    want = fa2cpu.flash_attention(q, k, v, causal=True, sinks=sinks)
    same(ft.flash_attention(T(q), T(k), T(v), causal=True, sinks=T(sinks)), want)  # eager, no grad
    tq, tk, tv, ts = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v, sinks))
    out = ft.flash_attention(tq, tk, tv, causal=True, sinks=ts)
    same(out.detach(), want)
    out.backward(torch.from_numpy(dout))
    r_dq, r_dk, r_dv, r_ds = ref.attention_backward_ref(dout, q, k, v, causal=True, sinks=sinks)
    for name, t, r in (("dq", tq, r_dq), ("dk", tk, r_dk), ("dv", tv, r_dv)):
        check_close(N(t.grad), r, "float32", name)
    np.testing.assert_allclose(ts.grad.numpy(), r_ds, rtol=1e-4, atol=1e-5)


def test_sinks_only_need_grad(rng):
    """sinks alone requiring grad (an nn.Parameter of a frozen model) still gets its gradient."""
    q, k, v = (torch.from_numpy(rand(rng, (1, 2, 9, 8))) for _ in range(3))
    sinks = torch.zeros(2, requires_grad=True)
    out, lse = ft.flash_attention(q, k, v, sinks=sinks, return_lse=True)
    (out.sum() + lse.sum()).backward()
    eps = 1e-3
    with torch.no_grad():
        for h in range(2):
            plus, minus = sinks.detach().clone(), sinks.detach().clone()
            plus[h] += eps
            minus[h] -= eps
            f = [sum(t.sum() for t in ft.flash_attention(q, k, v, sinks=s, return_lse=True)) for s in (plus, minus)]
            assert abs(float((f[0] - f[1]) / (2 * eps)) - float(sinks.grad[h])) < 1e-2


def test_sinks_varlen_and_kvcache(rng):
    cu = np.array([0, 5, 5, 40], np.int64)
    q, k, v, dout = (rand(rng, (40, 2, 16)) for _ in range(4))
    sinks = np.array([0.5, -1.5], np.float32)
    tq, tk, tv, ts = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v, sinks))
    out = ft.flash_attention_varlen(tq, tk, tv, torch.from_numpy(cu), torch.from_numpy(cu), causal=True, sinks=ts)
    same(out.detach(), fa2cpu.flash_attention_varlen(q, k, v, cu, cu, causal=True, sinks=sinks))
    out.backward(torch.from_numpy(dout))
    o_np, lse_np = fa2cpu.flash_attention_varlen(q, k, v, cu, cu, causal=True, sinks=sinks, return_lse=True)
    *_, ds = fa2cpu.flash_attention_varlen_backward(dout, q, k, v, o_np, lse_np, cu, cu, causal=True, sinks=sinks)
    np.testing.assert_allclose(ts.grad.numpy(), ds, rtol=1e-5, atol=1e-6)
    qc, kc, vc = rand(rng, (1, 1, 4, 16)), rand(rng, (1, 32, 2, 16)), rand(rng, (1, 32, 2, 16))
    s4 = np.array([1.0, 0.0, -1.0, 2.0], np.float32)
    same(ft.flash_attention_with_kvcache(T(qc), T(kc.copy()), T(vc.copy()), cache_seqlens=20, sinks=T(s4)),
         fa2cpu.flash_attention_with_kvcache(qc, kc, vc, cache_seqlens=20, sinks=s4))


@INDUCTOR_WARNING
def test_sinks_compile_fullgraph(rng):
    q, k, v = (torch.from_numpy(rand(rng, (1, 2, 9, 8))) for _ in range(3))
    sinks = torch.tensor([0.3, -0.7])
    fn = torch.compile(lambda q, k, v, s: ft.flash_attention(q, k, v, causal=True, sinks=s), fullgraph=True)
    same(fn(q, k, v, sinks), ft.flash_attention(q, k, v, causal=True, sinks=sinks))


# ------------------------------------------------------------------------------ session 44's fuzzing

def test_a_meta_tensor_beside_cpu_ones_is_refused():
    """A meta tensor among CPU ones dispatches the operator to its fake implementation: refused
    there and before (before: uninitialised memory returned, garbage gradients)."""
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 8, device="meta"), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="k: on device meta"):
        ft.flash_attention(q, k, v)
    with pytest.raises(ValueError, match="sinks: on device meta"):
        ft.flash_attention(q, torch.randn(1, 2, 5, 8), v, sinks=torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match="every tensor must be on one device"):
        torch.ops.fa2cpu.flash_attention(q.detach(), k, v, False, None, [-1, -1], None, None, None, "bhsd", None)
    qv, kv = torch.randn(5, 2, 8), torch.randn(5, 2, 8, device="meta")
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="k: on device meta"):
        ft.flash_attention_varlen(qv.requires_grad_(), kv, torch.randn(5, 2, 8), cu, cu)
    with pytest.raises(ValueError, match="cu_seqlens_k: on device meta"):
        ft.flash_attention_varlen(qv, torch.randn(5, 2, 8), torch.randn(5, 2, 8), cu, cu.to("meta"))
    # all on meta: shape inference through the fake implementation, as before
    qm = torch.randn(1, 2, 4, 8, device="meta")
    assert ft.flash_attention(qm, k, k).shape == (1, 2, 4, 8)


@pytest.mark.parametrize("route", ["step", "general"])
def test_an_expanded_cache_is_refused_as_an_append_target(route):
    """Sequences of an expanded (stride-0) cache share their rows: an append would let them
    overwrite each other (torch refuses such writes itself; a broadcast NumPy cache is read-only)."""
    kc, vc = torch.zeros(1, 4, 1, 16).expand(2, -1, -1, -1), torch.zeros(1, 4, 1, 16).expand(2, -1, -1, -1)
    q, kn, vn = (torch.randn(2, 1, 1, 16) for _ in range(3))
    extra = {} if route == "step" else dict(alibi_slopes=torch.zeros(1))
    with pytest.raises(ValueError, match="k_cache: axis 0 has stride 0"):
        ft.flash_attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=0, **extra)
    assert not kc.any() and not vc.any()
    cache = torch.zeros(2, 4, 1, 16)
    with pytest.raises(ValueError, match="v_cache: the same memory as k_cache"):
        ft.flash_attention_with_kvcache(q, cache, cache, kn, vn, cache_seqlens=0, **extra)
    assert not cache.any()


def test_return_lse_must_be_a_bool():
    x = torch.ones(1, 1, 4, 8)
    with pytest.raises(TypeError, match="return_lse: expected a bool"):
        ft.flash_attention(x, x, x, return_lse="no")
    with pytest.raises(TypeError, match="return_lse: expected a bool"):
        ft.flash_attention_with_kvcache(x, x.clone(), x.clone(), return_lse=1)
