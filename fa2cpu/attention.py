"""Public attention functions: every argument checked and normalised into a Problem
(fa2cpu/_validate.py), then one launch (_launch) into the core. The dtype codes of the C++ DType
enum are in fa2cpu/_checks.py (_DTYPES)."""
import numpy as np

from . import _core
from ._checks import _CODES, _bool, _sinks
from ._validate import attention_problem, kvcache_problem, kvcache_problem_lean, varlen_problem

__all__ = ["flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache"]


def _launch(problem, lse):
    """The one call into the kernels: a Problem -> ``_core.run``. ``lse``: float32 (batch,
    q_heads, rows) view to fill, or None."""
    (q, k, v, out, dtype_code, batch, q_heads, kv_heads, q_length, kv_length, scale, softcap, window_left,
     window_right, alibi_slopes, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, kv_seqlens, block_table, block_size,
     num_threads, num_splits, sinks, kv_dtype_code, k_scale, v_scale) = problem
    _core.run(q, k, v, out, lse, dtype=dtype_code, batch=batch, hq=q_heads, hk=kv_heads, nq=q_length, nk=kv_length,
              scale=scale, softcap=softcap, win_left=window_left, win_right=window_right,
              alibi=alibi_slopes, mask=mask, mask_kind=mask_kind, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k,
              seqlen_k=kv_seqlens, block_table=block_table, block_size=block_size, num_threads=num_threads,
              num_splits=num_splits, sinks=sinks, kv_dtype=kv_dtype_code, k_scale=k_scale, v_scale=v_scale)


def _with_sinks(problem, sinks):
    """The problem with its attention sinks checked and attached (no-op for None)."""
    return problem if sinks is None else problem._replace(sinks=_sinks(sinks, problem.q_heads))


