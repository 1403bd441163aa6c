"""flash_attention_backward: gradients of flash_attention.

The float64 oracle ``attention_backward_ref`` (fa2cpu/_reference.py, analytic gradients on the full
score matrix) is itself checked by central finite differences of ``attention_ref`` and, when torch
is importable, by torch autograd. The kernel's gradients are then compared with it (and with torch
autograd through SDPA) on every family for shapes that break the tilings, every option, GQA/MQA, layouts and ranks, strides,
dtypes (TOL table of conftest), empty rows, NaN isolation, bit-identical results for any thread
count, memory and errors.
"""

import textwrap

import numpy as np
import pytest

import fa2cpu
import fa2cpu.backward as bw
from conftest import DTYPES, NP_DTYPES, arg, check_close, check_same, peak_memory_script, rand, ref, run_python

bwd_ref = ref.attention_backward_ref


# ------------------------------------------------------------------------------ helpers

def _inputs(rng, B, Hq, Hk, Nq, Nk, D, Dv=None, dtype="float32", layout="bhsd", qscale=1.0):
    Dv = D if Dv is None else Dv
    if layout == "bhsd":
        shapes = (B, Hq, Nq, D), (B, Hk, Nk, D), (B, Hk, Nk, Dv), (B, Hq, Nq, Dv)
    else:
        shapes = (B, Nq, Hq, D), (B, Nk, Hk, D), (B, Nk, Hk, Dv), (B, Nq, Hq, Dv)
    q, k, v, dout = (rand(rng, s, dtype) for s in shapes)
    if qscale != 1.0:
        q = (q.astype(np.float32) * np.float32(qscale)).astype(q.dtype)
    return dout, q, k, v


def _backward(dout, q, k, v, **kw):
    """Forward by the kernel (out, lse), then the backward."""
    fwd = {key: val for key, val in kw.items() if key != "num_threads"}
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True, **fwd)
    return fa2cpu.flash_attention_backward(dout, q, k, v, out, lse, **kw)


def _check(grads, dout, q, k, v, what="", **kw):
    """Kernel grads vs the float64 oracle: dtype, shapes, values (TOL[dtype]), no NaN."""
    want = bwd_ref(dout, q, k, v, **kw)
    for name, g, r, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert g.dtype == q.dtype, f"{name}: dtype {g.dtype}"
        assert g.shape == x.shape, f"{name}: shape {g.shape} != {x.shape}"
        assert not np.isnan(g.astype(np.float32)).any(), f"{name}: NaN {what}"
        check_close(g, r, q.dtype, what=f"{name} {what}")
    return want


def _varlen_inputs(rng, dtype, Hq=4, Hk=2, D=16, Dv=8):
    """Five packed sequences, one without queries and one without keys, and keys without
    queries: lengths, cu_seqlens (int64 for q, int32 for k) and q, k, v."""
    lq, lk = [3, 0, 17, 1, 9], [5, 4, 17, 0, 30]
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q, k, v = rand(rng, (cq[-1], Hq, D), dtype), rand(rng, (ck[-1], Hk, D), dtype), rand(rng, (ck[-1], Hk, Dv), dtype)
    return lq, lk, cq, ck, q, k, v


def _run(rng, B, Hq, Hk, Nq, Nk, D, Dv=None, dtype="float32", layout="bhsd", **kw):
    dout, q, k, v = _inputs(rng, B, Hq, Hk, Nq, Nk, D, Dv, dtype, layout)
    grads = _backward(dout, q, k, v, layout=layout, **kw)
    return _check(grads, dout, q, k, v, what=str(kw), layout=layout, **kw), grads


# ------------------------------------------------------------------------------ the oracle itself

ORACLE_CASES = {
    "plain": dict(B=1, Hq=1, Hk=1, Nq=3, Nk=4, D=3, Dv=2, kw={}),
    "gqa-causal-nq<nk": dict(B=1, Hq=2, Hk=1, Nq=3, Nk=5, D=3, Dv=2, kw=dict(causal=True, scale=0.7)),
    "window-softcap-alibi-bh": dict(B=2, Hq=2, Hk=1, Nq=4, Nk=3, D=2, Dv=3,
                                    kw=dict(window=(1, 0), softcap=0.8, alibi="bh")),
    "softcap-alibi-h-empty-rows": dict(B=1, Hq=2, Hk=2, Nq=5, Nk=2, D=2, Dv=2,
                                       kw=dict(causal=True, softcap=1.5, alibi="h")),
}


def _oracle_kw(kw, B, Hq, rng):
    kw = dict(kw)
    if kw.get("alibi") == "h":
        kw["alibi_slopes"] = rng.random(Hq).astype(np.float32)
    elif kw.get("alibi") == "bh":
        kw["alibi_slopes"] = rng.random((B, Hq)).astype(np.float32)
    kw.pop("alibi", None)
    return kw


