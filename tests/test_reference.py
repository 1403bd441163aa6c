"""The float64 oracle itself: checked against PyTorch SDPA and against explicit constructions.

These tests need no compiled fa2cpu; torch comparisons are skipped where torch is missing.
"""

import math

import ml_dtypes
import numpy as np
import pytest

from conftest import rand, ref

attention_ref = ref.attention_ref

# The oracle is float64; torch in float64 agrees to rounding.
ATOL = RTOL = 1e-10


def _torch():
    return pytest.importorskip("torch")


def _sdpa(q, k, v, **kw):
    torch = _torch()
    t = [torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64)) for x in (q, k, v)]
    if "attn_mask" in kw and kw["attn_mask"] is not None:
        kw["attn_mask"] = torch.from_numpy(np.ascontiguousarray(kw["attn_mask"]))
    return torch.nn.functional.scaled_dot_product_attention(*t, **kw).numpy()


def _lse_explicit(q, k, scale, vis=None, bias=None):
    """logsumexp over visible scores, computed independently (bhsd, Hq == Hk)."""
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64)) * scale
    if bias is not None:
        s = s + bias
    if vis is not None:
        s = np.where(vis, s, -np.inf)
    m = s.max(-1, keepdims=True)
    return (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]


def _band_loops(nq, nk, left, right):
    """The visibility rule of API.md written as literal loops."""
    vis = np.zeros((nq, nk), dtype=bool)
    for i in range(nq):
        for j in range(nk):
            lo_ok = left < 0 or i + nk - nq - left <= j
            hi_ok = right < 0 or j <= i + nk - nq + right
            vis[i, j] = lo_ok and hi_ok
    return vis


# ------------------------------------------------------------------------------ vs torch

@pytest.mark.parametrize("B,H,Nq,Nk,D,Dv", [(1, 1, 1, 1, 1, 1), (2, 3, 5, 7, 8, 8), (1, 2, 17, 9, 16, 5),
                                            (2, 1, 33, 64, 64, 80)])
