"""Public attention functions: argument validation and normalisation, then one call into the core.

Every check happens here, before anything is written: bad input raises TypeError (wrong type or
dtype) or ValueError (wrong shape or value) naming the argument. Nothing is copied except where
a stride is not a multiple of the item size (exotic byte-offset views), a float mask of another
float dtype (converted at its own, un-broadcast size) and the small index arrays (always copied,
so that an `out=` sharing their memory cannot change them while the kernels read them).

Limits (API.md, "Conventions"): positions and window bounds are Python/int64 integers end to end;
window bounds past every sequence are normalised to -1 (unbounded), so the core never sees a bound
that could overflow; floats that reach the kernels (scale, softcap, slopes, mask values) must fit
float32 after the kernels' log2(e) scaling; thread counts are capped at the usable CPUs.
"""
import math
import numbers

import ml_dtypes
import numpy as np

from . import _core

__all__ = ["flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache"]

# dtype -> code of the C++ DType enum (csrc/include/fa2cpu/fa2cpu.h)
_DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(ml_dtypes.bfloat16): 2}
_ACCEPTED = "float32, float16 or ml_dtypes.bfloat16"
MAX_HEAD_DIM = 256  # kMaxHeadDim in csrc/include/fa2cpu/fa2cpu.h

# Float limits. The kernels work in the log2 domain: scale, mask values and ALiBi slopes are
# multiplied by log2(e) in float32, so their magnitude must stay below FLT_MAX / log2(e).
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32
_LOG2E = 1.4426950408889634
_LOG2_MAX = _F32_MAX / _LOG2E                 # ~2.36e38
_MAX_SPLITS = 1 << 20                         # more splits than this never help (a split >= 1 tile)


# ---------------------------------------------------------------------------------------------
# small validators
# ---------------------------------------------------------------------------------------------
def _not_an_array(name, x):
    """TypeError for a q/k/v-like argument that is not an ndarray, saying what it is."""
    kind = type(x)
    if kind.__module__.split(".")[0] == "torch":
        return TypeError(f"{name}: got a torch.Tensor; the NumPy API takes NumPy arrays. For tensors use "
                         f"fa2cpu.torch (same functions, zero-copy, autograd): import fa2cpu.torch")
    if isinstance(x, (list, tuple)):
        return TypeError(f"{name}: expected a NumPy array, got a Python {kind.__name__}; convert it first, "
                         f"e.g. np.asarray({name}, dtype=np.float32)")
    return TypeError(f"{name}: expected a NumPy array, got {kind.__name__}")


def _data(name, x):
    """q, k, v, caches, out, dout: ndarrays only (no silent conversion of lists or tensors)."""
    if isinstance(x, np.ndarray):
        return x
    raise _not_an_array(name, x)


def _array(name, x):
    """Small arguments (masks, slopes, index arrays): ndarrays or anything np.asarray accepts."""
    if isinstance(x, np.ndarray):
        return x
    if x is None:
        raise TypeError(f"{name}: expected a NumPy array, got None")
    if type(x).__module__.split(".")[0] == "torch":
        raise _not_an_array(name, x)
    try:
        return np.asarray(x)
    except Exception as e:  # noqa: BLE001 - report any conversion failure as a type problem
        raise TypeError(f"{name}: expected a NumPy array, got {type(x).__name__}") from e


def _dtype_code(name, a):
    code = _DTYPES.get(a.dtype)
    if code is None:
        raise TypeError(f"{name}: dtype {a.dtype} is not supported; expected {_ACCEPTED}")
    return code


def _same_dtype(ref_name, ref, **arrays):
    for name, a in arrays.items():
        if a.dtype != ref.dtype:
            raise TypeError(f"{name}: dtype {a.dtype} does not match {ref_name}'s dtype {ref.dtype}; "
                            f"q, k and v must share one dtype ({_ACCEPTED}), no implicit casts")


def _fix_strides(a):
    """The core addresses arrays by element strides through typed pointers; a data pointer or byte
    stride that is not a multiple of the item size (only hand-made views) gets a contiguous copy."""
    return a if a.flags.aligned else a.copy(order="C")  # a fresh, aligned buffer


