"""Quantized KV caches (API.md, "Quantized cache"): int8 and float8_e4m3fn codes with per-(token,
head) float32 scales, contiguous and paged, read by every family's decode and tile loops and
compared with the float64 reference on the dequantized cache (code * scale); the quantizing
append's exact rounding rule; errors that leave caches and scales byte-identical."""

import ml_dtypes
import numpy as np
import pytest

import fa2cpu
from conftest import DTYPES, arg, check_close, rand, ref, run_python
from test_kvcache import assert_bytes_equal

F8 = np.dtype(ml_dtypes.float8_e4m3fn)
CODES = {"int8": (np.dtype(np.int8), 127.0), "fp8": (F8, 448.0)}


def quantize(x, code, with_scales=True):
    """API.md's rule, written out independently of the library: per (token, head) row, in float32,
    scale = max|x| / limit, code = round(x / scale) (int8: half to even; float8: to nearest even,
    saturating), a row of zeros gets scale 0 and codes 0."""
    dt, limit = CODES[code]
    x = np.asarray(x, np.float32)
    if not with_scales:
        return np.clip(x, -limit, limit).astype(dt), None
    scale = (np.abs(x).max(axis=-1) / np.float32(limit)).astype(np.float32)
    codes = np.zeros(x.shape, dt)
    nz = scale > 0
    y = x[nz] / scale[nz][:, None]
    codes[nz] = np.clip(np.rint(y) if dt == np.int8 else y, -limit, limit).astype(dt)
    return codes, scale


def dequantize(codes, scale):
    values = codes.astype(np.float64)
    return values if scale is None else values * scale.astype(np.float64)[..., None]


def paged(rng, kc, block_size, spare=3):
    """The contiguous (B, cap, ...) array `kc` spread over shuffled blocks of `block_size` rows."""
    B, cap = kc.shape[:2]
    per = cap // block_size
    table = rng.permutation(B * per + spare)[:B * per].reshape(B, per).astype(np.int32)
    out = np.zeros((B * per + spare, block_size) + kc.shape[2:], kc.dtype)
    for b in range(B):
        for j in range(per):
            out[table[b, j]] = kc[b, j * block_size:(j + 1) * block_size]
    return out, table


def quant_cache(rng, B, cap, Hk, D, Dv, code, with_scales=True, block_size=None, table_rng=None):
    """(k_cache, v_cache, k_scale, v_scale, block_table) holding quantized random values."""
    kc, ks = quantize(rand(rng, (B, cap, Hk, D)) * 2, code, with_scales)
    vc, vs = quantize(rand(rng, (B, cap, Hk, Dv)), code, with_scales)
    if block_size is None:
        return kc, vc, ks, vs, None
    t_seed = int(rng.integers(1 << 30))
    kc, table = paged(np.random.default_rng(t_seed), kc, block_size)
    vc, _ = paged(np.random.default_rng(t_seed), vc, block_size)
    if with_scales:
        ks, _ = paged(np.random.default_rng(t_seed), ks, block_size)
        vs, _ = paged(np.random.default_rng(t_seed), vs, block_size)
    return kc, vc, ks, vs, table


