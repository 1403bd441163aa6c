"""Argument checks and normalisation shared by every entry point (NumPy, backward, torch).

Every check happens before anything is written: bad input raises TypeError (wrong type or dtype)
or ValueError (wrong shape or value) naming the argument. Nothing is copied except where a stride
is not a multiple of the item size (exotic byte-offset views), a float mask of another float dtype
(converted at its own, un-broadcast size) and the small index arrays (always copied, so that an
`out=` sharing their memory cannot change them while the kernels read them).

Limits (API.md, "Conventions"): positions and window bounds are Python/int64 integers end to end;
window bounds past every sequence are normalised to -1 (unbounded), so the core never sees a bound
that could overflow; floats that reach the kernels (scale, softcap, slopes, mask values) must fit
float32 after the kernels' log2(e) scaling; thread counts are capped at the usable CPUs.
"""
import math
import numbers
from typing import NamedTuple, Optional

import ml_dtypes
import numpy as np

from . import _core

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


def _bool(name, x):
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")
    return bool(x)


def _window_pair(window):
    """(left, right) ints of a window argument (values checked by _Options)."""
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window: expected a pair (left, right) of ints >= -1, got {window!r}") from None
    return _int("window", left), _int("window", right)


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
        left, right = _window_pair(window)
        if left < -1 or right < -1:
            raise ValueError(f"window: entries must be >= -1 (-1 = unbounded), got {window!r}")
        if _bool("causal", causal):
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


_TooHardError = getattr(getattr(np, "exceptions", np), "TooHardError")  # numpy >= 2.0 / older


def _overlaps(a, b):
    """Exact test whether two arrays share a byte (np.shares_memory), bounded in effort: disjoint
    interleaved views such as x[..., :8] and x[..., 8:] are told apart; a case too hard to decide
    quickly counts as overlapping."""
    if not np.may_share_memory(a, b):
        return False
    try:
        return bool(np.shares_memory(a, b, max_work=100_000))
    except _TooHardError:
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
    if out.size and not out.flags.c_contiguous and any(
            stride == 0 and n > 1 for stride, n in zip(out.strides, out.shape)):
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


def _cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, total_q, total_k):
    """Both offset arrays of packed sequences -> private int64 copies of one shape (B+1,)."""
    cu_q = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q)
    cu_k = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_k: shape {cu_k.shape} does not match cu_seqlens_q's shape {cu_q.shape}")
    return cu_q, cu_k


def _packed(**arrays):
    """Arrays of packed sequences (q, k, v; the backward's dout, out): ndarrays of q's dtype, one
    of the kernels', each 3-D (total, H, D). Returns them in the order given."""
    arrays = {name: _data(name, a) for name, a in arrays.items()}
    q = arrays["q"]
    _dtype_code("q", q)
    _same_dtype("q", q, **{name: a for name, a in arrays.items() if name != "q"})
    for name, a in arrays.items():
        if a.ndim != 3:
            raise ValueError(f"{name}: expected a 3-D (total, H, D) array, got shape {a.shape}")
    return tuple(arrays.values())