@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_oracle_finite_differences(case, rng):
    """Central differences of sum(attention_ref(q, k, v) * dout), every input entry, float64."""
    c = ORACLE_CASES[case]
    kw = _oracle_kw(c["kw"], c["B"], c["Hq"], rng)
    dout, q, k, v = (x.astype(np.float64) * 1.5 for x in
                     _inputs(rng, c["B"], c["Hq"], c["Hk"], c["Nq"], c["Nk"], c["D"], c["Dv"]))
    grads = bwd_ref(dout, q, k, v, **kw)
    eps = 1e-6

    def loss(qq, kk, vv):
        return float(np.sum(ref.attention_ref(qq, kk, vv, **kw)[0] * dout))

    for idx, (name, x, g) in enumerate(zip("qkv", (q, k, v), grads)):
        fd = np.zeros_like(x)
        for pos in np.ndindex(x.shape):
            args = [q, k, v]
            plus, minus = x.copy(), x.copy()
            plus[pos] += eps
            minus[pos] -= eps
            args[idx] = plus
            lp = loss(*args)
            args[idx] = minus
            fd[pos] = (lp - loss(*args)) / (2 * eps)
        np.testing.assert_allclose(g, fd, atol=1e-7, rtol=1e-6, err_msg=f"d{name} ({case})")
    if case.endswith("empty-rows"):  # Nq - Nk = 3 rows see nothing under bottom-right causal
        assert np.all(grads[0][0, :, :3] == 0)


