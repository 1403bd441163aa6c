"""Adversarial inputs (issue 8): every defect found by trying to break the library, one test each.

A test whose failure mode is a crash or a hang runs its code in a subprocess with a timeout, so a
regression fails the test instead of killing or stalling the run.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import fa2cpu
from conftest import REPO, arg, check_close, check_same, rand, ref, run_python

NAN_ROW = 3  # the query row that carries a NaN in the NaN tests


def run_py(code, timeout=120, env=None, cwd=None):
    """run_python from the folder above the package's checkout (the installed package is imported)."""
    return run_python(code, env=env, cwd=cwd or pathlib.Path(fa2cpu.__file__).parents[2], timeout=timeout)


def assert_ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


# ------------------------------------------------------------------------------ 1: Hq == 0

def test_zero_query_heads_every_entry_point():
    proc = run_py("""
        import numpy as np, fa2cpu
        z = np.zeros
        f = np.float32
        out, lse = fa2cpu.flash_attention(z((1, 0, 1, 8), f), z((1, 1, 1, 8), f), z((1, 1, 1, 8), f), return_lse=True)
        assert out.shape == (1, 0, 1, 8) and lse.shape == (1, 0, 1)
        out = fa2cpu.flash_attention(z((1, 1, 0, 8), f), z((1, 1, 1, 8), f), z((1, 1, 1, 8), f), layout="bshd")
        assert out.shape == (1, 1, 0, 8)
        out = fa2cpu.flash_attention(z((0, 1, 8), f), z((1, 1, 8), f), z((1, 1, 8), f), causal=True)
        assert out.shape == (0, 1, 8)
        cu = np.array([0, 1], np.int32)
        out, lse = fa2cpu.flash_attention_varlen(z((1, 0, 8), f), z((1, 1, 8), f), z((1, 1, 8), f), cu, cu,
                                                 return_lse=True)
        assert out.shape == (1, 0, 8) and lse.shape == (0, 1)
        kc, vc = z((1, 4, 1, 8), f), z((1, 4, 1, 8), f)
        out = fa2cpu.flash_attention_with_kvcache(z((1, 1, 0, 8), f), kc, vc, z((1, 1, 1, 8), f) + 1,
                                                  z((1, 1, 1, 8), f) + 2, cache_seqlens=1)
        assert out.shape == (1, 1, 0, 8) and (kc[0, 1] == 1).all() and (vc[0, 1] == 2).all()
        out = fa2cpu.flash_attention_with_kvcache(z((1, 1, 0, 8), f), z((3, 2, 1, 8), f), z((3, 2, 1, 8), f),
                                                  block_table=np.array([[2, 0]], np.int32), cache_seqlens=3)
        assert out.shape == (1, 1, 0, 8)
        q, k, v = z((1, 0, 2, 8), f), z((1, 1, 3, 8), f) + 1, z((1, 1, 3, 8), f)
        o, l = fa2cpu.flash_attention(q, k, v, return_lse=True)
        dq, dk, dv = fa2cpu.flash_attention_backward(o, q, k, v, o, l)
        assert dq.shape == q.shape and (dk == 0).all() and (dv == 0).all()
        print("ok")
    """)
    assert_ok(proc)


# ------------------------------------------------------------------------------ 2: fork

def test_fork_after_use_child_completes():
    proc = run_py("""
        import os, sys, time
        import numpy as np, fa2cpu
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((2, 4, 300, 32), dtype=np.float32) for _ in range(3))
        want = fa2cpu.flash_attention(q, k, v, num_threads=2)
        pid = os.fork()
        if pid == 0:
            try:
                got = fa2cpu.flash_attention(q, k, v, num_threads=2)
                got2 = fa2cpu.flash_attention_with_kvcache(q[:, :, :1].transpose(0, 2, 1, 3).copy(),
                    k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), num_splits=4, num_threads=2)
                os._exit(0 if np.array_equal(got, want) and np.isfinite(got2).all() else 3)
            except BaseException:
                os._exit(4)
        t0 = time.time()
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.time() - t0 > 60:
                os.kill(pid, 9)
                sys.exit("child hung")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(status) == 0, status
        # and the parent keeps working
        assert np.array_equal(fa2cpu.flash_attention(q, k, v, num_threads=2), want)
        print("ok")
    """, timeout=120)
    assert_ok(proc)


def test_multiprocessing_fork_pool_after_use():
    proc = run_py("""
        import multiprocessing as mp
        import numpy as np, fa2cpu
        rng = np.random.default_rng(1)
        q, k, v = (rng.standard_normal((1, 4, 257, 64), dtype=np.float32) for _ in range(3))
        want = fa2cpu.flash_attention(q, k, v, causal=True, num_threads=2)

        def work(i):
            return float(np.abs(fa2cpu.flash_attention(q, k, v, causal=True, num_threads=2) - want).max())

        with mp.get_context("fork").Pool(2) as pool:
            errs = pool.map(work, range(6), chunksize=1)
        assert max(errs) == 0.0, errs
        print("ok")
    """, timeout=180)
    assert_ok(proc)


# ------------------------------------------------------------------------------ 3: out= over index arrays

def test_out_sharing_memory_with_cu_seqlens():
    rng = np.random.default_rng(3)
    Hq, D, lens = 2, 8, [3, 5]
    T = sum(lens)
    q, k, v = (rand(rng, (T, Hq, D)) for _ in range(3))
    buf = np.zeros(T * Hq * D, np.float32)
    cu = buf[:2 * 3].view(np.int64)  # int64 cu_seqlens_q living inside out's memory
    cu[:] = [0, 3, 8]
    want = fa2cpu.flash_attention_varlen(q, k, v, np.array([0, 3, 8]), np.array([0, 3, 8]))
    try:
        got = fa2cpu.flash_attention_varlen(q, k, v, cu, np.array([0, 3, 8]), out=buf.reshape(T, Hq, D))
    except ValueError as e:
        assert "out" in str(e)
        return
    np.testing.assert_array_equal(got, want)


def test_out_sharing_memory_with_block_table():
    rng = np.random.default_rng(4)
    B, Nq, Hq, Hk, D, bs = 2, 1, 4, 2, 16, 4
    kc, vc = rand(rng, (6, bs, Hk, D)), rand(rng, (6, bs, Hk, D))
    q = rand(rng, (B, Nq, Hq, D))
    table = np.array([[5, 1, 3], [0, 2, 4]], np.int32)
    want = fa2cpu.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=11, block_table=table)
    buf = np.zeros(B * Nq * Hq * D, np.float32)
    bt = buf[:6].view(np.int32).reshape(2, 3)  # block_table inside out's memory
    bt[:] = table
    try:
        got = fa2cpu.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=11, block_table=bt,
                                                  out=buf.reshape(B, Nq, Hq, D))
    except ValueError as e:
        assert "out" in str(e)
        return
    np.testing.assert_array_equal(got, want)


def test_out_overlapping_alibi_or_mask_is_refused():
    rng = np.random.default_rng(5)
    q, k, v = (rand(rng, (1, 2, 4, 8)) for _ in range(3))
    buf = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match=arg("out")):
        fa2cpu.flash_attention(q, k, v, alibi_slopes=buf[:2], out=buf.reshape(1, 2, 4, 8))
    with pytest.raises(ValueError, match=arg("out")):
        fa2cpu.flash_attention(q, k, v, mask=buf[:4].reshape(1, 1, 1, 4), out=buf.reshape(1, 2, 4, 8))


# ------------------------------------------------------------------------------ 4 and 10: thread counts

def test_huge_thread_count_under_address_space_limit():
    proc = run_py("""
        import resource
        import numpy as np, fa2cpu
        from fa2cpu import _core
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((2000, 1, 4, 8), dtype=np.float32) for _ in range(3))
        want = fa2cpu.flash_attention(q, k, v, num_threads=1)
        vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))  # 1 GiB more
        for nt in (2000, 2 ** 31, 2 ** 40):
            got = fa2cpu.flash_attention(q, k, v, num_threads=nt)
            assert np.array_equal(got, want)
        assert 0 < _core.pool_threads() <= _core.max_useful_threads(), _core.pool_threads()
        print("ok")
    """)
    assert_ok(proc)


def test_thread_count_is_capped_in_every_entry_point():
    rng = np.random.default_rng(6)
    q, k, v = (rand(rng, (1, 2, 5, 8)) for _ in range(3))
    want = fa2cpu.flash_attention(q, k, v)
    np.testing.assert_array_equal(fa2cpu.flash_attention(q, k, v, num_threads=2 ** 31), want)
    qb, kb, vb = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    got = fa2cpu.flash_attention_with_kvcache(qb, kb, vb, num_threads=2 ** 63, num_splits=2 ** 40)
    np.testing.assert_allclose(got.transpose(0, 2, 1, 3), want, atol=2e-6)
    got = fa2cpu.flash_attention_varlen(q[0].transpose(1, 0, 2), k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2),
                                        [0, 5], [0, 5], num_threads=10 ** 30)
    np.testing.assert_array_equal(got.transpose(1, 0, 2), want[0])
    do = np.ones_like(want)
    _, lse = fa2cpu.flash_attention(q, k, v, return_lse=True)
    g1 = fa2cpu.flash_attention_backward(do, q, k, v, want, lse, num_threads=2 ** 40)
    g2 = fa2cpu.flash_attention_backward(do, q, k, v, want, lse, num_threads=1)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=1e-6)


# ------------------------------------------------------------------------------ 5: > 2**24 keys

NK_BIG = 2 ** 24 + 2  # the last key, 2**24 + 1, is not a float32


def _big_keys(D=1):
    """q = 0 (every score 0), K read through a zero stride, V = position % 7 (64 MiB)."""
    k = np.broadcast_to(np.ones((1, 1, 1, D), np.float32), (1, 1, NK_BIG, D))
    v = (np.arange(NK_BIG) % 7).astype(np.float32).reshape(1, 1, NK_BIG, 1)
    return k, v


def _expected_big(nq, left, slope=0.0):
    """out/lse of row i (bottom-right aligned) seeing keys [diag - left, diag] with bias -slope*dist."""
    outs, lses = [], []
    for i in range(nq):
        diag = i + NK_BIG - nq
        j = np.arange(diag - left, diag + 1)
        w = np.exp(-slope * (diag - j).astype(np.float64))
        outs.append((w * (j % 7)).sum() / w.sum())
        lses.append(np.log(w.sum()))
    return np.array(outs), np.array(lses)


@pytest.mark.parametrize("left", [0, 2, 300])
def test_more_than_2_pow_24_keys_attend_the_right_keys(isa, left):
    k, v = _big_keys()
    nq = 3
    q = np.zeros((1, 1, nq, 1), np.float32)
    slope = np.array([0.25], np.float32)
    for s in (0.0, 0.25):
        kw = dict(alibi_slopes=slope) if s else {}
        out, lse = fa2cpu.flash_attention(q, k, v, window=(left, 0), return_lse=True, **kw)
        want_o, want_l = _expected_big(nq, left, s)
        np.testing.assert_allclose(out[0, 0, :, 0], want_o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse[0, 0], want_l, rtol=1e-5, atol=1e-5)
    # the same through the KV cache (decode, one query) and varlen
    out = fa2cpu.flash_attention_with_kvcache(q[:, :, -1:].transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                                              v.transpose(0, 2, 1, 3), window=(left, 0), num_splits=1)
    np.testing.assert_allclose(out[0, 0, 0, 0], _expected_big(1, left)[0][0], rtol=1e-5)
    cu = np.array([0, NK_BIG])
    out = fa2cpu.flash_attention_varlen(q[0, :, -1:].transpose(1, 0, 2), k[0].transpose(1, 0, 2),
                                        v[0].transpose(1, 0, 2), np.array([0, 1]), cu, window=(left, 0))
    np.testing.assert_allclose(out[0, 0, 0], _expected_big(1, left)[0][0], rtol=1e-5)


# ------------------------------------------------------------------------------ 6: huge windows

HUGE = [(-1, 2 ** 63 - 1), (2 ** 63 - 1, -1), (2 ** 63, 2 ** 63), (2 ** 100, 0), (10 ** 30, 3)]


