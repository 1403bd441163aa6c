"""Attention sinks (API.md "sinks"): one raw logit per query head that joins every row's softmax
denominator with no value vector, on every entry point and the backward (``dsinks``).

The float64 oracle (fa2cpu/_reference.py) adds the sink to a finished row (lse' = logaddexp(lse,
sink), out' = out * exp(lse - lse')); its backward treats the sink as one more column of S. The
oracle's dsinks is itself checked by central finite differences of the forward oracle. Kernel
results are compared on every usable family for tile-breaking shapes, GQA, causal/window rows
that see no key, splits, paged caches, layouts and dtypes.
"""
import numpy as np
import pytest

import fa2cpu
from conftest import DTYPES, NP_DTYPES, arg, check_close, qkv, rand, ref


def _sinks(rng, h, scale=2.0):
    return (rng.standard_normal(h) * scale).astype(np.float32)


# ------------------------------------------------------------------------------ the oracle itself

def test_reference_dsinks_by_finite_differences(rng):
    B, Hq, Hk, Nq, Nk, D = 1, 4, 2, 5, 9, 8
    q, k, v = (rng.standard_normal(s) for s in ((B, Hq, Nq, D), (B, Hk, Nk, D), (B, Hk, Nk, D)))
    dout = rng.standard_normal((B, Hq, Nq, D))
    sinks = rng.standard_normal(Hq)
    *_, dsinks = ref.attention_backward_ref(dout, q, k, v, causal=True, sinks=sinks)
    eps = 1e-6
    for h in range(Hq):
        plus, minus = sinks.copy(), sinks.copy()
        plus[h] += eps
        minus[h] -= eps
        fp = (ref.attention_ref(q, k, v, causal=True, sinks=plus)[0] * dout).sum()
        fm = (ref.attention_ref(q, k, v, causal=True, sinks=minus)[0] * dout).sum()
        assert abs((fp - fm) / (2 * eps) - dsinks[h]) < 1e-6 * max(1.0, abs(dsinks[h])), h


def test_reference_without_a_sink_is_unchanged(rng):
    q, k, v = qkv(rng, 1, 2, 2, 7, 9, 8)
    a = ref.attention_ref(q, k, v, causal=True)
    b = ref.attention_ref(q, k, v, causal=True, sinks=np.full(2, -np.inf))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


# ------------------------------------------------------------------------------ forward

SHAPES = [(1, 1), (7, 7), (129, 129), (257, 65), (65, 257), (1, 1031), (300, 300)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Nq,Nk", SHAPES, ids=[f"{a}x{b}" for a, b in SHAPES])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_matches_reference(isa, rng, dtype, Nq, Nk, causal):
    q, k, v = qkv(rng, 2, 4, 2, Nq, Nk, 64, dtype=dtype)
    sinks = _sinks(rng, 4)
    out, lse = fa2cpu.flash_attention(q, k, v, causal=causal, sinks=sinks, return_lse=True)
    r_out, r_lse = ref.attention_ref(q, k, v, causal=causal, sinks=sinks)
    check_close(out, r_out, dtype)
    check_close(lse, r_lse, dtype, "lse")


@pytest.mark.parametrize("options", [dict(window=(16, 0)), dict(softcap=5.0), dict(window=(8, 4), causal=True),
                                     dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32))],
                         ids=["window", "softcap", "window-causal", "alibi"])
def test_forward_with_options(isa, rng, options):
    q, k, v = qkv(rng, 1, 4, 1, 100, 140, 32, layout="bshd")
    sinks = _sinks(rng, 4)
    out, lse = fa2cpu.flash_attention(q, k, v, layout="bshd", sinks=sinks, return_lse=True, **options)
    r_out, r_lse = ref.attention_ref(q, k, v, layout="bshd", sinks=sinks, **options)
    check_close(out, r_out, "float32")
    check_close(lse, r_lse, "float32", "lse")


def test_rows_that_see_no_key_return_zero_with_the_sink_as_lse(isa, rng):
    # causal with Nq > Nk (bottom-right): the first Nq - Nk rows see no key
    q, k, v = qkv(rng, 1, 3, 3, 20, 5, 16)
    sinks = np.array([0.5, -2.0, 7.0], np.float32)
    out, lse = fa2cpu.flash_attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert np.all(out[:, :, :15] == 0)
    np.testing.assert_array_equal(lse[0, :, :15], np.broadcast_to(sinks[:, None], (3, 15)))
    check_close(out, ref.attention_ref(q, k, v, causal=True, sinks=sinks)[0], "float32")


def test_special_sink_values(isa, rng):
    q, k, v = qkv(rng, 1, 4, 4, 33, 40, 16)
    plain, plain_lse = fa2cpu.flash_attention(q, k, v, return_lse=True)
    sinks = np.array([-np.inf, np.inf, np.nan, 0.0], np.float32)
    out, lse = fa2cpu.flash_attention(q, k, v, sinks=sinks, return_lse=True)
    np.testing.assert_array_equal(out[:, 0], plain[:, 0])  # -inf: no sink at all
    np.testing.assert_array_equal(lse[:, 0], plain_lse[:, 0])
    assert np.all(out[:, 1] == 0) and np.all(lse[:, 1] == np.inf)  # +inf: all weight on the sink
    assert np.all(np.isnan(out[:, 2])) and np.all(np.isnan(lse[:, 2]))  # NaN stays in its head
    check_close(out[:, 3], ref.attention_ref(q, k, v, sinks=sinks)[0][:, 3], "float32")


def test_varlen(isa, rng):
    lens_q, lens_k = [5, 0, 130, 1], [9, 3, 130, 300]
    cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    q, k, v = rand(rng, (cu_q[-1], 4, 32)), rand(rng, (cu_k[-1], 2, 32)), rand(rng, (cu_k[-1], 2, 32))
    sinks = _sinks(rng, 4)
    out, lse = fa2cpu.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, sinks=sinks, return_lse=True)
    r_out, r_lse = ref.varlen_ref(q, k, v, cu_q, cu_k, causal=True, sinks=sinks)
    check_close(out, r_out, "float32")
    check_close(lse, r_lse, "float32", "lse")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 0, 5])
def test_kvcache_decode_and_splits(isa, rng, dtype, paged, num_splits):
    B, Hq, Hk, D, cap, block = 2, 8, 2, 64, 1024, 64
    seqlens = np.array([1000, 300], np.int32)
    q = rand(rng, (B, 1, Hq, D), dtype)
    k_new, v_new = rand(rng, (B, 1, Hk, D), dtype), rand(rng, (B, 1, Hk, D), dtype)
    if paged:
        k_cache, v_cache = rand(rng, (B * cap // block, block, Hk, D), dtype), rand(rng, (B * cap // block, block, Hk, D), dtype)
        table = rng.permutation(B * cap // block).astype(np.int32).reshape(B, cap // block)
    else:
        k_cache, v_cache = rand(rng, (B, cap, Hk, D), dtype), rand(rng, (B, cap, Hk, D), dtype)
        table = None
    sinks = _sinks(rng, Hq)
    r_out, r_lse = ref.kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                   sinks=sinks)
    out, lse = fa2cpu.flash_attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                   block_table=table, sinks=sinks, num_splits=num_splits,
                                                   return_lse=True)
    check_close(out, r_out, dtype)
    check_close(lse, r_lse, dtype, "lse")


def test_kvcache_bad_sinks_leave_the_cache_untouched(rng):
    q = rand(rng, (1, 1, 4, 16))
    k_cache, v_cache = rand(rng, (1, 32, 2, 16)), rand(rng, (1, 32, 2, 16))
    before = k_cache.copy(), v_cache.copy()
    with pytest.raises(ValueError, match=arg("sinks")):
        fa2cpu.flash_attention_with_kvcache(q, k_cache, v_cache, rand(rng, (1, 1, 2, 16)), rand(rng, (1, 1, 2, 16)),
                                            cache_seqlens=3, sinks=np.zeros(2, np.float32))
    np.testing.assert_array_equal(k_cache, before[0])
    np.testing.assert_array_equal(v_cache, before[1])


@pytest.mark.parametrize("bad,error", [(np.zeros(3, np.float32), ValueError), (np.zeros((1, 4), np.float32), ValueError),
                                       (np.array(["a"] * 4), TypeError), (np.full(4, 1e300), ValueError)],
                         ids=["short", "2-d", "strings", "beyond-float32"])
def test_errors_name_sinks(rng, bad, error):
    q, k, v = qkv(rng, 1, 4, 2, 3, 3, 8)
    with pytest.raises(error, match=arg("sinks")):
        fa2cpu.flash_attention(q, k, v, sinks=bad)


def test_sinks_are_read_not_kept(rng):
    """A list works; the caller's array is copied (changing it afterwards changes nothing)."""
    q, k, v = qkv(rng, 1, 2, 2, 9, 9, 8)
    sinks = np.array([1.0, -1.0], np.float32)
    a = fa2cpu.flash_attention(q, k, v, sinks=[1.0, -1.0])
    b = fa2cpu.flash_attention(q, k, v, sinks=sinks)
    np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------ backward

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_matches_reference(isa, rng, dtype, causal):
    B, Hq, Hk, Nq, Nk, D = 1, 4, 2, 70, 129, 32
    q, k, v = qkv(rng, B, Hq, Hk, Nq, Nk, D, dtype=dtype)
    dout = rand(rng, (B, Hq, Nq, D), dtype)
    sinks = _sinks(rng, Hq)
    out, lse = fa2cpu.flash_attention(q, k, v, causal=causal, sinks=sinks, return_lse=True)
    grads = fa2cpu.flash_attention_backward(dout, q, k, v, out, lse, causal=causal, sinks=sinks)
    want = ref.attention_backward_ref(dout, q, k, v, causal=causal, sinks=sinks)
    assert len(grads) == 4 and grads[3].dtype == np.float32 and grads[3].shape == (Hq,)
    for name, g, r in zip(("dq", "dk", "dv"), grads[:3], want[:3]):
        check_close(g, r, dtype, name)
    # dsinks sums over every row of a head: compare relative to the size of its terms
    scale = np.abs(want[3]).max() + 1.0
    np.testing.assert_allclose(grads[3] / scale, want[3] / scale, atol=dict(float32=1e-5).get(dtype, 2e-2))


def test_varlen_backward_dsinks(isa, rng):
    lens = [3, 0, 40]
    cu = np.cumsum([0] + lens)
    q, k, v, dout = (rand(rng, (cu[-1], 2, 16)) for _ in range(4))
    sinks = _sinks(rng, 2)
    out, lse = fa2cpu.flash_attention_varlen(q, k, v, cu, cu, causal=True, sinks=sinks, return_lse=True)
    dq, dk, dv, dsinks = fa2cpu.flash_attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, causal=True,
                                                                sinks=sinks)
    want = np.zeros(2)
    for b in range(len(lens)):
        s = slice(cu[b], cu[b + 1])
        if cu[b + 1] > cu[b]:
            *_, ds = ref.attention_backward_ref(dout[None, s], q[None, s], k[None, s], v[None, s], causal=True,
                                                layout="bshd", sinks=sinks)
            want += ds
    np.testing.assert_allclose(dsinks, want, rtol=1e-4, atol=1e-5)
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), (q, k, v)):
        assert g.shape == w.shape, name