def _torch_grads(torch, dout, q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=None,
                 alibi_slopes=None):
    """Torch autograd in float64, bhsd 4-D, GQA by repeat_interleave (autograd sums the group),
    bottom-right masks given explicitly (torch's is_causal is top-left aligned)."""
    B, Hq, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    tq, tk, tv = (torch.tensor(x.astype(np.float64), requires_grad=True) for x in (q, k, v))
    kr = tk.repeat_interleave(Hq // Hk, dim=1)
    vr = tv.repeat_interleave(Hq // Hk, dim=1)
    vis = torch.from_numpy(ref.visible_band(Nq, Nk, causal=causal, window=window))
    bias = torch.zeros(B, Hq, Nq, Nk, dtype=torch.float64)
    if alibi_slopes is not None:
        sl = torch.from_numpy(np.broadcast_to(alibi_slopes.astype(np.float64), (B, Hq)).copy())
        i = torch.arange(Nq)[:, None]
        j = torch.arange(Nk)[None, :]
        bias = bias - sl[:, :, None, None] * (i + Nk - Nq - j).abs().to(torch.float64)
    sc = 1 / np.sqrt(D) if scale is None else scale
    if softcap is None:
        # SDPA itself, float mask = bias + -inf outside the band
        m = bias.masked_fill(~vis, float("-inf"))
        out = torch.nn.functional.scaled_dot_product_attention(tq, kr, vr, attn_mask=m, scale=sc)
    else:
        s = softcap * torch.tanh((tq @ kr.transpose(-1, -2)) * sc / softcap) + bias
        out = torch.softmax(s.masked_fill(~vis, float("-inf")), -1) @ vr
    out.backward(torch.from_numpy(dout.astype(np.float64)))
    return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


TORCH_CASES = [
    dict(B=2, Hq=3, Hk=3, Nq=9, Nk=9, D=8, Dv=8, kw={}),
    dict(B=1, Hq=4, Hk=2, Nq=6, Nk=13, D=8, Dv=5, kw=dict(causal=True)),
    dict(B=1, Hq=4, Hk=1, Nq=13, Nk=6, D=4, Dv=7, kw=dict(window=(2, 3), scale=0.3)),
    dict(B=2, Hq=2, Hk=1, Nq=8, Nk=11, D=8, Dv=8, kw=dict(causal=True, softcap=2.0, alibi="bh")),
    dict(B=1, Hq=2, Hk=2, Nq=10, Nk=10, D=8, Dv=4, kw=dict(window=(3, -1), alibi="h")),
]


@pytest.mark.parametrize("case", range(len(TORCH_CASES)))
def test_oracle_vs_torch_autograd(case, rng):
    torch = pytest.importorskip("torch")
    c = TORCH_CASES[case]
    kw = _oracle_kw(c["kw"], c["B"], c["Hq"], rng)
    dout, q, k, v = (x * 2 for x in _inputs(rng, c["B"], c["Hq"], c["Hk"], c["Nq"], c["Nk"], c["D"], c["Dv"]))
    for g, t, name in zip(bwd_ref(dout, q, k, v, **kw), _torch_grads(torch, dout, q, k, v, **kw), "qkv"):
        np.testing.assert_allclose(g, t, atol=1e-10, rtol=1e-10, err_msg=f"d{name}")


def test_kernel_vs_torch_autograd(rng):
    """Second opinion on the kernel itself (float32), GQA + bottom-right causal + alibi + Nq != Nk."""
    torch = pytest.importorskip("torch")
    dout, q, k, v = _inputs(rng, 2, 4, 2, 37, 70, 32, 24)
    slopes = rng.random(4).astype(np.float32)
    kw = dict(causal=True, alibi_slopes=slopes)
    for g, t in zip(_backward(dout, q, k, v, **kw), _torch_grads(torch, dout, q, k, v, **kw)):
        check_close(g, t, "float32")


# ------------------------------------------------------------------------------ kernel vs oracle

@pytest.mark.parametrize("Nq,Nk", [(1, 1), (7, 7), (1, 300), (300, 1), (255, 256), (256, 255), (256, 256),
                                   (257, 257), (131, 17), (17, 131), (509, 263)])
@pytest.mark.parametrize("causal", [False, True])
def test_lengths(Nq, Nk, causal, rng):
    _run(rng, 1, 2, 1, Nq, Nk, 16, 8, causal=causal)


@pytest.mark.parametrize("D,Dv", [(1, 1), (3, 5), (64, 64), (80, 48), (100, 72), (128, 256), (256, 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_dims_per_isa(D, Dv, dtype, isa, rng):
    """Head dims whole, partial and below the families' 16 x 16 transposes (100 / 72: whole
    blocks plus a tail), 2 heads x 33 rows (a partial row block)."""
    _run(rng, 1, 2, 2, 33, 45, D, Dv, dtype=dtype, causal=True)


@pytest.mark.parametrize("Hq,Hk", [(8, 2), (4, 1), (6, 3), (5, 5)])
def test_gqa_mqa(Hq, Hk, rng):
    """dk/dv summed over the query heads of a group (the oracle sums by construction)."""
    _, grads = _run(rng, 2, Hq, Hk, 40, 29, 16, 12, causal=True)
    if Hk == 1:
        # MQA: dk is the sum over all query heads of per-head gradients computed with Hk = Hq
        dout, q, k, v = _inputs(rng, 1, Hq, 1, 11, 13, 8)
        _, dk, dv = _backward(dout, q, k, v)
        kr, vr = np.repeat(k, Hq, axis=1), np.repeat(v, Hq, axis=1)
        _, dk_r, dv_r = _backward(dout, q, kr, vr)
        check_close(dk, dk_r.sum(axis=1, keepdims=True, dtype=np.float64), "float32", what="dk")
        check_close(dv, dv_r.sum(axis=1, keepdims=True, dtype=np.float64), "float32", what="dv")


@pytest.mark.parametrize("Nq,Nk", [(40, 40), (23, 61), (61, 23)])
@pytest.mark.parametrize("opts", [
    dict(window=(5, 3)), dict(window=(0, 0)), dict(window=(-1, 4)), dict(window=(7, -1)),
    dict(window=(6, 9), causal=True), dict(softcap=1.0), dict(softcap=30.0, causal=True),
    dict(alibi="h"), dict(alibi="bh", causal=True), dict(scale=0.05), dict(scale=-0.4, softcap=2.0),
    dict(window=(4, 2), softcap=1.5, alibi="bh", scale=0.3),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_options(Nq, Nk, opts, rng):
    kw = _oracle_kw(opts, 2, 4, rng)
    _run(rng, 2, 4, 2, Nq, Nk, 16, 12, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_per_isa(dtype, isa, rng):
    """out/lse from each kernel family; low-precision gradients within TOL[dtype]."""
    slopes = rng.random(4).astype(np.float32)
    _run(rng, 1, 4, 2, 70, 90, 64, 32, dtype=dtype, causal=True, softcap=5.0, alibi_slopes=slopes)
    _run(rng, 2, 2, 1, 129, 33, 48, 48, dtype=dtype, layout="bshd", window=(8, 4))


def test_out_and_lse_from_the_oracle(rng):
    """The backward needs only a correct (out, lse), whoever computed it."""
    dout, q, k, v = _inputs(rng, 1, 2, 1, 50, 64, 16, 16)
    out, lse = ref.attention_ref(q, k, v, causal=True)
    grads = fa2cpu.flash_attention_backward(dout, q, k, v, out.astype(np.float32), lse.astype(np.float32),
                                            causal=True)
    _check(grads, dout, q, k, v, causal=True)


# Tile sizes of the families' backward (csrc/kernels/common/backward_loop.h): key tiles of 128
# (avx2, AVX-512 families) or 64 (generic) keys, row blocks of 96 (64: the amx family's float32)
# / 16 / 8 rows (heads x queries), and the driver's key splits at tile multiples. Shapes around
# them, primes, Nq != Nk both ways.
TILE_EDGE_SHAPES = [(1, 7), (7, 1), (63, 65), (65, 63), (64, 64), (127, 129), (129, 127), (128, 128),
                    (97, 193), (191, 97), (257, 131)]


@pytest.mark.parametrize("Nq,Nk", TILE_EDGE_SHAPES)
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window=(3, 2), softcap=2.0, alibi="h")],
                         ids=["plain", "causal", "window-softcap-alibi"])
def test_tile_edges_per_isa(Nq, Nk, opts, isa, rng):
    """Every family across its tile edges: partial key tiles, partial row blocks (3 heads per kv
    head: rows = 3 Nq), band-skipped blocks and key splits whose dq partials are summed."""
    kw = _oracle_kw(opts, 1, 3, rng)
    _run(rng, 1, 3, 1, Nq, Nk, 8, 5, **kw)


def test_layouts_and_ranks(rng):
    dout, q, k, v = _inputs(rng, 2, 3, 3, 21, 17, 8, 6)
    kw = dict(causal=True, window=(5, -1))
    g4 = _backward(dout, q, k, v, **kw)
    _check(g4, dout, q, k, v, **kw)
    t = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))  # noqa: E731
    gs = _backward(t(dout), t(q), t(k), t(v), layout="bshd", **kw)
    for a, b in zip(gs, g4):
        check_same(a.transpose(0, 2, 1, 3), b, "float32")
    g3 = _backward(dout[1], q[1], k[1], v[1], **kw)
    g2 = _backward(dout[1, 2], q[1, 2], k[1, 2], v[1, 2], **kw)
    for a3, a2, b in zip(g3, g2, g4):
        assert a3.shape == b.shape[1:] and a2.shape == b.shape[2:]
        check_same(a3, b[1], "float32")
        check_same(a2, b[1, 2], "float32")
    # 2-D / 3-D lse are (Nq,) / (Hq, Nq)
    out, lse = fa2cpu.flash_attention(q[1, 2], k[1, 2], v[1, 2], return_lse=True, **kw)
    assert lse.shape == (21,)
    fa2cpu.flash_attention_backward(dout[1, 2], q[1, 2], k[1, 2], v[1, 2], out, lse, **kw)


def test_strides_do_not_matter(rng):
    """Non-contiguous, negative-stride and broadcast (zero-stride) inputs give the same gradients."""
    dout, q, k, v = _inputs(rng, 2, 4, 2, 30, 26, 16, 8)
    kw = dict(causal=True, softcap=3.0)
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True, **kw)
    base = fa2cpu.flash_attention_backward(dout, q, k, v, out, lse, **kw)
    big = [np.zeros(x.shape[:-1] + (2 * x.shape[-1],), np.float32) for x in (dout, q, k, v, out)]
    views = []
    for b, x in zip(big, (dout, q, k, v, out)):
        b[..., ::2] = x
        views.append(b[..., ::2])
    flipped = [np.flip(np.flip(x, 2).copy(), 2) for x in (dout, q, k, v, out)]
    lse_f = np.asfortranarray(lse)
    for args in (views, flipped, [np.asfortranarray(x) for x in (dout, q, k, v, out)]):
        got = fa2cpu.flash_attention_backward(*args[:4], args[4], lse_f, **kw)
        for a, b in zip(got, base):
            check_same(a, b, "float32")
    # K/V broadcast over the batch: dk/dv are per batch entry (the output is never broadcast)
    k1, v1 = np.broadcast_to(k[:1], k.shape), np.broadcast_to(v[:1], v.shape)
    out1, lse1 = fa2cpu.flash_attention(q, k1, v1, return_lse=True, **kw)
    got = fa2cpu.flash_attention_backward(dout, q, k1, v1, out1, lse1, **kw)
    assert all(g.strides[0] != 0 for g in got)
    _check(got, dout, q, k1, v1, **kw)


def test_bf16_rows_taken_as_they_are_match_strided_rows(isa, rng):
    """Contiguous bf16 rows reach the amx family's operands as they are (backward_loop.h
    pack_row_raw / pack_key_raw; the avx512bf16 family too); rows with a feature stride go
    through float32 rows. Same bits either way, with bf16 denormals in every input (read as zero by
    the tile products), head dims that are not whole tiles (odd ones past a whole 32-feature
    block: K^T's transpose tail) and keys that are not whole 16-key blocks, on every family."""
    for B, Hq, Hk, Nq, Nk, D, Dv, causal in ((2, 4, 2, 37, 53, 40, 24, True), (1, 2, 1, 70, 300, 128, 72, False),
                                             (1, 2, 2, 20, 37, 65, 33, True)):
        dout, q, k, v = _inputs(rng, B, Hq, Hk, Nq, Nk, D, Dv, "bfloat16")
        for x in (dout, q, k, v):
            x.view(np.uint16).reshape(-1)[::29] = 0x0003  # denormals
        out, lse = fa2cpu.flash_attention(q, k, v, causal=causal, return_lse=True)
        base = fa2cpu.flash_attention_backward(dout, q, k, v, out, lse, causal=causal)
        views = []
        for x in (dout, q, k, v, out):
            wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
            wide[..., ::2] = x
            views.append(wide[..., ::2])
        got = fa2cpu.flash_attention_backward(*views[:5], lse, causal=causal)
        for name, a, b in zip(("dq", "dk", "dv"), got, base):
            assert a.tobytes() == b.tobytes(), f"{name}: strided rows changed the bits"
        _check(base, dout, q, k, v, causal=causal)


def test_inputs_untouched_and_fresh_outputs(rng):
    dout, q, k, v = _inputs(rng, 1, 2, 1, 12, 9, 8)
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True)
    saved = [x.copy() for x in (dout, q, k, v, out, lse)]
    grads = fa2cpu.flash_attention_backward(dout, q, k, v, out, lse)
    for x, y in zip((dout, q, k, v, out, lse), saved):
        np.testing.assert_array_equal(x, y)
    for g in grads:
        assert g.flags.c_contiguous and g.flags.writeable
        assert not any(np.may_share_memory(g, x) for x in (dout, q, k, v, out, lse))


def test_rows_without_keys_contribute_nothing(rng):
    # bottom-right causal with Nq > Nk: the first Nq - Nk rows see nothing (lse = -inf)
    dout, q, k, v = _inputs(rng, 1, 2, 1, 12, 4, 8)
    out, lse = fa2cpu.flash_attention(q, k, v, causal=True, return_lse=True)
    assert np.all(np.isneginf(lse[:, :, :8]))
    dq, dk, dv = fa2cpu.flash_attention_backward(dout, q, k, v, out, lse, causal=True)
    assert not any(np.isnan(g).any() for g in (dq, dk, dv))
    assert np.all(dq[:, :, :8] == 0)
    # dk/dv are those of the live rows alone (the dead rows' huge q/dout must not leak in)
    q2, dout2 = q.copy(), dout.copy()
    q2[:, :, :8] = 1e4
    dout2[:, :, :8] = 1e4
    _, dk2, dv2 = fa2cpu.flash_attention_backward(dout2, q2, k, v, out, lse, causal=True)
    check_same(dk2, dk, "float32")
    check_same(dv2, dv, "float32")
    # window rows with nothing visible (Nq > Nk, window right of the diagonal only)
    _run(rng, 1, 2, 2, 30, 10, 8, window=(0, 3))
    # Nk = 0: nothing visible anywhere; Nq = 0: nothing asks
    dout, q, k, v = _inputs(rng, 1, 2, 1, 5, 0, 8, 3)
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True)
    dq, dk, dv = fa2cpu.flash_attention_backward(dout, q, k, v, out, lse)
    assert np.all(dq == 0) and dk.shape == (1, 1, 0, 8) and dv.shape == (1, 1, 0, 3)
    dout, q, k, v = _inputs(rng, 1, 2, 1, 0, 6, 8, 3)
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True)
    dq, dk, dv = fa2cpu.flash_attention_backward(dout, q, k, v, out, lse)
    assert dq.shape == (1, 2, 0, 8) and np.all(dk == 0) and np.all(dv == 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_gradient_element_is_written(isa, rng, dtype, monkeypatch):
    """The gradients start uninitialised (backward.py _gradients): here they start as NaN, so an
    element the core leaves unwritten shows. Rows that see no key, sequences without keys or
    queries, no query heads, split kv heads (one kv head, long causal window: several key ranges whose dq
    partials the driver sums), GQA in bshd and varlen with empty sequences, on every family."""
    monkeypatch.setattr(bw, "_uninitialised", lambda shape, dtype: np.full(shape, np.nan, dtype))
    _run(rng, 1, 2, 1, 12, 4, 8, dtype=dtype, causal=True)            # the first 8 rows see nothing
    _run(rng, 1, 2, 2, 30, 10, 8, dtype=dtype, window=(0, 3))         # window rows with nothing
    _run(rng, 1, 4, 1, 70, 700, 32, 16, dtype=dtype, causal=True, window=(150, 0))  # split kv head
    _run(rng, 2, 6, 2, 33, 47, 24, 40, dtype=dtype, layout="bshd", causal=True)
    for hq, nq, nk in ((2, 5, 0), (2, 0, 6), (0, 4, 6)):  # no keys; no query rows; no query heads
        dout, q, k, v = _inputs(rng, 1, hq, 1, nq, nk, 8, 3, dtype)
        out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True)
        for g in fa2cpu.flash_attention_backward(dout, q, k, v, out, lse):
            assert np.all(g.astype(np.float32) == 0)
    lq, lk, cq, ck, q, k, v = _varlen_inputs(rng, dtype)
    out, lse = fa2cpu.flash_attention_varlen(q, k, v, cq, ck, return_lse=True, causal=True)
    grads = fa2cpu.flash_attention_varlen_backward(rand(rng, out.shape, dtype), q, k, v, out, lse, cq, ck, causal=True)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert not np.isnan(g.astype(np.float32)).any(), f"{name}: an element left unwritten"