def _int(name, x, minimum=None):
    if type(x) is int:  # the common case, without the ABC checks below (~1 us per call)
        if minimum is not None and x < minimum:
            raise ValueError(f"{name}: must be >= {minimum}, got {x}")
        return x
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    x = int(x)
    if minimum is not None and x < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {x}")
    return x


def _threads(num_threads):
    """None -> OpenMP's current maximum (OMP_NUM_THREADS, threadpoolctl), else an int >= 1; either
    capped at the CPUs this process may run on (more threads never help; thousands cannot even
    be created)."""
    if num_threads is None:
        n = _core.max_threads()
    else:
        n = _int("num_threads", num_threads, 1)
    return max(1, min(n, _core.max_useful_threads()))


def _f32_real(name, x, what="a float"):
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{name}: expected {what}, got {type(x).__name__}")
    return float(x)


def _head_dims(q_name, q_d, k_d, v_d, shapes, k_name="k", v_name="v"):
    """shapes: {name: user-facing shape} for the messages."""
    if q_d != k_d:
        raise ValueError(f"{k_name}: head dim {k_d} does not match {q_name}'s head dim {q_d} "
                         f"({k_name} shape {shapes[k_name]}, {q_name} shape {shapes[q_name]})")
    for name, d in ((q_name, q_d), (v_name, v_d)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: head dim must be in 1..{MAX_HEAD_DIM}, got {d} (shape {shapes[name]})")


def _heads(hq, hk, hv, shapes, q_name="q", k_name="k", v_name="v"):
    if hk < 1:
        raise ValueError(f"{k_name}: needs at least one head, got shape {shapes[k_name]}")
    if hv != hk:
        raise ValueError(f"{v_name}: {hv} heads do not match {k_name}'s {hk} heads "
                         f"({v_name} shape {shapes[v_name]}, {k_name} shape {shapes[k_name]})")
    if hq % hk:
        raise ValueError(f"{q_name}: number of query heads {hq} is not a multiple of the number of "
                         f"key/value heads {hk} (GQA/MQA needs Hq % Hk == 0; {q_name} shape {shapes[q_name]}, "
                         f"{k_name} shape {shapes[k_name]})")


class _Options:
    """Score options shared by every entry point, normalised for the core.

    ``nq_max``/``nk_max`` bound the query/key lengths of every sequence of the call: a window bound
    that reaches past them is the same as unbounded and becomes -1, so any int is accepted and the
    core only sees bounds in [-1, max length] (no int64 overflow, no Cython OverflowError)."""
    __slots__ = ("scale", "softcap", "left", "right")

    def __init__(self, d, causal, scale, window, softcap, nq_max, nk_max):
        if scale is None and softcap is None and type(window) is tuple and window == (-1, -1) and type(causal) is bool:
            self.scale, self.softcap, self.left = 1.0 / math.sqrt(d), 0.0, -1
            self.right = 0 if causal and nq_max > 1 else -1  # right >= nq - 1 clips nothing
            return
        if scale is None:
            self.scale = 1.0 / math.sqrt(d)
        else:
            self.scale = _f32_real("scale", scale)
            if not math.isfinite(self.scale):
                raise ValueError(f"scale: must be finite, got {self.scale}")
            if abs(self.scale) > _LOG2_MAX:
                raise ValueError(f"scale: {self.scale:g} does not fit float32 once multiplied by log2(e) "
                                 f"(|scale| must be <= {_LOG2_MAX:.4g})")
        if softcap is None:
            self.softcap = 0.0
        else:
            self.softcap = _f32_real("softcap", softcap, "a float or None")
            if not (self.softcap >= 0.0 and math.isfinite(self.softcap)):
                raise ValueError(f"softcap: must be a finite value >= 0 (0 or None = off), got {softcap}")
            # The kernels compute scale / softcap and softcap * log2(e) in float32.
            if self.softcap and not (_F32_TINY <= self.softcap <= _LOG2_MAX
                                     and abs(self.scale) / self.softcap <= _F32_MAX):
                raise ValueError(f"softcap: {self.softcap:g} does not fit float32 (needs {_F32_TINY:.3g} <= softcap "
                                 f"<= {_LOG2_MAX:.4g} and |scale| / softcap <= {_F32_MAX:.4g}; scale = {self.scale:g})")
        try:
            left, right = window
        except (TypeError, ValueError):
            raise ValueError(f"window: expected a pair (left, right) of ints >= -1, got {window!r}") from None
        left = _int("window", left)
        right = _int("window", right)
        if left < -1 or right < -1:
            raise ValueError(f"window: entries must be >= -1 (-1 = unbounded), got {window!r}")
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
        if causal:
            right = 0
        # Row i of a sequence sees [i + nk - nq - left, i + nk - nq + right] within [0, nk): left >= nk - 1
        # or right >= nq - 1 no longer clips anything.
        self.left = -1 if left >= nk_max else left
        self.right = -1 if right >= nq_max else right


def _alibi(alibi_slopes, batch, hq):
    """-> float32 (batch, hq) view (zero batch stride for a (hq,) input) or None."""
    if alibi_slopes is None:
        return None
    a = _array("alibi_slopes", alibi_slopes)
    if a.dtype != np.float32:
        raise TypeError(f"alibi_slopes: dtype {a.dtype} is not supported; expected float32")
    if a.shape == (hq,):
        a = np.broadcast_to(a[None, :], (batch, hq))
    elif a.shape != (batch, hq):
        raise ValueError(f"alibi_slopes: expected shape ({hq},) or ({batch}, {hq}), got {a.shape}")
    if a.size:
        with np.errstate(invalid="ignore"):
            big = np.abs(a) > _LOG2_MAX
        if np.any(big & np.isfinite(a)):
            raise ValueError(f"alibi_slopes: |slope| must be <= {_LOG2_MAX:.4g} (slopes are multiplied by log2(e) "
                             f"in float32), got {float(np.abs(a[big]).max()):g}")
    return _fix_strides(a)


def _mask(mask, shape):
    """-> (4-D view broadcast to `shape` with zero strides, kind) with kind 1 = bool, 2 = float."""
    if mask is None:
        return None, 0
    m = _array("mask", mask)
    if m.dtype == np.bool_:
        kind = 1
    elif m.dtype.kind == "f" or m.dtype == ml_dtypes.bfloat16:
        kind = 2
        # Checked and converted at the mask's own size: axes the caller broadcast (stride 0) stay so.
        compact = m[tuple(slice(0, 1) if st == 0 and n > 1 else slice(None) for st, n in zip(m.strides, m.shape))]
        if compact.size:
            # Finite values must fit float32 after the kernels' log2(e) scaling; -inf (masked out),
            # +inf and NaN are values with a meaning (the row becomes NaN for the last two).
            c = compact.astype(np.float64) if compact.dtype != np.float32 else compact
            fin = np.isfinite(c)
            hi = np.max(c, initial=-np.inf, where=fin)
            lo = np.min(c, initial=np.inf, where=fin)
            if hi > _LOG2_MAX or lo < -_LOG2_MAX:
                raise ValueError(f"mask: finite additive values must be within +-{_LOG2_MAX:.4g} (they are scaled "
                                 f"by log2(e) in float32), got values in [{lo:g}, {hi:g}]; use -inf to mask out")
        if m.dtype != np.float32:
            m = np.broadcast_to(compact.astype(np.float32), m.shape)
    else:
        raise TypeError(f"mask: dtype {m.dtype} is not supported; expected bool (True = attend) "
                        f"or a float dtype (added to the scores)")
    if m.ndim > 4:
        raise ValueError(f"mask: shape {m.shape} is not broadcastable to {shape}")
    try:
        m = np.broadcast_to(m, shape)
    except ValueError:
        raise ValueError(f"mask: shape {m.shape} is not broadcastable to {shape} "
                         f"(batch, q heads, q length, k length)") from None
    if kind == 1:
        m = m.view(np.uint8)
    return _fix_strides(m), kind


def _overlaps(a, b):
    """Exact test whether two arrays share a byte (np.shares_memory), bounded in effort: disjoint
    interleaved views such as x[..., :8] and x[..., 8:] are told apart; a case too hard to decide
    quickly counts as overlapping."""
    if not np.may_share_memory(a, b):
        return False
    try:
        return bool(np.shares_memory(a, b, max_work=100_000))
    except np.exceptions.TooHardError if hasattr(np, "exceptions") else np.TooHardError:
        return True


def _out(out, shape, dtype, inputs):
    """Validates a caller's out= array (nothing is written before all checks pass). `inputs` maps
    names to every array the kernels read while writing out (None entries are skipped)."""
    if out is None:
        return np.empty(shape, dtype)
    if not isinstance(out, np.ndarray):
        raise _not_an_array("out", out)
    if out.dtype != dtype:
        raise TypeError(f"out: dtype {out.dtype} does not match the result dtype {np.dtype(dtype)}")
    if out.shape != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)}, got {out.shape}")
    if not out.flags.writeable:
        raise ValueError("out: array is read-only")
    if not out.flags.aligned:  # data pointer and strides multiples of the item's alignment
        raise ValueError("out: data pointer and strides must be aligned to the item size")
    if out.size and any(0 in out.strides[i:i + 1] and out.shape[i] > 1 for i in range(out.ndim)):
        raise ValueError("out: must not have zero (broadcast) strides")
    if out.size:
        for name, a in inputs.items():
            if isinstance(a, np.ndarray) and a.size and _overlaps(out, a):
                raise ValueError(f"out: must not overlap the input {name}")
    return out


