"""fa2cpu.flash_attention against the float64 oracle, on every usable kernel family and dtype.

Shapes break tilings (1, 7, tile-1, tile, tile+1, primes, > 1000, Nq != Nk both ways, odd D);
every option of API.md is exercised alone and combined; memory layouts (views, negative and zero
strides) must not change the answer.
"""

import numpy as np
import pytest

import fa2cpu
from conftest import DTYPES, NP_DTYPES, TOL_ZERO_Q_LSE, check_close, check_same, qkv, rand, ref

LENGTHS = [1, 7, 63, 64, 65, 127, 128, 129, 257, 1031]
# Every length on the diagonal, plus each length paired with the one three places further on, in
# both orders: covers Nq < Nk and Nq > Nk at every length without the full 10 x 10 product.
SEQ_PAIRS = ([(n, n) for n in LENGTHS]
             + [(LENGTHS[i], LENGTHS[(i + 3) % len(LENGTHS)]) for i in range(len(LENGTHS))]
             + [(LENGTHS[(i + 3) % len(LENGTHS)], LENGTHS[i]) for i in range(len(LENGTHS))])

HEAD_DIMS = [1, 16, 64, 80, 96, 128, 200, 256]
# (D, Dv): every D with Dv == D, and pairs with Dv != D in both directions.
DIM_PAIRS = [(d, d) for d in HEAD_DIMS] + [(64, 16), (16, 256), (80, 1), (200, 96), (1, 128), (256, 64),
                                           (96, 80)]

_REF_ONLY = ("return_lse", "num_threads", "out")


def check(q, k, v, dtype, **kw):
    """Run flash_attention with return_lse, compare out and lse to the oracle; return them."""
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True, **kw)
    r_out, r_lse = ref.attention_ref(q, k, v, **{a: b for a, b in kw.items() if a not in _REF_ONLY})
    assert out.dtype == np.asarray(q).dtype, f"out dtype {out.dtype} != input dtype {q.dtype}"
    assert lse.dtype == np.float32, f"lse dtype {lse.dtype}"
    check_close(out, r_out, dtype, "out")
    check_close(lse, r_lse, dtype, "lse")
    return out, lse


# ------------------------------------------------------------------------------ shape grids

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Nq,Nk", SEQ_PAIRS, ids=[f"{a}x{b}" for a, b in SEQ_PAIRS])
def test_seqlens(isa, rng, dtype, causal, Nq, Nk):
    big = max(Nq, Nk) > 300
    B, H = (1, 1) if big else (2, 2)
    q, k, v = qkv(rng, B, H, H, Nq, Nk, 64, dtype=dtype)
    check(q, k, v, dtype, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,Dv", DIM_PAIRS, ids=[f"D{a}-Dv{b}" for a, b in DIM_PAIRS])
def test_head_dims(isa, rng, dtype, D, Dv):
    q, k, v = qkv(rng, 1, 2, 2, 65, 130, D, Dv, dtype=dtype)
    check(q, k, v, dtype)
    check(q[:, :, :, :], k[:, :, :31], v[:, :, :31], dtype, causal=True)  # Nk < Nq rows too


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 80, 200, 256])
def test_head_dims_long(isa, rng, dtype, D):
    q, k, v = qkv(rng, 1, 1, 1, 129, 1031, D, dtype=dtype)
    check(q, k, v, dtype, causal=True)


# ------------------------------------------------------------------------------ options