@pytest.mark.parametrize("dtype", DTYPES)
def test_kept_gradient_memory_is_reused_only_when_dropped(rng, dtype):
    """Gradients live in kept memory (_core.gradient_array): a call while earlier gradients (or a
    view of one) are alive never writes into them, and memory comes back for reuse only once the
    last array of it is gone. Each call still matches the oracle."""
    from fa2cpu import _core
    if bw._uninitialised is not _core.gradient_array:
        pytest.fail("flash_attention_backward does not allocate through _core.gradient_array")
    dout, q, k, v = _inputs(rng, 1, 2, 1, 37, 29, 8, 5, dtype)
    first = _backward(dout, q, k, v, causal=True)
    _check(first, dout, q, k, v, causal=True)
    held = [g.copy() for g in first]
    addr = [g.__array_interface__["data"][0] for g in first]
    view = first[0][0, 1]                                   # a view of dq: keeps its memory
    second = _backward(dout, rand(rng, q.shape, dtype), k, rand(rng, v.shape, dtype), causal=True)
    assert not any(np.shares_memory(a, b) for a, b in zip(first, second))
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(first, held))  # untouched
    del first                                               # dk, dv come back; dq stays (the view)
    third = _backward(dout, q, k, v, causal=True)
    assert [g.__array_interface__["data"][0] for g in third[1:]] == addr[1:], "dk / dv memory not reused"
    assert not np.shares_memory(view, third[0])
    assert np.array_equal(view.view(np.uint8), held[0][0, 1].view(np.uint8)), "a live view was overwritten"
    _check(third, dout, q, k, v, causal=True)
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(third, held))  # same inputs, bits
    fourth = _backward(dout, q, k, v, causal=True)          # a block is handed out once
    assert not any(np.shares_memory(a, b) for a, b in zip(third, fourth))


