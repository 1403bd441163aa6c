"""Backward pass of :func:`fa2cpu.flash_attention` and :func:`fa2cpu.flash_attention_varlen`.

Arguments are checked here (the same checks as the forwards', fa2cpu/_checks.py); the gradients
are computed by the C++ FlashAttention-2 backward (csrc/driver/backward.cpp driving the selected
family's csrc/kernels/common/backward_loop.h) through ``_core.run_backward``: P recomputed from the
forward's LSE tile by tile, no Nq x Nk buffer, float32 accumulation, bit-identical results for
any thread count (the work plan depends on the shapes and on the machine's CPU count, which sizes
the key ranges of one work item, never on ``num_threads``).
"""
import numpy as np

from . import _core
from ._checks import (_DTYPES, _Options, _alibi, _cu_seqlens_pair, _data, _dsinks, _max_seqlens, _packed, _qkv, _sinks,
                      _threads)

__all__ = ["flash_attention_backward", "flash_attention_varlen_backward"]


def _match(name, a, shape, dtype, what):
    """dout / out / lse: exact dtype and shape."""
    if a.dtype != dtype:
        raise TypeError(f"{name}: dtype {a.dtype} does not match {what} dtype {np.dtype(dtype)}")
    if a.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {a.shape}")


def _gradients(q, k, v):
    """New dq, dk, dv (shapes of q, k, v, q's dtype) for ``_core.run_backward`` to fill. Left
    uninitialised (``_uninitialised``): the core writes every element (zeros for dq rows that
    see no key, whole-head rows of a sequence without keys and dK / dV of keys no row sees:
    backward_loop.h's zero_dq_outside and dK / dV rows, backward.cpp's reduce_group), so
    np.zeros only added a one-thread memset of memory the allocator hands back (bench/RESULTS.md,
    session 47). Without query rows (Hq = 0 or Nq = 0) the gradients are zeros: the core returns
    at once when there are no query heads. tests/test_backward.py fills the arrays with NaN to
    check that nothing is left unwritten."""
    new = np.zeros if q.size == 0 else _uninitialised
    return new(q.shape, q.dtype), new(k.shape, q.dtype), new(v.shape, q.dtype)


_uninitialised = _core.gradient_array  # kept memory of earlier gradients (_core.pyx says why)