WINDOWS = [(0, 0), (16, 0), (3, 7), (-1, 5), (40, -1), (200, 200), (0, -1), (-1, 0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Nq,Nk", [(97, 97), (65, 200), (200, 65)])
@pytest.mark.parametrize("window", WINDOWS, ids=[f"w{a}_{b}" for a, b in WINDOWS])
def test_window(isa, rng, dtype, Nq, Nk, window):
    q, k, v = qkv(rng, 1, 2, 2, Nq, Nk, 32, dtype=dtype)
    check(q, k, v, dtype, window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [(16, -1), (8, 4), (0, 0), (-1, -1)], ids=str)
def test_causal_window(isa, rng, dtype, window):
    """causal=True means right = 0 whatever window's right is; window's left still applies."""
    q, k, v = qkv(rng, 1, 2, 2, 100, 150, 32, dtype=dtype)
    out, _ = check(q, k, v, dtype, causal=True, window=window)
    out2 = fa2cpu.flash_attention(q, k, v, window=(window[0], 0))
    check_close(out, out2.astype(np.float64), dtype)


# Logit steps per 128 keys (natural-log units), one per row, cycling: flat, below and above the
# online softmax's lazy-rescale threshold (8 in log2 = 5.55 here: tile_loop.h kRescaleLog2), far
# above it, and falling. Rows of one vector thus keep a stale max while their neighbours move it.
MAX_STEPS = [0.0, 2.0, 5.4, 5.7, 12.0, 40.0, -4.0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_running_max_steps(isa, rng, dtype, causal):
    Nq, Nk = 40, 1031
    q, k, v = qkv(rng, 1, 2, 2, Nq, Nk, 64, dtype=dtype)
    step = np.array(MAX_STEPS, np.float32)[np.arange(Nq) % len(MAX_STEPS)]
    bias = step[:, None] * (np.arange(Nk, dtype=np.float32) // 128)[None, :]
    check(q, k, v, dtype, mask=np.ascontiguousarray(np.broadcast_to(bias, (1, 2, Nq, Nk))), causal=causal)
    # the same rises through ALiBi (slopes per head: 0.04 and 0.05 per key, i.e. 7.4 and 9.2 log2
    # units per 128 keys towards each row's diagonal), no mask
    check(q, k, v, dtype, alibi_slopes=np.array([0.04, 0.05], np.float32), causal=causal)
    # the same through the scores themselves, no bias: K's rows grow by 128-key blocks (x1, x3,
    # x5, ...), so the scaled softmax meets tile maxima far past the running one (tile_loop.h's
    # one-pass softmax falls back to two passes there)
    grow = (1 + 2 * (np.arange(Nk) // 128)).astype(np.float32)[None, None, :, None]
    check(q, k * grow.astype(k.dtype), v, dtype, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [0.5, 2.0, 30.0])
def test_softcap(isa, rng, dtype, softcap):
    q = rand(rng, (2, 2, 70, 48), dtype, scale=2.0)
    k = rand(rng, (2, 2, 90, 48), dtype, scale=2.0)
    v = rand(rng, (2, 2, 90, 48), dtype)
    check(q, k, v, dtype, softcap=softcap)
    check(q, k, v, dtype, softcap=softcap, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_off_values(isa, rng, dtype):
    """softcap None and 0 both mean off."""
    q, k, v = qkv(rng, 1, 2, 2, 33, 47, 16, dtype=dtype)
    a = fa2cpu.flash_attention(q, k, v)
    b = fa2cpu.flash_attention(q, k, v, softcap=0.0)
    np.testing.assert_array_equal(a.astype(np.float64), b.astype(np.float64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["h", "bh"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi(isa, rng, dtype, shape, causal):
    B, Hq, Hk = 2, 4, 2
    q, k, v = qkv(rng, B, Hq, Hk, 77, 131, 32, dtype=dtype)
    slopes = (rng.random((Hq,) if shape == "h" else (B, Hq)) * 0.5).astype(np.float32)
    check(q, k, v, dtype, alibi_slopes=slopes, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale(isa, rng, dtype):
    q, k, v = qkv(rng, 1, 2, 2, 40, 50, 24, dtype=dtype)
    check(q, k, v, dtype, scale=0.05)
    check(q, k, v, dtype, scale=0.4, causal=True)


# Mask shapes broadcastable to (B, Hq, Nq, Nk) with B=2, Hq=4, Nq=65, Nk=130.
MB, MH, MNQ, MNK = 2, 4, 65, 130
MASK_SHAPES = [(MNQ, MNK), (1, 1, MNQ, MNK), (MB, 1, 1, MNK), (MH, 1, MNK), (MB, MH, MNQ, MNK), (MNK,),
               (MNQ, 1), (MB, MH, 1, MNK)]


def _make_mask(rng, shape, kind):
    if kind == "bool":
        m = rng.random(shape) < 0.75
    else:
        m = rand(rng, shape, "float32", scale=2.0)
    return m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("mshape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mask_shapes(isa, rng, dtype, kind, mshape):
    q, k, v = qkv(rng, MB, MH, 2, MNQ, MNK, 32, dtype=dtype)
    mask = _make_mask(rng, mshape, kind)
    check(q, k, v, dtype, mask=mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_zero_strides(isa, rng, dtype, kind):
    """Masks made by np.broadcast_to (stride 0 axes) and other views are read through strides."""
    q, k, v = qkv(rng, MB, MH, 2, MNQ, MNK, 32, dtype=dtype)
    row = _make_mask(rng, (MNK,), kind)
    col = _make_mask(rng, (MNQ, 1), kind)
    per_head = _make_mask(rng, (MH, 1, MNK), kind)
    big = _make_mask(rng, (MB, MH, 2 * MNQ, MNK + 5), kind)
    for mask in (np.broadcast_to(row, (MB, MH, MNQ, MNK)),
                 np.broadcast_to(col, (MNQ, MNK)),
                 np.broadcast_to(per_head, (MB, MH, MNQ, MNK)),
                 np.broadcast_to(row, (1, 1, MNQ, MNK)),
                 big[:, :, ::2, 3:3 + MNK],               # step and offset
                 big[:, :, ::-2, :MNK][:, :, :MNQ],       # negative stride
                 _make_mask(rng, (MNK, MNQ), kind).T):    # transposed
        assert mask.shape[-1] == MNK
        check(q, k, v, dtype, mask=mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hk", [(8, 2), (8, 1), (6, 3)], ids=["gqa8-2", "mqa8-1", "gqa6-3"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa(isa, rng, dtype, Hq, Hk, causal):
    q, k, v = qkv(rng, 2, Hq, Hk, 37, 129, 64, 48, dtype=dtype)
    check(q, k, v, dtype, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("Nq,Nk", [(129, 257), (257, 129), (64, 64), (1, 300)])
def test_everything_combined(isa, rng, dtype, layout, Nq, Nk):
    """causal + window + alibi + softcap + float/bool mask + GQA, in both layouts."""
    B, Hq, Hk = 2, 8, 2
    q, k, v = qkv(rng, B, Hq, Hk, Nq, Nk, 80, 64, dtype=dtype, layout=layout)
    slopes = (rng.random((B, Hq)) * 0.1).astype(np.float32)
    fmask = rand(rng, (Hq, 1, Nk), "float32")
    bmask = np.broadcast_to(rng.random((B, 1, Nq, Nk)) < 0.9, (B, Hq, Nq, Nk))
    common = dict(causal=True, window=(50, 3), alibi_slopes=slopes, softcap=8.0, layout=layout)
    check(q, k, v, dtype, mask=fmask, **common)
    check(q, k, v, dtype, mask=bmask, **common)


# ------------------------------------------------------------------------------ layouts, ranks, strides

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bshd_equals_bhsd(isa, rng, dtype, causal):
    q, k, v = qkv(rng, 2, 4, 2, 70, 90, 40, dtype=dtype, layout="bshd")
    out, lse = check(q, k, v, dtype, causal=causal, layout="bshd")
    assert out.shape == (2, 70, 4, 40) and lse.shape == (2, 4, 70)
    out2, lse2 = fa2cpu.flash_attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), causal=causal,
                                        return_lse=True)
    check_same(out.transpose(0, 2, 1, 3), out2, dtype)
    check_same(lse, lse2, "float32", what="lse")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rank2_rank3(isa, rng, dtype):
    q2, k2, v2 = rand(rng, (100, 32), dtype), rand(rng, (130, 32), dtype), rand(rng, (130, 20), dtype)
    out, lse = check(q2, k2, v2, dtype, causal=True)
    assert out.shape == (100, 20) and lse.shape == (100,)
    assert isinstance(fa2cpu.flash_attention(q2, k2, v2), np.ndarray)
    q3, k3, v3 = rand(rng, (4, 100, 32), dtype), rand(rng, (2, 130, 32), dtype), rand(rng, (2, 130, 20), dtype)
    out, lse = check(q3, k3, v3, dtype, causal=True)
    assert out.shape == (4, 100, 20) and lse.shape == (4, 100)
    check(q3, k3, v3, dtype, mask=rng.random((100, 130)) < 0.8)


def _views(rng, shape, dtype):
    """The same logical array in several memory layouts (all 4-D bhsd views)."""
    B, H, N, D = shape
    base = rand(rng, shape, dtype)
    yield "contiguous", base
    t = np.ascontiguousarray(base.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # bshd storage
    yield "transposed", t
    big = np.zeros((B, H, 2 * N, 2 * D), dtype=base.dtype)
    big[:, :, ::2, ::2] = base
    yield "step", big[:, :, ::2, ::2]
    rev = np.ascontiguousarray(base[:, :, ::-1, :])[:, :, ::-1, :]
    yield "negative", rev
    revd = np.ascontiguousarray(base[..., ::-1])[..., ::-1]
    yield "negative-d", revd
    fort = np.asfortranarray(base)
    yield "fortran", fort


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["q", "k", "v", "all"])
def test_noncontiguous_views(isa, rng, dtype, which):
    shapes = {"q": (2, 4, 67, 40), "k": (2, 2, 131, 40), "v": (2, 2, 131, 24)}
    views = {n: list(_views(rng, s, dtype)) for n, s in shapes.items()}
    base = {n: views[n][0][1] for n in shapes}
    expect = fa2cpu.flash_attention(base["q"], base["k"], base["v"], causal=True)
    for i, (name, _) in enumerate(views["q"]):
        args = {n: (views[n][i][1] if which in (n, "all") else base[n]) for n in shapes}
        for n in shapes:
            np.testing.assert_array_equal(args[n].astype(np.float64), base[n].astype(np.float64))
        out, _ = check(args["q"], args["k"], args["v"], dtype, causal=True)
        # results must not depend on memory layout (beyond float re-association)
        check_same(out, expect, dtype, what=f"{which} {name} vs contiguous")


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_kv(isa, rng, dtype):
    """K/V shared across the batch through zero strides (np.broadcast_to)."""
    q = rand(rng, (3, 4, 50, 32), dtype)
    k1, v1 = rand(rng, (1, 2, 77, 32), dtype), rand(rng, (1, 2, 77, 32), dtype)
    k, v = np.broadcast_to(k1, (3, 2, 77, 32)), np.broadcast_to(v1, (3, 2, 77, 32))
    assert k.strides[0] == 0
    check(q, k, v, dtype, causal=True)
    # broadcast along heads as well
    kh, vh = np.broadcast_to(k1[:, :1], (3, 2, 77, 32)), np.broadcast_to(v1[:, :1], (3, 2, 77, 32))
    check(q, kh, vh, dtype)
    # and a broadcast q (every batch identical)
    qb = np.broadcast_to(q[:1], q.shape)
    out, _ = check(qb, k, v, dtype)
    np.testing.assert_array_equal(out[0].astype(np.float64), out[2].astype(np.float64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_strides_along_sequence_and_dim(isa, rng, dtype):
    """K/V repeated along the key axis and along D through stride 0."""
    q = rand(rng, (1, 2, 40, 24), dtype)
    k1, v1 = rand(rng, (1, 2, 1, 24), dtype), rand(rng, (1, 2, 70, 1), dtype)
    k = np.broadcast_to(k1, (1, 2, 70, 24))          # every key the same
    v = np.broadcast_to(v1, (1, 2, 70, 16))          # every v row constant along Dv
    out, _ = check(q, k, v, dtype, causal=True)
    check(q, rand(rng, (1, 2, 70, 24), dtype), v, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exotic_byte_layouts(isa, rng, dtype):
    """A field of a structured array (byte stride not a multiple of the item size) and an
    unaligned data pointer give the same answer as plain arrays."""
    q, k, v = qkv(rng, 1, 2, 2, 33, 47, 16, dtype=dtype)
    rec = np.zeros(q.shape, dtype=[("x", q.dtype), ("pad", "u1")])
    rec["x"] = q
    assert rec["x"].strides[-1] == q.itemsize + 1
    check(rec["x"], k, v, dtype)
    buf = np.zeros(k.nbytes + 1, np.uint8)
    unaligned = np.ndarray(k.shape, k.dtype, buffer=buf, offset=1)
    unaligned[...] = k
    assert not unaligned.flags.aligned
    check(q, unaligned, v, dtype, causal=True)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_out_overlapping_an_input_is_never_silently_wrong(isa, rng, which):
    """out= aliasing an input: either a ValueError naming out (nothing written) or the right answer."""
    q, k, v = qkv(rng, 1, 2, 2, 70, 70, 16)
    args = {"q": q, "k": k, "v": v}
    expect, _ = ref.attention_ref(q, k, v, causal=True)
    alias = args[which]
    saved = alias.copy()
    try:
        fa2cpu.flash_attention(q, k, v, causal=True, out=alias)
    except ValueError as e:
        assert "out" in str(e)
        np.testing.assert_array_equal(alias, saved)
    else:
        check_close(alias, expect, "float32")


@pytest.mark.parametrize("dtype", DTYPES)
def test_bshd_views(isa, rng, dtype):
    q, k, v = qkv(rng, 2, 4, 2, 65, 129, 32, dtype=dtype, layout="bshd")
    qv = q[:, ::-1]                                   # negative stride along Nq
    kv_big = rand(rng, (2, 129, 2, 96), dtype)
    kv = kv_big[..., ::3]                             # step along D
    vv = np.broadcast_to(v[:1], v.shape)              # zero batch stride
    check(qv, kv, vv, dtype, layout="bshd", causal=True)


# ------------------------------------------------------------------------------ out=, return_lse

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_out_argument(isa, rng, dtype, layout):
    q, k, v = qkv(rng, 2, 4, 2, 33, 70, 32, 16, dtype=dtype, layout=layout)
    oshape = (2, 4, 33, 16) if layout == "bhsd" else (2, 33, 4, 16)
    out = np.full(oshape, 7, dtype=NP_DTYPES[dtype])
    res = fa2cpu.flash_attention(q, k, v, out=out, layout=layout, causal=True)
    assert res is out
    r_out, r_lse = ref.attention_ref(q, k, v, layout=layout, causal=True)
    check_close(out, r_out, dtype)
    out[...] = 7
    res, lse = fa2cpu.flash_attention(q, k, v, out=out, layout=layout, causal=True, return_lse=True)
    assert res is out
    check_close(out, r_out, dtype)
    check_close(lse, r_lse, dtype, "lse")


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_strided_view(isa, rng, dtype):
    """out= may be a non-contiguous view of the right shape and dtype ("any strides are accepted")."""
    q, k, v = qkv(rng, 1, 2, 2, 40, 60, 16, dtype=dtype)
    big = np.full((1, 2, 80, 16), 7, dtype=NP_DTYPES[dtype])
    view = big[:, :, ::2]
    res = fa2cpu.flash_attention(q, k, v, out=view)
    assert res is view
    check_close(view, ref.attention_ref(q, k, v)[0], dtype)
    assert np.all(big[:, :, 1::2].astype(np.float32) == 7), "wrote outside the out view"


@pytest.mark.parametrize("dtype", DTYPES)
def test_return_types(isa, rng, dtype):
    q, k, v = qkv(rng, 2, 2, 2, 10, 12, 8, dtype=dtype)
    out = fa2cpu.flash_attention(q, k, v)
    assert isinstance(out, np.ndarray) and out.shape == (2, 2, 10, 8) and out.dtype == q.dtype
    res = fa2cpu.flash_attention(q, k, v, return_lse=True)
    assert isinstance(res, tuple) and len(res) == 2
    assert res[1].shape == (2, 2, 10) and res[1].dtype == np.float32
    np.testing.assert_array_equal(res[0].astype(np.float64), out.astype(np.float64))


# ------------------------------------------------------------------------------ empty rows, NaN

def _assert_empty_rows(out, lse, rows):
    """rows: boolean over the row axis of bhsd out (..., Nq, Dv) / lse (..., Nq)."""
    o = out.astype(np.float64)
    assert not np.isnan(o).any() and not np.isnan(lse).any(), "NaN from masking"
    assert np.all(o[..., rows, :] == 0), "rows without visible keys must be exactly 0"
    assert np.all(lse[..., rows] == -np.inf), "rows without visible keys must have lse -inf"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_without_visible_keys(isa, rng, dtype):
    Nq, Nk = 150, 70
    q, k, v = qkv(rng, 1, 2, 2, Nq, Nk, 32, dtype=dtype)
    # causal with Nq > Nk: the first Nq - Nk rows see nothing
    out, lse = check(q, k, v, dtype, causal=True)
    _assert_empty_rows(out, lse, np.arange(Nq) < Nq - Nk)
    # bool mask with some all-False rows (one of them inside an otherwise full tile)
    mask = rng.random((Nq, Nk)) < 0.8
    dead = np.zeros(Nq, bool)
    dead[[0, 5, 63, 64, 149]] = True
    mask[dead] = False
    out, lse = check(q, k, v, dtype, mask=mask)
    _assert_empty_rows(out, lse, dead)
    # float mask of -inf rows
    fmask = np.zeros((Nq, Nk), np.float32)
    fmask[dead] = -np.inf
    out, lse = check(q, k, v, dtype, mask=fmask)
    _assert_empty_rows(out, lse, dead)
    # a window that excludes everything for some rows: right < 0 impossible, use left=0,right=0
    # with Nq > Nk (diagonal i + Nk - Nq is negative for the first rows)
    out, lse = check(q, k, v, dtype, window=(0, 0))
    _assert_empty_rows(out, lse, np.arange(Nq) < Nq - Nk)
    # a mask that hides every key of every row
    out, lse = check(q, k, v, dtype, mask=np.zeros((1, 1, 1, Nk), bool))
    _assert_empty_rows(out, lse, np.ones(Nq, bool))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_in_query_row_is_isolated(isa, rng, dtype):
    q, k, v = qkv(rng, 1, 2, 2, 100, 90, 32, dtype=dtype)
    q[0, 1, 37, 5] = np.nan
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True)
    o = out.astype(np.float64)
    assert np.isnan(o[0, 1, 37]).all(), "NaN must propagate into its own row"
    keep = np.ones(o.shape[:3], bool)
    keep[0, 1, 37] = False
    assert np.isfinite(o[keep]).all() and np.isfinite(lse[keep]).all()
    r_out, r_lse = ref.attention_ref(q, k, v)
    check_close(o[keep], r_out[keep], dtype)
    check_close(lse[keep], r_lse[keep], dtype, "lse")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_in_key_affects_only_rows_that_see_it(isa, rng, dtype):
    Nq = Nk = 130
    q, k, v = qkv(rng, 1, 1, 1, Nq, Nk, 32, dtype=dtype)
    k[0, 0, 100, 3] = np.nan
    out, lse = fa2cpu.flash_attention(q, k, v, causal=True, return_lse=True)
    o = out.astype(np.float64)
    r_out, r_lse = ref.attention_ref(q, k, v, causal=True)
    check_close(o[0, 0, :100], r_out[0, 0, :100], dtype)
    check_close(lse[0, 0, :100], r_lse[0, 0, :100], dtype, "lse")
    assert np.isnan(o[0, 0, 100:]).all(axis=-1).all(), "rows that see the NaN key must be NaN"


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_sequences(isa, rng, dtype):
    """Nk = 0: every row sees no key (0, -inf); Nq = 0: an empty result of the right shape."""
    q, k, v = qkv(rng, 2, 4, 2, 9, 0, 16, 8, dtype=dtype)
    out, lse = check(q, k, v, dtype)
    _assert_empty_rows(out, lse, np.ones(9, bool))
    q, k, v = qkv(rng, 2, 4, 2, 0, 9, 16, 8, dtype=dtype)
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True, causal=True)
    assert out.shape == (2, 4, 0, 8) and lse.shape == (2, 4, 0)


# ------------------------------------------------------------------------------ precision-free probes
# Low-precision tolerances hide a single dropped key among a thousand; these probes do not.

VIS_OPTS = [dict(), dict(causal=True), dict(window=(5, 3)), dict(window=(0, 0)), dict(causal=True, window=(17, -1)),
            dict(mask=True), dict(mask=True, causal=True, window=(40, 2))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Nq,Nk", [(1, 256), (63, 64), (130, 65), (257, 200)], ids=lambda x: str(x))
@pytest.mark.parametrize("opts", VIS_OPTS, ids=lambda o: "-".join(f"{a}={b}" for a, b in o.items()) or "plain")
def test_visibility_map(isa, rng, dtype, Nq, Nk, opts):
    """v = identity (Dv = Nk) makes out the attention matrix P itself: its zero pattern is exactly
    the set of invisible keys, whatever the precision."""
    B, Hq, Hk = 1, 4, 2
    q, k = rand(rng, (B, Hq, Nq, 32), dtype), rand(rng, (B, Hk, Nk, 32), dtype)
    v = np.broadcast_to(np.eye(Nk, dtype=NP_DTYPES[dtype]), (B, Hk, Nk, Nk))
    kw = dict(opts)
    if kw.pop("mask", False):
        kw["mask"] = rng.random((Hq, Nq, Nk)) < 0.7
    out, _ = check(q, k, v, dtype, **kw)
    r_out, _ = ref.attention_ref(q, k, v, **kw)
    got = out.astype(np.float64) != 0
    want = r_out != 0
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{len(bad)} (b, h, i, j) with wrong visibility, first: {bad[:5].tolist()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Nq,Nk", [(1, 1031), (129, 1031), (1031, 257), (65, 64)], ids=lambda x: str(x))
def test_zero_q_lse_counts_visible_keys(isa, rng, dtype, Nq, Nk):
    B, Hq, Hk = 1, 2, 1
    q = np.zeros((B, Hq, Nq, 64), NP_DTYPES[dtype])
    k, v = rand(rng, (B, Hk, Nk, 64), dtype), rand(rng, (B, Hk, Nk, 64), dtype)
    slopes = np.array([0.01, 0.125], np.float32)
    for kw in (dict(), dict(causal=True), dict(window=(100, 5)), dict(window=(0, 0)),
               dict(mask=rng.random((Nq, Nk)) < 0.9, causal=True), dict(alibi_slopes=slopes, causal=True),
               dict(mask=rand(rng, (1, Nk), "float32"), window=(300, 300))):
        out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True, **kw)
        r_out, r_lse = ref.attention_ref(q, k, v, **kw)
        np.testing.assert_allclose(lse.astype(np.float64), r_lse, err_msg=f"lse {list(kw)}", **TOL_ZERO_Q_LSE)
        check_close(out, r_out, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_output_rounding_is_nearest_even(isa, rng, dtype, layout):
    """Every output element is rounded once, to nearest even, like NumPy / ml_dtypes. With q = 0
    and two keys each row is exactly (v0 + v1) / 2 in float32 (both are bf16 / fp16 values of
    nearby exponents: the sum is exact), a value with one bit more than the dtype holds, so about
    half of the outputs are ties; also a NaN, an inf, and for fp16 a subnormal result and ties at
    the largest finite values. Output rows of 1..40 features (vector bodies and tails) of 1..33 rows."""
    npd = NP_DTYPES[dtype]
    for D in (1, 7, 8, 9, 16, 23, 40):
        for nq in (1, 5, 33):
            bits = 7 if dtype == "bfloat16" else 10          # explicit mantissa bits
            mant = rng.integers(0, 2 ** bits, size=(2, D))
            sign = np.where(rng.random((2, D)) < 0.3, -1.0, 1.0)
            ex = rng.integers(-3, 4, size=(1, D))            # one exponent per feature (exact sums)
            v64 = sign * (1 + mant / 2.0 ** bits) * 2.0 ** ex
            if D >= 8:
                v64[:, 3] = [np.nan, 1.0]
                v64[:, 4] = [np.inf, -2.0]
            if dtype == "float16" and D >= 8:
                v64[:, 0] = [2.0 ** -20, 3 * 2.0 ** -24]     # subnormal result
                v64[:, 1] = [65504.0, 65504.0 - 32]          # 65488: a tie, to 65472 (even)
                v64[:, 2] = [-65504.0, -65504.0]             # the largest finite value
            v = v64.astype(npd)
            assert np.array_equal(v.astype(np.float64), v64, equal_nan=True), "inputs must be exact"
            k = np.zeros((1, 1, 2, D), npd)
            q = np.zeros((1, 1, nq, D), npd)
            vv = np.broadcast_to(v[None, None], (1, 1, 2, D))
            if layout == "bshd":
                q, k, vv = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, vv))
            out = np.asarray(fa2cpu.flash_attention(q, k, vv, layout=layout))
            if layout == "bshd":
                out = out.transpose(0, 2, 1, 3)
            want = ((v64[0] + v64[1]) / 2).astype(npd)     # float64 exact mean, rounded once
            got = out[0, 0]
            fin = ~np.isnan(want.astype(np.float32))
            assert np.array_equal(np.isnan(got.astype(np.float32)), np.broadcast_to(~fin, got.shape))
            assert np.array_equal(got[:, fin].view(np.uint16), np.broadcast_to(want[fin].view(np.uint16), (nq, fin.sum()))), (D, nq)