# ---------------------------------------------------------------------------------------------
# Problems: every argument of one public call checked, as the one launch (attention._launch) needs
# ---------------------------------------------------------------------------------------------
class Problem(NamedTuple):
    """One validated kernel launch: the arguments of ``_core.run`` (fa2cpu/attention.py, _launch).

    q, k, v, out are views of the caller's memory in the core's (batch, head, position, feature)
    order; packed sequences are one batch ``(1, H, total, D)`` cut by the cu_seqlens, a paged
    cache is ``(num_blocks, Hk, block_size, D)`` read through the block table."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    out: np.ndarray
    dtype_code: int                          # _DTYPES
    batch: int                               # sequences
    q_heads: int
    kv_heads: int
    q_length: int                            # rows per sequence (0: packed, from cu_seqlens_q)
    kv_length: int                           # keys per sequence, or the cache capacity
    scale: float                             # the rest as normalised by _Options
    softcap: float                           # 0 = off
    window_left: int                         # -1 = unbounded
    window_right: int
    alibi_slopes: Optional[np.ndarray]       # float32 (batch, q_heads)
    mask: Optional[np.ndarray]               # 4-D broadcast view: uint8 (bool) or float32
    mask_kind: int                           # 0 none, 1 bool, 2 additive float
    cu_seqlens_q: Optional[np.ndarray]       # int64 (batch + 1,): packed sequences
    cu_seqlens_k: Optional[np.ndarray]
    kv_seqlens: Optional[np.ndarray]         # int64 (batch,): KV cache, keys each sequence attends
    block_table: Optional[np.ndarray]        # int32 (batch, max_blocks): paged cache
    block_size: int                          # rows of a cache block (contiguous: the capacity)
    num_threads: int
    num_splits: int                          # key-axis splits (flash-decoding), 0 = automatic


class Append(NamedTuple):
    """New keys and values a KV-cache call writes before its launch, all in (batch, position,
    head, feature) order (a paged cache: (block, row in block, head, feature))."""
    k_cache: np.ndarray
    v_cache: np.ndarray
    k: np.ndarray
    v: np.ndarray
    start: object                            # first position: int (every sequence) or int64 (B,)


def attention_problem(q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout, num_threads,
                      out):
    """flash_attention's arguments -> (Problem, out in q's layout and rank)."""
    q, k, v, (q4, k4, v4), (B, Hq, Hk, Nq, Nk, D, Dv) = _qkv(q, k, v, layout)
    options = _Options(D, causal, scale, window, softcap, Nq, Nk)
    alibi = _alibi(alibi_slopes, B, Hq)
    mask4, mask_kind = _mask(mask, (B, Hq, Nq, Nk))
    threads = _threads(num_threads)
    out = _out(out, q.shape[:-1] + (Dv,), q.dtype, {"q": q, "k": k, "v": v, "alibi_slopes": alibi, "mask": mask4})
    out4 = out.transpose(0, 2, 1, 3) if layout == "bshd" else out[(None,) * (4 - q.ndim)]
    return Problem(q4, k4, v4, out4, dtype_code=_DTYPES[q.dtype], batch=B, q_heads=Hq, kv_heads=Hk,
                   q_length=Nq, kv_length=Nk, scale=options.scale, softcap=options.softcap,
                   window_left=options.left, window_right=options.right, alibi_slopes=alibi, mask=mask4,
                   mask_kind=mask_kind, cu_seqlens_q=None, cu_seqlens_k=None, kv_seqlens=None,
                   block_table=None, block_size=0, num_threads=threads, num_splits=0), out


def varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window,
                   softcap, alibi_slopes, num_threads, out):
    """flash_attention_varlen's arguments -> (Problem, out (total_q, Hq, Dv))."""
    q, k, v = _packed(q=q, k=k, v=v)
    total_q, Hq, D = q.shape
    total_k, Hk, Dk = k.shape
    shapes = {"q": q.shape, "k": k.shape, "v": v.shape}
    if v.shape[0] != total_k:
        raise ValueError(f"v: {v.shape[0]} rows do not match k's {total_k} rows (v shape {v.shape}, k shape {k.shape})")
    _heads(Hq, Hk, v.shape[1], shapes)
    Dv = v.shape[2]
    _head_dims("q", D, Dk, Dv, shapes)
    cu_q, cu_k = _cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    B = cu_q.shape[0] - 1
    for name, given, cu in (("max_seqlen_q", max_seqlen_q, cu_q), ("max_seqlen_k", max_seqlen_k, cu_k)):
        if given is not None:
            given = _int(name, given, 0)
            longest = int(np.diff(cu).max()) if B else 0
            if given < longest:
                raise ValueError(f"{name}: {given} is shorter than the longest sequence ({longest})")
    options = _Options(D, causal, scale, window, softcap, total_q, total_k)
    alibi = _alibi(alibi_slopes, B, Hq)
    threads = _threads(num_threads)
    out = _out(out, (total_q, Hq, Dv), q.dtype, {"q": q, "k": k, "v": v, "alibi_slopes": alibi})

    def one_batch(a):  # (total, H, D) -> (1, H, total, D)
        return a.transpose(1, 0, 2)[None]
    return Problem(one_batch(q), one_batch(k), one_batch(v), one_batch(out), dtype_code=_DTYPES[q.dtype],
                   batch=B, q_heads=Hq, kv_heads=Hk, q_length=0, kv_length=0, scale=options.scale,
                   softcap=options.softcap, window_left=options.left, window_right=options.right,
                   alibi_slopes=alibi, mask=None, mask_kind=0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                   kv_seqlens=None, block_table=None, block_size=0, num_threads=threads, num_splits=0), out