def _qkv(q, k, v, layout):
    """Validates q, k, v of flash_attention / flash_attention_backward (dtypes, ranks, shapes) and
    returns (q, k, v) as arrays, their 4-D (batch, head, position, feature) views (no copies)
    and the sizes (B, Hq, Hk, Nq, Nk, D, Dv)."""
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout: expected 'bhsd' or 'bshd', got {layout!r}")
    q = _data("q", q); k = _data("k", k); v = _data("v", v)
    _dtype_code("q", q)
    _same_dtype("q", q, k=k, v=v)
    rank = q.ndim
    if layout == "bshd" and rank != 4:
        raise ValueError(f"q: layout 'bshd' needs 4-D (B, N, H, D) arrays, got shape {q.shape}")
    if rank not in (2, 3, 4):
        raise ValueError(f"q: expected a 2-D (N, D), 3-D (H, N, D) or 4-D array, got shape {q.shape}")
    for name, a in (("k", k), ("v", v)):
        if a.ndim != rank:
            raise ValueError(f"{name}: expected a {rank}-D array like q, got shape {a.shape}")
    if layout == "bshd":
        q4, k4, v4 = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    else:
        lift = (None,) * (4 - rank)
        q4, k4, v4 = q[lift], k[lift], v[lift]
    B, Hq, Nq, D = q4.shape
    _, Hk, Nk, Dk = k4.shape
    shapes = {"q": q.shape, "k": k.shape, "v": v.shape}
    if k4.shape[0] != B or v4.shape[0] != B:
        bad = "k" if k4.shape[0] != B else "v"
        raise ValueError(f"{bad}: batch size does not match q's: expected {B}, got shape {shapes[bad]} "
                         f"(q shape {q.shape})")
    _heads(Hq, Hk, v4.shape[1], shapes)
    if v4.shape[2] != Nk:
        raise ValueError(f"v: sequence length {v4.shape[2]} does not match k's {Nk} "
                         f"(v shape {v.shape}, k shape {k.shape})")
    Dv = v4.shape[3]
    _head_dims("q", D, Dk, Dv, shapes)
    return q, k, v, (q4, k4, v4), (B, Hq, Hk, Nq, Nk, D, Dv)


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
def _cu_seqlens(name, cu, total):
    cu = _array(name, cu)
    if cu.dtype not in (np.int32, np.int64):
        raise TypeError(f"{name}: dtype {cu.dtype} is not supported; expected int32 or int64")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name}: expected a 1-D array of shape (B+1,), got shape {cu.shape}")
    cu = np.array(cu, dtype=np.int64, order="C")  # always a copy: out= may share the caller's memory
    if cu[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {cu[0]}")
    if np.any(np.diff(cu) < 0):
        raise ValueError(f"{name}: must be non-decreasing")
    if cu[-1] != total:
        raise ValueError(f"{name}: last entry {cu[-1]} does not equal the total number of rows {total}")
    return cu


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
