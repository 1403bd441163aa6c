"""fa2cpu.flash_attention_with_kvcache: contiguous and paged caches, append-then-attend, splits,
long decode, GQA, hostile inputs (nothing written on error), concurrent decode threads."""

import threading
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

import fa2cpu
from conftest import DTYPES, NP_DTYPES, arg, check_close, check_same, rand, ref, run_python

_REF_SKIP = ("num_splits", "num_threads", "out", "return_lse")


def assert_bytes_equal(a, b, what):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{what} bytes differ"


def make_cache(rng, B, cap, Hk, D, Dv, dtype, block_size=None, spare_blocks=3):
    """A contiguous cache (B, cap, Hk, D|Dv), or the same content paged with shuffled blocks."""
    kc, vc = rand(rng, (B, cap, Hk, D), dtype), rand(rng, (B, cap, Hk, Dv), dtype)
    if block_size is None:
        return kc, vc, None
    assert cap % block_size == 0
    per = cap // block_size
    nblocks = B * per + spare_blocks
    table = rng.permutation(nblocks)[:B * per].reshape(B, per).astype(np.int32)
    kp, vp = rand(rng, (nblocks, block_size, Hk, D), dtype), rand(rng, (nblocks, block_size, Hk, Dv), dtype)
    for b in range(B):
        for j in range(per):
            kp[table[b, j]] = kc[b, j * block_size:(j + 1) * block_size]
            vp[table[b, j]] = vc[b, j * block_size:(j + 1) * block_size]
    return kp, vp, table


def check_kv(q, kc, vc, k, v, dtype, **kw):
    """Call with return_lse; compare out/lse to the oracle, the caches to the expected bytes, and
    check cache_seqlens was not modified. Returns (out, lse)."""
    seqlens = kw.get("cache_seqlens")
    seqlens_before = None if seqlens is None else np.array(seqlens, copy=True)
    opts = {a: b for a, b in kw.items() if a not in _REF_SKIP}
    exp_k, exp_v = ref.kvcache_update_ref(kc, vc, k, v, cache_seqlens=kw.get("cache_seqlens"),
                                          block_table=kw.get("block_table"))
    r_out, r_lse = ref.kvcache_ref(q, kc, vc, k, v, **opts)
    out, lse = fa2cpu.flash_attention_with_kvcache(q, kc, vc, k, v, return_lse=True, **kw)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    check_close(out, r_out, dtype)
    check_close(lse, r_lse, dtype, "lse")
    assert_bytes_equal(kc, exp_k, "k_cache")
    assert_bytes_equal(vc, exp_v, "v_cache")
    if seqlens_before is not None:
        np.testing.assert_array_equal(np.asarray(seqlens), seqlens_before, "cache_seqlens modified")
    return out, lse


# ------------------------------------------------------------------------------ contiguous / paged

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [None, 16, 64], ids=["contiguous", "paged16", "paged64"])
@pytest.mark.parametrize("nnew", [0, 1, 5], ids=["read", "append1", "append5"])
def test_cache_attend(isa, rng, dtype, block_size, nnew):
    B, cap, Hq, Hk, D = 3, 320, 8, 2, 64
    kc, vc, table = make_cache(rng, B, cap, Hk, D, D, dtype, block_size)
    lens = np.array([0, 129, cap - 7], np.int32)
    Nq = max(nnew, 1)
    q = rand(rng, (B, Nq, Hq, D), dtype)
    k = v = None
    if nnew:
        k, v = rand(rng, (B, nnew, Hk, D), dtype), rand(rng, (B, nnew, Hk, D), dtype)
    check_kv(q, kc, vc, k, v, dtype, cache_seqlens=lens, block_table=table, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_equals_contiguous(isa, rng, dtype):
    B, cap, Hq, Hk, D, Dv = 2, 256, 4, 2, 80, 48
    seed = int(rng.integers(1 << 30))
    kc, vc, _ = make_cache(np.random.default_rng(seed), B, cap, Hk, D, Dv, dtype)
    kp, vp, table = make_cache(np.random.default_rng(seed), B, cap, Hk, D, Dv, dtype, block_size=32)
    q = rand(rng, (B, 3, Hq, D), dtype)
    kn, vn = rand(rng, (B, 3, Hk, D), dtype), rand(rng, (B, 3, Hk, Dv), dtype)
    lens = np.array([100, 253], np.int32)
    a = check_kv(q, kc, vc, kn, vn, dtype, cache_seqlens=lens, causal=True)
    b = check_kv(q, kp, vp, kn, vn, dtype, cache_seqlens=lens, block_table=table, causal=True)
    # The decode routes read paged tiles block by block (kTilesEndAtBlocks; blocks of >= 16 keys
    # as runs of one tile, smaller ones as tiles of their own), so the running max may move at
    # other keys than in the contiguous cache's 256-key tiles: rounding of the same order as a
    # different thread count (test_threads.py), not bit equality. Measured on the avx2 route (200
    # seeds, block sizes 16/32/64, tiles ending at blocks): at most 6.2 ulps (check_same's measure).
    check_same(a[0], b[0], dtype, ulps=8, what="out paged vs contiguous")
    check_same(a[1], b[1], "float32", ulps=8, what="lse paged vs contiguous")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 17, 24, 31, 100, 300])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(causal=True, window=(70, 0))], ids=["causal", "window"])