def test_kept_gradient_memory_limit():
    """FA2CPU_KEEP_GRADIENTS_MB caps the kept memory (0: nothing is kept; a value that is not a
    non-negative integer: the default, 256); a block larger than the cap is freed, the oldest
    blocks go first."""
    code = """
        import os, numpy as np, fa2cpu
        from fa2cpu import _core
        seen = []
        for n in (1 << 18, 1 << 19, 1 << 20, 3 << 18):     # float32 elements: 1, 2, 4, 3 MB
            a = _core.gradient_array((n,), np.float32)
            a[:] = 1.0
            del a
            seen.append(_core.kept_gradient_bytes())
        print(*seen)
    """
    default = [1 << 20, 3 << 20, 7 << 20, 10 << 20]
    for mb, want in (("0", [0, 0, 0, 0]), ("3", [1 << 20, 3 << 20, 3 << 20, 3 << 20]), ("256", default),
                     ("-1", default), ("lots", default), ("", default)):  # not a count: the default
        res = run_python(textwrap.dedent(code), env={"FA2CPU_KEEP_GRADIENTS_MB": mb})
        assert res.returncode == 0, res.stderr[-2000:]
        assert [int(x) for x in res.stdout.split()] == want, (mb, res.stdout)


def test_nan_stays_in_affected_rows(rng):
    """NaN in q row 3 of head 0 (causal): dq of the other rows and heads, dv of the keys row 3
    cannot see and everything of the other kv head / batch entry stay finite. (dk of keys in
    row 3's tile may get NaN through 0 * NaN in dS^T Q, exactly as in the float64 oracle, torch
    autograd and flash-attn.)"""
    dout, q, k, v = _inputs(rng, 2, 2, 2, 20, 20, 8)
    q[0, 0, 3, 1] = np.nan
    dq, dk, dv = _backward(dout, q, k, v, causal=True)
    assert np.isnan(dq[0, 0, 3]).all()
    rows = [i for i in range(20) if i != 3]
    assert np.isfinite(dq[0, 0, rows]).all() and np.isfinite(dq[0, 1]).all() and np.isfinite(dq[1]).all()
    assert np.isnan(dk[0, 0, :4]).any() and np.isnan(dv[0, 0, :4]).any()
    assert np.isfinite(dv[0, 0, 4:]).all()
    assert np.isfinite(dk[0, 1]).all() and np.isfinite(dv[0, 1]).all()
    assert np.isfinite(dk[1]).all() and np.isfinite(dv[1]).all()


