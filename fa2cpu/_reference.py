"""Float64 NumPy oracle for every semantic of ``API.md``.

This module is the test oracle, not a fast path: it materialises the full score matrix,
loops over (batch, head) and computes in float64. Inputs of any float dtype (float32,
float16, ``ml_dtypes.bfloat16``, float64) are converted to float64 first, so a reference for
a low-precision call is computed from the same rounded inputs the kernel saw.

Semantics, applied in this order to the scores of query row ``i`` and key column ``j``::

    s  = scale * q_i . k_j                        scale defaults to 1/sqrt(D)
    s  = softcap * tanh(s / softcap)              only when softcap > 0
    s += -slope * |i + Nk - Nq - j|               alibi, slopes (Hq,) or (B, Hq)
    s += mask                                     float mask, broadcast to (B, Hq, Nq, Nk)
    s  = -inf where invisible                     bool mask False, or outside the band
                                                  i + Nk - Nq - left <= j <= i + Nk - Nq + right
                                                  (-1 = unbounded; causal forces right = 0)

A row that sees no key returns output 0 and LSE ``-inf``. LSE is the natural-log logsumexp of
the visible scores. GQA: query head ``h`` uses key/value head ``h // (Hq // Hk)``.
"""

import math

import numpy as np

__all__ = ["attention_ref", "varlen_ref", "kvcache_ref", "kvcache_update_ref", "visible_band",
           "attention_backward_ref"]


def _f64(x):
    return np.asarray(x).astype(np.float64)


def visible_band(nq, nk, *, causal=False, window=(-1, -1)):
    """Bool ``(nq, nk)``: True where query ``i`` may see key ``j`` under causal/window (bottom-right)."""
    left, right = (int(w) for w in window)
    if causal:
        right = 0
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    diag = i + nk - nq
    vis = np.ones((nq, nk), dtype=bool)
    if left >= 0:
        vis &= j >= diag - left
    if right >= 0:
        vis &= j <= diag + right
    return vis


def _weighted_values(p, v, vis):
    """``p @ v`` where a key a row cannot see (``vis`` False, p = 0) is absent: an inf / NaN in its
    value reaches only the rows that see it (API.md: NaN / inf propagate into the affected rows
    only), where ``0 * inf`` would make every row NaN."""
    bad = ~np.isfinite(v)
    with np.errstate(invalid="ignore"):  # NaN rows stay NaN, as the contract says
        if not bad.any():
            return p @ v
        num = p @ np.where(bad, 0.0, v)
        for j, d in zip(*np.nonzero(bad)):
            rows = vis[:, j]
            num[rows, d] += p[rows, j] * v[j, d]
    return num


def _attention_bhsd(q, k, v, *, causal, scale, window, softcap, alibi_slopes, mask):
    """Core on float64 4-D bhsd arrays. Returns out (B, Hq, Nq, Dv), lse (B, Hq, Nq)."""
    B, Hq, Nq, D = q.shape
    Bk, Hk, Nk, Dk = k.shape
    if (Bk, Hk, Nk) != v.shape[:3] or Bk != B or Dk != D:
        raise ValueError(f"reference: inconsistent shapes q{q.shape} k{k.shape} v{v.shape}")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"reference: Hq={Hq} not a multiple of Hk={Hk}")
    Dv = v.shape[3]
    group = Hq // Hk
    if scale is None:
        scale = 1.0 / math.sqrt(D)

    band = visible_band(Nq, Nk, causal=causal, window=window)
    if alibi_slopes is not None:
        slopes = _f64(alibi_slopes)
        if slopes.shape == (Hq,):
            slopes = np.broadcast_to(slopes, (B, Hq))
        elif slopes.shape != (B, Hq):
            raise ValueError(f"reference: alibi_slopes shape {slopes.shape}, want ({Hq},) or ({B}, {Hq})")
        dist = np.abs(np.arange(Nq)[:, None] + Nk - Nq - np.arange(Nk)[None, :]).astype(np.float64)
    bool_mask = float_mask = None
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            bool_mask = np.broadcast_to(mask, (B, Hq, Nq, Nk))
        else:
            float_mask = np.broadcast_to(_f64(mask), (B, Hq, Nq, Nk))

    out = np.zeros((B, Hq, Nq, Dv), dtype=np.float64)
    lse = np.full((B, Hq, Nq), -np.inf, dtype=np.float64)
    for b in range(B):
        for h in range(Hq):
            hk = h // group
            s = scale * (q[b, h] @ k[b, hk].T)
            if softcap is not None and softcap > 0:
                s = softcap * np.tanh(s / softcap)
            if alibi_slopes is not None:
                s = s - slopes[b, h] * dist
            vis = band if bool_mask is None else band & bool_mask[b, h]
            if float_mask is not None:  # -inf hides the key, as False does (whatever its score)
                s = s + float_mask[b, h]
                vis = vis & ~np.isneginf(float_mask[b, h])
            s = np.where(vis, s, -np.inf)
            # Rows where every score is -inf (nothing visible, or a float mask of -inf) stay 0 / -inf.
            live = ~np.all(np.isneginf(s), axis=1)
            if not live.any():
                continue
            sl = s[live]
            m = np.max(sl, axis=1, keepdims=True)
            with np.errstate(invalid="ignore"):  # NaN rows stay NaN, as the contract says
                p = np.exp(sl - m)
            l = p.sum(axis=1, keepdims=True)
            out[b, h, live] = _weighted_values(p, v[b, hk], vis[live]) / l
            lse[b, h, live] = (m + np.log(l))[:, 0]
    return out, lse