# ---------------------------------------------------------------------------------------------
# flash_attention
# ---------------------------------------------------------------------------------------------
def flash_attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=None,
                    alibi_slopes=None, mask=None, return_lse=False, layout="bhsd",
                    num_threads=None, out=None, sinks=None):
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
        scores; float dtypes other than float32 are converted at the mask's own size; -inf
        hides the key as False does, whatever its score). Read through its strides, never
        expanded.
    return_lse : bool
        Also return the natural-log log-sum-exp, float32 ``(B, Hq, Nq)`` (``(Hq, Nq)`` /
        ``(Nq,)`` for 3-D / 2-D inputs). A row that sees no key gets output 0 and LSE -inf.
    layout : {"bhsd", "bshd"}
    num_threads : int, optional
        OpenMP threads; None follows OpenMP's current maximum (``OMP_NUM_THREADS``,
        ``threadpoolctl.threadpool_limits(n, user_api="openmp")``). The GIL is released.
    out : ndarray, optional
        Written in place and returned; exact shape (q's with last dim Dv) and dtype.
    sinks : array_like, optional
        float32 ``(Hq,)`` attention sinks (gpt-oss): one raw logit per query head (no scale,
        softcap or ALiBi) that joins every row's softmax denominator with no value vector:
        ``lse_i = log(exp(sinks[h]) + sum_j exp(s_ij))``; a row that sees no key gets output 0
        and LSE ``sinks[h]``. Folded into the online softmax's start: no cost per key.

    Returns
    -------
    out, or ``(out, lse)`` when ``return_lse``.

    Notes
    -----
    A key a row cannot see (causal, window, mask) is absent from that row: an inf or NaN in its
    k or v never reaches the row, even where the tiles compute it beside rows that see it. A row
    that sees an inf / NaN in v gets it in that column (``p * v`` for p > 0); a NaN in q, in a
    k it sees or in the mask makes the row NaN (out and LSE).
    """
    return_lse = _bool("return_lse", return_lse)
    problem, out = attention_problem(q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout,
                                     num_threads, out)
    problem = _with_sinks(problem, sinks)
    if not return_lse:
        _launch(problem, None)
        return out
    lse = np.empty((problem.batch, problem.q_heads, problem.q_length), np.float32)
    _launch(problem, lse)
    return out, lse.reshape(lse.shape[4 - out.ndim:])  # (B, Hq, Nq), (Hq, Nq) or (Nq,) like q's rank


# ---------------------------------------------------------------------------------------------
# flash_attention_varlen
# ---------------------------------------------------------------------------------------------
def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                           max_seqlen_k=None, causal=False, scale=None, window=(-1, -1),
                           softcap=None, alibi_slopes=None, return_lse=False,
                           num_threads=None, out=None, sinks=None):
    """Attention over packed ragged sequences (what a server's prefill step sends).

    q ``(total_q, Hq, D)``, k ``(total_k, Hk, D)``, v ``(total_k, Hk, Dv)``; sequence b uses rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k/v.
    ``cu_seqlens_*``: int32/int64 ``(B+1,)``, starting at 0, non-decreasing, last = total.
    Empty sequences are allowed. Causal/window/alibi are aligned per sequence (bottom-right).
    ``max_seqlen_*`` are optional; when given they must be >= the longest sequence.
    Other arguments (``sinks`` included) as in :func:`flash_attention`. Returns
    ``out (total_q, Hq, Dv)`` or ``(out, lse)`` with lse float32 ``(Hq, total_q)``.
    """
    return_lse = _bool("return_lse", return_lse)
    problem, out = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                  scale, window, softcap, alibi_slopes, num_threads, out)
    problem = _with_sinks(problem, sinks)
    if not return_lse:
        _launch(problem, None)
        return out
    lse = np.empty((problem.q_heads, out.shape[0]), np.float32)
    _launch(problem, lse[None])
    return out, lse


# ---------------------------------------------------------------------------------------------
# flash_attention_with_kvcache
# ---------------------------------------------------------------------------------------------
def flash_attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
                                 block_table=None, causal=False, scale=None, window=(-1, -1),
                                 softcap=None, alibi_slopes=None, return_lse=False,
                                 num_splits=0, num_threads=None, out=None, layout="bshd", sinks=None,
                                 k_scale=None, v_scale=None):
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
    1 = never, n = n splits; results agree up to float rounding. Other arguments (``sinks``
    included) as in :func:`flash_attention`. Returns ``out (B, Nq, Hq, Dv)`` or ``(out, lse)`` with lse ``(B, Hq, Nq)``.

    ``layout="bhsd"`` takes every 4-D argument (q, caches, k, v, out) and returns out in PyTorch's
    head-major order instead: q ``(B, Hq, Nq, D)``, ``k_cache (B, Hk, Ncap, D)`` (paged:
    ``(num_blocks, Hk, block_size, D)``), ``k (B, Hk, Nnew, D)``, out ``(B, Hq, Nq, Dv)``; read and
    written in place all the same (only strides differ). lse is ``(B, Hq, Nq)`` in both layouts.

    **Quantized cache**: ``k_cache`` / ``v_cache`` may hold ``int8`` or ``ml_dtypes.float8_e4m3fn``
    codes (q, k, v stay float32/float16/bfloat16). ``k_scale``, ``v_scale``: float32, the cache's
    shape without the last axis (``(B, Ncap, Hk)``; paged ``(num_blocks, block_size, Hk)``; with
    ``layout="bhsd"`` ``(B, Hk, Ncap)``), one scale per stored token and head: the cached value is
    ``code * scale``. int8 requires scales; float8 accepts None (scale 1). Appended k/v are
    quantized in place per token and head with ``scale = max|x| / 127`` (int8, codes
    ``rint(x / scale)``) or ``max|x| / 448`` (float8, codes ``x / scale`` rounded to nearest even),
    in float32, the scale written to the scale arrays (a row of zeros gets scale 0 and codes 0);
    into a float8 cache without scales they are converted directly (round to nearest, saturating at
    +-448). Codes are dequantized in registers inside the kernels; no float copy of the cache is made.
    """
    return_lse = _bool("return_lse", return_lse)
    out, lse = _with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window,
                             softcap, alibi_slopes, return_lse, num_splits, num_threads, out, layout, sinks,
                             k_scale, v_scale)
    return (out, lse) if return_lse else out


def _with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window, softcap,
                  alibi_slopes, return_lse, num_splits, num_threads, out, layout, sinks=None, k_scale=None,
                  v_scale=None):
    """flash_attention_with_kvcache -> (out, lse or None); also fa2cpu.torch's, on tensor views."""
    # The lean checks first (a decode step's common case, a few microseconds), else every check.
    found = None if alibi_slopes is not None else kvcache_problem_lean(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window, softcap, num_splits,
        num_threads, out, layout, k_scale, v_scale)
    problem, out, append = found or kvcache_problem(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window, softcap, alibi_slopes,
        num_splits, num_threads, out, layout, k_scale, v_scale)
    problem = _with_sinks(problem, sinks)
    if append is not None:  # every check passed: write the new keys/values in place
        _append(append, problem.block_table, problem.block_size)
    lse = np.empty((problem.batch, problem.q_heads, problem.q_length), np.float32) if return_lse else None
    _launch(problem, lse)
    return out, lse


def _quantize(x, cache, with_scales):
    """New keys or values ``(B, n, Hk, D)`` as codes of a quantized cache's dtype and their float32
    scales ``(B, n, Hk)`` (None without scales): API.md's rule, computed in float32."""
    x = np.asarray(x, np.float32)
    limit = np.float32(_CODES[cache.dtype][1])
    # np.minimum/np.maximum: np.clip's semantics (NaN stays NaN) at a fraction of its call cost,
    # which is most of a decode step's append.
    if not with_scales:  # float8 without scales: direct conversion, saturating (NaN stays NaN)
        return np.minimum(np.maximum(x, -limit), limit).astype(cache.dtype), None
    scale = np.abs(x).max(axis=-1) / limit
    y = x / np.where(scale > 0, scale, np.float32(1))[..., None]
    if cache.dtype == np.int8:
        np.rint(y, out=y)
    elif not scale.all():  # float8: a row of zeros (-0.0 included) gets codes 0, not 0x80
        y[scale == 0] = 0.0
    return np.minimum(np.maximum(y, -limit, out=y), limit, out=y).astype(cache.dtype), scale


def _append(append, block_table, block_size):
    """Writes ``append.k``, ``append.v`` ``(B, n, Hk, D)`` into its caches at positions
    ``start[b] .. + n - 1``: contiguous caches ``(B, Ncap, Hk, D)`` when block_table is None, else
    paged ``(num_blocks, block_size, Hk, D)`` through block_table ``(B, max_blocks)``; into a
    quantized cache as codes, with their scales into the scale arrays (same positions). Slice
    assignments for one start or small batches (decode), one fancy-indexed assignment otherwise."""
    k_cache, v_cache, k, v, start, k_scale, v_scale = append
    B, n = k.shape[:2]
    pairs = [(k_cache, k), (v_cache, v)]
    if k_cache.dtype in _CODES:  # codes into the caches, their scales (if any) into the scale arrays
        pairs = []
        for cache, x, scales in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
            codes, new_scales = _quantize(x, cache, scales is not None)
            pairs += [(cache, codes)] + ([(scales, new_scales)] if scales is not None else [])
    if block_table is None and type(start) is int:
        for dst, src in pairs:
            dst[:, start:start + n] = src
        return
    if B * n <= 8:
        for b in range(B):
            first = start if type(start) is int else int(start[b])
            for t in range(n):
                position = first + t
                if block_table is None:
                    block, row = b, position
                else:
                    block, row = block_table[b, position // block_size], position % block_size
                for dst, src in pairs:
                    dst[block, row] = src[b, t]
        return
    positions = np.broadcast_to(np.asarray(start, np.int64).reshape(-1, 1) + np.arange(n)[None, :], (B, n))
    if block_table is None:
        blocks, rows = np.broadcast_to(np.arange(B)[:, None], positions.shape), positions
    else:
        blocks, rows = block_table[np.arange(B)[:, None], positions // block_size], positions % block_size
    for dst, src in pairs:
        dst[blocks, rows] = src