def kvcache_problem(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window, softcap,
                    alibi_slopes, num_splits, num_threads, out, layout):
    """flash_attention_with_kvcache's arguments -> (Problem, out in the caller's layout, Append or
    None). Also the decode path of fa2cpu.torch, so the common case (int or (1,) cache_seqlens,
    default options) avoids array reductions and costs a few microseconds."""
    if alibi_slopes is None:
        found = _kvcache_lean(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window,
                              softcap, num_splits, num_threads, out, layout)
        if found is not None:
            return found
    return _kvcache_checked(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window,
                            softcap, alibi_slopes, num_splits, num_threads, out, layout)


def _kvcache_checked(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window, softcap,
                     alibi_slopes, num_splits, num_threads, out, layout):
    """kvcache_problem with every check, for any input (errors name the argument)."""
    if layout == "bshd":
        return _kvcache_problem(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale,
                                window, softcap, alibi_slopes, num_splits, num_threads, out, layout)
    if layout != "bhsd":
        raise ValueError(f"layout: expected 'bshd' (flash-attn order) or 'bhsd' (PyTorch order), got {layout!r}")

    def swap(a):  # (B, H, N, D) <-> (B, N, H, D); anything else is left for the checks to name
        return a.transpose(0, 2, 1, 3) if isinstance(a, np.ndarray) and a.ndim == 4 else a
    try:
        problem, new_out, append = _kvcache_problem(
            swap(q), swap(k_cache), swap(v_cache), swap(k), swap(v), cache_seqlens, block_table, causal,
            scale, window, softcap, alibi_slopes, num_splits, num_threads, swap(out), layout)
    except ValueError as e:
        raise ValueError(f"{e} [shapes shown in (B, N, H, D) order; layout='bhsd' was given]") from None
    return problem, (out if out is not None else swap(new_out)), append  # the caller's own out= object


# Small read-only int64 arrays of cache lengths, by (batch, length): a scalar cache_seqlens needs
# a (B,) array for the core on every decode step.
_SEQLEN_ARRAYS = {}


def _seqlen_array(batch, length):
    lengths = _SEQLEN_ARRAYS.get((batch, length))
    if lengths is None:
        if len(_SEQLEN_ARRAYS) > 1024:
            _SEQLEN_ARRAYS.clear()
        lengths = np.full(batch, length, np.int64)
        lengths.flags.writeable = False
        _SEQLEN_ARRAYS[(batch, length)] = lengths
    return lengths


# Bounds of the lean path's scalar options: well inside what _Options accepts (floats that fit
# float32 after log2(e) scaling), so the lean path never accepts what the full checks refuse.
_LEAN_FLOAT_MAX = 1e30
_LEAN_MAX_SPLITS = 1024
_INT32 = np.dtype(np.int32)
_INDEX_DTYPES = (_INT32, np.dtype(np.int64))  # dtype instances: `in` then tests identity first (~0.05 us, not 0.5)