DETERMINISM_SHAPES = [
    dict(B=1, Hq=1, Hk=1, Nq=300, Nk=270),    # one kv head: the key axis split 3 ways, dq partials summed
    dict(B=3, Hq=4, Hk=2, Nq=129, Nk=257),    # splits of several heads, GQA
    dict(B=2, Hq=64, Hk=32, Nq=33, Nk=200),   # 64 kv heads: no split, each item writes its dq
    dict(B=1, Hq=2, Hk=2, Nq=1, Nk=500),      # decode-like rows
    dict(B=1, Hq=4, Hk=2, Nq=600, Nk=700),    # dq sums of 1200 rows a kv head: several row chunks each
    # on 2 CPUs 4 splits a kv head; with the fine schedule tail forced on there (the sanitized CI
    # build, .ci/sanitize), the last kv head in 8 (on 16 CPUs every kv head takes 8 anyway)
    dict(B=1, Hq=8, Hk=4, Nq=300, Nk=1100),
]


@pytest.mark.parametrize("shape", range(len(DETERMINISM_SHAPES)))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_threads_give_identical_bits(shape, dtype, isa, rng):
    """The same bits for 1, 2, 3 and the default number of threads (no atomics, fixed reduction
    order), on every family, whether or not the key axis is split."""
    c = DETERMINISM_SHAPES[shape]
    dout, q, k, v = _inputs(rng, c["B"], c["Hq"], c["Hk"], c["Nq"], c["Nk"], 32, 16, dtype)
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True, causal=True)
    results = [fa2cpu.flash_attention_backward(dout, q, k, v, out, lse, causal=True, num_threads=n)
               for n in (1, 2, 3, None)]
    for n, other in zip((2, 3, None), results[1:]):
        for name, a, b in zip(("dq", "dk", "dv"), other, results[0]):
            assert a.tobytes() == b.tobytes(), f"{name}: num_threads={n} differs from 1"
    _check(results[0], dout, q, k, v, causal=True)


