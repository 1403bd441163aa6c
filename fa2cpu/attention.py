"""Public attention functions: arguments checked and normalised (fa2cpu/_validate.py), then one
call into the core."""
import numbers

import numpy as np

from . import _core
from ._validate import (_DTYPES, _MAX_SPLITS, _Options, _alibi, _array, _cu_seqlens, _data, _dtype_code,
                        _head_dims, _heads, _int, _mask, _out, _qkv, _same_dtype, _threads)

__all__ = ["flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache"]


# ---------------------------------------------------------------------------------------------
# flash_attention
# ---------------------------------------------------------------------------------------------
def flash_attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=None,
                    alibi_slopes=None, mask=None, return_lse=False, layout="bhsd",
                    num_threads=None, out=None):
    """Exact attention ``softmax(scale * q @ k^T + bias) @ v`` with FlashAttention-2 tiling.

    Parameters
    ----------
    q, k, v : ndarray
        ``layout="bhsd"``: q ``(B, Hq, Nq, D)``, k ``(B, Hk, Nk, D)``, v ``(B, Hk, Nk, Dv)``
        (PyTorch SDPA order); 3-D ``(H, N, D)`` and 2-D ``(N, D)`` inputs are also accepted.
        ``layout="bshd"``: ``(B, N, H, D)`` (flash-attn order), 4-D only.
        One dtype for all three: float32, float16 or ``ml_dtypes.bfloat16`` (accumulation is
        float32). Any strides (views, negative strides, broadcast K/V) are read in place.
        ``Hq % Hk == 0`` (GQA/MQA: query head h uses kv head ``h // (Hq // Hk)``, K/V never
        repeated). D and Dv in 1..256.
    causal : bool
        Bottom-right aligned causal mask: query i sees key j iff ``j <= i + Nk - Nq``.
    scale : float, optional
        Score scale, default ``1/sqrt(D)``.
    window : (int, int)
        Sliding window ``(left, right)``, -1 = unbounded: query i sees key j iff
        ``i + Nk - Nq - left <= j <= i + Nk - Nq + right``. ``causal=True`` sets right = 0.
    softcap : float, optional
        When > 0, scores become ``softcap * tanh(s / softcap)`` (after scaling, before biases).
    alibi_slopes : float32 ndarray ``(Hq,)`` or ``(B, Hq)``, optional
        Adds ``-slope * |i + Nk - Nq - j|`` to the scores.
    mask : ndarray, optional
        Broadcastable to ``(B, Hq, Nq, Nk)``: bool (True = may attend) or float (added to the
        scores; float dtypes other than float32 are converted at the mask's own size). Read
        through its strides, never expanded.
    return_lse : bool
        Also return the natural-log log-sum-exp, float32 ``(B, Hq, Nq)`` (``(Hq, Nq)`` /
        ``(Nq,)`` for 3-D / 2-D inputs). A row that sees no key gets output 0 and LSE -inf.
    layout : {"bhsd", "bshd"}
    num_threads : int, optional
        OpenMP threads; None follows OpenMP's current maximum (``OMP_NUM_THREADS``,
        ``threadpoolctl.threadpool_limits(n, user_api="openmp")``). The GIL is released.
    out : ndarray, optional
        Written in place and returned; exact shape (q's with last dim Dv) and dtype.

    Returns
    -------
    out, or ``(out, lse)`` when ``return_lse``.
    """
    q, k, v, (q4, k4, v4), (B, Hq, Hk, Nq, Nk, D, Dv) = _qkv(q, k, v, layout)
    dt = _DTYPES[q.dtype]
    rank = q.ndim
    opt = _Options(D, causal, scale, window, softcap, Nq, Nk)
    alibi = _alibi(alibi_slopes, B, Hq)
    mask4, mask_kind = _mask(mask, (B, Hq, Nq, Nk))
    nt = _threads(num_threads)

    out_shape = q.shape[:-1] + (Dv,)
    out = _out(out, out_shape, q.dtype, {"q": q, "k": k, "v": v, "alibi_slopes": alibi, "mask": mask4})
    if layout == "bshd":
        o4 = out.transpose(0, 2, 1, 3)
    else:
        o4 = out[(None,) * (4 - rank)]
    lse = np.empty((B, Hq, Nq), np.float32) if return_lse else None
    _core.run(q4, k4, v4, o4, lse,
              dtype=dt, batch=B, hq=Hq, hk=Hk, nq=Nq, nk=Nk,
              scale=opt.scale, softcap=opt.softcap, win_left=opt.left, win_right=opt.right,
              alibi=alibi, mask=mask4, mask_kind=mask_kind,
              cu_q=None, cu_k=None, seqlen_k=None, block_table=None, block_size=0,
              num_threads=nt, num_splits=0)
    if not return_lse:
        return out
    return out, lse.reshape(q.shape[:-3] + (Hq, Nq) if rank >= 3 else (Nq,))