def check_quant(q, kc, vc, ks, vs, k, v, dtype, **kw):
    """One call with return_lse against the float64 reference on the dequantized caches (after
    the expected append); the caches and scales must hold exactly the expected codes."""
    code = "int8" if kc.dtype == np.int8 else "fp8"
    exp = []
    for cache, scale, new in ((kc, ks, k), (vc, vs, v)):
        c, s = cache.copy(), None if scale is None else scale.copy()
        if new is not None:
            codes, scales = quantize(new, code, scale is not None)
            lens = np.broadcast_to(np.asarray(kw["cache_seqlens"]), (q.shape[0],))
            table = kw.get("block_table")
            bs = cache.shape[1]
            for b in range(q.shape[0]):
                for t in range(new.shape[1]):
                    pos = int(lens[b]) + t
                    blk, row = (b, pos) if table is None else (table[b, pos // bs], pos % bs)
                    c[blk, row] = codes[b, t]
                    if s is not None:
                        s[blk, row] = scales[b, t]
        exp.append((c, s))
    (ek, eks), (ev, evs) = exp
    lens = kw.get("cache_seqlens")
    nnew = 0 if k is None else k.shape[1]
    r_opts = {a: b for a, b in kw.items() if a not in ("num_splits", "num_threads", "cache_seqlens", "block_table")}
    r_out, r_lse = ref.kvcache_ref(q, dequantize(ek, eks), dequantize(ev, evs),
                                   cache_seqlens=None if lens is None else np.asarray(lens) + nnew,
                                   block_table=kw.get("block_table"), **r_opts)
    out, lse = fa2cpu.flash_attention_with_kvcache(q, kc, vc, k, v, k_scale=ks, v_scale=vs, return_lse=True, **kw)
    check_close(out, r_out, dtype)
    check_close(lse, r_lse, dtype, "lse")
    assert_bytes_equal(kc, ek, "k_cache")
    assert_bytes_equal(vc, ev, "v_cache")
    if ks is not None:
        assert_bytes_equal(ks, eks, "k_scale")
        assert_bytes_equal(vs, evs, "v_scale")
    return out


# ------------------------------------------------------------------------------ numerics

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("code", ["int8", "fp8"])
@pytest.mark.parametrize("block_size", [None, 16, 64], ids=["contiguous", "paged16", "paged64"])
@pytest.mark.parametrize("nq,nnew", [(1, 0), (1, 1), (7, 7), (40, 0)], ids=["decode", "decode+append", "chunk7", "prefill40"])
def test_quantized_cache(isa, rng, dtype, code, block_size, nq, nnew):
    B, cap, Hq, Hk, D = 3, 320, 8, 2, 64
    kc, vc, ks, vs, table = quant_cache(rng, B, cap, Hk, D, D, code, block_size=block_size)
    lens = np.array([0, 129, cap - 7 - nnew], np.int32)
    q = rand(rng, (B, nq, Hq, D), dtype)
    k = v = None
    if nnew:
        k, v = rand(rng, (B, nnew, Hk, D), dtype), rand(rng, (B, nnew, Hk, D), dtype)
    check_quant(q, kc, vc, ks, vs, k, v, dtype, cache_seqlens=lens, block_table=table, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("code", ["int8", "fp8"])
@pytest.mark.parametrize("block_size", [17, 31, 100])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(causal=True, window=(70, 0))], ids=["causal", "window"])
def test_quantized_tiles_spanning_blocks(isa, rng, dtype, code, block_size, opts):
    """Paged quantized tiles spanning whole blocks of 16-31 keys (one run each; odd runs pair their
    last key with itself in the int16 route), and tiles of one block (100), a window starting
    inside a block, GQA 4 and 2."""
    B, Hq, Hk, D, Dv = 2, 8, 4, 64, 72
    cap = block_size * (700 // block_size + 1)
    kc, vc, ks, vs, table = quant_cache(rng, B, cap, Hk, D, Dv, code, block_size=block_size)
    lens = np.array([cap - 5, 3 * block_size // 2], np.int32)
    for nq, hq in ((1, Hq), (2, 2 * Hk)):
        q = rand(rng, (B, nq, hq, D), dtype)
        check_quant(q, kc, vc, ks, vs, None, None, dtype, cache_seqlens=lens, block_table=table, **opts)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("code", ["int8", "fp8"])
@pytest.mark.parametrize("cap", [1, 7, 255, 256, 257, 521])
@pytest.mark.parametrize("D,Dv", [(128, 128), (1, 17), (96, 40), (33, 250)])
def test_tile_edges(isa, rng, code, cap, D, Dv, dtype):
    """Capacities around the decode route's 256-key tile and primes (odd key counts: the bf16
    decode's key pairs); head dims off the 16 / 32 lanes; GQA 6/3 (rows of a group span kv heads)."""
    B, Hq, Hk = 2, 6, 3
    kc, vc, ks, vs, _ = quant_cache(rng, B, cap, Hk, D, Dv, code)
    for nq in (1, 3, 17):
        q = rand(rng, (B, nq, Hq, D), dtype)
        check_quant(q, kc, vc, ks, vs, None, None, dtype, cache_seqlens=np.array([cap, cap // 2], np.int32))


@pytest.mark.parametrize("splits", [1, 0, 3])
@pytest.mark.parametrize("code", ["int8", "fp8"])
def test_splits(isa, rng, code, splits):
    """Split-KV (flash-decoding) over a long quantized cache, B=1: the merge sees dequantized partials."""
    B, cap, Hq, Hk, D = 1, 4100, 8, 2, 64
    kc, vc, ks, vs, _ = quant_cache(rng, B, cap, Hk, D, D, code)
    q = rand(rng, (B, 1, Hq, D))
    check_quant(q, kc, vc, ks, vs, None, None, "float32", cache_seqlens=cap, num_splits=splits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("code", ["int8", "fp8"])
@pytest.mark.parametrize("Hq,Hk", [(4, 2), (8, 2), (6, 3)])
def test_shared_head_storage_keeps_per_head_scales(isa, rng, code, dtype, Hq, Hk):
    """kv heads that share their codes (head stride 0: np.broadcast_to) but not their scales: each
    query row is scaled by its own head's K and V scales, also where one row group (4 rows) spans
    heads whose K/V rows are the same memory."""
    B, cap, D = 2, 70, 32
    kc1, vc1, _, _, _ = quant_cache(rng, B, cap, 1, D, D, code)
    kc, vc = (np.broadcast_to(a, (B, cap, Hk, D)) for a in (kc1, vc1))
    ks = rng.uniform(0.01, 0.04, (B, cap, Hk)).astype(np.float32)  # codes x scale ~ N(0, 1), as quantize gives
    vs = (rng.uniform(0.01, 0.02, (B, cap, 1)) * np.arange(1, Hk + 1)).astype(np.float32)  # heads differ
    q = rand(rng, (B, 1, Hq, D), dtype)
    check_quant(q, kc, vc, ks, vs, None, None, dtype, cache_seqlens=np.array([cap, 33], np.int32))


def test_float8_without_scales(isa, rng):
    """float8 caches need no scales (scale 1); appended values are converted directly, saturating."""
    B, cap, Hq, Hk, D = 2, 64, 4, 1, 32
    kc, vc, ks, vs, _ = quant_cache(rng, B, cap, Hk, D, D, "fp8", with_scales=False)
    assert ks is None and vs is None
    q = rand(rng, (B, 2, Hq, D))
    k, v = rand(rng, (B, 2, Hk, D)) * 300, rand(rng, (B, 2, Hk, D)) * 300  # some beyond +-448
    check_quant(q, kc, vc, None, None, k, v, "float32", cache_seqlens=10)
    assert np.abs(kc[:, 10:12].astype(np.float32)).max() == 448.0


def test_bhsd_layout(isa, rng):
    """layout='bhsd': caches (B, Hk, Ncap, D) and scales (B, Hk, Ncap), same results as bshd."""
    B, cap, Hq, Hk, D = 2, 100, 4, 2, 32
    kc, vc, ks, vs, _ = quant_cache(rng, B, cap, Hk, D, D, "int8")
    q = rand(rng, (B, 1, Hq, D))
    k, v = rand(rng, (B, 1, Hk, D)), rand(rng, (B, 1, Hk, D))
    args = [a.copy() for a in (kc, vc, ks, vs)]
    want = fa2cpu.flash_attention_with_kvcache(q, *args[:2], k, v, k_scale=args[2], v_scale=args[3], cache_seqlens=50)
    t = [np.ascontiguousarray(np.swapaxes(a, 1, 2)) for a in (kc, vc, ks, vs)]
    got = fa2cpu.flash_attention_with_kvcache(np.swapaxes(q, 1, 2), t[0], t[1], np.swapaxes(k, 1, 2),
                                              np.swapaxes(v, 1, 2), k_scale=t[2], v_scale=t[3], cache_seqlens=50,
                                              layout="bhsd")
    np.testing.assert_array_equal(np.swapaxes(got, 1, 2), want)
    for a, b in zip(t, args):
        np.testing.assert_array_equal(np.swapaxes(a, 1, 2), b)


def test_quantize_rule_exact(rng):
    """The append writes exactly API.md's codes and scales: the element of largest magnitude gets
    code +-127 (+-448), every value is within half a code step, a zero row gets scale 0, codes 0."""
    B, cap, Hk, D = 2, 8, 3, 16
    for code in ("int8", "fp8"):
        dt, limit = CODES[code]
        kc, vc = np.zeros((B, cap, Hk, D), dt), np.zeros((B, cap, Hk, D), dt)
        ks, vs = np.full((B, cap, Hk), -1, np.float32), np.full((B, cap, Hk), -1, np.float32)
        k = rand(rng, (B, 2, Hk, D)) * 3
        k[0, 1, 2] = 0.0
        v = rand(rng, (B, 2, Hk, D))
        q = rand(rng, (B, 1, Hk, D))
        fa2cpu.flash_attention_with_kvcache(q, kc, vc, k, v, k_scale=ks, v_scale=vs, cache_seqlens=3)
        codes, scales = quantize(k, code)
        assert_bytes_equal(kc[:, 3:5], codes, "codes")
        assert_bytes_equal(ks[:, 3:5], scales, "scales")
        assert ks[0, 4, 2] == 0 and not kc[0, 4, 2].astype(np.float32).any()
        assert (ks[:, :3] == -1).all() and (ks[:, 5:] == -1).all()  # nothing else written
        got = kc[:, 3:5].astype(np.float32)
        nz = ks[:, 3:5] > 0
        assert (np.abs(got).max(axis=-1)[nz] == limit).all()
        err = np.abs(got * ks[:, 3:5, :, None] - k)
        step = ks[:, 3:5, :, None] * (0.5 if code == "int8" else 2.0 ** -4 * np.maximum(np.abs(got), 2.0 ** -6))
        assert (err <= step * (1 + 1e-6) + 1e-30).all()


def test_nan_code_propagates(isa, rng):
    """A float8 NaN code (S.1111.111) makes the rows that see it NaN, as a NaN in a float cache would."""
    B, cap, Hq, Hk, D = 1, 40, 2, 1, 16
    kc, vc, _, _, _ = quant_cache(rng, B, cap, Hk, D, D, "fp8", with_scales=False)
    vc.view(np.uint8)[0, 5, 0, 3] = 0x7F
    for nq in (1, 20):
        out = fa2cpu.flash_attention_with_kvcache(rand(rng, (B, nq, Hq, D)), kc, vc, cache_seqlens=cap)
        assert np.isnan(out[..., 3]).all()


# ---------------------------------------------- int8 cache, 16-bit queries: the int16 products
# On the AVX-512 families an int8 cache read by bf16 / fp16 queries takes int16 dot products
# (gemm_decode.h, Q16DecodeGemm<I8Int16Codes>; vpdpwssd, or vpmaddwd + vpaddd without
# AVX512-VNNI): q rounded to int16 per row, P x v_scale per (row, tile). Its
# error (~2^-15 of a row's largest value) is far inside TOL, so these tests bound it more tightly
# than TOL would: a weight or q kept at 8 bits, or a lost tile, would show at this bound (the
# other families run the same checks on their float32 route).
TIGHT = {"float16": dict(atol=2e-3, rtol=2e-3), "bfloat16": dict(atol=8e-3, rtol=8e-3)}


def check_lse_bound(lse, r_lse, q, k, table=None):
    """|LSE error| <= the error q's rounding to 2^-15 of its row's max |q| can cause: every score
    moves by at most 2^-15 * max|q_row| * sum_d |k_cd| * D^-1/2 (plus float32 rounding)."""
    if table is not None:  # paged K: its blocks in sequence order
        k = np.stack([np.concatenate(list(k[table[b]]), axis=0) for b in range(table.shape[0])])
    qmax = np.abs(q.astype(np.float64)).max(axis=-1)                  # (B, Nq, Hq)
    kl1 = np.abs(k).sum(axis=-1).max(axis=1)                          # (B, Hk)
    group = q.shape[2] // k.shape[2]
    bound = 2.0 ** -15 * qmax * np.repeat(kl1, group, axis=1)[:, None, :] / np.sqrt(q.shape[-1])
    bound = np.moveaxis(bound, 1, 2)                                  # (B, Hq, Nq) as lse
    err = np.abs(lse.astype(np.float64) - r_lse)
    assert (err <= bound + 1e-5 * (1 + np.abs(r_lse))).all(), f"lse error {err.max():.3g} > bound"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "paged16"])
@pytest.mark.parametrize("Hq,Hk", [(32, 8), (6, 6), (6, 2)], ids=["gqa4", "mha", "gqa3"])
@pytest.mark.parametrize("D,Dv,cap", [(128, 128, 600), (72, 40, 255), (256, 256, 257), (16, 100, 1)])
def test_int16_products_precision(isa, rng, dtype, layout, Hq, Hk, D, Dv, cap):
    B = 2
    block = 16 if layout == "paged16" else None
    cap_alloc = -(-cap // 16) * 16 if block else cap
    kc, vc, ks, vs, table = quant_cache(rng, B, cap_alloc, Hk, D, Dv, "int8", block_size=block)
    q = rand(rng, (B, 1, Hq, D), dtype, scale=2.0)
    lens = np.array([cap, max(1, cap // 3)], np.int32)
    r_out, r_lse = ref.kvcache_ref(q, dequantize(kc, ks), dequantize(vc, vs), cache_seqlens=lens, block_table=table)
    if layout == "bhsd":
        kc, vc, ks, vs = (np.ascontiguousarray(np.swapaxes(a, 1, 2)) for a in (kc, vc, ks, vs))
        out, lse = fa2cpu.flash_attention_with_kvcache(np.swapaxes(q, 1, 2), kc, vc, k_scale=ks, v_scale=vs,
                                                       cache_seqlens=lens, return_lse=True, layout="bhsd")
        out = np.swapaxes(out, 1, 2)  # lse is (B, H, Nq) in both layouts
    else:
        out, lse = fa2cpu.flash_attention_with_kvcache(q, kc, vc, k_scale=ks, v_scale=vs, cache_seqlens=lens,
                                                       block_table=table, return_lse=True)
    np.testing.assert_allclose(out.astype(np.float64), r_out, **TIGHT[dtype])
    check_lse_bound(lse, r_lse, q, dequantize(kc if layout != "bhsd" else np.swapaxes(kc, 1, 2),
                                              ks if layout != "bhsd" else np.swapaxes(ks, 1, 2)), table)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_int16_products_extremes(isa, rng, dtype):
    """The int32 sums' worst case (D = 256, every code -128 or 127, q at its largest code) stays
    exact; a q row or a score far below the others (tiny weights in a tile) keeps its accuracy;
    a NaN in one q row makes that row NaN and leaves the others alone."""
    B, cap, Hq, Hk, D = 1, 300, 4, 1, 256
    kc = np.full((B, cap, Hk, D), -128, np.int8)
    kc[:, ::2] = 127
    vc = rng.integers(-128, 128, (B, cap, Hk, D)).astype(np.int8)
    ks = np.full((B, cap, Hk), 1e-3, np.float32)
    vs = (rng.random((B, cap, Hk)) * 1e-2).astype(np.float32)
    q = rand(rng, (B, 1, Hq, D), dtype)
    q[0, 0, 0] = np.full(D, 1.5, q.dtype)           # every product at the bound
    q[0, 0, 1] = (rand(rng, (D,)) * 1e-30).astype(q.dtype)  # tiny scores
    q[0, 0, 2, 5] = np.nan
    r_out, r_lse = ref.kvcache_ref(q, dequantize(kc, ks), dequantize(vc, vs))
    out, lse = fa2cpu.flash_attention_with_kvcache(q, kc, vc, k_scale=ks, v_scale=vs, return_lse=True)
    assert np.isnan(out[0, 0, 2]).all() and np.isnan(lse[0, 2, 0])
    keep = [0, 1, 3]
    np.testing.assert_allclose(out[0, 0, keep].astype(np.float64), r_out[0, 0, keep], **TIGHT[dtype])
    check_lse_bound(lse[:, keep], r_lse[:, keep], q[:, :, keep], dequantize(kc, ks))


_AVX512_I8_CHILD = """
import sys
import ml_dtypes, numpy as np, fa2cpu
fa2cpu.set_isa("avx512")
got = np.load(sys.argv[1])
qdtype = ml_dtypes.bfloat16 if str(got["qdtype"]) == "bfloat16" else np.float16
res = {}
for i in range(int(got["n"])):
    a = {x: got[f"{x}{i}"] for x in ("q", "kc", "vc", "ks", "vs", "lens")}
    table = got[f"table{i}"] if f"table{i}" in got else None
    out, lse = fa2cpu.flash_attention_with_kvcache(a["q"].view(qdtype), a["kc"], a["vc"], k_scale=a["ks"],
                                                   v_scale=a["vs"], cache_seqlens=a["lens"], block_table=table,
                                                   num_splits=int(got[f"splits{i}"]), return_lse=True)
    res[f"o{i}"], res[f"l{i}"] = out.astype(np.float32), lse
np.savez(sys.argv[2], **res)
"""


@pytest.mark.skipif("avx512" not in fa2cpu.available_isas(), reason="the avx512 family does not run on this CPU")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_avx512_int8_decode_forms(tmp_path, rng, dtype):
    """The avx512 family's int8-cache decode for 16-bit q (gemm_decode.h I8Decode16Loop): int16
    products by vpdpwssd where the CPU has AVX512-VNNI, else by vpmaddwd + vpaddd (FA2CPU_I8_DECODE=madd
    forces it), or the float32 route (FA2CPU_I8_DECODE=float); the form is read once per process,
    hence child processes. Every form against the float64 reference at the int16 route's tight
    bound, on head dims with 32-feature tails, one-head and head-spanning groups, paged blocks and
    splits; the two int16 forms give the same bits (exact int32 sums) and the float32 route other
    bits (else the switch did nothing)."""
    cases = [(2, 300, 8, 2, 128, 128, None, 0), (1, 80, 6, 1, 72, 40, 16, 3), (2, 513, 4, 4, 256, 256, None, 2),
             (1, 5, 2, 1, 16, 100, None, 0)]
    inp = {"n": np.array(len(cases)), "qdtype": np.array(dtype)}
    refs = []
    for i, (B, cap, Hq, Hk, D, Dv, block, splits) in enumerate(cases):
        kc, vc, ks, vs, table = quant_cache(rng, B, cap, Hk, D, Dv, "int8", block_size=block)
        q = rand(rng, (B, 1, Hq, D), dtype, scale=2.0)
        lens = (np.arange(B, dtype=np.int32) * (cap // 3) + cap - B + 1).clip(1, cap).astype(np.int32)
        k = dequantize(kc, ks)
        refs.append((q, k, table, ref.kvcache_ref(q, k, dequantize(vc, vs), cache_seqlens=lens, block_table=table)))
        inp.update({f"q{i}": q.view(np.uint16), f"kc{i}": kc, f"vc{i}": vc, f"ks{i}": ks, f"vs{i}": vs,
                    f"lens{i}": lens, f"splits{i}": np.array(splits)})
        if table is not None:
            inp[f"table{i}"] = table
    np.savez(tmp_path / "in.npz", **inp)
    outs = {}
    for form in ("default", "madd", "float"):
        path = tmp_path / f"out_{form}.npz"
        env = {"FA2CPU_I8_DECODE": None if form == "default" else form, "FA2CPU_ISA": None}
        res = run_python(_AVX512_I8_CHILD, tmp_path / "in.npz", path, env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        outs[form] = np.load(path)
        for i, (q, k, table, (r_out, r_lse)) in enumerate(refs):
            np.testing.assert_allclose(outs[form][f"o{i}"].astype(np.float64), r_out, **TIGHT[dtype],
                                       err_msg=f"case {i}, FA2CPU_I8_DECODE={form}")
            check_lse_bound(outs[form][f"l{i}"], r_lse, q, k, table)
    for i in range(len(cases)):
        assert np.array_equal(outs["default"][f"o{i}"], outs["madd"][f"o{i}"]), f"case {i}: int16 forms differ"
        assert np.array_equal(outs["default"][f"l{i}"], outs["madd"][f"l{i}"]), f"case {i}: int16 forms' lse differ"
    assert any(not np.array_equal(outs["default"][f"o{i}"], outs["float"][f"o{i}"]) for i in range(len(cases))), \
        "the default form gave the float32 route's bits"


# ------------------------------------------------------------------------------ errors

def _setup(rng, code="int8"):
    B, cap, Hq, Hk, D = 2, 16, 4, 2, 8
    kc, vc, ks, vs, _ = quant_cache(rng, B, cap, Hk, D, D, code)
    q = rand(rng, (B, 1, Hq, D))
    k, v = rand(rng, (B, 1, Hk, D)), rand(rng, (B, 1, Hk, D))
    return q, kc, vc, ks, vs, k, v


def _untouched(call, arrays, exc, match):
    before = [a.copy() for a in arrays]
    with pytest.raises(exc, match=match):
        call()
    for a, b in zip(arrays, before):
        assert_bytes_equal(a, b, "array changed by a failed call")


def test_int8_requires_scales(rng):
    q, kc, vc, ks, vs, k, v = _setup(rng)
    _untouched(lambda: fa2cpu.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, k_scale=ks),
               [kc, vc, ks], ValueError, arg("v_scale"))
    _untouched(lambda: fa2cpu.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3),
               [kc, vc], ValueError, arg("k_scale"))


def test_scales_with_float_cache(rng):
    q, kc, vc, ks, vs, k, v = _setup(rng)
    fk, fv = kc.astype(np.float32), vc.astype(np.float32)
    _untouched(lambda: fa2cpu.flash_attention_with_kvcache(q, fk, fv, k, v, cache_seqlens=3, k_scale=ks, v_scale=vs),
               [fk, fv, ks, vs], ValueError, arg("k_scale"))


@pytest.mark.parametrize("bad,exc,match", [
    (lambda s: s.astype(np.float64), TypeError, "float32"),
    (lambda s: s[:, :-1], ValueError, "shape"),
    (lambda s: s[..., None], ValueError, "shape"),
    (lambda s: s.tolist(), TypeError, "NumPy array"),
])
def test_bad_scales(rng, bad, exc, match):
    q, kc, vc, ks, vs, k, v = _setup(rng)
    _untouched(lambda: fa2cpu.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, k_scale=ks,
                                                           v_scale=bad(vs)),
               [kc, vc, ks, vs], exc, match)


def test_read_only_scales_with_append(rng):
    q, kc, vc, ks, vs, k, v = _setup(rng)
    vs.flags.writeable = False
    _untouched(lambda: fa2cpu.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, k_scale=ks, v_scale=vs),
               [kc, vc, ks, vs], ValueError, arg("v_scale"))
    fa2cpu.flash_attention_with_kvcache(q, kc, vc, k_scale=ks, v_scale=vs, cache_seqlens=3)  # reading is fine


def test_mixed_cache_dtypes(rng):
    q, kc, vc, ks, vs, k, v = _setup(rng)
    vf8 = vc.astype(F8)
    _untouched(lambda: fa2cpu.flash_attention_with_kvcache(q, kc, vf8, k, v, cache_seqlens=3, k_scale=ks, v_scale=vs),
               [kc, vf8, ks, vs], TypeError, arg("v_cache"))
    with pytest.raises(TypeError, match=arg("q")):
        fa2cpu.flash_attention_with_kvcache(q.astype(np.int8), kc, vc, k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("code", ["int8", "fp8"])
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_non_finite_append(rng, code, bad):
    q, kc, vc, ks, vs, k, v = _setup(rng, code)
    v[1, 0, 1, 2] = bad
    _untouched(lambda: fa2cpu.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, k_scale=ks, v_scale=vs),
               [kc, vc, ks, vs], ValueError, arg("v"))


def test_capacity_exceeded(rng):
    q, kc, vc, ks, vs, k, v = _setup(rng)
    _untouched(lambda: fa2cpu.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=16, k_scale=ks, v_scale=vs),
               [kc, vc, ks, vs], ValueError, "capacity")


def test_out_overlapping_scales(rng):
    q, kc, vc, ks, vs, k, v = _setup(rng)
    out = ks.reshape(-1)[:q.size].reshape(q.shape)
    _untouched(lambda: fa2cpu.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, k_scale=ks, v_scale=vs,
                                                           out=out),
               [kc, vc, ks, vs], ValueError, arg("out"))


@pytest.mark.parametrize("code", ["int8", "fp8"])
def test_sinks_on_a_quantized_cache(isa, rng, code):
    """Attention sinks join the softmax of a quantized cache's decode and chunked prefill alike."""
    B, cap, Hq, Hk, D = 2, 300, 8, 2, 64
    kc, vc, ks, vs, _ = quant_cache(rng, B, cap, Hk, D, D, code)
    sinks = rand(rng, (Hq,)) * 2
    for nq in (1, 20):
        q = rand(rng, (B, nq, Hq, D))
        check_quant(q, kc, vc, ks, vs, None, None, "float32", cache_seqlens=np.array([cap, 120], np.int32),
                    causal=True, sinks=sinks)


# ------------------------------------- float8 cache, bf16 queries: the bf16 products
# On AVX512-BF16 families a float8 cache read by bf16 queries takes bf16 pair products
# (gemm_decode.h, Q16DecodeGemm<F8Bf16Codes>): codes to bf16 by a table (exact), q as given,
# P x v_scale rounded to bf16. Other families and query dtypes run the float32 route; every
# family runs these checks.
ALL_F8 = np.arange(256, dtype=np.uint8).view(F8)


def test_f8_every_code_decodes_exactly(isa):
    """V: one key holding all 256 codes (two rows of 128 features) with v_scale 1: the output is
    each code's value (NaN for the NaN codes), exactly. K: q one-hot per head picks one code: the
    LSE of the one key is scale * value (the NaN codes, last in each row, replaced by zero there:
    0 x NaN would make every score NaN, as the second check shows)."""
    expect = ALL_F8.astype(np.float64).reshape(2, 128)
    ones = np.ones((1, 1, 1), np.float32)
    for part in range(2):
        codes = ALL_F8[part * 128:(part + 1) * 128]
        vc = codes.reshape(1, 1, 1, 128).copy()
        kc = np.zeros_like(vc)
        q = np.zeros((1, 1, 1, 128), ml_dtypes.bfloat16)
        out = fa2cpu.flash_attention_with_kvcache(q, kc, vc, k_scale=ones, v_scale=ones, cache_seqlens=1)
        got = out.astype(np.float64).reshape(128)
        want = expect[part]
        assert np.array_equal(np.isnan(got), np.isnan(want)), f"NaN codes, part {part}"
        ok = ~np.isnan(want)
        assert np.array_equal(got[ok], want[ok]), f"V codes, part {part}: {np.flatnonzero(got[ok] != want[ok])}"
        kc = vc.copy()
        kc.view(np.uint8)[0, 0, 0, 127] = 0  # the NaN code (0x7f / 0xff) -> +0
        want = np.where(np.isnan(want), 0.0, want)
        for first in range(0, 128, 16):  # 16 heads, one-hot q at features first .. first + 15
            q = np.zeros((1, 1, 16, 128), ml_dtypes.bfloat16)
            q[0, 0, np.arange(16), first + np.arange(16)] = 1
            _, lse = fa2cpu.flash_attention_with_kvcache(q, kc, np.zeros_like(kc), k_scale=ones, v_scale=ones,
                                                         cache_seqlens=1, scale=1.0, return_lse=True)
            np.testing.assert_allclose(lse.astype(np.float64).reshape(16), want[first:first + 16], rtol=1e-6, atol=0,
                                       err_msg=f"K codes, part {part}, features {first}")
        _, lse = fa2cpu.flash_attention_with_kvcache(q, vc, np.zeros_like(vc), k_scale=ones, v_scale=ones,
                                                     cache_seqlens=1, scale=1.0, return_lse=True)
        assert np.isnan(lse).all(), "a NaN code in K makes every score of that key NaN"


@pytest.mark.parametrize("layout", ["bshd", "paged16"])
@pytest.mark.parametrize("Hq,Hk", [(32, 8), (6, 2)], ids=["gqa4", "gqa3"])
@pytest.mark.parametrize("D,Dv,cap", [(128, 128, 600), (72, 40, 255), (256, 256, 257), (16, 100, 1)])
def test_f8_bf16_products_precision(isa, rng, layout, Hq, Hk, D, Dv, cap):
    """bf16 q on a float8 cache: each weight P x v_scale rounded to bf16 moves by at most 2^-8 of
    itself, so an output by at most 2^-8 of sum_c p_c |v_c| (the reference on |V|), plus the bf16
    output's own rounding (2^-8 of it); the LSE within float32 noise (q and the codes are exact,
    the scores float32 sums)."""
    B = 2
    block = 16 if layout == "paged16" else None
    cap_alloc = -(-cap // 16) * 16 if block else cap
    kc, vc, ks, vs, table = quant_cache(rng, B, cap_alloc, Hk, D, Dv, "fp8", block_size=block)
    q = rand(rng, (B, 1, Hq, D), "bfloat16", scale=2.0)
    lens = np.array([cap, max(1, cap // 3)], np.int32)
    r_out, r_lse = ref.kvcache_ref(q, dequantize(kc, ks), dequantize(vc, vs), cache_seqlens=lens, block_table=table)
    out, lse = fa2cpu.flash_attention_with_kvcache(q, kc, vc, k_scale=ks, v_scale=vs, cache_seqlens=lens,
                                                   block_table=table, return_lse=True)
    r_abs, _ = ref.kvcache_ref(q, dequantize(kc, ks), np.abs(dequantize(vc, vs)), cache_seqlens=lens, block_table=table)
    err = np.abs(out.astype(np.float64) - r_out)
    assert (err <= 2.0 ** -8 * (r_abs + np.abs(r_out)) + 1e-6).all(), f"max error {err.max():.3g}"
    np.testing.assert_allclose(lse.astype(np.float64), r_lse, rtol=1e-5, atol=1e-5)


def test_float8_row_of_negative_zeros_gets_codes_0():
    """API.md: a row of zeros gets scale 0 and codes 0, -0.0 included (float8 would write -0,
    0x80); -0.0 in a row that is not all zeros keeps float8's -0."""
    f8 = ml_dtypes.float8_e4m3fn
    q = np.ones((1, 1, 1, 8), np.float32)
    k = np.zeros((1, 2, 1, 8), np.float32)
    k[0, 0, 0, ::2] = -0.0
    k[0, 1, 0, :] = -0.0
    k[0, 1, 0, 3] = 2.0
    kc, vc = np.zeros((1, 4, 1, 8), f8), np.zeros((1, 4, 1, 8), f8)
    ks, vs = np.full((1, 4, 1), -1, np.float32), np.full((1, 4, 1), -1, np.float32)
    fa2cpu.flash_attention_with_kvcache(q, kc, vc, k, k, cache_seqlens=0, k_scale=ks, v_scale=vs)
    assert ks[0, 0, 0] == 0 and (kc.view(np.uint8)[0, 0] == 0).all()
    codes = kc.view(np.uint8)[0, 1, 0]
    assert codes[0] == 0x80 and codes[3] == np.float32(448).astype(f8).view(np.uint8)
