"""fa2cpu.flash_attention_varlen: packed ragged batches (empty sequences included) against the
oracle and against per-sequence flash_attention, on every family and dtype; hostile cu_seqlens."""

import numpy as np
import pytest

import fa2cpu
from conftest import DTYPES, NP_DTYPES, arg, check_close, check_same, rand, ref

# Per-sequence (len_q, len_k): empty q, empty k, both empty, tiling breakers, Nq != Nk both ways.
RAGGED = [(3, 5), (0, 4), (7, 0), (0, 0), (65, 65), (1, 129), (128, 64), (129, 257), (1, 1), (64, 127)]
LONG = [(257, 1031), (0, 0), (31, 7), (1031, 129)]


def _cu(lengths, dtype=np.int32):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(dtype)


def _packed(rng, seqs, Hq, Hk, D, Dv, dtype):
    lq, lk = [a for a, _ in seqs], [b for _, b in seqs]
    cq, ck = _cu(lq), _cu(lk)
    q = rand(rng, (int(cq[-1]), Hq, D), dtype)
    k = rand(rng, (int(ck[-1]), Hk, D), dtype)
    v = rand(rng, (int(ck[-1]), Hk, Dv), dtype)
    return q, k, v, cq, ck


def check_varlen(q, k, v, cq, ck, dtype, **kw):
    out, lse = fa2cpu.flash_attention_varlen(q, k, v, cq, ck, return_lse=True, **kw)
    opts = {a: b for a, b in kw.items() if a not in ("num_threads", "out", "max_seqlen_q", "max_seqlen_k")}
    r_out, r_lse = ref.varlen_ref(q, k, v, cq, ck, **opts)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    assert out.shape == (q.shape[0], q.shape[1], v.shape[2]) and lse.shape == (q.shape[1], q.shape[0])
    check_close(out, r_out, dtype)
    check_close(lse, r_lse, dtype, "lse")
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_ragged(isa, rng, dtype, causal, heads):
    q, k, v, cq, ck = _packed(rng, RAGGED, *heads, 64, 64, dtype)
    out, lse = check_varlen(q, k, v, cq, ck, dtype, causal=causal)
    # sequences with queries but no keys: 0 and -inf
    for b, (nq, nk) in enumerate(RAGGED):
        if nq and not nk:
            rows = slice(cq[b], cq[b + 1])
            assert np.all(out[rows].astype(np.float64) == 0) and np.all(lse[:, rows] == -np.inf)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_long(isa, rng, dtype):
    q, k, v, cq, ck = _packed(rng, LONG, 2, 1, 80, 48, dtype)
    check_varlen(q, k, v, cq, ck, dtype, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opts", [
    dict(window=(16, 0)), dict(window=(3, 7)), dict(window=(-1, 2), causal=True), dict(softcap=3.0),
    dict(scale=0.2), dict(alibi_slopes="h"), dict(alibi_slopes="bh", causal=True),
    dict(causal=True, window=(20, -1), softcap=5.0, alibi_slopes="bh"),
], ids=lambda o: "-".join(f"{a}={b}" for a, b in o.items()))
def test_options(isa, rng, dtype, opts):
    Hq, Hk = 4, 2
    q, k, v, cq, ck = _packed(rng, RAGGED, Hq, Hk, 32, 32, dtype)
    opts = dict(opts)
    if opts.get("alibi_slopes") == "h":
        opts["alibi_slopes"] = (rng.random(Hq) * 0.3).astype(np.float32)
    elif opts.get("alibi_slopes") == "bh":
        opts["alibi_slopes"] = (rng.random((len(RAGGED), Hq)) * 0.3).astype(np.float32)
    check_varlen(q, k, v, cq, ck, dtype, **opts)