def test_plain_vs_torch(B, H, Nq, Nk, D, Dv):
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, (B, H, Nq, D)), rand(rng, (B, H, Nk, D)), rand(rng, (B, H, Nk, Dv))
    out, lse = attention_ref(q, k, v)
    np.testing.assert_allclose(out, _sdpa(q, k, v), atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(lse, _lse_explicit(q, k, 1 / math.sqrt(D)), atol=ATOL, rtol=RTOL)


def test_scale_vs_torch():
    rng = np.random.default_rng(1)
    q, k, v = (rand(rng, (1, 2, 9, 12)) for _ in range(3))
    out, lse = attention_ref(q, k, v, scale=0.37)
    np.testing.assert_allclose(out, _sdpa(q, k, v, scale=0.37), atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(lse, _lse_explicit(q, k, 0.37), atol=ATOL, rtol=RTOL)


def test_causal_square_vs_torch():
    rng = np.random.default_rng(2)
    q, k, v = (rand(rng, (2, 2, 13, 8)) for _ in range(3))
    out, lse = attention_ref(q, k, v, causal=True)
    np.testing.assert_allclose(out, _sdpa(q, k, v, is_causal=True), atol=ATOL, rtol=RTOL)
    vis = np.tril(np.ones((13, 13), dtype=bool))
    np.testing.assert_allclose(lse, _lse_explicit(q, k, 8 ** -0.5, vis), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("Nq,Nk", [(5, 12), (1, 9), (12, 12)])
def test_causal_bottom_right_vs_torch_mask(Nq, Nk):
    """torch's is_causal is top-left aligned; the contract is bottom-right: use an explicit mask."""
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, (1, 2, Nq, 16)), rand(rng, (1, 2, Nk, 16)), rand(rng, (1, 2, Nk, 16))
    vis = np.tril(np.ones((Nq, Nk), dtype=bool), k=Nk - Nq)
    out, _ = attention_ref(q, k, v, causal=True)
    np.testing.assert_allclose(out, _sdpa(q, k, v, attn_mask=vis), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("Hq,Hk", [(8, 2), (4, 1), (6, 3)])
def test_gqa_vs_torch_repeat(Hq, Hk):
    rng = np.random.default_rng(4)
    q, k, v = rand(rng, (2, Hq, 7, 8)), rand(rng, (2, Hk, 11, 8)), rand(rng, (2, Hk, 11, 4))
    out, lse = attention_ref(q, k, v)
    kr, vr = np.repeat(k, Hq // Hk, axis=1), np.repeat(v, Hq // Hk, axis=1)
    np.testing.assert_allclose(out, _sdpa(q, kr, vr), atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(lse, _lse_explicit(q, kr, 8 ** -0.5), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("mshape", [(9, 11), (1, 1, 9, 11), (2, 1, 1, 11), (3, 1, 11), (2, 3, 9, 11)])
def test_bool_mask_vs_torch(mshape):
    rng = np.random.default_rng(5)
    q, k, v = rand(rng, (2, 3, 9, 8)), rand(rng, (2, 3, 11, 8)), rand(rng, (2, 3, 11, 8))
    mask = rng.random(mshape) < 0.7
    mask[..., 0] = True  # every row sees something (torch returns NaN for empty rows)
    out, lse = attention_ref(q, k, v, mask=mask)
    np.testing.assert_allclose(out, _sdpa(q, k, v, attn_mask=mask), atol=ATOL, rtol=RTOL)
    vis = np.broadcast_to(mask, (2, 3, 9, 11))
    np.testing.assert_allclose(lse, _lse_explicit(q, k, 8 ** -0.5, vis), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("mshape", [(9, 11), (1, 1, 9, 11), (2, 1, 1, 11), (3, 1, 11)])
def test_float_mask_vs_torch(mshape):
    rng = np.random.default_rng(6)
    q, k, v = rand(rng, (2, 3, 9, 8)), rand(rng, (2, 3, 11, 8)), rand(rng, (2, 3, 11, 8))
    mask = rand(rng, mshape, scale=2.0)
    out, lse = attention_ref(q, k, v, mask=mask)
    np.testing.assert_allclose(out, _sdpa(q, k, v, attn_mask=mask.astype(np.float64)), atol=ATOL, rtol=RTOL)
    bias = np.broadcast_to(mask.astype(np.float64), (2, 3, 9, 11))
    np.testing.assert_allclose(lse, _lse_explicit(q, k, 8 ** -0.5, bias=bias), atol=ATOL, rtol=RTOL)


def test_softcap_vs_torch_manual():
    torch = _torch()
    rng = np.random.default_rng(7)
    q, k, v = (rand(rng, (1, 2, 10, 8), scale=3.0) for _ in range(3))
    cap = 1.5
    out, lse = attention_ref(q, k, v, softcap=cap, causal=True)
    tq, tk, tv = (torch.from_numpy(x.astype(np.float64)) for x in (q, k, v))
    s = cap * torch.tanh((tq @ tk.transpose(-1, -2)) * 8 ** -0.5 / cap)
    s = s.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    np.testing.assert_allclose(out, (torch.softmax(s, -1) @ tv).numpy(), atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(lse, torch.logsumexp(s, -1).numpy(), atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------ self-consistency

def test_causal_equals_tril_mask():
    rng = np.random.default_rng(8)
    q, k, v = (rand(rng, (1, 2, 21, 8)) for _ in range(3))
    a = attention_ref(q, k, v, causal=True)
    b = attention_ref(q, k, v, mask=np.tril(np.ones((21, 21), dtype=bool)))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("Nq,Nk", [(9, 9), (5, 14), (14, 5)])
@pytest.mark.parametrize("window,causal", [((2, 3), False), ((0, 0), False), ((-1, 2), False),
                                           ((4, -1), False), ((3, 5), True), ((-1, -1), True)])
def test_window_equals_band_mask(Nq, Nk, window, causal):
    rng = np.random.default_rng(9)
    q, k, v = rand(rng, (1, 1, Nq, 8)), rand(rng, (1, 1, Nk, 8)), rand(rng, (1, 1, Nk, 8))
    left, right = window
    vis = _band_loops(Nq, Nk, left, 0 if causal else right)
    a = attention_ref(q, k, v, causal=causal, window=window)
    b = attention_ref(q, k, v, mask=vis)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(ref.visible_band(Nq, Nk, causal=causal, window=window), vis)


@pytest.mark.parametrize("slopes_shape", ["h", "bh"])
def test_alibi_equals_float_mask(slopes_shape):
    rng = np.random.default_rng(10)
    B, H, Nq, Nk = 2, 3, 6, 10
    q, k, v = rand(rng, (B, H, Nq, 8)), rand(rng, (B, H, Nk, 8)), rand(rng, (B, H, Nk, 8))
    slopes = rng.random((H,) if slopes_shape == "h" else (B, H)).astype(np.float32)
    sl = np.broadcast_to(slopes.astype(np.float64), (B, H))
    bias = np.zeros((B, H, Nq, Nk))
    for b in range(B):
        for h in range(H):
            for i in range(Nq):
                for j in range(Nk):
                    bias[b, h, i, j] = -sl[b, h] * abs(i + Nk - Nq - j)
    a = attention_ref(q, k, v, alibi_slopes=slopes)
    b = attention_ref(q, k, v, mask=bias)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, atol=1e-12, rtol=1e-12)


def test_softcap_order_before_alibi_and_mask():
    """softcap applies to the scaled scores only; alibi and float mask are added after it."""
    rng = np.random.default_rng(11)
    q, k, v = (rand(rng, (1, 1, 5, 4), scale=4.0) for _ in range(3))
    bias = rand(rng, (5, 5))
    slopes = np.array([0.3], np.float32)
    out, lse = attention_ref(q, k, v, softcap=2.0, alibi_slopes=slopes, mask=bias)
    s = (q[0, 0].astype(np.float64) @ k[0, 0].T.astype(np.float64)) / 2.0
    s = 2.0 * np.tanh(s / 2.0) - 0.3 * np.abs(np.arange(5)[:, None] - np.arange(5)[None]) + bias
    p = np.exp(s - s.max(1, keepdims=True))
    np.testing.assert_allclose(out[0, 0], (p / p.sum(1, keepdims=True)) @ v[0, 0], atol=1e-7)
    np.testing.assert_allclose(lse[0, 0], np.log(np.exp(s).sum(1)), atol=1e-7)


def test_rows_without_keys_are_zero_and_neg_inf():
    rng = np.random.default_rng(12)
    q, k, v = rand(rng, (1, 1, 8, 4)), rand(rng, (1, 1, 3, 4)), rand(rng, (1, 1, 3, 4))
    out, lse = attention_ref(q, k, v, causal=True)  # Nq > Nk: first Nq - Nk rows see nothing
    assert np.all(out[0, 0, :5] == 0) and np.all(lse[0, 0, :5] == -np.inf)
    assert np.all(np.isfinite(out[0, 0, 5:])) and np.all(np.isfinite(lse[0, 0, 5:]))
    mask = np.ones((8, 3), bool)
    mask[2] = False
    fmask = np.zeros((8, 3), np.float32)
    fmask[4] = -np.inf
    for kw in (dict(mask=mask), dict(mask=fmask), dict(window=(0, 0), causal=True)):
        out, lse = attention_ref(q, k, v, **kw)
        assert not np.isnan(out).any() and not np.isnan(lse).any()
    # Nk = 0 everywhere
    out, lse = attention_ref(q, k[:, :, :0], v[:, :, :0])
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_layouts_and_ranks_agree():
    rng = np.random.default_rng(13)
    q, k, v = rand(rng, (2, 3, 7, 8)), rand(rng, (2, 3, 9, 8)), rand(rng, (2, 3, 9, 5))
    out, lse = attention_ref(q, k, v, causal=True)
    o2, l2 = attention_ref(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), causal=True, layout="bshd")
    np.testing.assert_array_equal(o2.transpose(0, 2, 1, 3), out)
    np.testing.assert_array_equal(l2, lse)
    o3, l3 = attention_ref(q[1], k[1], v[1], causal=True)
    np.testing.assert_array_equal(o3, out[1])
    np.testing.assert_array_equal(l3, lse[1])
    o4, l4 = attention_ref(q[1, 2], k[1, 2], v[1, 2], causal=True)
    np.testing.assert_array_equal(o4, out[1, 2])
    np.testing.assert_array_equal(l4, lse[1, 2])
    assert o4.shape == (7, 5) and l4.shape == (7,)


def test_low_precision_inputs_converted_exactly():
    rng = np.random.default_rng(14)
    for dt in (np.float16, ml_dtypes.bfloat16):
        q, k, v = (rand(rng, (1, 2, 5, 8), dt) for _ in range(3))
        a = attention_ref(q, k, v)
        b = attention_ref(*(x.astype(np.float64) for x in (q, k, v)))
        for x, y in zip(a, b):
            assert x.dtype == np.float64
            np.testing.assert_array_equal(x, y)


def test_nan_row_isolated():
    rng = np.random.default_rng(15)
    q, k, v = (rand(rng, (1, 1, 6, 4)) for _ in range(3))
    q[0, 0, 2, 1] = np.nan
    out, lse = attention_ref(q, k, v)
    assert np.isnan(out[0, 0, 2]).all() and np.isnan(lse[0, 0, 2])
    keep = [0, 1, 3, 4, 5]
    assert np.isfinite(out[0, 0, keep]).all() and np.isfinite(lse[0, 0, keep]).all()


# ------------------------------------------------------------------------------ varlen / kvcache oracles

def test_varlen_ref_equals_per_sequence():
    rng = np.random.default_rng(16)
    lq, lk = [3, 0, 5, 1], [4, 2, 0, 6]
    cq, ck = np.cumsum([0] + lq), np.cumsum([0] + lk)
    q, k, v = rand(rng, (cq[-1], 4, 8)), rand(rng, (ck[-1], 2, 8)), rand(rng, (ck[-1], 2, 6))
    slopes = rng.random((4, 4)).astype(np.float32)
    out, lse = ref.varlen_ref(q, k, v, cq, ck, causal=True, alibi_slopes=slopes)
    assert out.shape == (cq[-1], 4, 6) and lse.shape == (4, cq[-1])
    for b in range(4):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        o, l = attention_ref(q[None, sq], k[None, sk], v[None, sk], causal=True, layout="bshd",
                             alibi_slopes=slopes[b])
        np.testing.assert_array_equal(out[sq], o[0])
        np.testing.assert_array_equal(lse[:, sq], l[0])
    # sequence 2 has queries but no keys
    assert np.all(out[cq[2]:cq[3]] == 0) and np.all(lse[:, cq[2]:cq[3]] == -np.inf)


def test_kvcache_ref_paged_equals_contiguous_and_inputs_untouched():
    rng = np.random.default_rng(17)
    B, cap, Hk, D, bs = 2, 12, 2, 8, 4
    kc, vc = rand(rng, (B, cap, Hk, D)), rand(rng, (B, cap, Hk, D))
    q, kn, vn = rand(rng, (B, 2, 4, D)), rand(rng, (B, 2, Hk, D)), rand(rng, (B, 2, Hk, D))
    lens = np.array([3, 10], np.int32)
    # paged copy of the same data, blocks shuffled
    nblk = B * cap // bs
    perm = rng.permutation(nblk)
    table = perm.reshape(B, cap // bs).astype(np.int32)
    kp, vp = np.zeros((nblk, bs, Hk, D), np.float32), np.zeros((nblk, bs, Hk, D), np.float32)
    for b in range(B):
        for blk in range(cap // bs):
            kp[table[b, blk]] = kc[b, blk * bs:(blk + 1) * bs]
            vp[table[b, blk]] = vc[b, blk * bs:(blk + 1) * bs]
    saved = [x.copy() for x in (kc, vc, kp, vp)]
    a = ref.kvcache_ref(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True)
    b = ref.kvcache_ref(q, kp, vp, kn, vn, cache_seqlens=lens, block_table=table, causal=True)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    for x, y in zip((kc, vc, kp, vp), saved):
        np.testing.assert_array_equal(x, y)
    # equals plain attention over the concatenated history
    for bi in range(B):
        kk = np.concatenate([kc[bi, :lens[bi]], kn[bi]])[None]
        vv = np.concatenate([vc[bi, :lens[bi]], vn[bi]])[None]
        o, l = attention_ref(q[bi:bi + 1], kk, vv, causal=True, layout="bshd")
        np.testing.assert_array_equal(a[0][bi], o[0])
        np.testing.assert_array_equal(a[1][bi], l[0])
    ku, _ = ref.kvcache_update_ref(kc, vc, kn, vn, cache_seqlens=lens)
    np.testing.assert_array_equal(ku[1, 10:12], kn[1])
    np.testing.assert_array_equal(ku[0, 3:5], kn[0])
    with pytest.raises(ValueError):
        ref.kvcache_ref(q, kc, vc, kn, vn, cache_seqlens=np.array([3, 11], np.int32))
