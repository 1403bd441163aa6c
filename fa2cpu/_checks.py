"""Checks and normalisation of single arguments, shared by every entry point (NumPy, backward,
torch); fa2cpu/_validate.py combines them into one Problem per call.

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

import numpy as np

from . import _core


def ml_dtype(name):
    """np.dtype of ``ml_dtypes.<name>``, importing ml_dtypes on first use: `import ml_dtypes` costs
    ~1 s with NumPy 2.4 (its ufunc loops' registration), so neither `import fa2cpu` nor
    `import fa2cpu.torch` does it (see _DtypeTable)."""
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))


class _DtypeTable(dict):
    """dtype -> value, whose ml_dtypes entries are added the first time a dtype of that name is
    looked up: `import ml_dtypes` costs ~1 s with NumPy 2.4 (its ufunc loops' registration), and an
    array of an ml_dtypes dtype means ml_dtypes is imported already, so `import fa2cpu` need not
    import it. Lookups of the dtypes present cost what a dict's do (get / in / [] of a hit run the
    dict's own code first)."""

    def __init__(self, items, lazy):
        super().__init__(items)
        self._lazy = lazy  # ml_dtypes attribute name -> value

    def _load(self, dt):
        # ml_dtypes' dtypes are of kind "V"; NumPy's own are not (and dt.name costs ~1.7 us, a
        # tenth of a decode call's Python, where `float32 cache in _CODES` asks every call)
        if getattr(dt, "kind", None) != "V":
            return False
        name = getattr(dt, "name", None)
        if name not in self._lazy:
            return False
        ref = ml_dtype(name)
        if dt != ref:
            return False
        self[ref] = self._lazy[name]
        return True

    def __missing__(self, dt):
        if self._load(dt):
            return dict.__getitem__(self, dt)
        raise KeyError(dt)

    def get(self, dt, default=None):
        v = dict.get(self, dt, self)
        if v is not self:
            return v
        return dict.__getitem__(self, dt) if self._load(dt) else default

    def __contains__(self, dt):
        return dict.__contains__(self, dt) or self._load(dt)


# dtype -> code of the C++ DType enum (csrc/include/fa2cpu/fa2cpu.h)
_DTYPES = _DtypeTable({np.dtype(np.float32): 0, np.dtype(np.float16): 1}, {"bfloat16": 2})
_ACCEPTED = "float32, float16 or ml_dtypes.bfloat16"
# Quantized KV caches (API.md, "Quantized cache"): code dtype -> (C++ DType code, largest code).
_CODES = _DtypeTable({np.dtype(np.int8): (_core.DTYPE_CODES["int8"], 127.0)},
                     {"float8_e4m3fn": (_core.DTYPE_CODES["float8_e4m3fn"], 448.0)})
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
    if isinstance(x, np.ma.MaskedArray):
        return TypeError(f"{name}: got a numpy.ma.MaskedArray, whose mask the kernels would ignore; pass "
                         f"{name}.filled(value) (or np.asarray({name}) to use the data as it is)")
    return TypeError(f"{name}: expected a NumPy array, got {kind.__name__}")


def _data(name, x):
    """q, k, v, caches, out, dout: ndarrays only (no silent conversion of lists or tensors)."""
    if type(x) is np.ndarray or (isinstance(x, np.ndarray) and not isinstance(x, np.ma.MaskedArray)):
        return x
    raise _not_an_array(name, x)


def _array(name, x):
    """Small arguments (masks, slopes, index arrays): ndarrays or anything np.asarray accepts."""
    if isinstance(x, np.ma.MaskedArray):  # its mask would be ignored
        raise _not_an_array(name, x)
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


def _cache_scale(name, scale, cache_name, cache, appending):
    """k_scale / v_scale of a KV cache (API.md, "Quantized cache"): None, or a float32 ndarray of
    the cache's shape without the last axis, one scale per stored token and head, written in
    place when k/v are appended. Returns the array or None."""
    code = _CODES.get(cache.dtype)
    if scale is None:
        if code is not None and cache.dtype == np.int8:
            raise ValueError(f"{name}: an int8 {cache_name} needs its float32 scales, shape {cache.shape[:-1]} "
                             f"(the cached value is code * scale)")
        return None
    if code is None:
        raise ValueError(f"{name}: scales go with a quantized (int8 or float8_e4m3fn) cache; {cache_name} is "
                         f"{cache.dtype}")
    scale = _data(name, scale)
    if scale.dtype != np.float32:
        raise TypeError(f"{name}: dtype {scale.dtype} is not supported; expected float32")
    if scale.shape != cache.shape[:-1]:
        raise ValueError(f"{name}: expected shape {cache.shape[:-1]} ({cache_name}'s shape without the last axis), "
                         f"got {scale.shape}")
    if not scale.flags.aligned:
        raise ValueError(f"{name}: data pointer and strides must be aligned to 4 bytes")
    if appending:
        _append_target(name, scale)
    return scale


def _append_target(name, a):
    """A cache or scale array that an append writes: writable, and no two of its elements at one
    address (a zero stride on an axis longer than 1: a broadcast / expanded view, whose sequences
    would overwrite each other's rows)."""
    if not a.flags.writeable:
        raise ValueError(f"{name}: array is read-only but k/v are to be appended")
    axis = _zero_stride_axis(a)
    if axis is not None:
        raise ValueError(f"{name}: axis {axis} has stride 0 (a broadcast or expanded view): appended rows would "
                         f"overwrite each other")


def _zero_stride_axis(a):
    """The first axis longer than 1 with stride 0 (elements sharing an address), or None."""
    for axis, (n, st) in enumerate(zip(a.shape, a.strides)):
        if st == 0 and n > 1:
            return axis
    return None


def _distinct_targets(k_name, k, v_name, v):
    """The k and v arrays an append writes must not share memory (v would overwrite k)."""
    if k.size and v.size and _overlaps(k, v):
        raise ValueError(f"{v_name}: the same memory as {k_name} (or part of it); the append would write v over k")


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
    try:
        return float(x)
    except OverflowError:  # an int beyond any float
        raise ValueError(f"{name}: an int of {int(x).bit_length()} bits does not fit float32") from None


def _bool(name, x):
    if type(x) is bool:  # the common case first (a decode call's return_lse)
        return x
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")
    return bool(x)


def _window_pair(window):
    """(left, right) ints of a window argument (values checked by _Options)."""
    try:
        if not isinstance(window, (tuple, list, np.ndarray)):  # a set / dict / generator has no order to trust
            raise TypeError
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


def _sinks(sinks, hq):
    """-> a private float32 (hq,) copy of the attention sinks, or None. Raw logits, one per query
    head; values must fit float32 (-inf means no sink, +inf and NaN propagate into that head)."""
    if sinks is None:
        return None
    a = _array("sinks", sinks)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"sinks: dtype {a.dtype} is not supported; expected float32 (one logit per query head)")
    if a.shape != (hq,):
        raise ValueError(f"sinks: expected shape ({hq},) (one logit per query head), got {a.shape}")
    with np.errstate(invalid="ignore", over="ignore"):
        wide = np.asarray(a, np.float64)
        big = np.isfinite(wide) & (np.abs(wide) > float(np.finfo(np.float32).max))
    if np.any(big):
        raise ValueError(f"sinks: values must fit float32, got {float(np.abs(wide[big]).max()):g}")
    return np.array(a, dtype=np.float32)  # a copy: out= can never alias it


def _dsinks(sinks, dout_rows, out_rows, lse_rows):
    """Gradient of sum(dout * out) in the sinks (API.md): dsinks[h] = -sum_i exp(sinks[h] - lse_i)
    * sum_d(dout_i * out_i). ``*_rows`` are views with the query head on axis -2 of dout/out rows
    ``(..., H, Dv)`` and on the last axis of lse ``(..., H)``; float64 sums, float32 result."""
    delta = np.einsum("...hd,...hd->...h", dout_rows.astype(np.float64), out_rows.astype(np.float64))
    lse = lse_rows.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        weight = np.exp(sinks.astype(np.float64) - lse)
    weight[np.isneginf(lse) & np.isneginf(sinks)[(None,) * (lse.ndim - 1)]] = 0.0  # no sink, no key: no term
    return (-(weight * delta).reshape(-1, len(sinks)).sum(axis=0)).astype(np.float32)


def _mask(mask, shape):
    """-> (4-D view broadcast to `shape` with zero strides, kind) with kind 1 = bool, 2 = float."""
    if mask is None:
        return None, 0
    m = _array("mask", mask)
    if m.dtype == np.bool_:
        kind = 1
    elif m.dtype.kind == "f" or m.dtype.name == "bfloat16" and _DTYPES.get(m.dtype) == 2:
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
        elif not m.flags.aligned:  # copied at its own size (_fix_strides below would copy the broadcast)
            m = np.broadcast_to(compact.copy(order="C"), m.shape)
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
    if out.size and not out.flags.c_contiguous and _zero_stride_axis(out) is not None:
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
    if np.any(cu[1:] < cu[:-1]):  # compared, not subtracted: np.diff wraps near the int64 limits
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


def _max_seqlens(max_seqlen_q, max_seqlen_k, cu_q, cu_k):
    """The varlen calls' optional bounds: ints >= the longest sequence of their side."""
    for name, given, cu in (("max_seqlen_q", max_seqlen_q, cu_q), ("max_seqlen_k", max_seqlen_k, cu_k)):
        if given is not None:
            given = _int(name, given, 0)
            longest = int(np.diff(cu).max()) if cu.shape[0] > 1 else 0
            if given < longest:
                raise ValueError(f"{name}: {given} is shorter than the longest sequence ({longest})")


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