def _kvcache_lean(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window, softcap,
                  num_splits, num_threads, out, layout):
    """kvcache_problem for the common decode case, checked with cheap metadata tests (a decode step
    costs tens of microseconds; the full checks cost several). Returns None, having changed
    nothing, for anything outside it; _kvcache_problem then checks everything and words the errors.

    Covered: q, caches (and k, v) plain ndarrays of one kernel dtype, 4-D, either layout;
    contiguous cache, or paged with an int32 block table; int or int32/int64 ``(B,)``
    cache_seqlens; no alibi; Python scalars for the options; ``out`` None or a C-contiguous
    array that shares no memory with an input. Within that case the results equal
    _kvcache_problem's (same normalisation of options, same core arguments)."""
    if type(q) is not np.ndarray or type(k_cache) is not np.ndarray or type(v_cache) is not np.ndarray:
        return None
    dtype = q.dtype
    dtype_code = _DTYPES.get(dtype)
    if dtype_code is None or k_cache.dtype is not dtype or v_cache.dtype is not dtype \
            or q.ndim != 4 or k_cache.ndim != 4 or v_cache.ndim != 4:
        return None
    if type(causal) is not bool or type(num_splits) is not int or not 0 <= num_splits <= _LEAN_MAX_SPLITS \
            or not (num_threads is None or (type(num_threads) is int and num_threads >= 1)):
        return None
    if type(window) is tuple and window == (-1, -1):
        left = right = -1
    elif (type(window) is tuple and len(window) == 2 and type(window[0]) is int
          and type(window[1]) is int and window[0] >= -1 and window[1] >= -1):
        left, right = window
    else:
        return None
    # The core's (batch, head, position, feature) views; "bshd" input is (batch, position, ...).
    if layout == "bshd":
        q4, k_cache4, v_cache4 = q.transpose(0, 2, 1, 3), k_cache.transpose(0, 2, 1, 3), v_cache.transpose(0, 2, 1, 3)
    elif layout == "bhsd":
        q4, k_cache4, v_cache4 = q, k_cache, v_cache
    else:
        return None
    B, Hq, Nq, D = q4.shape
    num_blocks, Hk, block_size, Dk = k_cache4.shape
    v_blocks, v_heads, v_rows, Dv = v_cache4.shape
    if (v_blocks, v_heads, v_rows) != (num_blocks, Hk, block_size) or B < 1 or Hk < 1 or block_size < 1 \
            or Hq % Hk or Dk != D or not 0 < D <= MAX_HEAD_DIM or not 0 < Dv <= MAX_HEAD_DIM:
        return None
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif type(scale) is not float or not abs(scale) <= _LEAN_FLOAT_MAX:   # NaN fails too
        return None
    if softcap is None:
        softcap = 0.0
    elif type(softcap) is not float or not (softcap == 0.0 or (
            1.0 / _LEAN_FLOAT_MAX <= softcap <= _LEAN_FLOAT_MAX and abs(scale) / softcap <= _LEAN_FLOAT_MAX)):
        return None
    new_tokens = 0
    if k is not None or v is not None:
        if type(k) is not np.ndarray or type(v) is not np.ndarray or k.dtype is not dtype or v.dtype is not dtype \
                or k.ndim != 4 or v.ndim != 4 or not k_cache.flags.writeable or not v_cache.flags.writeable:
            return None
        if layout == "bhsd":  # the append takes (batch, position, head, feature)
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        new_tokens = k.shape[1]
        if k.shape != (B, new_tokens, Hk, D) or v.shape != (B, new_tokens, Hk, Dv):
            return None
    if block_table is None:
        if num_blocks != B:
            return None
        capacity = block_size
    else:
        if type(block_table) is not np.ndarray or block_table.dtype is not _INT32 or block_table.ndim != 2 \
                or block_table.shape[0] != B:
            return None
        capacity = block_table.shape[1] * block_size
    if type(cache_seqlens) is int:
        lengths, length = None, cache_seqlens
    elif type(cache_seqlens) is np.ndarray and cache_seqlens.dtype in _INDEX_DTYPES \
            and cache_seqlens.shape == (B,):
        if B == 1:  # one length: no array reductions
            lengths, length = None, int(cache_seqlens[0])
        else:
            lengths, length = cache_seqlens.astype(np.int64), None   # private copy: out= cannot change it
    else:
        return None
    if lengths is None:
        shortest = longest = length
    else:
        shortest, longest = int(lengths.min()), int(lengths.max())
    if shortest < 0 or longest + new_tokens > capacity:
        return None
    kv_seqlens = _seqlen_array(B, length + new_tokens) if lengths is None else lengths + new_tokens
    table = None
    if block_table is not None:
        table = np.array(block_table, np.int32, order="C")   # private copy
        if lengths is None:
            used = table[:, :(length + new_tokens + block_size - 1) // block_size]
        else:
            used = table[np.arange(table.shape[1])[None, :] < ((kv_seqlens + block_size - 1) // block_size)[:, None]]
        if used.size and (used.min() < 0 or used.max() >= num_blocks):
            return None
    out_shape = (B, Nq, Hq, Dv) if layout == "bshd" else (B, Hq, Nq, Dv)
    if out is None:
        out = np.empty(out_shape, dtype)
    elif type(out) is not np.ndarray or out.dtype is not dtype or out.shape != out_shape \
            or not out.flags.c_contiguous or not out.flags.writeable or not out.flags.aligned \
            or np.may_share_memory(out, q) or np.may_share_memory(out, k_cache) \
            or np.may_share_memory(out, v_cache) or (new_tokens and (
                np.may_share_memory(out, k) or np.may_share_memory(out, v))):
        return None
    # As _Options: causal sets right = 0; bounds past every sequence mean unbounded (-1).
    if causal:
        right = 0
    if left >= capacity:
        left = -1
    if right >= Nq:
        right = -1
    # As _threads: None = OpenMP's current maximum; capped at the CPUs this process may use.
    threads = max(1, min(_core.max_threads() if num_threads is None else num_threads, _core.max_useful_threads()))
    append = None
    if new_tokens:
        append = Append(k_cache if layout == "bshd" else k_cache.transpose(0, 2, 1, 3),
                        v_cache if layout == "bshd" else v_cache.transpose(0, 2, 1, 3),
                        k, v, length if lengths is None else lengths)
    # _make of a tuple in field order: keywords would cost ~1.5 us on the per-token path.
    return Problem._make((q4, k_cache4, v_cache4, out.transpose(0, 2, 1, 3) if layout == "bshd" else out,
                          dtype_code, B, Hq, Hk, Nq, capacity, scale, softcap, left, right, None, None, 0, None,
                          None, kv_seqlens, table, block_size, threads, num_splits)), out, append


def _kvcache_problem(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window, softcap,
                     alibi_slopes, num_splits, num_threads, out, layout):
    """kvcache_problem on (B, N, H, D)-ordered arrays; ``layout`` only words the messages."""
    q = _data("q", q); k_cache = _data("k_cache", k_cache); v_cache = _data("v_cache", v_cache)
    dtype_code = _dtype_code("q", q)
    _same_dtype("q", q, k_cache=k_cache, v_cache=v_cache)
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if a.ndim != 4:
            raise ValueError(f"{name}: expected a 4-D array, got shape {a.shape}")
    B, Nq, Hq, D = q.shape
    num_blocks, block_size, Hk, Dk = k_cache.shape  # contiguous cache: (B, capacity, Hk, D)
    if v_cache.shape[:2] != (num_blocks, block_size):
        raise ValueError(f"v_cache: shape {v_cache.shape} does not match k_cache's leading dims "
                         f"{(num_blocks, block_size)}")
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
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not cache.flags.writeable:
                raise ValueError(f"{name}: array is read-only but k/v are to be appended")

    if block_table is not None:
        table = _array("block_table", block_table)
        if table.dtype not in (np.int32, np.int64):
            raise TypeError(f"block_table: dtype {table.dtype} is not supported; expected int32 or int64")
        if table.ndim != 2 or table.shape[0] != B:
            raise ValueError(f"block_table: expected shape ({B}, max_blocks), got {table.shape}")
        if block_size < 1:
            raise ValueError("k_cache: block size (dim 1) must be >= 1")
        if num_blocks > np.iinfo(np.int32).max:
            raise ValueError(f"k_cache: {num_blocks} blocks; a paged cache holds at most 2**31 - 1 blocks")
        capacity = table.shape[1] * block_size
    else:
        table = None
        if num_blocks != B:
            raise ValueError(f"k_cache: batch size {num_blocks} does not match q's batch size {B} "
                             f"(pass block_table for a paged cache)")
        capacity = block_size

    new_tokens = 0
    if (k is None) != (v is None):
        raise ValueError("k, v: give both new keys and new values, or neither")
    if k is not None:
        k = _data("k", k); v = _data("v", v)
        _same_dtype("q", q, k=k, v=v)
        if k.ndim != 4 or k.shape[0] != B or k.shape[2:] != (Hk, D):
            raise ValueError(f"k: expected shape ({B}, Nnew, {Hk}, {D}), got {k.shape}")
        new_tokens = k.shape[1]
        if v.shape != (B, new_tokens, Hk, Dv):
            raise ValueError(f"v: expected shape {(B, new_tokens, Hk, Dv)}, got {v.shape}")

    # One length for every sequence (None = full, an int, or a (1,) array) stays a scalar: no
    # array reductions on the per-token decode path. Else `lengths` holds a private int64 copy.
    lengths = None
    if cache_seqlens is None:
        if new_tokens:
            raise ValueError("cache_seqlens: required when appending k/v (the default means a full cache)")
        length = capacity
    elif type(cache_seqlens) is int or (isinstance(cache_seqlens, (numbers.Integral, np.integer))
                                        and not isinstance(cache_seqlens, (bool, np.bool_))):
        length = int(cache_seqlens)
    else:
        given = _array("cache_seqlens", cache_seqlens)
        if given.dtype not in (np.int32, np.int64):
            raise TypeError(f"cache_seqlens: dtype {given.dtype} is not supported; expected an int or int32 (B,)")
        if given.shape != (B,):
            raise ValueError(f"cache_seqlens: expected shape ({B},), got {given.shape}")
        if B == 1:
            length = int(given[0])
        else:
            lengths = given.astype(np.int64)
            length = None
    if lengths is None:
        shortest = longest = length
    elif B:
        shortest, longest = int(lengths.min()), int(lengths.max())
    else:
        shortest = longest = 0
    if shortest < 0:
        raise ValueError(f"cache_seqlens: entries must be >= 0, got {shortest}")
    if longest + new_tokens > capacity:
        raise ValueError(f"cache_seqlens: cache_seqlens + {new_tokens} new tokens = {longest + new_tokens} "
                         f"exceeds the cache capacity {capacity}; the cache was left unchanged")
    if lengths is None:
        kv_seqlens = _seqlen_array(B, length + new_tokens)
    else:
        kv_seqlens = lengths + new_tokens if new_tokens else lengths
    if table is not None:
        if B:  # the entries each sequence reads must name a block
            if lengths is None:
                used = table[:, :(length + new_tokens + block_size - 1) // block_size]
            else:
                blocks_read = (kv_seqlens + block_size - 1) // block_size
                used = table[np.arange(table.shape[1])[None, :] < blocks_read[:, None]]
            if used.size and (used.min() < 0 or used.max() >= num_blocks):
                raise ValueError(f"block_table: entries used by the sequences must be in [0, {num_blocks}), "
                                 f"got values in [{int(used.min())}, {int(used.max())}]")
        # Always a private int32 copy (entries past a sequence's blocks are never read, so the
        # wrap of an out-of-range int64 there is harmless): out= may share the caller's memory.
        table = table.astype(np.int32, order="C", copy=True)

    # Every remaining check and conversion happens before the append writes the first byte.
    options = _Options(D, causal, scale, window, softcap, Nq, capacity)
    alibi = _alibi(alibi_slopes, B, Hq)
    threads = _threads(num_threads)
    splits = min(_int("num_splits", num_splits, 0), _MAX_SPLITS)
    out = _out(out, (B, Nq, Hq, Dv), q.dtype,
               {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "alibi_slopes": alibi})
    append = None
    if new_tokens:
        append = Append(k_cache, v_cache, k, v, length if lengths is None else lengths)
    return Problem(q.transpose(0, 2, 1, 3), k_cache.transpose(0, 2, 1, 3), v_cache.transpose(0, 2, 1, 3),
                   out.transpose(0, 2, 1, 3), dtype_code=dtype_code, batch=B, q_heads=Hq, kv_heads=Hk, q_length=Nq,
                   kv_length=capacity, scale=options.scale, softcap=options.softcap, window_left=options.left,
                   window_right=options.right, alibi_slopes=alibi, mask=None, mask_kind=0, cu_seqlens_q=None,
                   cu_seqlens_k=None, kv_seqlens=kv_seqlens, block_table=table, block_size=block_size,
                   num_threads=threads, num_splits=splits), out, append