@pytest.mark.parametrize("window", HUGE)
@pytest.mark.parametrize("nq,nk", [(9, 5), (5, 9), (7, 7)])
def test_huge_window_bounds_equal_unbounded(isa, rng, window, nq, nk):
    q, k, v = rand(rng, (2, 4, nq, 16)), rand(rng, (2, 2, nk, 16)), rand(rng, (2, 2, nk, 16))
    eq = (-1 if window[0] >= nk else window[0], -1 if window[1] >= nq else window[1])
    out, lse = fa2cpu.flash_attention(q, k, v, window=window, return_lse=True)
    want, want_lse = fa2cpu.flash_attention(q, k, v, window=eq, return_lse=True)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    r_out, r_lse = ref.attention_ref(q, k, v, window=eq)
    check_close(out, r_out, "float32")
    do = rand(rng, out.shape)
    g = fa2cpu.flash_attention_backward(do, q, k, v, out, lse, window=window)
    g_eq = fa2cpu.flash_attention_backward(do, q, k, v, out, lse, window=eq)
    for a, b in zip(g, g_eq):
        np.testing.assert_array_equal(a, b)
    # kvcache (with append: nothing may be written before the window is accepted) and varlen
    kc, vc = np.zeros((2, nk + 2, 2, 16), np.float32), np.zeros((2, nk + 2, 2, 16), np.float32)
    o = fa2cpu.flash_attention_with_kvcache(q.transpose(0, 2, 1, 3), kc, vc, k.transpose(0, 2, 1, 3),
                                            v.transpose(0, 2, 1, 3), cache_seqlens=0, window=window)
    np.testing.assert_allclose(o.transpose(0, 2, 1, 3), want, atol=2e-6)
    cu_q, cu_k = np.array([0, nq, 2 * nq]), np.array([0, nk, 2 * nk])
    flat = lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3).reshape(-1, a.shape[1], a.shape[3]))  # noqa: E731
    o = fa2cpu.flash_attention_varlen(flat(q), flat(k), flat(v), cu_q, cu_k, window=window)
    np.testing.assert_allclose(o, flat(want), atol=2e-6)


# ------------------------------------------------------------------------------ 7: NaN with split-KV

def test_nan_query_row_with_split_kv_is_nan(isa, rng):
    B, Hq, Hk, D = 1, 4, 2, 32
    # flash_attention with automatic splits (Nq = 40, Nk = 2000)
    q, k, v = rand(rng, (B, Hq, 40, D)), rand(rng, (B, Hk, 2000, D)), rand(rng, (B, Hk, 2000, D))
    q[0, 1, NAN_ROW, 5] = np.nan
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True)
    assert np.isnan(out[0, 1, NAN_ROW]).all() and np.isnan(lse[0, 1, NAN_ROW])
    good = np.ones(out.shape[:3], bool)
    good[0, 1, NAN_ROW] = False
    r_out, r_lse = ref.attention_ref(np.nan_to_num(q), k, v)
    check_close(out[good], r_out[good], "float32")
    check_close(lse[good], r_lse[good], "float32", "lse")
    # kvcache decode over 4096 keys, automatic and explicit splits
    kc, vc = rand(rng, (B, 4096, Hk, D)), rand(rng, (B, 4096, Hk, D))
    qd = rand(rng, (B, 1, Hq, D))
    qd[0, 0, 2, 0] = np.nan
    for splits in (0, 4):
        out, lse = fa2cpu.flash_attention_with_kvcache(qd, kc, vc, num_splits=splits, return_lse=True)
        assert np.isnan(out[0, 0, 2]).all() and np.isnan(lse[0, 2, 0]), splits
        assert np.isfinite(out[0, 0, [0, 1, 3]]).all() and np.isfinite(lse[0, [0, 1, 3], 0]).all()


# ------------------------------------------------------------------------------ 8: floats beyond float32

@pytest.mark.parametrize("kw,name", [
    (dict(scale=1e39), "scale"), (dict(scale=-3e38), "scale"), (dict(scale=2.5e38), "scale"),
    (dict(softcap=1e39), "softcap"), (dict(softcap=1e-40), "softcap"), (dict(softcap=1e-36, scale=1e3), "softcap"),
])
def test_floats_that_do_not_fit_float32_are_refused(kw, name):
    rng = np.random.default_rng(8)
    q, k, v = (rand(rng, (1, 2, 3, 8)) for _ in range(3))
    with pytest.raises(ValueError, match=arg(name)):
        fa2cpu.flash_attention(q, k, v, **kw)
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=arg(name)):  # the backward applies the same rule
        fa2cpu.flash_attention_backward(out, q, k, v, out, lse, **kw)


@pytest.mark.parametrize("value,dtype", [(3e38, np.float32), (-3e38, np.float32), (3e38, np.float64),
                                         (1e39, np.float64), (-1e300, np.float64)])
def test_additive_mask_beyond_float32_log2_range_is_refused(value, dtype):
    rng = np.random.default_rng(9)
    q, k, v = (rand(rng, (1, 2, 3, 8)) for _ in range(3))
    m = np.zeros((1, 1, 3, 3), dtype)
    m[0, 0, 1, 2] = value
    with pytest.raises(ValueError, match=arg("mask")):
        fa2cpu.flash_attention(q, k, v, mask=m)


def test_large_but_valid_floats_are_exact(isa):
    rng = np.random.default_rng(10)
    q, k, v = (rand(rng, (1, 2, 5, 8)) for _ in range(3))
    m = np.zeros((1, 1, 5, 5), np.float32)
    m[..., 0] = -2e38  # fits after scaling by log2(e): still masks key 0 out
    m[..., 4] = -np.inf
    out = fa2cpu.flash_attention(q, k, v, mask=m)
    check_close(out, ref.attention_ref(q, k, v, mask=m)[0], "float32")
    slopes = np.array([1e30, 2.0], np.float32)
    out = fa2cpu.flash_attention(q, k, v, alibi_slopes=slopes, causal=True)
    check_close(out, ref.attention_ref(q, k, v, alibi_slopes=slopes, causal=True)[0], "float32")
    with pytest.raises(ValueError, match=arg("alibi_slopes")):
        fa2cpu.flash_attention(q, k, v, alibi_slopes=np.array([3e38, 1.0], np.float32))


# ------------------------------------------------------------------------------ 9: nothing written on error

def _cache_case(rng, paged):
    B, Hq, Hk, D = 2, 4, 2, 8
    q = rand(rng, (B, 1, Hq, D))
    kn, vn = rand(rng, (B, 1, Hk, D)), rand(rng, (B, 1, Hk, D))
    if paged:
        kc, vc = rand(rng, (4, 4, Hk, D)), rand(rng, (4, 4, Hk, D))
        extra = dict(block_table=np.array([[3, 1], [0, 2]], np.int32))
    else:
        kc, vc = rand(rng, (B, 8, Hk, D)), rand(rng, (B, 8, Hk, D))
        extra = {}
    return q, kc, vc, kn, vn, extra


BAD_KVCACHE_CALLS = [
    ("v_cache", dict(readonly="v")),
    ("k_cache", dict(readonly="k")),
    ("alibi_slopes", dict(alibi_slopes=np.ones(3, np.float32))),
    ("out", dict(out=np.zeros((2, 1, 4, 9), np.float32))),
    ("scale", dict(scale=1e39)),
    ("softcap", dict(softcap=-1.0)),
    ("window", dict(window=(-2, 0))),
    ("num_splits", dict(num_splits=-1)),
    ("num_threads", dict(num_threads=0)),
    ("cache_seqlens", dict(cache_seqlens=8)),
]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("name,bad", BAD_KVCACHE_CALLS, ids=[b[0] + str(i) for i, b in enumerate(BAD_KVCACHE_CALLS)])
def test_kvcache_errors_leave_caches_byte_identical(name, bad, paged):
    rng = np.random.default_rng(11)
    q, kc, vc, kn, vn, extra = _cache_case(rng, paged)
    bad = dict(bad)
    ro = bad.pop("readonly", None)
    if ro:
        (kc if ro == "k" else vc).flags.writeable = False
    before = kc.tobytes(), vc.tobytes()
    kw = dict(extra, cache_seqlens=3)
    kw.update(bad)
    with pytest.raises((ValueError, TypeError), match=arg(name)):
        fa2cpu.flash_attention_with_kvcache(q, kc, vc, kn, vn, **kw)
    assert (kc.tobytes(), vc.tobytes()) == before


@pytest.mark.parametrize("kw", [dict(num_threads=2 ** 40), dict(num_splits=2 ** 40), dict(window=(2 ** 63, 0)),
                                dict(num_threads=2 ** 31, num_splits=2 ** 63 - 1, window=(-1, 2 ** 64))])
def test_kvcache_extreme_ints_are_accepted_and_exact(kw):
    rng = np.random.default_rng(12)
    q, kc, vc, kn, vn, _ = _cache_case(rng, False)
    kc2, vc2 = kc.copy(), vc.copy()
    out = fa2cpu.flash_attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=3, **kw)
    same = {(2 ** 63, 0): (-1, 0), (-1, 2 ** 64): (-1, -1)}
    plain = {"window": same[kw["window"]]} if "window" in kw else {}
    want = fa2cpu.flash_attention_with_kvcache(q, kc2, vc2, kn, vn, cache_seqlens=3, num_splits=1, **plain)
    np.testing.assert_allclose(out, want, atol=2e-6)
    np.testing.assert_array_equal(kc, kc2)


# ------------------------------------------------------------------------------ 10: exact overlap test

def test_disjoint_interleaved_out_is_accepted(isa):
    rng = np.random.default_rng(13)
    big = rand(rng, (1, 2, 6, 16))
    q = big[..., :8]
    k, v = rand(rng, (1, 2, 6, 8)), rand(rng, (1, 2, 6, 8))
    want = fa2cpu.flash_attention(q.copy(), k, v)
    got = fa2cpu.flash_attention(q, k, v, out=big[..., 8:])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(big[..., 8:], want)
    with pytest.raises(ValueError, match=arg("out")):  # real overlap is still refused
        fa2cpu.flash_attention(big[..., :8], k, v, out=big[..., 4:12])


# ------------------------------------------------------------------------------ 11: k_cache named

def test_kvcache_head_dim_mismatch_names_k_cache():
    rng = np.random.default_rng(14)
    q = rand(rng, (1, 1, 2, 8))
    with pytest.raises(ValueError, match=arg("k_cache")) as info:
        fa2cpu.flash_attention_with_kvcache(q, rand(rng, (1, 4, 2, 16)), rand(rng, (1, 4, 2, 8)))
    assert not str(info.value).startswith("k:")
    with pytest.raises(ValueError, match=arg("v_cache")):
        fa2cpu.flash_attention_with_kvcache(q, rand(rng, (1, 4, 2, 8)), rand(rng, (1, 4, 2, 300)))


# ------------------------------------------------------------------------------ the C++ assertion layer

def test_core_refuses_params_that_break_its_contract():
    from fa2cpu import _core
    q = np.zeros((1, 3, 2, 8), np.float32)
    k = np.zeros((1, 2, 2, 8), np.float32)
    o = np.zeros_like(q)
    base = dict(dtype=0, batch=1, hq=3, hk=2, nq=2, nk=2, scale=1.0, softcap=0.0, win_left=-1, win_right=-1,
                alibi=None, mask=None, mask_kind=0, cu_q=None, cu_k=None, seqlen_k=None, block_table=None,
                block_size=0, num_threads=1, num_splits=0)
    with pytest.raises(ValueError, match="hq must be a multiple of hk"):
        _core.run(q, k, k, o, None, **base)
    big = np.zeros((1, 2, 2, 300), np.float32)
    with pytest.raises(ValueError, match="head dims"):
        _core.run(big, big, big, big.copy(), None, **dict(base, hq=2))
    with pytest.raises(ValueError, match="block_size"):
        _core.run(k, k, k, k.copy(), None, **dict(base, hq=2, block_table=np.zeros((1, 1), np.int32)))
    with pytest.raises(ValueError, match="window"):
        _core.run(k, k, k, k.copy(), None, **dict(base, hq=2, win_left=-5))


# ------------------------------------------------------------------------------ clear messages

def test_python_list_as_q_says_list():
    rng = np.random.default_rng(15)
    k, v = rand(rng, (1, 2, 3, 4)), rand(rng, (1, 2, 3, 4))
    with pytest.raises(TypeError, match=r"q: .*Python list"):
        fa2cpu.flash_attention(np.zeros((1, 2, 3, 4)).tolist(), k, v)
    with pytest.raises(TypeError, match=r"k_cache: .*Python list"):
        fa2cpu.flash_attention_with_kvcache(rand(rng, (1, 1, 2, 4)), [[[[0.0] * 4] * 2] * 3], v)