# ---------------------------------------------------------------------------------------------
# flash_attention_varlen
# ---------------------------------------------------------------------------------------------
def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                           max_seqlen_k=None, causal=False, scale=None, window=(-1, -1),
                           softcap=None, alibi_slopes=None, return_lse=False,
                           num_threads=None, out=None):
    """Attention over packed ragged sequences (what a server's prefill step sends).

    q ``(total_q, Hq, D)``, k ``(total_k, Hk, D)``, v ``(total_k, Hk, Dv)``; sequence b uses rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k/v.
    ``cu_seqlens_*``: int32/int64 ``(B+1,)``, starting at 0, non-decreasing, last = total.
    Empty sequences are allowed. Causal/window/alibi are aligned per sequence (bottom-right).
    ``max_seqlen_*`` are optional; when given they must be >= the longest sequence.
    Other arguments as in :func:`flash_attention`. Returns ``out (total_q, Hq, Dv)`` or
    ``(out, lse)`` with lse float32 ``(Hq, total_q)``.
    """
    q = _data("q", q); k = _data("k", k); v = _data("v", v)
    dt = _dtype_code("q", q)
    _same_dtype("q", q, k=k, v=v)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 3:
            raise ValueError(f"{name}: expected a 3-D (total, H, D) array, got shape {a.shape}")
    Tq, Hq, D = q.shape
    Tk, Hk, Dk = k.shape
    shapes = {"q": q.shape, "k": k.shape, "v": v.shape}
    if v.shape[0] != Tk:
        raise ValueError(f"v: {v.shape[0]} rows do not match k's {Tk} rows (v shape {v.shape}, k shape {k.shape})")
    _heads(Hq, Hk, v.shape[1], shapes)
    Dv = v.shape[2]
    _head_dims("q", D, Dk, Dv, shapes)
    cu_q = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, Tq)
    cu_k = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, Tk)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_k: shape {cu_k.shape} does not match cu_seqlens_q's shape {cu_q.shape}")
    B = cu_q.shape[0] - 1
    for name, given, cu in (("max_seqlen_q", max_seqlen_q, cu_q), ("max_seqlen_k", max_seqlen_k, cu_k)):
        if given is not None:
            given = _int(name, given, 0)
            longest = int(np.diff(cu).max()) if B else 0
            if given < longest:
                raise ValueError(f"{name}: {given} is shorter than the longest sequence ({longest})")
    opt = _Options(D, causal, scale, window, softcap, Tq, Tk)
    alibi = _alibi(alibi_slopes, B, Hq)
    nt = _threads(num_threads)
    out = _out(out, (Tq, Hq, Dv), q.dtype, {"q": q, "k": k, "v": v, "alibi_slopes": alibi})
    lse = np.empty((Hq, Tq), np.float32) if return_lse else None
    view = lambda a: a.transpose(1, 0, 2)[None]  # noqa: E731 - (1, H, total, D)
    _core.run(view(q), view(k), view(v), out.transpose(1, 0, 2)[None],
              None if lse is None else lse[None],
              dtype=dt, batch=B, hq=Hq, hk=Hk, nq=0, nk=0,
              scale=opt.scale, softcap=opt.softcap, win_left=opt.left, win_right=opt.right,
              alibi=alibi, mask=None, mask_kind=0,
              cu_q=cu_q, cu_k=cu_k, seqlen_k=None, block_table=None, block_size=0,
              num_threads=nt, num_splits=0)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# flash_attention_with_kvcache
