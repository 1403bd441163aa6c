"""Smoke tests: one call of every entry point on every family and dtype, against the oracle.

A quick check that a build works (the packaging checks run these against an installed wheel with
no compiler on PATH, a clang build and the generic-only build; see .ci/packaging). The full grids
live in the other test files.
"""

import numpy as np

import fa2cpu
from conftest import DTYPES, check_close, rand, ref

import pytest


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_entry_point(isa, rng, dtype):
    q, k, v = rand(rng, (2, 4, 37, 40), dtype), rand(rng, (2, 2, 53, 40), dtype), rand(rng, (2, 2, 53, 24), dtype)
    kw = dict(causal=True, window=(20, 3), softcap=15.0, alibi_slopes=np.array([0.1, 0.2, 0.0, 0.3], np.float32))
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True, **kw)
    r_out, r_lse = ref.attention_ref(q, k, v, **kw)
    check_close(out, r_out, dtype)
    check_close(lse, r_lse, dtype, "lse")

    cq, ck = np.array([0, 5, 5, 37]), np.array([0, 20, 31, 53])
    qv, kv_, vv = (a[0].transpose(1, 0, 2) for a in (q, k, v))
    out = fa2cpu.flash_attention_varlen(qv, kv_, vv, cq, ck, causal=True)
    check_close(out, ref.varlen_ref(qv, kv_, vv, cq, ck, causal=True)[0], dtype)

    kc, vc = rand(rng, (2, 64, 2, 40), dtype), rand(rng, (2, 64, 2, 24), dtype)
    qd, kn, vn = rand(rng, (2, 1, 4, 40), dtype), rand(rng, (2, 1, 2, 40), dtype), rand(rng, (2, 1, 2, 24), dtype)
    r_out, _ = ref.kvcache_ref(qd, kc, vc, kn, vn, cache_seqlens=np.array([30, 63], np.int32))
    out = fa2cpu.flash_attention_with_kvcache(qd, kc, vc, kn, vn, cache_seqlens=np.array([30, 63], np.int32))
    check_close(out, r_out, dtype)

    if dtype == "float32":
        q1, k1, v1 = rand(rng, (1, 2, 9, 8)), rand(rng, (1, 1, 11, 8)), rand(rng, (1, 1, 11, 8))
        o1, l1 = fa2cpu.flash_attention(q1, k1, v1, causal=True, return_lse=True)
        do = rand(rng, o1.shape)
        got = fa2cpu.flash_attention_backward(do, q1, k1, v1, o1, l1, causal=True)
        want = ref.attention_backward_ref(do, q1, k1, v1, causal=True)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