def test_torch_tensor_points_to_fa2cpu_torch():
    torch = pytest.importorskip("torch")
    q = torch.zeros(1, 2, 3, 4)
    for t in (q, q.bfloat16(), q.requires_grad_()):
        with pytest.raises(TypeError, match=r"q: .*fa2cpu\.torch"):
            fa2cpu.flash_attention(t, t, t)


def test_block_table_int64_is_accepted():
    rng = np.random.default_rng(16)
    q, kc, vc, kn, vn, extra = _cache_case(rng, True)
    want = fa2cpu.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=5, **extra)
    got = fa2cpu.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=5,
                                              block_table=extra["block_table"].astype(np.int64))
    np.testing.assert_array_equal(got, want)
    got = fa2cpu.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=[5, 2], block_table=[[3, 1], [0, 2]])
    want = fa2cpu.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([5, 2], np.int32), **extra)
    np.testing.assert_array_equal(got, want)


def test_import_from_unbuilt_source_checkout_says_how_to_build(tmp_path):
    src = tmp_path / "checkout"
    shutil.copytree(REPO / "fa2cpu", src / "fa2cpu", ignore=shutil.ignore_patterns("*.so", "*.pyd", "_core.cpp",
                                                                                 "__pycache__"))
    shutil.copy(REPO / "setup.py", src / "setup.py")
    # -S: no site-packages, so neither an installed nor an editable fa2cpu can shadow the checkout
    proc = subprocess.run([sys.executable, "-S", "-c", "import fa2cpu"], capture_output=True, text=True,
                          timeout=60, cwd=src)
    assert proc.returncode != 0
    assert "not built" in proc.stderr and "build_ext --inplace" in proc.stderr, proc.stderr
    assert "circular import" not in proc.stderr.splitlines()[-1]


def test_fa2cpu_isa_warning_points_at_the_importing_line(tmp_path):
    script = tmp_path / "user_code.py"
    script.write_text("import warnings\nwarnings.simplefilter('always')\nimport fa2cpu  # line 3\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, FA2CPU_ISA="no-such-family"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "FA2CPU_ISA" in proc.stderr and f"{script}:3" in proc.stderr, proc.stderr
    assert "__init__.py" not in proc.stderr


# ------------------------------------------------------------------------------ threads under load

def test_results_do_not_depend_on_threads_or_a_busy_core(isa, rng):
    """Items are claimed dynamically by whichever thread is running: with a competitor process
    spinning on the cores the answer is still bit-identical to one thread."""
    q, k, v = rand(rng, (2, 4, 130, 32)), rand(rng, (2, 2, 257, 32)), rand(rng, (2, 2, 257, 32))
    one = fa2cpu.flash_attention(q, k, v, causal=True, num_threads=1)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for _ in range(5):
            check_same(fa2cpu.flash_attention(q, k, v, causal=True, num_threads=2), one, "float32", ulps=0)
    finally:
        hog.kill()
        hog.wait()


# ------------------------------------------------------------------------------ session 44's fuzzing

@pytest.mark.parametrize("side", ["q", "k"])
def test_cu_seqlens_whose_differences_wrap_are_refused(side):
    """np.diff of [0, 3 * 2**61, -2**62, 4] wraps to all-positive differences: the check compares
    neighbours instead (before: bad_alloc, a segfault, or a hang in the varlen backward)."""
    proc = run_py(f"""
        import numpy as np, pytest, fa2cpu
        x = np.ones((4, 2, 8), np.float32)
        bad, good = np.array([0, 3 * 2**61, -2**62, 4], np.int64), np.array([0, 1, 2, 4], np.int64)
        cq, ck = (bad, good) if "{side}" == "q" else (good, bad)
        name = "cu_seqlens_{side}"
        with pytest.raises(ValueError, match=name + ": must be non-decreasing"):
            fa2cpu.flash_attention_varlen(x, x, x, cq, ck, num_threads=1)
        out, lse = fa2cpu.flash_attention_varlen(x, x, x, good, good, return_lse=True)
        with pytest.raises(ValueError, match=name + ": must be non-decreasing"):
            fa2cpu.flash_attention_varlen_backward(out, x, x, x, out, lse, cq, ck, num_threads=1)
    """, timeout=60)
    assert_ok(proc)


def test_backward_lse_with_odd_byte_strides_gives_the_same_gradients(rng):
    """An lse whose byte strides are not multiples of 4 (a float32 field of packed records) is
    copied like q / k / v (before: the kernels read it at stride // 4, garbage gradients)."""
    def odd(a):  # the same values at a byte stride of 6 per element
        raw = np.zeros(a.size * 6 + 8, np.uint8)
        st = tuple(6 * int(np.prod(a.shape[i + 1:])) for i in range(a.ndim))
        b = np.ndarray(a.shape, np.float32, buffer=raw, offset=2, strides=st)
        b[...] = a
        return b
    q, k, v = rand(rng, (1, 2, 5, 8)), rand(rng, (1, 1, 5, 8)), rand(rng, (1, 1, 5, 8))
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True)
    dout = rand(rng, out.shape)
    want = fa2cpu.flash_attention_backward(dout, q, k, v, out, lse)
    for got, w in zip(fa2cpu.flash_attention_backward(dout, q, k, v, out, odd(lse)), want):
        np.testing.assert_array_equal(got, w)
    qv, kv, vv = (np.ascontiguousarray(x[0].transpose(1, 0, 2)) for x in (q, k, v))
    cu = np.array([0, 2, 5])
    o, l = fa2cpu.flash_attention_varlen(qv, kv, vv, cu, cu, return_lse=True)
    want = fa2cpu.flash_attention_varlen_backward(o, qv, kv, vv, o, l, cu, cu)
    for got, w in zip(fa2cpu.flash_attention_varlen_backward(o, qv, kv, vv, o, odd(l), cu, cu), want):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("append", [False, True])
def test_paged_capacity_beyond_int64_is_refused_before_writing(append):
    """16 blocks of 2**60 rows (a zero-stride cache) are 2**64 keys: ValueError naming block_table,
    the cache untouched (before: the append was written, then an OverflowError naming nothing)."""
    from numpy.lib.stride_tricks import as_strided
    base = np.zeros((1, 1, 1, 1), np.float32)
    kc, vc = (as_strided(base, shape=(1, 2**60, 1, 1), strides=(0, 0, 0, 4)) for _ in range(2))
    bt = np.zeros((1, 16), np.int32)
    q = np.ones((1, 1, 1, 1), np.float32)
    new = dict(k=np.full((1, 1, 1, 1), 5.0, np.float32), v=np.full((1, 1, 1, 1), 5.0, np.float32)) if append else {}
    # (appending, the zero-stride rows are refused first: test_append_targets_that_alias_...)
    name = arg("k_cache") if append else arg("block_table")
    for extra in ({}, dict(alibi_slopes=np.zeros(1, np.float32))):  # the fast checks, then the full ones
        with pytest.raises(ValueError, match=name):
            fa2cpu.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=5, block_table=bt, num_threads=1,
                                                **new, **extra)
        assert base.ravel()[0] == 0


def test_unaligned_float_mask_is_not_copied_at_full_size(rng):
    """A float32 (Nk,) mask read from packed records (unaligned) is copied at its own size, not at
    the broadcast (B, Hq, Nq, Nk) one (API.md: a mask is never expanded to a full copy)."""
    import tracemalloc
    B, H, N, D = 1, 8, 256, 16
    q, k, v = (rand(rng, (B, H, N, D)) for _ in range(3))
    rec = np.zeros(N, dtype=np.dtype([("tag", "u1"), ("bias", "<f4")], align=False))
    rec["bias"] = rng.standard_normal(N).astype(np.float32)
    rec["bias"][-3:] = -np.inf
    m = rec["bias"]
    assert not m.flags.aligned
    want = fa2cpu.flash_attention(q, k, v, mask=np.ascontiguousarray(m), num_threads=1)
    tracemalloc.start()
    try:
        got = fa2cpu.flash_attention(q, k, v, mask=m, num_threads=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(got, want)
    full = B * H * N * N * 4
    assert peak < full // 4, (peak, full)


@pytest.mark.parametrize("name", ["scale", "softcap"])
def test_float_arguments_given_as_huge_ints_name_the_argument(name):
    q = np.ones((1, 1, 2, 4), np.float32)
    with pytest.raises(ValueError, match=arg(name)):
        fa2cpu.flash_attention(q, q, q, **{name: 10**400})
    with pytest.raises(ValueError, match=arg(name)):
        fa2cpu.flash_attention_with_kvcache(q, q.copy(), q.copy(), **{name: 10**400})


def test_varlen_backward_checks_max_seqlen_like_the_forward():
    x = np.ones((4, 2, 8), np.float32)
    cu = np.array([0, 1, 4])
    out, lse = fa2cpu.flash_attention_varlen(x, x, x, cu, cu, return_lse=True)
    with pytest.raises(ValueError, match=arg("max_seqlen_q")):
        fa2cpu.flash_attention_varlen_backward(out, x, x, x, out, lse, cu, cu, max_seqlen_q=2)
    with pytest.raises(TypeError, match=arg("max_seqlen_k")):
        fa2cpu.flash_attention_varlen_backward(out, x, x, x, out, lse, cu, cu, max_seqlen_k="x")
    fa2cpu.flash_attention_varlen_backward(out, x, x, x, out, lse, cu, cu, max_seqlen_q=3, max_seqlen_k=9)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nonfinite_key_hidden_by_a_bool_mask_stays_out(isa, rng, bad, dtype):
    """A NaN / inf key (garbage in a padding slot) that a bool mask hides reaches no row: the mask
    selects -inf instead of adding it to the score (before: NaN + -inf = NaN in every row). A
    row the mask hides everything from returns 0 / -inf."""
    import ml_dtypes
    dt = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    for nq, nk in ((16, 16), (40, 300), (1, 70)):  # a tile loop, several key tiles, a decode-shaped call
        q, k, v = (rand(rng, s).astype(dt) for s in ((1, 2, nq, 32), (1, 1, nk, 32), (1, 1, nk, 32)))
        hidden = [0, nk // 2, nk - 1]
        k[0, 0, hidden, :] = bad
        m = np.ones((1, 2, nq, nk), bool)
        m[..., hidden] = False
        m[0, 1, 0, :] = False  # a row that sees nothing
        out, lse = fa2cpu.flash_attention(q, k, v, mask=m, return_lse=True)
        r_out, _ = ref.attention_ref(q, np.where(np.isfinite(k.astype(np.float32)), k, 0).astype(dt), v, mask=m)
        assert np.isfinite(out).all() and np.isfinite(lse[0, 0]).all()
        assert (out[0, 1, 0] == 0).all() and lse[0, 1, 0] == -np.inf
        check_close(out, r_out, dtype)


def _hidden_values_case(rng, dt, shape_v, keys, head, bad):
    v = rand(rng, shape_v).astype(dt)
    v[(0, head, keys, 3) if len(shape_v) == 4 else (keys, head, 3)] = bad
    return v


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_nonfinite_value_of_a_hidden_key_reaches_no_other_row(isa, rng, bad, dtype):
    """An inf / NaN in V at a key that causal, a window or a mask hides from some rows reaches only
    the rows that see it (API.md: NaN / inf propagate into the affected rows only). The products
    take P = 0 for hidden keys, and 0 x inf = NaN made rows of the same tile NaN (under causal up to
    ~50 rows before the key, on every family). Rows that see the key get +-inf / NaN in its column,
    as p x v gives for p > 0; the others match the reference on a V without it."""
    import ml_dtypes
    dt = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    for nq, nk, Hq, Hk, D in ((300, 300, 2, 1, 64), (40, 300, 4, 2, 32), (7, 7, 1, 1, 16), (97, 513, 2, 2, 128)):
        q, k = rand(rng, (1, Hq, nq, D)).astype(dt), rand(rng, (1, Hk, nk, D)).astype(dt)
        keys = sorted({0, 5 % nk, nk // 2, nk - 2})
        v = _hidden_values_case(rng, dt, (1, Hk, nk, D), keys, Hk - 1, bad)
        seen = rng.random((1, Hq, nq, nk)) < 0.6
        for kw in (dict(causal=True), dict(window=(10, 5)), dict(mask=seen),
                   dict(mask=np.where(seen, rand(rng, seen.shape), -np.inf).astype(np.float32))):
            out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True, **kw)
            r_out, r_lse = ref.attention_ref(q, k, v, **kw)
            check_close(out, r_out, dtype)
            check_close(lse, r_lse, dtype, what="lse")
            vis = ref.visible_band(nq, nk, causal=kw.get("causal", False), window=kw.get("window", (-1, -1)))
            for h in range(Hq):
                m = vis & (seen[0, h] if "mask" in kw else True)
                sees = m[:, keys].any(axis=1) if h // (Hq // Hk) == Hk - 1 else np.zeros(nq, bool)
                assert np.isfinite(out[0, h][~sees].astype(np.float32)).all(), (kw.keys(), h)
                assert not np.isfinite(out[0, h, sees, 3].astype(np.float32)).any(), (kw.keys(), h)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_value_of_a_hidden_key_varlen_and_kvcache(isa, rng, bad):
    """The same through varlen and a KV cache (chunked prefill rows under causal: contiguous and
    paged, a float8 NaN code or an int8 row's non-finite scale, with and without split-KV)."""
    import ml_dtypes
    from test_kvcache_quant import dequantize, paged, quantize
    dt = ml_dtypes.bfloat16
    # varlen: two sequences, the bad value in the second, keys hidden from its first rows
    cu = np.array([0, 70, 250])
    q, k = rand(rng, (250, 4, 32)).astype(dt), rand(rng, (250, 2, 32)).astype(dt)
    v = _hidden_values_case(rng, dt, (250, 2, 32), [71, 200], 1, bad)
    out = fa2cpu.flash_attention_varlen(q, k, v, cu, cu, causal=True)
    check_close(out, ref.varlen_ref(q, k, v, cu, cu, causal=True)[0], "bfloat16")
    assert np.isfinite(out[:71].astype(np.float32)).all() and np.isfinite(out[72:200, :2].astype(np.float32)).all()
    # KV cache: 5 new rows per sequence; key lens - 2 hidden from the first 3 of them
    B, cap, Hq, Hk, D, nq = 2, 320, 4, 2, 32, 5
    lens = np.array([200, 150], np.int32)
    qc = rand(rng, (B, nq, Hq, D)).astype(dt)
    floats = rand(rng, (B, cap, Hk, D)).astype(dt), rand(rng, (B, cap, Hk, D)).astype(dt)
    for kind in ("bf16", "int8", "fp8"):
        if kind == "bf16":
            kc, vc = (x.copy() for x in floats)
            ks = vs = None
            vc[0, lens[0] - 2, 1, 3] = bad
            kf, vf = kc, vc
        else:
            code = "int8" if kind == "int8" else "fp8"
            (kc, ks), (vc, vs) = (quantize(x.astype(np.float32), code) for x in floats)
            if kind == "int8":
                vs[0, lens[0] - 2, 1] = bad
            else:
                vc.view(np.uint8)[0, lens[0] - 2, 1, 3] = 0x7F
            kf, vf = dequantize(kc, ks), dequantize(vc, vs)
        r_out = ref.kvcache_ref(qc, kf, vf, cache_seqlens=lens, causal=True)[0]
        for block_size in (None, 16):
            pk, pv, pks, pvs, table = kc, vc, ks, vs, None
            if block_size:
                t_seed = int(rng.integers(1 << 30))
                pk, table = paged(np.random.default_rng(t_seed), kc, block_size)
                pv, _ = paged(np.random.default_rng(t_seed), vc, block_size)
                if ks is not None:
                    pks, _ = paged(np.random.default_rng(t_seed), ks, block_size)
                    pvs, _ = paged(np.random.default_rng(t_seed), vs, block_size)
            for splits in (1, 3):
                out = fa2cpu.flash_attention_with_kvcache(qc, pk, pv, cache_seqlens=lens, block_table=table,
                                                          causal=True, num_splits=splits, k_scale=pks, v_scale=pvs)
                check_close(out, r_out, "bfloat16", what=f"{kind} block {block_size} splits {splits}")
                assert np.isfinite(out[0, :3].astype(np.float32)).all() and np.isfinite(out[1].astype(np.float32)).all()
                assert not np.isfinite(out[0, 3:, 2:, 3].astype(np.float32)).any()


@pytest.mark.parametrize("which", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_nonfinite_input_of_a_hidden_pair_reaches_no_other_gradient(isa, rng, which, bad, dtype):
    """The backward's side of the rule above: an inf / NaN in q or dout (a row) or in k (a key)
    reaches only the gradients of pairs causal / the window lets see each other. The updates take
    P = dS = 0 for hidden pairs, and 0 x inf = NaN made dK / dV of keys a bad row never sees
    (and dQ of rows that never see a bad key) NaN, on every family. Checked against the
    reference, whose products leave hidden pairs out the same way."""
    import ml_dtypes
    dt = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    for nq, nk, Hq, Hk, D, kw in ((300, 300, 2, 1, 64, dict(causal=True)), (40, 300, 4, 2, 32, dict(causal=True)),
                                   (200, 200, 2, 2, 128, dict(window=(30, 7))), (7, 7, 1, 1, 16, dict(causal=True))):
        q, do = rand(rng, (1, Hq, nq, D)).astype(dt), rand(rng, (1, Hq, nq, D)).astype(dt)
        k, v = rand(rng, (1, Hk, nk, D)).astype(dt), rand(rng, (1, Hk, nk, D)).astype(dt)
        x = {"q": q, "k": k, "v": v, "dout": do}[which]
        at = (x.shape[2] * 2) // 5
        x[0, x.shape[1] - 1, at, 3] = bad
        out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True, **kw)
        grads = fa2cpu.flash_attention_backward(do, q, k, v, out, lse, **kw)
        refs = ref.attention_backward_ref(do, q, k, v, **kw)
        for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
            check_close(g, r, dtype, what=f"{name} ({which}, {nq}x{nk}, {kw})")
        if which in ("q", "dout"):  # keys the bad row cannot see keep finite dK / dV
            vis = ref.visible_band(nq, nk, causal=kw.get("causal", False), window=kw.get("window", (-1, -1)))
            unseen = ~vis[at]
            for g in grads[1:]:
                assert np.isfinite(g[0, Hk - 1, unseen].astype(np.float32)).all(), (which, kw)


@pytest.mark.parametrize("which", ["q", "k", "dout"])
def test_nonfinite_input_of_a_hidden_pair_varlen_backward(isa, rng, which):
    """The same through the varlen backward (rows and keys found through cu_seqlens): two
    sequences, a NaN in the second, causal; each sequence against the reference."""
    import ml_dtypes
    dt = ml_dtypes.bfloat16
    cu = np.array([0, 70, 250])
    q, do = rand(rng, (250, 4, 32)).astype(dt), rand(rng, (250, 4, 32)).astype(dt)
    k, v = rand(rng, (250, 2, 32)).astype(dt), rand(rng, (250, 2, 32)).astype(dt)
    {"q": q, "k": k, "dout": do}[which][150, 3 if which != "k" else 1, 5] = np.nan
    out, lse = fa2cpu.flash_attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)
    grads = fa2cpu.flash_attention_varlen_backward(do, q, k, v, out, lse, cu, cu, causal=True)
    for a, z in zip(cu[:-1], cu[1:]):
        t = lambda x: x[a:z].transpose(1, 0, 2)
        refs = ref.attention_backward_ref(t(do), t(q), t(k), t(v), causal=True)
        for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
            check_close(t(g), r, "bfloat16", what=f"{name} ({which}, rows {a}:{z})")


def test_append_targets_that_alias_are_refused_before_writing():
    """An append into a writable zero-stride cache (rows shared between sequences), into one array
    given as both caches, or into one array given as both scales: ValueError, nothing written."""
    from numpy.lib.stride_tricks import as_strided
    q, kn, vn = (np.ones((2, 1, 1, 8), np.float32) for _ in range(3))
    base = np.zeros((1, 4, 1, 8), np.float32)
    kc = as_strided(base, shape=(2, 4, 1, 8), strides=(0,) + base.strides[1:])
    for extra in ({}, dict(alibi_slopes=np.zeros(1, np.float32))):  # the fast checks, then the full ones
        with pytest.raises(ValueError, match=arg("k_cache") + ": axis 0 has stride 0"):
            fa2cpu.flash_attention_with_kvcache(q, kc, np.zeros((2, 4, 1, 8), np.float32), kn, vn, cache_seqlens=0,
                                                **extra)
        cache = np.zeros((2, 4, 1, 8), np.float32)
        with pytest.raises(ValueError, match=arg("v_cache") + ": the same memory as k_cache"):
            fa2cpu.flash_attention_with_kvcache(q, cache, cache[:], kn, vn, cache_seqlens=0, **extra)
        codes, s = np.zeros((2, 4, 1, 8), np.int8), np.zeros((2, 4, 1), np.float32)
        with pytest.raises(ValueError, match=arg("v_scale") + ": the same memory as k_scale"):
            fa2cpu.flash_attention_with_kvcache(q, codes, codes.copy(), kn, vn, cache_seqlens=0, k_scale=s,
                                                v_scale=s, **extra)
        assert not base.any() and not cache.any() and not codes.any() and not s.any()


def test_loose_option_and_array_types_are_refused():
    """A window as a set / dict / generator (no order to trust), a non-bool return_lse, and masked
    arrays (whose mask the kernels would ignore) are refused, naming the argument."""
    x = np.ones((1, 1, 4, 8), np.float32)
    for window in ({3, 5}, {3: 0, 5: 0}, (w for w in (3, 5))):
        with pytest.raises(ValueError, match=arg("window")):
            fa2cpu.flash_attention(x, x, x, window=window)
    np.testing.assert_array_equal(fa2cpu.flash_attention(x, x, x, window=np.array([1, 0])),
                                  fa2cpu.flash_attention(x, x, x, window=[1, 0]))
    for call in (lambda: fa2cpu.flash_attention(x, x, x, return_lse="no"),
                 lambda: fa2cpu.flash_attention_with_kvcache(x, x.copy(), x.copy(), return_lse=1),
                 lambda: fa2cpu.flash_attention_varlen(x[0, 0, :, None], x[0, 0, :, None], x[0, 0, :, None],
                                                       np.array([0, 4]), np.array([0, 4]), return_lse=None)):
        with pytest.raises(TypeError, match=arg("return_lse")):
            call()
    assert len(fa2cpu.flash_attention(x, x, x, return_lse=np.bool_(True))) == 2
    with pytest.raises(TypeError, match=arg("k") + ": got a numpy.ma.MaskedArray"):
        fa2cpu.flash_attention(x, np.ma.masked_array(x, mask=x > 2), x)
    with pytest.raises(TypeError, match=arg("mask") + ": got a numpy.ma.MaskedArray"):
        fa2cpu.flash_attention(x, x, x, mask=np.ma.masked_array(np.ones((4, 4), bool)))


def test_import_failure_of_a_built_checkout_keeps_its_own_message(tmp_path):
    """A built checkout whose import fails for another reason (here: no NumPy, `python -S`) reports
    that reason, not "not built"."""
    src = tmp_path / "checkout"
    shutil.copytree(REPO / "fa2cpu", src / "fa2cpu", ignore=shutil.ignore_patterns("*.so", "_core.cpp", "__pycache__"))
    shutil.copy(REPO / "setup.py", src / "setup.py")
    built = list(pathlib.Path(fa2cpu.__file__).parent.glob("_core*.so"))  # the imported package's, wherever it is
    assert built
    shutil.copy(built[0], src / "fa2cpu" / built[0].name)
    proc = subprocess.run([sys.executable, "-S", "-c", "import fa2cpu"], capture_output=True, text=True,
                          timeout=60, cwd=src)
    assert proc.returncode != 0
    assert "not built" not in proc.stderr and "numpy" in proc.stderr, proc.stderr


def test_append_targets_overlapping_in_part_are_refused_interleaved_ones_accepted():
    q, kn, vn = (np.ones((2, 1, 1, 8), np.float32) for _ in range(3))
    base = np.zeros((2, 5, 1, 8), np.float32)
    with pytest.raises(ValueError, match=arg("v_cache") + ": the same memory as k_cache"):
        fa2cpu.flash_attention_with_kvcache(q, base[:, 0:4], base[:, 1:5], kn, vn, cache_seqlens=0)
    assert not base.any()
    kv = np.zeros((2, 4, 2, 8), np.float32)  # (B, N, k / v, D): disjoint, interleaved
    fa2cpu.flash_attention_with_kvcache(q, kv[:, :, 0:1], kv[:, :, 1:2], kn, vn + 1, cache_seqlens=0)
    assert (kv[:, 0, 0] == 1).all() and (kv[:, 0, 1] == 2).all()