def flash_attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None,
                             window=(-1, -1), softcap=None, alibi_slopes=None,
                             layout="bhsd", num_threads=None, sinks=None):
    """Gradients of :func:`flash_attention` with respect to q, k and v (FlashAttention-2 backward).

    Given the upstream gradient ``dout`` and the forward's ``out`` and ``lse``
    (``flash_attention(..., return_lse=True)``), returns ``(dq, dk, dv)`` of the loss
    ``sum(dout * out)``. The probabilities are recomputed tile by tile from ``lse``
    (``P = exp(s - lse)``), so memory stays O(N * D) per head: the Nq x Nk matrix is never formed.
    Where a kv head's keys are split over work items, their float32 partial ``dq`` rows live in a
    buffer that the calling thread keeps for its next backward (up to 256 MiB; larger ones are
    freed after the call), as a training loop repeats the same shapes. For the same reason the
    memory of gradients the caller has dropped is kept and handed to the next backward's
    ``dq``, ``dk``, ``dv`` of the same byte size (never while any array or view of it is alive),
    up to ``FA2CPU_KEEP_GRADIENTS_MB`` MiB (read at import; default 256, ``0`` keeps nothing):
    fresh memory is zeroed by the kernel page by page inside the parallel kernels, which made a
    2-thread backward up to 1.3x slower (bench/RESULTS.md, session 48). The arrays therefore do
    not own their memory (``flags.owndata`` is False and ``ndarray.resize`` refuses them); their
    base does, and gives it back only when no array or view of it is left.

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
        Threads of the library's pool; None follows OpenMP's current maximum, like the forward.
        The GIL is released during the compute. The gradients are bit-identical for any value
        (on one machine: the split of the key axis into work items depends on its CPU count).

    sinks : array_like, optional
        The forward's attention sinks (float32 ``(Hq,)``); ``lse`` must be the forward's with them.

    Returns
    -------
    (dq, dk, dv) : new arrays with the shapes of q, k, v, in the input dtype (accumulation is
        float32). dk/dv are summed over the query heads of each GQA group. With ``sinks``:
        ``(dq, dk, dv, dsinks)``, ``dsinks[h] = -sum_i exp(sinks[h] - lse_i) * sum_d(dout_i * out_i)``
        float32 ``(Hq,)``. (The other gradients need nothing more: P = exp(s - lse) with the sink
        inside lse, and a sink has no value vector.)

    Notes
    -----
    A (query, key) pair that causal / the window hides is absent, as in the forward: an inf or
    NaN in a row of q or dout, or in a key of k, reaches only the gradients of the pairs it is
    part of that can see each other (D_i is ``rowsum(dout * out)``, FlashAttention-2's form).
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
    sinks = _sinks(sinks, Hq)
    threads = _threads(num_threads)

    dq, dk, dv = _gradients(q, k, v)
    if layout == "bshd":
        do4, o4, dq4, dk4, dv4 = (a.transpose(0, 2, 1, 3) for a in (dout, out, dq, dk, dv))
    else:
        lift = (None,) * (4 - rank)
        do4, o4, dq4, dk4, dv4 = (a[lift] for a in (dout, out, dq, dk, dv))
    _core.run_backward(do4, q4, k4, v4, o4, lse[(None,) * (3 - lse.ndim)], dq4, dk4, dv4, dtype=_DTYPES[q.dtype],
                       batch=B, hq=Hq, hk=Hk, nq=Nq, nk=Nk, scale=options.scale, softcap=options.softcap,
                       win_left=options.left, win_right=options.right, alibi=alibi, cu_q=None, cu_k=None,
                       num_threads=threads)
    if sinks is None:
        return dq, dk, dv
    lse4 = lse[(None,) * (3 - lse.ndim)]  # (B, Hq, Nq): rows with the head on the last axis below
    return dq, dk, dv, _dsinks(sinks, do4.transpose(0, 2, 1, 3), o4.transpose(0, 2, 1, 3), lse4.transpose(0, 2, 1))


def flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                                    max_seqlen_k=None, causal=False, scale=None, window=(-1, -1), softcap=None,
                                    alibi_slopes=None, num_threads=None, sinks=None):
    """Gradients of :func:`fa2cpu.flash_attention_varlen` with respect to q, k and v.

    q ``(total_q, Hq, D)``, k ``(total_k, Hk, D)``, v ``(total_k, Hk, Dv)``; ``dout``/``out``
    ``(total_q, Hq, Dv)`` and ``lse`` float32 ``(Hq, total_q)`` as the forward returned them;
    ``cu_seqlens_*`` and the options must be the forward's (masks and alibi aligned per sequence,
    as in the forward); other arguments (``sinks`` included: then ``dsinks`` is returned as a
    fourth gradient) as in :func:`flash_attention_backward`. Returns new ``(dq, dk, dv)`` in the
    input dtype; rows of a sequence without keys (and keys of a sequence without queries) get zero
    gradients.
    """
    q, k, v, dout, out = _packed(q=q, k=k, v=v, dout=dout, out=out)
    lse = _data("lse", lse)
    total_q, Hq, _ = q.shape
    _match("dout", dout, (total_q, Hq, v.shape[2]), q.dtype, "the forward output's (q's)")
    _match("out", out, (total_q, Hq, v.shape[2]), q.dtype, "the forward output's (q's)")
    _match("lse", lse, (Hq, total_q), np.float32, "float32")
    cu_q, cu_k = _cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, total_q, k.shape[0])
    _max_seqlens(max_seqlen_q, max_seqlen_k, cu_q, cu_k)  # checked as the forward's; the loop needs none
    B = cu_q.shape[0] - 1
    options = _Options(q.shape[2], causal, scale, window, softcap, total_q, k.shape[0])
    alibi = _alibi(alibi_slopes, B, Hq)
    sinks = _sinks(sinks, Hq)
    threads = _threads(num_threads)
    _qkv(q[None], k[None], v[None], "bshd")  # heads, rows and head dims: flash_attention_backward's checks
    dq, dk, dv = _gradients(q, k, v)

    def one_batch(a):  # (total, H, D) -> (1, H, total, D)
        return a.transpose(1, 0, 2)[None]
    _core.run_backward(one_batch(dout), one_batch(q), one_batch(k), one_batch(v), one_batch(out), lse[None],
                       one_batch(dq), one_batch(dk), one_batch(dv), dtype=_DTYPES[q.dtype], batch=B, hq=Hq,
                       hk=k.shape[1], nq=0, nk=0, scale=options.scale, softcap=options.softcap,
                       win_left=options.left, win_right=options.right, alibi=alibi, cu_q=cu_q, cu_k=cu_k,
                       num_threads=threads)
    if sinks is None:
        return dq, dk, dv
    return dq, dk, dv, _dsinks(sinks, dout, out, lse.T)