def _with_sinks(out, lse, sinks):
    """Adds attention sinks (one raw logit per query head, no value) to a bhsd result:
    lse' = log(exp(lse) + exp(sink)), out' = out * exp(lse - lse')."""
    sink = _f64(sinks)[None, :, None]
    with np.errstate(invalid="ignore"):
        new = np.logaddexp(lse, sink)
        factor = np.where(np.isneginf(lse), 0.0, np.exp(lse - new))
    return out * factor[..., None], new


def attention_ref(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=None,
                  alibi_slopes=None, mask=None, layout="bhsd", sinks=None):
    """Float64 reference of ``fa2cpu.flash_attention`` (``sinks``: (Hq,) attention sinks).

    Returns ``(out, lse)``: ``out`` float64 in q's layout and rank (last dim Dv), ``lse`` float64
    ``(B, Hq, Nq)`` / ``(Hq, Nq)`` / ``(Nq,)`` for 4-D / 3-D / 2-D input.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    rank = q.ndim
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"reference: layout {layout!r}")
    if layout == "bshd":
        if rank != 4:
            raise ValueError("reference: bshd needs 4-D inputs")
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    elif rank in (2, 3):
        lead = (1,) * (4 - rank)
        q, k, v = (x.reshape(lead + x.shape) for x in (q, k, v))
    elif rank != 4:
        raise ValueError(f"reference: rank {rank}")
    out, lse = _attention_bhsd(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                               alibi_slopes=alibi_slopes, mask=mask)
    if sinks is not None:
        out, lse = _with_sinks(out, lse, sinks)
    if layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    elif rank in (2, 3):
        out = out.reshape(out.shape[4 - rank:])
        lse = lse.reshape(lse.shape[4 - rank:])
    return out, lse


def varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, *, alibi_slopes=None, **options):
    """Float64 reference of ``fa2cpu.flash_attention_varlen``.

    q ``(total_q, Hq, D)``, k ``(total_k, Hk, D)``, v ``(total_k, Hk, Dv)``; sequence b uses rows
    ``cu[b]:cu[b+1]``. Returns out ``(total_q, Hq, Dv)``, lse ``(Hq, total_q)``.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    cq = np.asarray(cu_seqlens_q, dtype=np.int64)
    ck = np.asarray(cu_seqlens_k, dtype=np.int64)
    if cq.shape != ck.shape or cq.ndim != 1:
        raise ValueError("reference: cu_seqlens shapes")
    Hq, Dv = q.shape[1], v.shape[2]
    out = np.zeros((q.shape[0], Hq, Dv), dtype=np.float64)
    lse = np.full((Hq, q.shape[0]), -np.inf, dtype=np.float64)
    slopes = None if alibi_slopes is None else _f64(alibi_slopes)
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            continue
        sb = slopes if slopes is None or slopes.ndim == 1 else slopes[b]
        o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], layout="bshd",
                             alibi_slopes=sb, **options)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


def _cache_geometry(k_cache, cache_seqlens, block_table):
    """(B, capacity, seqlens int64 (B,)) for a contiguous or paged cache."""
    if block_table is None:
        B, cap = k_cache.shape[0], k_cache.shape[1]
    else:
        bt = np.asarray(block_table)
        B, cap = bt.shape[0], bt.shape[1] * k_cache.shape[1]
    if cache_seqlens is None:
        lens = np.full(B, cap, dtype=np.int64)
    else:
        lens = np.broadcast_to(np.asarray(cache_seqlens, dtype=np.int64), (B,)).copy()
    return B, cap, lens


def _positions(b, n, k_cache, block_table):
    """Index arrays addressing logical positions [0, n) of sequence b in the cache."""
    p = np.arange(n)
    if block_table is None:
        return (np.full(n, b), p)
    bs = k_cache.shape[1]
    bt = np.asarray(block_table)
    return (bt[b, p // bs], p % bs)


def kvcache_update_ref(k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, block_table=None):
    """Copies of the caches (same dtype) with k/v appended at ``cache_seqlens[b]...``.

    Raises ValueError if an append would exceed the capacity. Inputs are not modified.
    """
    kc, vc = np.array(k_cache, copy=True), np.array(v_cache, copy=True)
    if k is None:
        return kc, vc
    B, cap, lens = _cache_geometry(kc, cache_seqlens, block_table)
    nnew = k.shape[1]
    if np.any(lens + nnew > cap):
        raise ValueError("reference: append exceeds cache capacity")
    for b in range(B):
        idx = _positions(b, lens[b] + nnew, kc, block_table)
        new = tuple(i[lens[b]:] for i in idx)
        kc[new] = k[b]
        vc[new] = v[b]
    return kc, vc


def kvcache_ref(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, block_table=None,
                alibi_slopes=None, **options):
    """Float64 reference of ``fa2cpu.flash_attention_with_kvcache`` (inputs are not modified).

    q ``(B, Nq, Hq, D)``; contiguous cache ``(B, Ncap, Hk, D)`` or paged ``(num_blocks, block_size,
    Hk, D)`` with ``block_table (B, max_blocks)``. Returns out ``(B, Nq, Hq, Dv)``, lse ``(B, Hq, Nq)``.
    """
    kc, vc = kvcache_update_ref(k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                block_table=block_table)
    B, _, lens = _cache_geometry(kc, cache_seqlens, block_table)
    nnew = 0 if k is None else k.shape[1]
    q = _f64(q)
    Nq, Hq, Dv = q.shape[1], q.shape[2], vc.shape[3]
    out = np.zeros((B, Nq, Hq, Dv), dtype=np.float64)
    lse = np.full((B, Hq, Nq), -np.inf, dtype=np.float64)
    slopes = None if alibi_slopes is None else _f64(alibi_slopes)
    for b in range(B):
        idx = _positions(b, lens[b] + nnew, kc, block_table)
        kb, vb = _f64(kc[idx]), _f64(vc[idx])  # (L, Hk, D)
        sb = slopes if slopes is None or slopes.ndim == 1 else slopes[b]
        o, l = attention_ref(q[b:b + 1], kb[None], vb[None], layout="bshd", alibi_slopes=sb, **options)
        out[b], lse[b] = o[0], l[0]
    return out, lse


def attention_backward_ref(dout, q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=None,
                           alibi_slopes=None, layout="bhsd", sinks=None):
    """Float64 reference of ``fa2cpu.flash_attention_backward``: analytic gradients of
    :func:`attention_ref` (no mask) for the loss ``sum(out * dout)``.

    The forward is recomputed here from q, k, v (the caller's out/lse are not used), with the
    full score matrix per (batch, head)::

        dV  = P^T dO                         summed over the query heads of a GQA group
        dP  = dO V^T
        dS  = P * (dP - rowsum(dO * O))      (= rowsum(P * dP) for finite inputs)
        dS *= 1 - tanh(s_raw / softcap)^2    softcap chain rule, s_raw = scale * q.k
        dQ  = scale * dS K,  dK = scale * dS^T Q

    Alibi is a constant bias (no gradient); rows that see no key contribute nothing. With
    ``sinks`` (one logit per query head, no value) P shares each row's denominator with the sink
    and ``(dq, dk, dv, dsinks)`` is returned, dsinks[h] = -sum_i P_sink,i * rowsum(dO * O)_i.
    Returns ``(dq, dk, dv)`` float64 with the shapes of q, k, v (any rank / layout they have).
    """
    dout, q, k, v = _f64(dout), _f64(q), _f64(k), _f64(v)
    rank = q.ndim
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"reference: layout {layout!r}")
    if layout == "bshd":
        if rank != 4:
            raise ValueError("reference: bshd needs 4-D inputs")
        dout, q, k, v = (x.transpose(0, 2, 1, 3) for x in (dout, q, k, v))
    elif rank in (2, 3):
        lead = (1,) * (4 - rank)
        dout, q, k, v = (x.reshape(lead + x.shape) for x in (dout, q, k, v))
    elif rank != 4:
        raise ValueError(f"reference: rank {rank}")
    B, Hq, Nq, D = q.shape
    _, Hk, Nk, _ = k.shape
    group = Hq // Hk
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    band = visible_band(Nq, Nk, causal=causal, window=window)
    if alibi_slopes is not None:
        slopes = np.broadcast_to(_f64(alibi_slopes), (B, Hq)) if np.ndim(alibi_slopes) == 1 else _f64(alibi_slopes)
        dist = np.abs(np.arange(Nq)[:, None] + Nk - Nq - np.arange(Nk)[None, :]).astype(np.float64)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    dsinks = np.zeros(Hq)
    # inf / NaN inputs: NaN wherever they reach, as the contract says (no warnings for it)
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(B):
            for h in range(Hq):
                hk = h // group
                s_raw = scale * (q[b, h] @ k[b, hk].T)
                if softcap is not None and softcap > 0:
                    t = np.tanh(s_raw / softcap)
                    s = softcap * t
                else:
                    t, s = None, s_raw
                if alibi_slopes is not None:
                    s = s - slopes[b, h] * dist
                s = np.where(band, s, -np.inf)
                p = np.zeros_like(s)
                do = dout[b, h]
                if sinks is not None:  # the sink as one more column of s, with no value
                    sink = np.full((Nq, 1), float(sinks[h]))
                    full = np.concatenate([s, sink], axis=1)
                    live = ~np.all(np.isneginf(full), axis=1)
                    e = np.zeros_like(full)
                    e[live] = np.exp(full[live] - full[live].max(axis=1, keepdims=True))
                    e[live] /= e[live].sum(axis=1, keepdims=True)
                    p = e[:, :-1]
                    dsinks[h] -= (e[:, -1] * ((p @ v[b, hk]) * do).sum(axis=1)).sum()
                else:
                    live = ~np.all(np.isneginf(s), axis=1)
                    if live.any():
                        sl = s[live]
                        e = np.exp(sl - sl.max(axis=1, keepdims=True))
                        p[live] = e / e.sum(axis=1, keepdims=True)
                # A pair the mask hides is absent (P = dS = 0 and no inf / NaN of its operands), as
                # in the forward (_weighted_values); D_i = rowsum(dO * O), FlashAttention-2's form
                # (rowsum(P * dP) is the same number for finite inputs, not for infinite ones).
                p = np.where(band, p, 0.0)  # (a NaN row's max made its hidden columns NaN too)
                dv[b, hk] += _weighted_values(p.T, do, band.T)
                dp = np.where(band, do @ v[b, hk].T, 0.0)
                delta = (do * _weighted_values(p, v[b, hk], band)).sum(axis=1, keepdims=True)
                ds = p * (dp - delta)
                if t is not None:
                    ds = ds * (1.0 - t * t)
                ds = np.where(band, ds, 0.0)  # (p = 0 there, but D_i may be NaN)
                dq[b, h] = scale * _weighted_values(ds, k[b, hk], band)
                dk[b, hk] += scale * _weighted_values(ds.T, q[b, h], band.T)
    if layout == "bshd":
        dq, dk, dv = (x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))
    elif rank in (2, 3):
        dq, dk, dv = (x.reshape(x.shape[4 - rank:]) for x in (dq, dk, dv))
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)