def test_paged_tiles_spanning_blocks(isa, rng, dtype, block_size, opts):
    """Paged tiles of the decode routes span whole blocks of 16-31 keys (one run each, tile_loop.h;
    longer blocks are tiles of their own): block sizes that do not divide the 256-key tile, a
    window starting inside a block (the first tile then ends at its block), GQA items spanning
    kv heads, decode and a short chunk."""
    B, Hq, Hk, D, Dv = 2, 8, 4, 64, 40
    cap = block_size * (700 // block_size + 1)
    kc, vc, table = make_cache(rng, B, cap, Hk, D, Dv, dtype, block_size)
    lens = np.array([cap - 5, 3 * block_size // 2], np.int32)
    for nq in (1, 3):
        q = rand(rng, (B, nq, Hq, D), dtype)
        check_kv(q, kc, vc, None, None, dtype, cache_seqlens=lens, block_table=table, **opts)


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_blocks(isa, rng, dtype):
    """Two sequences share their prefix blocks (prefix caching); read-only attention over both."""
    bs, Hq, Hk, D = 16, 4, 1, 64
    kp, vp = rand(rng, (10, bs, Hk, D), dtype), rand(rng, (10, bs, Hk, D), dtype)
    table = np.array([[3, 7, 1, 0], [3, 7, 5, 2], [3, 3, 3, 3]], np.int32)
    lens = np.array([50, 64, 40], np.int32)
    q = rand(rng, (3, 2, Hq, D), dtype)
    check_kv(q, kp, vp, None, None, dtype, cache_seqlens=lens, block_table=table, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_append_then_read_back(isa, rng, dtype):
    """Append token by token (decode loop); every step's cache equals the reference cache, and
    a final read-only call over the grown cache equals attention over all appended tokens."""
    B, cap, Hk, Hq, D = 2, 48, 2, 4, 32
    for block_size in (None, 8):
        kc, vc, table = make_cache(rng, B, cap, Hk, D, D, dtype, block_size)
        lens = np.array([3, 10], np.int32)
        start = lens.copy()
        hist_k, hist_v = [], []
        for step in range(6):
            q = rand(rng, (B, 1, Hq, D), dtype)
            k, v = rand(rng, (B, 1, Hk, D), dtype), rand(rng, (B, 1, Hk, D), dtype)
            hist_k.append(k)
            hist_v.append(v)
            check_kv(q, kc, vc, k, v, dtype, cache_seqlens=lens, block_table=table)
            lens = lens + 1
        # read back the appended rows through the block table
        allk, allv = np.concatenate(hist_k, 1), np.concatenate(hist_v, 1)
        for b in range(B):
            pos = np.arange(start[b], start[b] + 6)
            if table is None:
                got_k, got_v = kc[b, pos], vc[b, pos]
            else:
                got_k, got_v = kc[table[b, pos // 8], pos % 8], vc[table[b, pos // 8], pos % 8]
            assert_bytes_equal(got_k, allk[b], "appended k")
            assert_bytes_equal(got_v, allv[b], "appended v")
        q = rand(rng, (B, 2, Hq, D), dtype)
        check_kv(q, kc, vc, None, None, dtype, cache_seqlens=lens, block_table=table, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_seqlens_forms(isa, rng, dtype):
    """cache_seqlens as an int, as an array, or absent (full capacity)."""
    B, cap, Hq, Hk, D = 2, 70, 2, 2, 16
    kc, vc, _ = make_cache(rng, B, cap, Hk, D, D, dtype)
    q = rand(rng, (B, 1, Hq, D), dtype)
    check_kv(q, kc, vc, None, None, dtype)
    check_kv(q, kc, vc, None, None, dtype, cache_seqlens=33)
    a = fa2cpu.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=33)
    b = fa2cpu.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([33, 33], np.int32))
    np.testing.assert_array_equal(a.astype(np.float64), b.astype(np.float64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_cache_rows(isa, rng, dtype):
    """cache_seqlens 0 and nothing appended: every row sees no key -> 0 and -inf, no NaN."""
    kc, vc, _ = make_cache(rng, 2, 32, 1, 16, 16, dtype)
    q = rand(rng, (2, 3, 2, 16), dtype)
    out, lse = check_kv(q, kc, vc, None, None, dtype, cache_seqlens=np.array([0, 5], np.int32))
    assert np.all(out[0].astype(np.float64) == 0) and np.all(lse[0] == -np.inf)
    assert np.isfinite(out[1].astype(np.float64)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [None, 16], ids=["contiguous", "paged"])
def test_num_splits_equal(isa, rng, dtype, block_size):
    B, cap, Hq, Hk, D = 2, 1040, 8, 2, 64
    kc, vc, table = make_cache(rng, B, cap, Hk, D, D, dtype, block_size)
    lens = np.array([1031, 200], np.int32)
    q = rand(rng, (B, 1, Hq, D), dtype)
    res = {}
    for s in (0, 1, 3, 7):
        res[s] = check_kv(q, kc, vc, None, None, dtype, cache_seqlens=lens, block_table=table, num_splits=s)
    for s in (0, 3, 7):
        check_same(res[s][0], res[1][0], dtype, ulps=4, what=f"out num_splits={s}")
        check_same(res[s][1], res[1][1], "float32", ulps=4, what=f"lse num_splits={s}")


@pytest.mark.parametrize("splits", [2, 3, 5, 8, 13, 16, 17, 33])
def test_split_merge_tree(isa, rng, splits):
    """Split-KV partials joined by the merge tree (driver.cpp): every tree shape (a missing right
    child at some level), rows that see no key in some splits (a causal 150-row chunk: the last
    splits' keys are invisible to its first rows), a NaN row, sinks (one -inf); against the
    reference, and the same bits for 1, 2 and 3 threads (which thread joins a node must not
    matter)."""
    cases = [  # (Nq, Hq, Hk, options): decode with GQA and sinks; a causal chunk with a window
        (1, 8, 2, dict(sinks=np.array([0.5, -1.0, -np.inf, 2.0, 0.0, 1.5, -3.0, 4.0], np.float32))),
        (150, 2, 2, dict(causal=True, window=(1700, 0))),
    ]
    for nq, hq, hk, opts in cases:
        kc, vc, _ = make_cache(rng, 2, 2200, hk, 64, 48, "float32")
        lens = np.array([2200 - nq, 1400 - nq], np.int32)
        q = rand(rng, (2, nq, hq, 64))
        q[1, nq // 2, hq - 1, 7] = np.nan
        r_out, r_lse = ref.kvcache_ref(np.nan_to_num(q), kc, vc, cache_seqlens=lens, **opts)
        got = {}
        for threads in (1, 2, 3):
            got[threads] = fa2cpu.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits,
                                                               num_threads=threads, return_lse=True, **opts)
        out, lse = got[1]
        assert np.isnan(out[1, nq // 2, hq - 1]).all() and np.isnan(lse[1, hq - 1, nq // 2])
        good = np.ones(out.shape[:3], bool)
        good[1, nq // 2, hq - 1] = False
        check_close(out[good], r_out[good], "float32")
        check_close(lse.transpose(0, 2, 1)[good], r_lse.transpose(0, 2, 1)[good], "float32", "lse")
        for threads in (2, 3):
            assert_bytes_equal(got[threads][0], out, f"out, {threads} threads vs 1")
            assert_bytes_equal(got[threads][1], lse, f"lse, {threads} threads vs 1")


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_decode_gqa(isa, rng, dtype):
    B, cap, Hq, Hk, D = 2, 4112, 8, 2, 128
    for block_size in (None, 16):
        kc, vc, table = make_cache(rng, B, cap, Hk, D, D, dtype, block_size)
        lens = np.array([4099, 2500], np.int32)
        q = rand(rng, (B, 1, Hq, D), dtype)
        kn, vn = rand(rng, (B, 1, Hk, D), dtype), rand(rng, (B, 1, Hk, D), dtype)
        check_kv(q, kc, vc, kn, vn, dtype, cache_seqlens=lens, block_table=table)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opts", [
    dict(window=(64, 0)), dict(softcap=4.0), dict(alibi_slopes="h"), dict(alibi_slopes="bh"),
    dict(scale=0.3), dict(causal=True, window=(40, -1), softcap=6.0, alibi_slopes="bh"),
], ids=lambda o: "-".join(f"{a}={b}" for a, b in o.items()))
def test_options(isa, rng, dtype, opts):
    B, cap, Hq, Hk, D = 2, 256, 4, 1, 32
    opts = dict(opts)
    if opts.get("alibi_slopes") == "h":
        opts["alibi_slopes"] = (rng.random(Hq) * 0.2).astype(np.float32)
    elif opts.get("alibi_slopes") == "bh":
        opts["alibi_slopes"] = (rng.random((B, Hq)) * 0.2).astype(np.float32)
    for block_size in (None, 32):
        kc, vc, table = make_cache(rng, B, cap, Hk, D, D, dtype, block_size)
        q = rand(rng, (B, 4, Hq, D), dtype)
        kn, vn = rand(rng, (B, 4, Hk, D), dtype), rand(rng, (B, 4, Hk, D), dtype)
        check_kv(q, kc, vc, kn, vn, dtype, cache_seqlens=np.array([17, 200], np.int32), block_table=table,
                 **opts)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_cache_and_out(isa, rng, dtype):
    """The cache is a view of a larger buffer (appends must go through its strides); out= is used."""
    B, Hq, Hk, D = 2, 4, 2, 32
    big_k, big_v = rand(rng, (B, 200, Hk, D), dtype), rand(rng, (B, 200, Hk, D), dtype)
    kc, vc = big_k[:, :100], big_v[:, 50:150]
    before_k, before_v = big_k.copy(), big_v.copy()
    q = rand(rng, (B, 2, Hq, D), dtype)
    kn, vn = rand(rng, (B, 2, Hk, D), dtype), rand(rng, (B, 2, Hk, D), dtype)
    lens = np.array([10, 98], np.int32)
    exp_k, exp_v = ref.kvcache_update_ref(kc, vc, kn, vn, cache_seqlens=lens)
    r_out, _ = ref.kvcache_ref(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True)
    out = np.full((B, 2, Hq, D), 9, NP_DTYPES[dtype])
    res = fa2cpu.flash_attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True, out=out)
    assert res is out
    check_close(out, r_out, dtype)
    assert_bytes_equal(kc, exp_k, "k_cache view")
    assert_bytes_equal(vc, exp_v, "v_cache view")
    assert_bytes_equal(big_k[:, 100:], before_k[:, 100:], "outside the k_cache view")
    assert_bytes_equal(big_v[:, :50], before_v[:, :50], "outside the v_cache view")
    assert_bytes_equal(big_v[:, 150:], before_v[:, 150:], "outside the v_cache view")


# ------------------------------------------------------------------------------ hostile inputs

def _small(paged=False, dtype="float32"):
    rng = np.random.default_rng(5)
    B, cap, Hq, Hk, D = 2, 32, 2, 1, 8
    kc, vc, table = make_cache(rng, B, cap, Hk, D, D, dtype, 8 if paged else None)
    q = rand(rng, (B, 1, Hq, D), dtype)
    kn, vn = rand(rng, (B, 3, Hk, D), dtype), rand(rng, (B, 3, Hk, D), dtype)
    return q, kc, vc, kn, vn, table


def _expect_error(exc, name, q, kc, vc, kn, vn, **kw):
    """The call raises exc naming `name` (or one of a tuple of names); nothing was written."""
    names = name if isinstance(name, tuple) else (name,)
    saved = kc.copy(), vc.copy()
    lens = kw.get("cache_seqlens")
    lens_saved = None if lens is None else np.array(lens, copy=True)
    out = np.full((q.shape[0], q.shape[1], q.shape[2], vc.shape[3]), 7, q.dtype)
    with pytest.raises(exc, match="|".join(arg(n) for n in names)):
        fa2cpu.flash_attention_with_kvcache(q, kc, vc, kn, vn, out=out, **kw)
    assert_bytes_equal(kc, saved[0], "k_cache after error")
    assert_bytes_equal(vc, saved[1], "v_cache after error")
    assert np.all(out.astype(np.float64) == 7), "out written before the error"
    if lens_saved is not None:
        np.testing.assert_array_equal(np.asarray(lens), lens_saved)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_overflow_leaves_cache_untouched(paged, dtype):
    q, kc, vc, kn, vn, table = _small(paged, dtype)
    # sequence 0 fits, sequence 1 would need 31 + 3 > 32: nothing may be written, not even for seq 0
    _expect_error(ValueError, "cache_seqlens", q, kc, vc, kn, vn,
                  cache_seqlens=np.array([2, 31], np.int32), block_table=table)
    _expect_error(ValueError, "cache_seqlens", q, kc, vc, kn, vn, cache_seqlens=30, block_table=table)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("lens", [[-1, 3], [3, 33], [3, 2 ** 31 - 1], [-(2 ** 31), 0]], ids=str)
def test_bad_cache_seqlens(paged, lens):
    q, kc, vc, kn, vn, table = _small(paged)
    cs = np.array(lens, np.int32)
    _expect_error(ValueError, "cache_seqlens", q, kc, vc, kn, vn, cache_seqlens=cs, block_table=table)
    _expect_error(ValueError, "cache_seqlens", q, kc, vc, None, None, cache_seqlens=cs, block_table=table)


def test_bad_cache_seqlens_shape_and_dtype():
    q, kc, vc, kn, vn, _ = _small()
    _expect_error(ValueError, "cache_seqlens", q, kc, vc, kn, vn, cache_seqlens=np.array([1, 2, 3], np.int32))
    _expect_error(ValueError, "cache_seqlens", q, kc, vc, kn, vn, cache_seqlens=-1)
    _expect_error((TypeError, ValueError), "cache_seqlens", q, kc, vc, kn, vn,
                  cache_seqlens=np.array([1.0, 2.0]))


@pytest.mark.parametrize("bad", [-1, 11, 2 ** 31 - 1], ids=["negative", "num_blocks", "huge"])
def test_block_table_out_of_range(bad):
    q, kc, vc, kn, vn, table = _small(paged=True)
    assert kc.shape[0] == 11  # 2 * 4 blocks + 3 spare
    t = table.copy()
    t[1, 1] = bad  # a block that sequence 1 uses (positions 8..15)
    _expect_error(ValueError, "block_table", q, kc, vc, kn, vn, cache_seqlens=np.array([4, 12], np.int32),
                  block_table=t)
    _expect_error(ValueError, "block_table", q, kc, vc, None, None, cache_seqlens=np.array([4, 12], np.int32),
                  block_table=t)


def test_block_table_shape_and_dtype():
    q, kc, vc, kn, vn, table = _small(paged=True)
    lens = np.array([4, 12], np.int32)
    _expect_error(ValueError, "block_table", q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table[:1])
    _expect_error(ValueError, "block_table", q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table[0])
    _expect_error((TypeError, ValueError), "block_table", q, kc, vc, kn, vn, cache_seqlens=lens,
                  block_table=table.astype(np.float32))


def test_new_kv_errors():
    q, kc, vc, kn, vn, _ = _small()
    lens = np.array([1, 2], np.int32)
    _expect_error(ValueError, "k", q, kc, vc, kn[..., :4], vn, cache_seqlens=lens)
    _expect_error(ValueError, "v", q, kc, vc, kn, vn[:, :2], cache_seqlens=lens)
    _expect_error(ValueError, "v", q, kc, vc, kn, None, cache_seqlens=lens)
    _expect_error(TypeError, "k", q, kc, vc, kn.astype(np.float16), vn, cache_seqlens=lens)
    _expect_error(TypeError, "k_cache", q, kc.astype(np.float16), vc, None, None, cache_seqlens=lens)
    _expect_error(ValueError, "v_cache", q, kc, vc[:, :5], None, None, cache_seqlens=lens)
    _expect_error(ValueError, ("q", "k_cache"), q[..., :5], kc, vc, None, None, cache_seqlens=lens)


def test_readonly_cache_with_append():
    q, kc, vc, kn, vn, _ = _small()
    kc.flags.writeable = False
    _expect_error(ValueError, "k_cache", q, kc, vc, kn, vn, cache_seqlens=np.array([1, 2], np.int32))


def test_readonly_and_broadcast_cache_without_append(isa):
    """Reading needs no write access: a read-only or np.broadcast_to cache works without k/v."""
    rng = np.random.default_rng(9)
    kc, vc, _ = make_cache(rng, 2, 64, 2, 16, 16, "float32")
    q = rand(rng, (2, 1, 4, 16))
    lens = np.array([10, 50], np.int32)
    kr = kc.copy()
    kr.flags.writeable = False
    check_kv(q, kr, vc, None, None, "float32", cache_seqlens=lens)
    kb = np.broadcast_to(kc[:1], kc.shape)
    check_kv(q, kb, vc, None, None, "float32", cache_seqlens=lens)
    kn, vn = rand(rng, (2, 1, 2, 16)), rand(rng, (2, 1, 2, 16))
    _expect_error(ValueError, "k_cache", q, kb, vc, kn, vn, cache_seqlens=lens)


@pytest.mark.parametrize("n", [0, -1])
def test_bad_num_threads_and_splits(n):
    q, kc, vc, kn, vn, _ = _small()
    lens = np.array([1, 2], np.int32)
    _expect_error(ValueError, "num_threads", q, kc, vc, kn, vn, cache_seqlens=lens, num_threads=n)
    if n < 0:
        _expect_error(ValueError, "num_splits", q, kc, vc, kn, vn, cache_seqlens=lens, num_splits=n)


# ------------------------------------------------------------------------------ concurrency

@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_concurrent_decode_threads(isa, paged):
    """8 Python threads each run a decode loop on their own cache at the same time."""
    n, steps, B, cap, Hq, Hk, D = 8, 4, 2, 512, 4, 2, 64
    rng = np.random.default_rng(7)
    states = []
    for i in range(n):
        kc, vc, table = make_cache(rng, B, cap, Hk, D, D, "float32", 32 if paged else None)
        lens0 = np.array([50 * i + 1, 400 - 30 * i], np.int32)
        qs = [rand(rng, (B, 1, Hq, D)) for _ in range(steps)]
        ks = [rand(rng, (B, 1, Hk, D)) for _ in range(steps)]
        vs = [rand(rng, (B, 1, Hk, D)) for _ in range(steps)]
        states.append(dict(kc=kc, vc=vc, table=table, lens0=lens0, qs=qs, ks=ks, vs=vs,
                           init=(kc.copy(), vc.copy())))
    barrier = threading.Barrier(n)

    def run(st):
        barrier.wait()
        outs = []
        for s in range(steps):
            outs.append(fa2cpu.flash_attention_with_kvcache(
                st["qs"][s], st["kc"], st["vc"], st["ks"][s], st["vs"][s], cache_seqlens=st["lens0"] + s,
                block_table=st["table"], num_threads=1 + (s % 2)))
        return outs

    with ThreadPoolExecutor(n) as ex:
        results = list(ex.map(run, states))
    for st, outs in zip(states, results):
        kc, vc = st["init"]
        for s in range(steps):
            lens = st["lens0"] + s
            r_out, _ = ref.kvcache_ref(st["qs"][s], kc, vc, st["ks"][s], st["vs"][s], cache_seqlens=lens,
                                       block_table=st["table"])
            check_close(outs[s], r_out, "float32")
            kc, vc = ref.kvcache_update_ref(kc, vc, st["ks"][s], st["vs"][s], cache_seqlens=lens,
                                            block_table=st["table"])
        assert_bytes_equal(st["kc"], kc, "k_cache")
        assert_bytes_equal(st["vc"], vc, "v_cache")


@pytest.mark.parametrize("paged", [False, True])
def test_pytorch_order_cache_with_layout_bhsd(isa, rng, paged):
    """layout='bhsd': q (B, Hq, Nq, D), caches (B|blocks, Hk, rows, D), k/v (B, Hk, Nnew, D), out
    (B, Hq, Nq, Dv): the same numbers as the flash-attn order, appended in place."""
    B, Nq, Hq, Hk, D, Dv = 2, 3, 4, 2, 16, 8
    q = rand(rng, (B, Nq, Hq, D))
    if paged:
        kc, vc = rand(rng, (5, 8, Hk, D)), rand(rng, (5, 8, Hk, Dv))
        extra = dict(block_table=np.array([[4, 0], [2, 1]], np.int32))
    else:
        kc, vc = rand(rng, (B, 16, Hk, D)), rand(rng, (B, 16, Hk, Dv))
        extra = {}
    kn, vn = rand(rng, (B, 2, Hk, D)), rand(rng, (B, 2, Hk, Dv))
    T = lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3))  # noqa: E731
    kc_t, vc_t = T(kc), T(vc)
    want, want_lse = fa2cpu.flash_attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=[5, 9], causal=True,
                                                         return_lse=True, **extra)
    out = np.empty((B, Hq, Nq, Dv), np.float32)
    got, lse = fa2cpu.flash_attention_with_kvcache(T(q), kc_t, vc_t, T(kn), T(vn), cache_seqlens=[5, 9], causal=True,
                                                   return_lse=True, layout="bhsd", out=out, **extra)
    assert got is out
    np.testing.assert_array_equal(got, T(want))
    np.testing.assert_array_equal(lse, want_lse)
    np.testing.assert_array_equal(kc_t, T(kc))
    np.testing.assert_array_equal(vc_t, T(vc))


def test_pytorch_order_cache_without_layout_mentions_layout():
    rng = np.random.default_rng(0)
    q = rand(rng, (1, 1, 4, 8))
    with pytest.raises(ValueError, match="layout='bhsd'"):
        fa2cpu.flash_attention_with_kvcache(q, rand(rng, (1, 2, 64, 8)), rand(rng, (1, 2, 64, 8)))
    with pytest.raises(ValueError, match=arg("layout")):
        fa2cpu.flash_attention_with_kvcache(q, rand(rng, (1, 64, 2, 8)), rand(rng, (1, 64, 2, 8)), layout="bnhd")


# ------------------------------------------------------------------------------ lean validator

def _same_problem_field(name, lean, full):
    if isinstance(full, np.ndarray):
        assert isinstance(lean, np.ndarray), name
        assert lean.shape == full.shape and lean.dtype == full.dtype, name
        if name in ("q", "k", "v", "k_scale", "v_scale"):  # views of the caller's arrays: same memory and strides
            assert lean.strides == full.strides and lean.ctypes.data == full.ctypes.data, name
        elif name != "out":  # out: each call allocated its own
            assert np.array_equal(lean, full), name
    else:
        assert lean == full and type(lean) is type(full), (name, lean, full)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", ["int", "array", "none", "append", "options", "out", "int8", "fp8-append"])
@pytest.mark.parametrize("batch", [1, 3])
def test_lean_validator_matches_full_checks(layout, paged, case, batch):
    """The decode path's lean validator (also fa2cpu.torch's) takes the common case and describes
    exactly the launch and append the full checks describe."""
    from fa2cpu._validate import kvcache_problem, kvcache_problem_lean
    rng = np.random.default_rng(0)
    Hq, Hk, D, Dv, cap, Nq = 4, 2, 16, 8, 64, 2
    kc, vc, table = make_cache(rng, batch, cap, Hk, D, Dv, "float32", block_size=16 if paged else None)
    q = rand(rng, (batch, Nq, Hq, D), "float32")
    k = v = out = None
    seqlens = {"array": np.array([40, 3, 17][:batch], np.int32), "none": None}.get(case, 40)  # None: full capacity
    options = dict(causal=False, scale=None, window=(-1, -1), softcap=None)
    k_scale = v_scale = None
    if case in ("int8", "fp8-append"):  # a quantized cache: codes + float32 scales (B|blocks, N, Hk)
        code = np.int8 if case == "int8" else ml_dtypes.float8_e4m3fn
        kc, vc = (np.clip(a * 40, -127, 127).astype(code) for a in (kc, vc))
        k_scale, v_scale = (np.abs(rand(rng, a.shape[:-1], "float32")) for a in (kc, vc))
    if case in ("append", "fp8-append"):
        k, v = rand(rng, (batch, 3, Hk, D), "float32"), rand(rng, (batch, 3, Hk, Dv), "float32")
    elif case == "options":
        options = dict(causal=True, scale=0.3, window=(5, 1000), softcap=20.0)
    elif case == "out":
        out = np.empty((batch, Nq, Hq, Dv), np.float32)
    if layout == "bhsd":
        swap = (lambda a: None if a is None else np.ascontiguousarray(a.transpose(0, 2, 1, 3)))
        q, kc, vc, k, v, out = map(swap, (q, kc, vc, k, v, out))
        k_scale, v_scale = (None if a is None else np.ascontiguousarray(a.transpose(0, 2, 1)) for a in (k_scale, v_scale))
    args = (q, kc, vc, k, v, seqlens, table, options["causal"], options["scale"], options["window"],
            options["softcap"])
    tail = (0, 1, out, layout)
    lean = kvcache_problem_lean(*args, *tail, k_scale, v_scale)
    assert lean is not None, "the common case left the lean path"
    full = kvcache_problem(*args, None, *tail, k_scale, v_scale)
    for field, lean_value, full_value in zip(full[0]._fields, lean[0], full[0]):
        _same_problem_field(field, lean_value, full_value)
    assert lean[1].shape == full[1].shape and (out is None or lean[1] is out and full[1] is out)
    assert (lean[2] is None) == (full[2] is None)
    if full[2] is not None:
        for field, lean_value, full_value in zip(full[2]._fields, lean[2], full[2]):
            if field == "start":
                assert np.array_equal(lean_value, full_value)
            elif full_value is None:  # a float cache has no scales
                assert lean_value is None, field
            else:
                assert lean_value.shape == full_value.shape and lean_value.strides == full_value.strides
                assert lean_value.ctypes.data == full_value.ctypes.data, field


_WIDEN_CHILD = """
import sys
import ml_dtypes, numpy as np, fa2cpu
fa2cpu.set_isa("avx2")
rng = np.random.default_rng(7)
res = {}
# (D, Dv, Hq, Hk, keys, num_splits): head dims with whole 16-feature blocks, an 8-feature step and
# a ragged tail; one-head groups (Hq / Hk = 4) and groups spanning heads (6 / 1, 2 / 1).
for i, (D, Dv, Hq, Hk, n, s) in enumerate([(40, 57, 8, 2, 300, 0), (128, 128, 8, 2, 700, 3), (23, 8, 6, 1, 33, 0),
                                            (96, 104, 2, 1, 129, 2), (16, 48, 4, 4, 5, 0)]):
    q = rng.standard_normal((2, 1, Hq, D)).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((2, n, Hk, D)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((2, n, Hk, Dv)).astype(ml_dtypes.bfloat16)
    out = fa2cpu.flash_attention_with_kvcache(q, k, v, num_splits=s)
    res.update({f"q{i}": q.astype(np.float32), f"k{i}": k.astype(np.float32), f"v{i}": v.astype(np.float32),
                f"o{i}": out.astype(np.float32)})
np.savez(sys.argv[1], **res)
"""


@pytest.mark.skipif("avx2" not in fa2cpu.available_isas(), reason="the avx2 family does not run on this CPU")
@pytest.mark.parametrize("widen", ["split", "zext"])
def test_avx2_bf16_cache_widen_forms(tmp_path, widen):
    """Both widenings of the avx2 family's bf16 cache decode (gemm_decode_avx2.h Avx2Bf16Decode: the
    CPU's vendor picks one per process, FA2CPU_AVX2_BF16_WIDEN forces it) against the float64
    reference, on head dims that cut the split form's 16-feature blocks (it keeps q and O permuted
    per whole block) and with split-KV partials (which read O back through the same layout)."""
    path = tmp_path / "widen.npz"
    res = run_python(_WIDEN_CHILD, path, env={"FA2CPU_AVX2_BF16_WIDEN": widen, "FA2CPU_ISA": None})
    assert res.returncode == 0, res.stderr[-3000:]
    got = np.load(path)
    for i in range(5):
        q, k, v = (got[f"{x}{i}"].astype(ml_dtypes.bfloat16) for x in "qkv")
        check_close(got[f"o{i}"], ref.kvcache_ref(q, k, v)[0], "bfloat16", what=f"case {i} ({widen})")