@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_per_sequence_flash_attention(isa, rng, dtype):
    seqs = [(5, 9), (70, 70), (1, 200), (33, 12)]
    q, k, v, cq, ck = _packed(rng, seqs, 4, 2, 48, 40, dtype)
    out = fa2cpu.flash_attention_varlen(q, k, v, cq, ck, causal=True)
    for b in range(len(seqs)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        one = fa2cpu.flash_attention(q[None, sq], k[None, sk], v[None, sk], causal=True, layout="bshd")
        check_close(out[sq], one[0].astype(np.float64), dtype, f"sequence {b}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cu_dtypes_max_seqlen_views_and_out(isa, rng, dtype):
    q, k, v, cq, ck = _packed(rng, RAGGED, 4, 2, 32, 24, dtype)
    base = check_varlen(q, k, v, cq, ck, dtype, causal=True)
    mq = max(a for a, _ in RAGGED)
    mk = max(b for _, b in RAGGED)
    for kw in (dict(cu_dtype=np.int64), dict(max_seqlen_q=mq, max_seqlen_k=mk)):
        cud = kw.pop("cu_dtype", np.int32)
        out, lse = check_varlen(q, k, v, cq.astype(cud), ck.astype(cud), dtype, causal=True, **kw)
        check_same(out, base[0], dtype)
    # non-contiguous packed inputs: heads reversed in storage, D strided
    big = np.zeros(k.shape[:2] + (k.shape[2] * 2,), k.dtype)
    big[..., ::2] = k
    qv = np.ascontiguousarray(q[:, ::-1])[:, ::-1]
    check_varlen(qv, big[..., ::2], v, cq, ck, dtype, causal=True)
    # out= written in place and returned
    out = np.full((q.shape[0], 4, 24), 5, NP_DTYPES[dtype])
    res = fa2cpu.flash_attention_varlen(q, k, v, cq, ck, causal=True, out=out)
    assert res is out
    check_close(out, ref.varlen_ref(q, k, v, cq, ck, causal=True)[0], dtype)


def test_single_sequence_equals_flash_attention(isa, rng):
    q, k, v, cq, ck = _packed(rng, [(129, 300)], 2, 2, 64, 64, "float32")
    a = fa2cpu.flash_attention_varlen(q, k, v, cq, ck, causal=True)
    b = fa2cpu.flash_attention(q[None], k[None], v[None], causal=True, layout="bshd")[0]
    check_close(a, b.astype(np.float64), "float32")


# ------------------------------------------------------------------------------ hostile cu_seqlens

def _base(rng=None):
    rng = rng or np.random.default_rng(0)
    return _packed(rng, [(3, 4), (5, 2), (2, 6)], 2, 2, 8, 8, "float32")


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
@pytest.mark.parametrize("bad", ["non_monotonic", "not_zero_start", "last_not_total", "last_too_big",
                                 "negative", "two_d", "empty"])
def test_bad_cu_seqlens(which, bad):
    q, k, v, cq, ck = _base()
    cu = (cq if which == "cu_seqlens_q" else ck).copy()
    total = cu[-1]
    if bad == "non_monotonic":
        cu[1], cu[2] = cu[2], cu[1]
    elif bad == "not_zero_start":
        cu[0] = 1
    elif bad == "last_not_total":
        cu[-1] = total - 1
    elif bad == "last_too_big":
        cu[-1] = total + 5
    elif bad == "negative":
        cu[1] = -3
    elif bad == "two_d":
        cu = cu[None]
    elif bad == "empty":
        cu = cu[:0]
    args = (cu, ck) if which == "cu_seqlens_q" else (cq, cu)
    out = np.full((q.shape[0], 2, 8), 7, np.float32)
    with pytest.raises(ValueError, match=arg(which)):
        fa2cpu.flash_attention_varlen(q, k, v, *args, out=out)
    assert np.all(out == 7), "out written before the error"


def test_cu_seqlens_batch_mismatch():
    q, k, v, cq, ck = _base()
    with pytest.raises(ValueError, match="cu_seqlens"):
        fa2cpu.flash_attention_varlen(q, k[:4], v[:4], cq, ck[:2])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint8])
def test_cu_seqlens_bad_dtype(dtype):
    q, k, v, cq, ck = _base()
    with pytest.raises((TypeError, ValueError), match=arg("cu_seqlens_q")):
        fa2cpu.flash_attention_varlen(q, k, v, cq.astype(dtype), ck)


def test_max_seqlen_too_small_is_rejected_or_ignored():
    """A wrong max_seqlen must never read or write out of bounds: error, or the right answer."""
    q, k, v, cq, ck = _base()
    try:
        out = fa2cpu.flash_attention_varlen(q, k, v, cq, ck, max_seqlen_q=1, max_seqlen_k=1)
    except ValueError as e:
        assert "max_seqlen" in str(e)
    else:
        check_close(out, ref.varlen_ref(q, k, v, cq, ck)[0], "float32")


def test_varlen_shape_and_dtype_errors():
    q, k, v, cq, ck = _base()
    with pytest.raises(ValueError, match=arg("q")):
        fa2cpu.flash_attention_varlen(q[None], k, v, cq, ck)
    with pytest.raises(ValueError, match=arg("v")):
        fa2cpu.flash_attention_varlen(q, k, v[:, :1], cq, ck)
    with pytest.raises(TypeError, match=arg("k")):
        fa2cpu.flash_attention_varlen(q, k.astype(np.float16), v, cq, ck)
    with pytest.raises(ValueError, match=arg("alibi_slopes")):
        fa2cpu.flash_attention_varlen(q, k, v, cq, ck, alibi_slopes=np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match=arg("out")):
        fa2cpu.flash_attention_varlen(q, k, v, cq, ck, out=np.zeros((q.shape[0], 2, 9), np.float32))