def test_varlen_threads_give_identical_bits(rng):
    lq, lk = [3, 0, 170, 1, 9], [5, 4, 300, 0, 130]
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    q, k, v = rand(rng, (cq[-1], 4, 16)), rand(rng, (ck[-1], 2, 16)), rand(rng, (ck[-1], 2, 8))
    out, lse = fa2cpu.flash_attention_varlen(q, k, v, cq, ck, return_lse=True, causal=True)
    do = rand(rng, out.shape)
    one = fa2cpu.flash_attention_varlen_backward(do, q, k, v, out, lse, cq, ck, causal=True, num_threads=1)
    two = fa2cpu.flash_attention_varlen_backward(do, q, k, v, out, lse, cq, ck, causal=True, num_threads=2)
    for a, b in zip(one, two):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_vs_torch_sdpa_autograd_per_isa(dtype, causal, isa, rng):
    """Each family's gradients against torch autograd through scaled_dot_product_attention (float64,
    from the same rounded inputs), within TOL[dtype]: GQA, Nq != Nk, D != Dv, tile-crossing sizes."""
    torch = pytest.importorskip("torch")
    dout, q, k, v = _inputs(rng, 1, 4, 2, 131, 200, 40, 24, dtype)
    grads = _backward(dout, q, k, v, causal=causal)
    f32 = [x.astype(np.float32) for x in (dout, q, k, v)]
    for name, g, t in zip(("dq", "dk", "dv"), grads, _torch_grads(torch, *f32, causal=causal)):
        check_close(g, t, dtype, what=name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kept_dq_partials_hold_nothing_over(dtype, isa, rng):
    """The calling thread keeps its dq partials buffer (split kv heads) for its next call: a call
    after a larger one with other values (left in that buffer) gets the same bits as before it,
    and the oracle's values, on every family, causal with rows that see none of a split's keys."""
    small = _inputs(rng, 1, 2, 1, 70, 400, 32, 16, dtype)
    large = _inputs(rng, 2, 4, 2, 300, 700, 32, 16, dtype, qscale=30.0)
    def grads(x):
        return _backward(*x, causal=True, window=(150, 0), num_threads=2)
    first = grads(small)
    grads(large)
    again = grads(small)
    for name, a, b in zip(("dq", "dk", "dv"), again, first):
        assert a.tobytes() == b.tobytes(), f"{name} changed after a larger call"
    _check(again, *small, causal=True, window=(150, 0))


def test_concurrent_calls(rng):
    """Calls from several Python threads at once (they share the library's pool) agree bit for bit."""
    from concurrent.futures import ThreadPoolExecutor
    dout, q, k, v = _inputs(rng, 2, 2, 1, 90, 300, 16)
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True)
    want = fa2cpu.flash_attention_backward(dout, q, k, v, out, lse)
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(fa2cpu.flash_attention_backward, dout, q, k, v, out, lse, num_threads=1 + i % 2)
                for i in range(8)]
        for f in futs:
            for a, b in zip(f.result(), want):
                assert a.tobytes() == b.tobytes()


MEMORY_SCRIPT = """
    n, d = int(sys.argv[1]), int(sys.argv[2])
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 1, n, d), dtype=np.float32) for _ in range(4))
    out, lse = fa2cpu.flash_attention(q, k, v, causal=True, return_lse=True)
    s = slice(0, 64)
    fa2cpu.flash_attention_backward(do[:, :, s], q[:, :, s], k[:, :, s], v[:, :, s], out[:, :, s],
                                    lse[:, :, s], causal=True)
    base = hwm_kib()
    dq, dk, dv = fa2cpu.flash_attention_backward(do, q, k, v, out, lse, causal=True)
    print(json.dumps({"extra_mib": (hwm_kib() - base) / 1024, "finite": bool(np.isfinite(dq).all())}))
"""


def test_memory_is_not_quadratic():
    """8192 x 8192: the score matrix alone would be 256 MiB; the backward stays far below."""
    info = peak_memory_script(MEMORY_SCRIPT, 8192, 64)
    assert info["finite"]
    assert info["extra_mib"] < 48, info


# ------------------------------------------------------------------------------ errors

def _args(dtype="float32", rank=4):
    rng = np.random.default_rng(0)
    dout, q, k, v = _inputs(rng, 2, 4, 2, 5, 7, 8, 6, dtype)
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True)
    lift = (0,) * (4 - rank)
    return dict(dout=dout[lift], q=q[lift], k=k[lift], v=v[lift], out=out[lift], lse=lse[lift])


def _call(a, **kw):
    return fa2cpu.flash_attention_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], **kw)


@pytest.mark.parametrize("which", ["dout", "q", "k", "v", "out"])
@pytest.mark.parametrize("bad", [np.float64, np.int32, "float16", "bfloat16"])
def test_dtype_errors(which, bad):
    a = _args()
    a[which] = a[which].astype(NP_DTYPES.get(bad, bad) if isinstance(bad, str) else bad)
    with pytest.raises(TypeError, match=arg(which)):
        _call(a)


def test_all_low_precision_accepted():
    for dt in DTYPES:
        dq, dk, dv = _call(_args(dt))
        assert dq.dtype == dk.dtype == dv.dtype == NP_DTYPES[dt]


@pytest.mark.parametrize("bad", [np.float64, np.float16])
def test_lse_dtype_error(bad):
    a = _args()
    a["lse"] = a["lse"].astype(bad)
    with pytest.raises(TypeError, match=arg("lse")):
        _call(a)


@pytest.mark.parametrize("rank", [2, 3, 4])
@pytest.mark.parametrize("which,cut", [("dout", -1), ("out", -1), ("dout", -2), ("out", 0), ("lse", -1),
                                       ("lse", 0)])
def test_shape_errors_name_argument_and_shapes(rank, which, cut):
    a = _args(rank=rank)
    x = a[which]
    if cut == 0:
        x = x[None]                              # one axis too many
    else:
        sl = [slice(None)] * x.ndim
        sl[cut] = slice(0, x.shape[cut] - 1)
        x = x[tuple(sl)]
    a[which] = x
    with pytest.raises(ValueError, match=arg(which)) as info:
        _call(a)
    msg = str(info.value)
    assert str(tuple(x.shape)) in msg and str(tuple(a[which].shape)) in msg


