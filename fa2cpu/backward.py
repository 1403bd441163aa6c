"""Backward pass of :func:`fa2cpu.flash_attention`: FlashAttention-2's blockwise algorithm in NumPy.

For each (batch, key/value head) the query heads of its GQA group are stacked row by row
(``(Nq, group, D)``), so one float32 matmul per tile serves the whole group and K/V are never
repeated. Key blocks form the outer loop (their dK/dV accumulate in a block-sized buffer), query
blocks the inner one (dQ accumulates in a float32 ``(Nq, group, D)`` buffer). The probabilities
are recomputed from the forward's LSE, ``P = exp(s - lse)``, so extra memory is O(N * D) per
task plus O(block^2) per tile; the Nq x Nk matrix never exists. Tiles outside the causal/window
band are skipped; only tiles crossing its edge build a visibility mask.
"""
import threading

import numpy as np

from ._checks import _Options, _alibi, _cu_seqlens_pair, _data, _packed, _qkv, _threads

__all__ = ["flash_attention_backward", "flash_attention_varlen_backward"]

# Tile sizes: key rows per block, and (query rows x group heads) per block. Module attributes so
# tests can shrink them to exercise many tile edges on small inputs.
_BLOCK_K = 256
_BLOCK_ROWS = 512
# Below this much work (B * Hq * Nq * Nk * (D + Dv) multiply-adds / 2) tasks run serially.
_PARALLEL_MIN_WORK = 1 << 22

_F32 = np.float32


# ---------------------------------------------------------------------------------------------
# BLAS thread limit: process-wide state, shared by concurrent calls (reference counted, so the
# caller's setting is restored when the last concurrent call returns).
# ---------------------------------------------------------------------------------------------
class _BlasLimit:
    _lock = threading.Lock()
    _users = 0
    _limiter = None

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        cls = type(self)
        with cls._lock:
            if cls._users == 0:
                try:
                    from threadpoolctl import threadpool_limits
                    cls._limiter = threadpool_limits(self.n, user_api="blas")
                except Exception:  # noqa: BLE001 - limiting is an optimisation, never an error
                    cls._limiter = None
            cls._users += 1
        return self

    def __exit__(self, *exc):
        cls = type(self)
        with cls._lock:
            cls._users -= 1
            if cls._users == 0 and cls._limiter is not None:
                try:
                    cls._limiter.restore_original_limits()
                finally:
                    cls._limiter = None
        return False


def _match(name, a, shape, dtype, what):
    """dout / out / lse: exact dtype and shape."""
    if a.dtype != dtype:
        raise TypeError(f"{name}: dtype {a.dtype} does not match {what} dtype {np.dtype(dtype)}")
    if a.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {a.shape}")


def _rows(x, b, first_head, group):
    """(Nq, group, d) float32 C-contiguous heads first_head .. first_head + group - 1 of batch b of a
    4-D bhsd view (read only:
    a view when already so, else a copy)."""
    return np.ascontiguousarray(x[b, first_head:first_head + group].transpose(1, 0, 2), dtype=_F32)