# ---------------------------------------------------------------------------------------------
def flash_attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
                                 block_table=None, causal=False, scale=None, window=(-1, -1),
                                 softcap=None, alibi_slopes=None, return_lse=False,
                                 num_splits=0, num_threads=None, out=None, layout="bshd"):
    """Attention of new queries against a KV cache (decode / chunked prefill), flash-attn layout.

    q ``(B, Nq, Hq, D)``. Contiguous cache: ``k_cache (B, Ncap, Hk, D)``, ``v_cache (B, Ncap, Hk, Dv)``.
    Paged cache: ``k_cache (num_blocks, block_size, Hk, D)`` with ``block_table`` int32
    ``(B, max_blocks)``: position p of sequence b is row ``p % block_size`` of block
    ``block_table[b, p // block_size]`` (entries past a sequence's length are never read).
    ``cache_seqlens``: int or int32/int64 ``(B,)``, tokens already valid (default: full capacity).
    ``k``, ``v`` ``(B, Nnew, Hk, D|Dv)``, if given, are first written **in place** into the cache at
    positions ``cache_seqlens[b] .. + Nnew - 1``; attention then covers ``[0, cache_seqlens[b] + Nnew)``.
    If that exceeds the capacity a ValueError is raised and the cache is left untouched;
    ``cache_seqlens`` itself is never modified. Masks are bottom-right aligned per sequence.
    ``num_splits``: 0 = split the key axis automatically for parallel decode (flash-decoding),
    1 = never, n = n splits; results agree up to float rounding. Other arguments as in
    :func:`flash_attention`. Returns ``out (B, Nq, Hq, Dv)`` or ``(out, lse)`` with lse ``(B, Hq, Nq)``.

    ``layout="bhsd"`` takes every 4-D argument (q, caches, k, v, out) and returns out in PyTorch's
    head-major order instead: q ``(B, Hq, Nq, D)``, ``k_cache (B, Hk, Ncap, D)`` (paged:
    ``(num_blocks, Hk, block_size, D)``), ``k (B, Hk, Nnew, D)``, out ``(B, Hq, Nq, Dv)``; read and
    written in place all the same (only strides differ). lse is ``(B, Hq, Nq)`` in both layouts.
    """
    if layout == "bhsd":
        t = lambda a: a.transpose(0, 2, 1, 3) if isinstance(a, np.ndarray) and a.ndim == 4 else a  # noqa: E731
        try:
            res = _kvcache_bshd(t(q), t(k_cache), t(v_cache), t(k), t(v), cache_seqlens, block_table, causal, scale,
                                window, softcap, alibi_slopes, return_lse, num_splits, num_threads, t(out), "bhsd")
        except ValueError as e:
            raise ValueError(f"{e} [shapes shown in (B, N, H, D) order; layout='bhsd' was given]") from None
        o = out if out is not None else t(res[0] if return_lse else res)  # the caller's own out= object
        return (o, res[1]) if return_lse else o
    if layout != "bshd":
        raise ValueError(f"layout: expected 'bshd' (flash-attn order) or 'bhsd' (PyTorch order), got {layout!r}")
    return _kvcache_bshd(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window, softcap,
                         alibi_slopes, return_lse, num_splits, num_threads, out, "bshd")


def _kvcache_bshd(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window, softcap,
                  alibi_slopes, return_lse, num_splits, num_threads, out, layout):
    q = _data("q", q); k_cache = _data("k_cache", k_cache); v_cache = _data("v_cache", v_cache)
    dt = _dtype_code("q", q)
    _same_dtype("q", q, k_cache=k_cache, v_cache=v_cache)
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if a.ndim != 4:
            raise ValueError(f"{name}: expected a 4-D array, got shape {a.shape}")
    B, Nq, Hq, D = q.shape
    nb, rows, Hk, Dk = k_cache.shape
    if v_cache.shape[:2] != (nb, rows):
        raise ValueError(f"v_cache: shape {v_cache.shape} does not match k_cache's leading dims {(nb, rows)}")
    shapes = {"q": q.shape, "k_cache": k_cache.shape, "v_cache": v_cache.shape}
    try:
        _heads(Hq, Hk, v_cache.shape[2], shapes, k_name="k_cache", v_name="v_cache")
    except ValueError as e:
        if layout == "bshd":
            raise ValueError(f"{e}. The default layout='bshd' expects caches as (B, Ncap, Hk, D); pass "
                             f"layout='bhsd' for PyTorch-order (B, Hk, Ncap, D) caches and queries") from None
        raise
    Dv = v_cache.shape[3]
    _head_dims("q", D, Dk, Dv, shapes, k_name="k_cache", v_name="v_cache")
    if k is not None:  # both caches are written by the append: both must be writable
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not c.flags.writeable:
                raise ValueError(f"{name}: array is read-only but k/v are to be appended")

    if block_table is not None:
        bt = _array("block_table", block_table)
        if bt.dtype not in (np.int32, np.int64):
            raise TypeError(f"block_table: dtype {bt.dtype} is not supported; expected int32 or int64")
        if bt.ndim != 2 or bt.shape[0] != B:
            raise ValueError(f"block_table: expected shape ({B}, max_blocks), got {bt.shape}")
        if rows < 1:
            raise ValueError("k_cache: block size (dim 1) must be >= 1")
        if nb > np.iinfo(np.int32).max:
            raise ValueError(f"k_cache: {nb} blocks; a paged cache holds at most 2**31 - 1 blocks")
        capacity = bt.shape[1] * rows
    else:
        bt = None
        if nb != B:
            raise ValueError(f"k_cache: batch size {nb} does not match q's batch size {B} "
                             f"(pass block_table for a paged cache)")
        capacity = rows

    nnew = 0
    if (k is None) != (v is None):
        raise ValueError("k, v: give both new keys and new values, or neither")
    if k is not None:
        k = _data("k", k); v = _data("v", v)
        _same_dtype("q", q, k=k, v=v)
        if k.ndim != 4 or k.shape[0] != B or k.shape[2:] != (Hk, D):
            raise ValueError(f"k: expected shape ({B}, Nnew, {Hk}, {D}), got {k.shape}")
        nnew = k.shape[1]
        if v.shape != (B, nnew, Hk, Dv):
            raise ValueError(f"v: expected shape {(B, nnew, Hk, Dv)}, got {v.shape}")

    # Scalar cache lengths (None = full, or an int) are checked as scalars: no array reductions
    # on the per-token decode path.
    if cache_seqlens is None:
        if nnew:
            raise ValueError("cache_seqlens: required when appending k/v (the default means a full cache)")
        scalar_len = capacity
    elif isinstance(cache_seqlens, (numbers.Integral, np.integer)) and not isinstance(cache_seqlens, (bool, np.bool_)):
        scalar_len = int(cache_seqlens)
    else:
        scalar_len = None
        cs = _array("cache_seqlens", cache_seqlens)
        if cs.dtype not in (np.int32, np.int64):
            raise TypeError(f"cache_seqlens: dtype {cs.dtype} is not supported; expected an int or int32 (B,)")
        if cs.shape != (B,):
            raise ValueError(f"cache_seqlens: expected shape ({B},), got {cs.shape}")
        seqlens = cs.astype(np.int64)
    if scalar_len is not None:
        lo = hi = scalar_len
    elif B:
        lo, hi = int(seqlens.min()), int(seqlens.max())
    else:
        lo = hi = 0
    if lo < 0:
        raise ValueError(f"cache_seqlens: entries must be >= 0, got {lo}")
    if hi + nnew > capacity:
        raise ValueError(f"cache_seqlens: cache_seqlens + {nnew} new tokens = {hi + nnew} "
                         f"exceeds the cache capacity {capacity}; the cache was left unchanged")
    if scalar_len is not None:
        seqlens = np.full(B, scalar_len, np.int64)
    total = seqlens + nnew if nnew else seqlens
    if bt is not None and B:
        used = (total + rows - 1) // rows  # blocks each sequence reads
        cols = np.arange(bt.shape[1])
        sel = cols[None, :] < used[:, None]
        vals = bt[sel]
        if vals.size and (vals.min() < 0 or vals.max() >= nb):
            raise ValueError(f"block_table: entries used by the sequences must be in [0, {nb}), "
                             f"got values in [{int(vals.min())}, {int(vals.max())}]")
    if bt is not None:
        # Always a private int32 copy (entries past a sequence's blocks are never read, so the
        # wrap of an out-of-range int64 there is harmless): out= may share the caller's memory.
        bt = bt.astype(np.int32, order="C", copy=True)

    # Every remaining check and conversion happens before the append writes the first byte.
    opt = _Options(D, causal, scale, window, softcap, Nq, capacity)
    alibi = _alibi(alibi_slopes, B, Hq)
    nt = _threads(num_threads)
    splits = min(_int("num_splits", num_splits, 0), _MAX_SPLITS)
    out = _out(out, (B, Nq, Hq, Dv), q.dtype,
               {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "alibi_slopes": alibi})

    if nnew and scalar_len is not None and bt is None:  # append in place (all checks passed)
        k_cache[:, scalar_len:scalar_len + nnew] = k
        v_cache[:, scalar_len:scalar_len + nnew] = v
    elif nnew:
        pos = seqlens[:, None] + np.arange(nnew)[None, :]                # (B, Nnew)
        if bt is None:
            bidx = np.broadcast_to(np.arange(B)[:, None], pos.shape)
            k_cache[bidx, pos] = k
            v_cache[bidx, pos] = v
        else:
            blk = bt[np.arange(B)[:, None], pos // rows]
            k_cache[blk, pos % rows] = k
            v_cache[blk, pos % rows] = v

    lse = np.empty((B, Hq, Nq), np.float32) if return_lse else None
    _core.run(q.transpose(0, 2, 1, 3), k_cache.transpose(0, 2, 1, 3), v_cache.transpose(0, 2, 1, 3),
              out.transpose(0, 2, 1, 3), lse,
              dtype=dt, batch=B, hq=Hq, hk=Hk, nq=Nq, nk=capacity,
              scale=opt.scale, softcap=opt.softcap, win_left=opt.left, win_right=opt.right,
              alibi=alibi, mask=None, mask_kind=0,
              cu_q=None, cu_k=None, seqlen_k=total, block_table=bt, block_size=rows,
              num_threads=nt, num_splits=splits)
    return (out, lse) if return_lse else out