@pytest.mark.parametrize("mutate,exc,name", [
    (lambda a: a.update(k=a["k"][:, :, :, :4]), ValueError, "k"),           # D mismatch
    (lambda a: a.update(q=a["q"][:, :3]), ValueError, "q"),                  # Hq % Hk
    (lambda a: a.update(v=a["v"][:, :, :6]), ValueError, "v"),              # Nk mismatch
    (lambda a: a.update(v=a["v"][:, :1]), ValueError, "v"),                 # Hk mismatch
    (lambda a: a.update(k=a["k"][:1]), ValueError, "k"),                    # batch
    (lambda a: a.update(q=a["q"][0]), ValueError, "k"),                     # rank mismatch
    (lambda a: a.update(q=None), TypeError, "q"),
], ids=["head-dim", "gqa", "nk", "hk", "batch", "rank", "none"])
def test_input_shape_errors(mutate, exc, name):
    a = _args()
    mutate(a)
    with pytest.raises(exc, match=arg(name)):
        _call(a)


def test_head_dim_limit():
    rng = np.random.default_rng(0)
    dout, q, k, v = _inputs(rng, 1, 1, 1, 2, 2, 257, 4)
    out = np.zeros(dout.shape, np.float32)
    lse = np.zeros((1, 1, 2), np.float32)
    with pytest.raises(ValueError, match=arg("q")):
        fa2cpu.flash_attention_backward(dout, q, k, v, out, lse)


@pytest.mark.parametrize("kw,exc,name", [
    (dict(layout="bsdh"), ValueError, "layout"),
    (dict(window=(2,)), ValueError, "window"),
    (dict(window=(-2, 0)), ValueError, "window"),
    (dict(window=(1.5, 0)), TypeError, "window"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap="x"), TypeError, "softcap"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale="x"), TypeError, "scale"),
    (dict(causal=1), TypeError, "causal"),
    (dict(num_threads=0), ValueError, "num_threads"),
    (dict(num_threads=1.0), TypeError, "num_threads"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.ones((3, 4), np.float32)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.ones(4)), TypeError, "alibi_slopes"),
], ids=lambda x: str(x) if isinstance(x, str) else None)
def test_option_errors(kw, exc, name):
    with pytest.raises(exc, match=arg(name)):
        _call(_args(), **kw)


def test_bshd_needs_4d():
    a = _args(rank=3)
    with pytest.raises(ValueError, match=arg("q")):
        _call(a, layout="bshd")


def test_errors_happen_before_any_work(monkeypatch):
    """Validation precedes the compute: a bad option late in the list still raises, nothing runs."""
    monkeypatch.setattr(bw._core, "run_backward", lambda *a, **k: pytest.fail("compute ran"))
    with pytest.raises(ValueError, match=arg("num_threads")):
        _call(_args(), causal=True, softcap=2.0, num_threads=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opts", [{}, dict(causal=True), dict(window=(5, 2), softcap=10.0), dict(alibi="bh")])
def test_varlen_backward_matches_reference_per_sequence(isa, rng, dtype, opts):
    """flash_attention_varlen_backward: per-sequence gradients (masks aligned per sequence), empty
    sequences and keys without queries included, against the float64 reference."""
    lq, lk, cq, ck, q, k, v = _varlen_inputs(rng, dtype)
    opts = dict(opts)
    if opts.pop("alibi", None):
        opts["alibi_slopes"] = (rng.random((len(lq), q.shape[1])) * 0.3).astype(np.float32)
    out, lse = fa2cpu.flash_attention_varlen(q, k, v, cq, ck, return_lse=True, **opts)
    do = rand(rng, out.shape, dtype)
    dq, dk, dv = fa2cpu.flash_attention_varlen_backward(do, q, k, v, out, lse, cq, ck, **opts)
    assert dq.dtype == q.dtype and dk.shape == k.shape and dv.shape == v.shape
    for b in range(len(lq)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if lq[b] == 0 or lk[b] == 0:
            assert not np.any(dk[sk].astype(np.float32)) and not np.any(dq[sq].astype(np.float32))
            continue
        o = {a: (c[b] if a == "alibi_slopes" else c) for a, c in opts.items()}
        rq, rk, rv = ref.attention_backward_ref(do[None, sq], q[None, sq], k[None, sk], v[None, sk], layout="bshd", **o)
        tol = dict(float32=3e-5, float16=1e-2, bfloat16=6e-2)[dtype]
        for name, got, want in (("dq", dq[sq], rq[0]), ("dk", dk[sk], rk[0]), ("dv", dv[sk], rv[0])):
            np.testing.assert_allclose(got.astype(np.float64), want, atol=tol, rtol=tol, err_msg=name)


def test_varlen_backward_errors_name_the_argument():
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, (5, 2, 8)), rand(rng, (6, 2, 8)), rand(rng, (6, 2, 8))
    out, lse = fa2cpu.flash_attention_varlen(q, k, v, [0, 5], [0, 6], return_lse=True)
    with pytest.raises(ValueError, match=arg("lse")):
        fa2cpu.flash_attention_varlen_backward(out, q, k, v, out, lse.T, [0, 5], [0, 6])
    with pytest.raises(ValueError, match=arg("cu_seqlens_k")):
        fa2cpu.flash_attention_varlen_backward(out, q, k, v, out, lse, [0, 5], [0, 5])
    with pytest.raises(TypeError, match=arg("dout")):
        fa2cpu.flash_attention_varlen_backward(out.astype(np.float16), q, k, v, out, lse, [0, 5], [0, 6])