def _task(b, kv_head, group, q4, k4, v4, do4, o4, lse3, dq4, dk4, dv4, alibi, options):
    """Gradients of query heads kv_head * group ... (kv_head + 1) * group - 1 and of kv head
    kv_head of batch b."""
    Nq, Nk = q4.shape[2], k4.shape[2]
    D = q4.shape[3]
    dtype = dq4.dtype
    first_head = kv_head * group
    scale, softcap = options.scale, options.softcap
    left, right = options.left, options.right
    diagonal_offset = Nk - Nq  # bottom-right alignment: row i's diagonal is key i + diagonal_offset

    dQ = np.zeros((Nq, group, D), _F32)
    if Nq and Nk:
        Q = _rows(q4, b, first_head, group)
        dO = _rows(do4, b, first_head, group)
        # D_i = rowsum(dO * O), per (row, head)
        dout_dot_out = np.einsum("igd,igd->ig", dO, _rows(o4, b, first_head, group))
        lse_rows = np.ascontiguousarray(lse3[b, first_head:first_head + group].T, dtype=_F32)  # (Nq, group)
        lse_rows[np.isneginf(lse_rows)] = np.inf   # rows that see no key: P = exp(-inf or s - inf) = 0, not NaN
        slopes = None if alibi is None else np.asarray(alibi[b, first_head:first_head + group], _F32)[None, :, None]
        block_k = max(1, _BLOCK_K)
        block_q = max(1, _BLOCK_ROWS // group)
        for key_start in range(0, Nk, block_k):
            key_end = min(Nk, key_start + block_k)
            # query rows that see at least one key of [key_start, key_end)
            first_row = max(0, key_start - diagonal_offset - right) if right >= 0 else 0
            end_row = min(Nq, key_end - diagonal_offset + left) if left >= 0 else Nq
            if first_row >= end_row:
                dk4[b, kv_head, key_start:key_end] = 0
                dv4[b, kv_head, key_start:key_end] = 0
                continue
            K = np.ascontiguousarray(k4[b, kv_head, key_start:key_end], dtype=_F32)
            V = np.ascontiguousarray(v4[b, kv_head, key_start:key_end], dtype=_F32)
            dK = np.zeros(K.shape, _F32)
            dV = np.zeros(V.shape, _F32)
            key_index = np.arange(key_start, key_end)
            for row_start in range(first_row, end_row, block_q):
                row_end = min(end_row, row_start + block_q)
                tile_rows = row_end - row_start
                tile_items = tile_rows * group
                Q_tile = Q[row_start:row_end].reshape(tile_items, D)
                dO_tile = dO[row_start:row_end].reshape(tile_items, -1)
                S = Q_tile @ K.T                                          # (tile_items, block_k)
                S *= _F32(scale)
                T = None
                if softcap > 0:
                    T = np.tanh(S * _F32(1.0 / softcap))
                    S = np.multiply(T, _F32(softcap), out=S)
                S_by_head = S.reshape(tile_rows, group, -1)
                query_index = np.arange(row_start, row_end)
                # (tile_rows, block_k): i + diagonal_offset - j
                diag = query_index[:, None] + diagonal_offset - key_index[None, :]
                if slopes is not None:
                    S_by_head -= slopes * np.abs(diag).astype(_F32)[:, None, :]
                S_by_head -= lse_rows[row_start:row_end, :, None]
                P = np.exp(S, out=S)
                # does every row of the tile see every key of the block?
                full = ((left < 0 or key_start >= row_end - 1 + diagonal_offset - left)
                        and (right < 0 or key_end - 1 <= row_start + diagonal_offset + right))
                hidden = None
                if not full:
                    hidden = np.zeros(diag.shape, bool)
                    if left >= 0:
                        hidden |= diag > left
                    if right >= 0:
                        hidden |= diag < -right
                    hidden = hidden[:, None, :]                            # (tile_rows, 1, block_k)
                    np.copyto(S_by_head, _F32(0), where=hidden)           # S_by_head is a view of P
                dV += P.T @ dO_tile
                dP = dO_tile @ V.T
                dP -= dout_dot_out[row_start:row_end].reshape(tile_items, 1)
                dS = np.multiply(P, dP, out=dP)
                if T is not None:
                    T *= T
                    np.subtract(_F32(1), T, out=T)
                    dS *= T
                if hidden is not None:  # exactly nothing from invisible keys, even where dP is NaN/inf
                    np.copyto(dS.reshape(tile_rows, group, -1), _F32(0), where=hidden)
                dQ[row_start:row_end] += (dS @ K).reshape(tile_rows, group, D)
                dK += dS.T @ Q_tile
            dK *= _F32(scale)
            dk4[b, kv_head, key_start:key_end] = dK.astype(dtype)
            dv4[b, kv_head, key_start:key_end] = dV.astype(dtype)
    else:
        dk4[b, kv_head] = 0
        dv4[b, kv_head] = 0
    dQ *= _F32(scale)
    dq4[b, first_head:first_head + group] = dQ.transpose(1, 0, 2).astype(dtype)


def flash_attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None,
                             window=(-1, -1), softcap=None, alibi_slopes=None,
                             layout="bhsd", num_threads=None):
    """Gradients of :func:`flash_attention` with respect to q, k and v (FlashAttention-2 backward).

    Given the upstream gradient ``dout`` and the forward's ``out`` and ``lse``
    (``flash_attention(..., return_lse=True)``), returns ``(dq, dk, dv)`` of the loss
    ``sum(dout * out)``. The probabilities are recomputed tile by tile from ``lse``
    (``P = exp(s - lse)``), so memory stays O(N * D) per head: the Nq x Nk matrix is never formed.

    Parameters
    ----------
    dout : ndarray
        Gradient of the output: the forward output's shape (q's with last dim Dv) and q's dtype.
    q, k, v : ndarray
        The forward's inputs, same layouts, ranks, dtypes and rules as :func:`flash_attention`:
        ``layout="bhsd"``: q ``(B, Hq, Nq, D)``, k ``(B, Hk, Nk, D)``, v ``(B, Hk, Nk, Dv)``,
        also 3-D ``(H, N, D)`` and 2-D ``(N, D)``; ``layout="bshd"``: ``(B, N, H, D)``, 4-D only.
        float32, float16 or ``ml_dtypes.bfloat16`` (one dtype); any strides. ``Hq % Hk == 0``.
    out : ndarray
        The forward output (same shape and dtype as ``dout``).
    lse : float32 ndarray
        The forward's log-sum-exp, ``(B, Hq, Nq)`` (``(Hq, Nq)`` / ``(Nq,)`` for 3-D / 2-D
        inputs). Rows with LSE ``-inf`` (no visible key) contribute nothing: zero gradient, no NaN.
    causal, scale, window, softcap, alibi_slopes :
        Must be the values the forward used; same meaning as in :func:`flash_attention`
        (bottom-right aligned causal/window, ``scale`` default ``1/sqrt(D)``, softcap chain rule
        ``d/ds [c tanh(s/c)] = 1 - tanh^2(s/c)``, alibi is a constant bias without gradient).
        There is no ``mask`` argument.
    layout : {"bhsd", "bshd"}
    num_threads : int, optional
        Threads used: (batch, kv head) tasks run in a thread pool and the BLAS library is limited
        (threadpoolctl) to the remaining share while the call runs. None follows OpenMP's current
        maximum, like the forward. NumPy releases the GIL in the heavy operations.

    Returns
    -------
    (dq, dk, dv) : new arrays with the shapes of q, k, v, in the input dtype (accumulation is
        float32). dk/dv are summed over the query heads of each GQA group.
    """
    q, k, v, (q4, k4, v4), (B, Hq, Hk, Nq, Nk, D, Dv) = _qkv(q, k, v, layout)
    dout = _data("dout", dout); out = _data("out", out); lse = _data("lse", lse)
    rank = q.ndim
    out_shape = q.shape[:-1] + (Dv,)
    _match("dout", dout, out_shape, q.dtype, "the forward output's (q's)")
    _match("out", out, out_shape, q.dtype, "the forward output's (q's)")
    lse_shape = (B, Hq, Nq) if rank == 4 else q.shape[:-1]
    if lse.dtype != np.float32:
        raise TypeError(f"lse: dtype {lse.dtype} is not supported; expected float32")
    if lse.shape != lse_shape:
        raise ValueError(f"lse: expected shape {lse_shape}, got {lse.shape}")
    options = _Options(D, causal, scale, window, softcap, Nq, Nk)
    alibi = _alibi(alibi_slopes, B, Hq)
    threads = _threads(num_threads)

    dq = np.empty(q.shape, q.dtype)
    dk = np.empty(k.shape, q.dtype)
    dv = np.empty(v.shape, q.dtype)
    if layout == "bshd":
        do4, o4 = dout.transpose(0, 2, 1, 3), out.transpose(0, 2, 1, 3)
        dq4, dk4, dv4 = (a.transpose(0, 2, 1, 3) for a in (dq, dk, dv))
        lse3 = lse
    else:
        lift = (None,) * (4 - rank)
        do4, o4, dq4, dk4, dv4 = (a[lift] for a in (dout, out, dq, dk, dv))
        lse3 = lse[(None,) * (3 - lse.ndim)]
    group = Hq // Hk
    if group == 0:  # no query heads: nothing depends on k, v
        dk[...] = 0
        dv[...] = 0
        return dq, dk, dv
    args = (group, q4, k4, v4, do4, o4, lse3, dq4, dk4, dv4, alibi, options)
    tasks = [(b, hk) for b in range(B) for hk in range(Hk)]
    # A thread pool costs ~ms to start, BLAS threads on tiny matmuls only add wake-up latency:
    # small problems run on the calling thread alone.
    small = B * Hq * Nq * Nk * (D + Dv) < _PARALLEL_MIN_WORK
    workers = 1 if small else min(threads, len(tasks))
    with _BlasLimit(1 if small else max(1, threads // workers)):
        if workers <= 1:
            for b, hk in tasks:
                _task(b, hk, *args)
        else:
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for f in [pool.submit(_task, b, hk, *args) for b, hk in tasks]:
                    f.result()
    return dq, dk, dv


def flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                                    max_seqlen_k=None, causal=False, scale=None, window=(-1, -1), softcap=None,
                                    alibi_slopes=None, num_threads=None):
    """Gradients of :func:`fa2cpu.flash_attention_varlen` with respect to q, k and v.

    q ``(total_q, Hq, D)``, k ``(total_k, Hk, D)``, v ``(total_k, Hk, Dv)``; ``dout``/``out``
    ``(total_q, Hq, Dv)`` and ``lse`` float32 ``(Hq, total_q)`` as the forward returned them;
    ``cu_seqlens_*`` and the options must be the forward's. Each sequence is differentiated with
    :func:`flash_attention_backward` on ``(1, n, H, D)`` views (masks aligned per sequence, as in
    the forward). Returns new ``(dq, dk, dv)`` in the input dtype; rows of a sequence without keys
    (and keys of a sequence without queries) get zero gradients.
    """
    q, k, v, dout, out = _packed(q=q, k=k, v=v, dout=dout, out=out)
    lse = _data("lse", lse)
    total_q, Hq, _ = q.shape
    _match("dout", dout, (total_q, Hq, v.shape[2]), q.dtype, "the forward output's (q's)")
    _match("out", out, (total_q, Hq, v.shape[2]), q.dtype, "the forward output's (q's)")
    _match("lse", lse, (Hq, total_q), np.float32, "float32")
    cu_q, cu_k = _cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, total_q, k.shape[0])
    del max_seqlen_q, max_seqlen_k  # bounds for the forward's planning; the loop needs none
    slopes = None
    if alibi_slopes is not None:
        slopes = _alibi(alibi_slopes, cu_q.shape[0] - 1, Hq)
    dq, dk, dv = np.zeros(q.shape, q.dtype), np.zeros(k.shape, q.dtype), np.zeros(v.shape, q.dtype)
    for b in range(cu_q.shape[0] - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q0 == q1 or k0 == k1:
            continue
        g = flash_attention_backward(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                     out[None, q0:q1], lse[None, :, q0:q1], causal=causal, scale=scale,
                                     window=window, softcap=softcap,
                                     alibi_slopes=None if slopes is None else slopes[b], layout="bshd",
                                     num_threads=num_threads)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv
