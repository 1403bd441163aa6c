"""fa2cpu on ``torch.Tensor``: the NumPy API's functions as PyTorch custom operators, and SDPA.

``import fa2cpu.torch`` imports torch (``import fa2cpu`` alone never does) and registers, in the
``torch.library`` namespace ``fa2cpu``:

====================================  ===========================================================
``fa2cpu::flash_attention``           functional forward -> (out, lse); autograd in q, k, v
``fa2cpu::flash_attention_out``       forward writing a caller's ``out`` (mutates it) -> lse
``fa2cpu::flash_attention_varlen``    functional packed forward -> (out, lse); autograd in q, k, v
``fa2cpu::flash_attention_varlen_out``  packed forward writing ``out`` -> lse
``fa2cpu::flash_attention_with_kvcache``  appends into k_cache/v_cache and writes ``out`` -> lse
``fa2cpu::flash_attention_backward``  (dq, dk, dv) of ``flash_attention``
``fa2cpu::flash_attention_varlen_backward``  (dq, dk, dv) of ``flash_attention_varlen``
====================================  ===========================================================

each with a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` traces them without
graph breaks. The public functions below (same names, arguments and semantics as
``fa2cpu.flash_attention`` & co., see API.md) call these operators when torch needs to see them
(autograd, ``torch.compile``, fake/meta tensors, dispatch modes) and otherwise call the kernels
directly, which skips the dispatcher and torch.library's Python layers (10-40 us per call).
``flash_attention_with_kvcache`` has a lean path for decode steps (see _kvcache_lean).

Zero copy both ways: a tensor's NumPy view shares its memory and strides (bfloat16 through an
``int16`` view re-typed as ``ml_dtypes.bfloat16``); results are torch tensors the kernels wrote
into. ``flash_attention_with_kvcache`` appends into the caller's cache tensors in place. (As
with any ``Tensor.numpy()``, a tensor viewed this way gets a non-resizable storage.)

:func:`scaled_dot_product_attention` is ``torch.nn.functional.scaled_dot_product_attention``
(same signature and semantics, torch's top-left causal alignment included) computed by fa2cpu,
falling back to torch's own implementation for what fa2cpu cannot compute; :func:`patch_sdpa`
installs it in ``torch.nn.functional``.
"""
import math
import os as _os
import numbers
import weakref

import ml_dtypes
import numpy as np
import torch

from . import _core
from . import attention as _api
from ._validate import MAX_HEAD_DIM as _MAX_HEAD_DIM, _int
from .backward import flash_attention_backward as _np_backward

__all__ = ["flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache",
           "scaled_dot_product_attention", "patch_sdpa"]

# torch's own SDPA, taken from the C extension (not from torch.nn.functional, which patch_sdpa
# or someone else may have replaced before this module was imported).
_torch_sdpa = torch._C._nn.scaled_dot_product_attention

# Inside PyTorch, run fa2cpu's parallel work on torch's threads: torch and fa2cpu share the
# process's one libgomp (same soname), and torch's OpenMP threads keep spinning for milliseconds
# after each op, so a second pool beside them got only part of the cores (in-model attention
# 0.24-0.72x of sdpa on 16 cores; bench/RESULTS.md). FA2CPU_PARALLEL=pool keeps fa2cpu's own pool.
def _torch_openmp_runtime():
    """Addresses of GOMP_parallel and omp_get_max_threads in the OpenMP runtime torch loaded (its
    own copy in torch/lib), or (0, 0) to use the one this extension links. Needed when they differ:
    a repaired wheel bundles a renamed libgomp, a clang build links libomp."""
    import ctypes
    import glob
    libdir = _os.path.join(_os.path.dirname(torch.__file__), "lib")
    for path in sorted(glob.glob(_os.path.join(libdir, "lib*omp*.so*"))):
        try:  # only a library torch has already loaded (RTLD_NOLOAD): never load a second runtime
            lib = ctypes.CDLL(path, mode=getattr(_os, "RTLD_NOLOAD", 4) | getattr(_os, "RTLD_LAZY", 1))
            return (ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value,
                    ctypes.cast(lib.omp_get_max_threads, ctypes.c_void_p).value)
        except (OSError, AttributeError):
            continue
    return 0, 0


def _use_torch_threads():
    """Run fa2cpu's parallel work on torch's OpenMP threads (done at import)."""
    _core.set_parallel_backend("openmp", *_torch_openmp_runtime())


if _os.environ.get("FA2CPU_PARALLEL", "").strip().lower() != "pool":
    _use_torch_threads()

_BF16 = np.dtype(ml_dtypes.bfloat16)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)   # the kernels' dtypes
_ACCEPTED = "torch.float32, torch.float16 or torch.bfloat16"
_PLAIN = (torch.Tensor, torch.nn.Parameter)                 # types the direct path may convert


# ---------------------------------------------------------------------------------------------
# Tensor <-> NumPy, without copies
# ---------------------------------------------------------------------------------------------
def _np(name, t):
    """NumPy view of a CPU tensor: same memory, same strides (bfloat16 -> ml_dtypes.bfloat16)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(f"{name}: expected a CPU tensor, got device {t.device}")
    if t.requires_grad:
        t = t.detach()
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16)
    return t.numpy()


def _np_opt(name, t):
    return None if t is None else _np(name, t)


def _tensor(a):
    """Tensor sharing the memory of the NumPy array ``a`` (bfloat16 through int16)."""
    if a.dtype == _BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _check_tensors(**named):
    """Before an operator call: tensors where the schema wants them (None allowed where it is
    optional), q of a kernel dtype, so the errors name the argument like the NumPy API's."""
    for name, t in named.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    q = named["q"]
    if q is None:
        raise TypeError("q: expected a torch.Tensor, got None")
    if q.dtype not in _FLOATS:
        raise TypeError(f"q: dtype {q.dtype} is not supported; expected {_ACCEPTED}")


def _result(q, v):
    """New (tensor, NumPy view) for the output of q's rows with v's head dim; (None, None) when
    the ranks are too low to say (the NumPy API then reports the bad shape)."""
    if q.dim() < 1 or v.dim() < 1:
        return None, None
    o = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    return o, _np("out", o)


def _direct(q, k, v, differentiable=True):
    """True when the kernels may be called directly on these tensors: plain CPU tensors, eager
    mode, no torch.compile tracing, no fake/meta/dispatch modes, and (for a ``differentiable``
    operator) no autograd graph to record. Otherwise the call goes through the torch.ops
    operator, which handles all of those."""
    if torch.compiler.is_compiling():
        return False
    if type(q) not in _PLAIN or type(k) not in _PLAIN or type(v) not in _PLAIN or not q.is_cpu:
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    return not (differentiable and torch.is_grad_enabled()
                and (q.requires_grad or k.requires_grad or v.requires_grad))


# Normalisers of scalar arguments for the operator schemas (the NumPy API checks values).
def _float_arg(name, x):
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a float, got {type(x).__name__}")
    return float(x)


def _bool_arg(name, x):
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")
    return bool(x)


def _window_arg(window):
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window: expected a pair (left, right) of ints >= -1, got {window!r}") from None
    return [_int("window", left), _int("window", right)]


def _int_arg(name, x, minimum):
    return None if x is None else _int(name, x, minimum)


def _no_grad_out(name, *tensors):
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(f"{name}(): out= does not support automatic differentiation (as in torch); "
                           f"call it without out= or under torch.no_grad()")


# ---------------------------------------------------------------------------------------------
# Implementations on real CPU tensors (called directly in eager mode and by the operators)
# ---------------------------------------------------------------------------------------------
def _fa_impl(q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout, num_threads,
             return_lse, out):
    """flash_attention on tensors -> (out, lse or None); ``out`` None = a new tensor."""
    qn, kn, vn = _np("q", q), _np("k", k), _np("v", v)
    if out is None:
        out, out_np = _result(q, v)
    else:
        out_np = _np("out", out)
        torch._C._increment_version((out,))   # written below (if every check passes)
    r = _api.flash_attention(qn, kn, vn, causal=causal, scale=scale, window=window, softcap=softcap,
                             alibi_slopes=_np_opt("alibi_slopes", alibi_slopes),
                             mask=_np_opt("mask", mask), return_lse=return_lse, layout=layout,
                             num_threads=num_threads, out=out_np)
    if out is None:  # the NumPy API allocated it (only when the shapes were already invalid)
        out = _tensor(r[0] if return_lse else r)
    return (out, _tensor(r[1])) if return_lse else (out, None)


def _varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                 window, softcap, alibi_slopes, num_threads, return_lse, out):
    """flash_attention_varlen on tensors -> (out, lse or None)."""
    qn, kn, vn = _np("q", q), _np("k", k), _np("v", v)
    if out is None:
        out, out_np = _result(q, v)
    else:
        out_np = _np("out", out)
        torch._C._increment_version((out,))   # written below (if every check passes)
    r = _api.flash_attention_varlen(qn, kn, vn, _np("cu_seqlens_q", cu_seqlens_q),
                                    _np("cu_seqlens_k", cu_seqlens_k), max_seqlen_q=max_seqlen_q,
                                    max_seqlen_k=max_seqlen_k, causal=causal, scale=scale,
                                    window=window, softcap=softcap,
                                    alibi_slopes=_np_opt("alibi_slopes", alibi_slopes),
                                    return_lse=return_lse, num_threads=num_threads, out=out_np)
    if out is None:
        out = _tensor(r[0] if return_lse else r)
    return (out, _tensor(r[1])) if return_lse else (out, None)


# Small read-only int64 arrays of cache lengths, by (batch, length): a scalar cache_seqlens needs
# a (B,) array for the core on every decode step.
_SEQLEN_ARRAYS = {}


def _seqlen_array(batch, n):
    a = _SEQLEN_ARRAYS.get((batch, n))
    if a is None:
        if len(_SEQLEN_ARRAYS) > 1024:
            _SEQLEN_ARRAYS.clear()
        a = np.full(batch, n, np.int64)
        a.flags.writeable = False
        _SEQLEN_ARRAYS[(batch, n)] = a
    return a


# Bounds of the lean path's scalar options: well inside what the NumPy API accepts (floats
# that fit float32 after log2(e) scaling), so the lean path never accepts what it would refuse.
_LEAN_FLOAT_MAX = 1e30
_LEAN_MAX_SPLITS = 1024


def _np_lean(t, bf16):
    """_np without the argument checks (the lean path has checked type and dtype)."""
    if t.requires_grad:
        t = t.detach()
    return t.view(torch.int16).numpy().view(_BF16) if bf16 else t.numpy()


class _Memory:
    """A NumPy ``__array_interface__`` (pointer, shape, strides, item type) and nothing else: the
    array made from it neither owns nor keeps alive the tensor it describes."""
    __slots__ = ("__array_interface__",)


_TYPESTR = {torch.float32: np.dtype(np.float32).str, torch.float16: np.dtype(np.float16).str,
            torch.bfloat16: np.dtype(np.int16).str}   # bfloat16: int16 items, re-typed below

# id(cache tensor) -> [weakref, data_ptr, shape, stride, dtype, NumPy view or None]. KV caches
# are long-lived: a tensor seen a second time gets a view made once (a bfloat16 view costs ~3 us
# per call otherwise), re-checked per call against the tensor's pointer, shape, strides and
# dtype. A tensor seen once (e.g. a fresh slice per call) only gets a plain view, as building
# the memoised one costs more. Memoised views are built from the tensor's metadata (pointer and
# strides), so they do not keep the tensor alive; entries leave with their tensor (weakref
# callback).
_CACHE_VIEWS = {}


def _np_cached(t, bf16):
    """NumPy view of a plain CPU tensor of a kernel dtype (memoised, see _CACHE_VIEWS)."""
    key = id(t)
    e = _CACHE_VIEWS.get(key)
    if e is None or e[0]() is not t:
        forget = lambda _, key=key: _CACHE_VIEWS.pop(key, None)  # noqa: E731
        _CACHE_VIEWS[key] = [weakref.ref(t, forget), 0, None, None, None, None]
        return _np_lean(t, bf16)
    ptr, shape, stride, dtype = t.data_ptr(), t.shape, t.stride(), t.dtype
    if e[5] is not None and e[1] == ptr and e[2] == shape and e[3] == stride and e[4] is dtype:
        return e[5]
    if t.numel() == 0:
        return _np_lean(t, bf16)
    item = t.element_size()
    m = _Memory()
    m.__array_interface__ = {"data": (ptr, False), "shape": tuple(shape),
                             "strides": tuple(s * item for s in stride),
                             "typestr": _TYPESTR[dtype], "version": 3}
    view = np.asarray(m)
    if bf16:
        view = view.view(_BF16)
    e[1:] = ptr, shape, stride, dtype, view
    return view


def _kvcache_lean(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window,
                  softcap, return_lse, num_splits, num_threads, out, layout):
    """The decode fast path: the common case checked with cheap metadata, then one core call.
    Returns None, having written nothing, for anything outside that case; the caller then takes
    the NumPy API, which checks everything and raises the documented errors.

    Covered: q, caches (and k, v) plain CPU tensors of one kernel dtype, 4-D, either layout;
    contiguous cache, or paged with an int32 block table; int or int32/int64 ``(B,)`` tensor
    ``cache_seqlens``; no alibi; Python scalars for the options; ``out`` None or a contiguous
    tensor that surely does not overlap an input. Within that case the checks, normalisations
    and core arguments are the NumPy API's (fa2cpu/attention.py, _kvcache_bshd): keep the two in
    step. Shapes are read from the NumPy views (cheaper than torch.Size); a new ``out`` is
    allocated by NumPy and wrapped with torch.from_numpy (half the cost of torch.empty).
    """
    dt = q.dtype
    if dt not in _FLOATS or k_cache.dtype is not dt or v_cache.dtype is not dt \
            or not k_cache.is_cpu or not v_cache.is_cpu:
        return None
    if type(causal) is not bool or type(num_splits) is not int \
            or not 0 <= num_splits <= _LEAN_MAX_SPLITS \
            or not (num_threads is None or (type(num_threads) is int and num_threads >= 1)):
        return None
    if type(window) is tuple and window == (-1, -1):
        left = right = -1
    elif (type(window) is tuple and len(window) == 2 and type(window[0]) is int
          and type(window[1]) is int and window[0] >= -1 and window[1] >= -1):
        left, right = window
    else:
        return None
    bf16 = dt is torch.bfloat16
    qn, kcn, vcn = _np_lean(q, bf16), _np_cached(k_cache, bf16), _np_cached(v_cache, bf16)
    if qn.ndim != 4 or kcn.ndim != 4 or vcn.ndim != 4:
        return None
    # The core's (batch, head, position, feature) views; "bshd" input is (batch, position, ...).
    if layout == "bshd":
        qh, kch, vch = qn.transpose(0, 2, 1, 3), kcn.transpose(0, 2, 1, 3), vcn.transpose(0, 2, 1, 3)
    elif layout == "bhsd":
        qh, kch, vch = qn, kcn, vcn
    else:
        return None
    B, Hq, Nq, D = qh.shape
    nb, Hk, rows, Dk = kch.shape
    vnb, vHk, vrows, Dv = vch.shape
    if (vnb, vHk, vrows) != (nb, Hk, rows) or B < 1 or Hk < 1 or rows < 1 or Hq % Hk or Dk != D \
            or not (0 < D <= _MAX_HEAD_DIM) or not (0 < Dv <= _MAX_HEAD_DIM):
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
    n = 0
    kh = vh = None
    if k is not None or v is not None:
        if (k is None or v is None or type(k) not in _PLAIN or type(v) not in _PLAIN
                or k.dtype is not dt or v.dtype is not dt or not k.is_cpu or not v.is_cpu):
            return None
        kn, vn = _np_lean(k, bf16), _np_lean(v, bf16)
        if kn.ndim != 4 or vn.ndim != 4:
            return None
        if layout == "bshd":
            kh, vh = kn.transpose(0, 2, 1, 3), vn.transpose(0, 2, 1, 3)
        else:
            kh, vh, kn, vn = kn, vn, kn.transpose(0, 2, 1, 3), vn.transpose(0, 2, 1, 3)
        n = kh.shape[2]
        if kh.shape != (B, Hk, n, D) or vh.shape != (B, Hk, n, Dv):
            return None

    if block_table is None:
        if nb != B:
            return None
        capacity = rows
    else:
        if type(block_table) not in _PLAIN or block_table.dtype is not torch.int32 \
                or not block_table.is_cpu or block_table.dim() != 2 or block_table.shape[0] != B:
            return None
        capacity = block_table.shape[1] * rows

    if type(cache_seqlens) is int:
        seqlens, lo = None, cache_seqlens
        hi = lo
    elif type(cache_seqlens) in _PLAIN and cache_seqlens.dtype in (torch.int32, torch.int64) \
            and cache_seqlens.is_cpu and cache_seqlens.shape == (B,):
        seqlens = cache_seqlens.numpy()
        if B == 1:                      # a scalar in disguise: no array reductions
            seqlens, lo = None, int(seqlens[0])
            hi = lo
        else:
            seqlens = seqlens.astype(np.int64)   # a private copy: out= cannot change it
            lo, hi = int(seqlens.min()), int(seqlens.max())
    else:
        return None
    if lo < 0 or hi + n > capacity:
        return None
    total = _seqlen_array(B, lo + n) if seqlens is None else seqlens + n
    bt = None
    if block_table is not None:
        bt = np.array(block_table.numpy(), np.int32, order="C")   # private copy
        used = (total + rows - 1) // rows                          # blocks each sequence reads
        if seqlens is None:
            vals = bt[:, :int(used[0])]
        else:
            vals = bt[np.arange(bt.shape[1])[None, :] < used[:, None]]
        if vals.size and (vals.min() < 0 or vals.max() >= nb):
            return None

    out_shape = (B, Nq, Hq, Dv) if layout == "bshd" else (B, Hq, Nq, Dv)
    if out is None:
        if bf16:
            out_np = np.empty(out_shape, np.int16)
            out = torch.from_numpy(out_np).view(torch.bfloat16)
            out_np = out_np.view(_BF16)
        else:
            out_np = np.empty(out_shape, qn.dtype)
            out = torch.from_numpy(out_np)
    else:
        if type(out) not in _PLAIN or out.dtype is not dt or not out.is_cpu or not out.is_contiguous():
            return None
        out_np = _np_lean(out, bf16)
        if out_np.shape != out_shape:
            return None
        for a in (qn, kcn, vcn, kh, vh):
            if a is not None and np.may_share_memory(out_np, a):
                return None
        torch._C._increment_version((out,))

    # As _Options: causal sets right = 0; bounds past every sequence mean unbounded (-1).
    if causal:
        right = 0
    if left >= capacity:
        left = -1
    if right >= Nq:
        right = -1
    # As _threads: None = OpenMP's current maximum; capped at the CPUs this process may use.
    num_threads = max(1, min(_core.max_threads() if num_threads is None else num_threads,
                             _core.max_useful_threads()))
    if n:  # every check passed: append in place (_append takes (batch, position, head, feature))
        if layout == "bhsd":
            kcn, vcn = kch.transpose(0, 2, 1, 3), vch.transpose(0, 2, 1, 3)
        _append(kcn, vcn, kn, vn, lo if seqlens is None else seqlens, bt, rows)
        torch._C._increment_version((k_cache, v_cache))
    lse = np.empty((B, Hq, Nq), np.float32) if return_lse else None
    _core.run(qh, kch, vch, out_np.transpose(0, 2, 1, 3) if layout == "bshd" else out_np, lse,
              dtype=_FLOATS.index(dt), batch=B, hq=Hq, hk=Hk, nq=Nq, nk=capacity,
              scale=scale, softcap=softcap, win_left=left, win_right=right,
              alibi=None, mask=None, mask_kind=0,
              cu_q=None, cu_k=None, seqlen_k=total, block_table=bt, block_size=rows,
              num_threads=num_threads, num_splits=num_splits)
    return out, (None if lse is None else torch.from_numpy(lse))


def _append(kc, vc, k, v, start, bt, rows):
    """Writes k, v ``(B, n, Hk, D)`` into the caches at positions ``start[b] .. + n - 1`` (start:
    int or int64 (B,)); contiguous cache ``(B, Ncap, Hk, D)`` when bt is None, else paged
    ``(num_blocks, rows, Hk, D)`` through block table bt ``(B, max_blocks)``. Slice assignments
    for small batches (decode), one fancy-indexed assignment otherwise."""
    B, n = k.shape[:2]
    if bt is None and type(start) is int:
        kc[:, start:start + n] = k
        vc[:, start:start + n] = v
        return
    if B * n <= 8:
        for b in range(B):
            s = start if type(start) is int else int(start[b])
            for t in range(n):
                p = s + t
                blk, r = (b, p) if bt is None else (bt[b, p // rows], p % rows)
                kc[blk, r] = k[b, t]
                vc[blk, r] = v[b, t]
        return
    pos = np.asarray(start, np.int64).reshape(-1, 1) + np.arange(n)[None, :]     # (B or 1, n)
    pos = np.broadcast_to(pos, (B, n))
    if bt is None:
        blk, r = np.broadcast_to(np.arange(B)[:, None], pos.shape), pos
    else:
        blk, r = bt[np.arange(B)[:, None], pos // rows], pos % rows
    kc[blk, r] = k
    vc[blk, r] = v


def _kvcache_impl(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window,
                  softcap, alibi_slopes, return_lse, num_splits, num_threads, out, layout):
    """flash_attention_with_kvcache on tensors -> (out, lse or None): the lean path when it
    applies, else the NumPy API."""
    if alibi_slopes is None and type(q) in _PLAIN and type(k_cache) in _PLAIN and type(v_cache) in _PLAIN:
        r = _kvcache_lean(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale,
                          window, softcap, return_lse, num_splits, num_threads, out, layout)
        if r is not None:
            return r
    return _kvcache_general(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale,
                            window, softcap, alibi_slopes, return_lse, num_splits, num_threads, out,
                            layout)


def _kvcache_general(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window,
                     softcap, alibi_slopes, return_lse, num_splits, num_threads, out, layout):
    """flash_attention_with_kvcache on tensors through the NumPy API -> (out, lse or None)."""
    qn, kcn, vcn = _np("q", q), _np("k_cache", k_cache), _np("v_cache", v_cache)
    if out is None:
        out, out_np = _result(q, v_cache)
    else:
        out_np = _np("out", out)
        torch._C._increment_version((out,))
    if isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = _np("cache_seqlens", cache_seqlens)
    r = _api.flash_attention_with_kvcache(
        qn, kcn, vcn, _np_opt("k", k), _np_opt("v", v), cache_seqlens=cache_seqlens,
        block_table=_np_opt("block_table", block_table), causal=causal, scale=scale, window=window,
        softcap=softcap, alibi_slopes=_np_opt("alibi_slopes", alibi_slopes), return_lse=return_lse,
        num_splits=num_splits, num_threads=num_threads, out=out_np, layout=layout)
    if k is not None:
        torch._C._increment_version((k_cache, v_cache))
    if out is None:
        out = _tensor(r[0] if return_lse else r)
    return (out, _tensor(r[1])) if return_lse else (out, None)


def _lse_grad_pass(backward, dlse_rows, q, k, v, lse, **kw):
    """Gradients in q, k of ``sum(dlse * lse)`` from ``backward`` itself: with v = 0 (Dv = 1),
    out = 1 and dout = -dlse the backward's dS = P * (dP - rowsum(dout * out)) is exactly
    P * dlse = dlse * d lse / d s (softcap's chain rule included). ``dlse_rows``: dlse laid out
    like q's rows with a trailing axis of 1 (the shape of that fake out)."""
    dout = (-dlse_rows).astype(q.dtype)
    ones = np.ones(dout.shape, q.dtype)
    zeros = np.zeros(v.shape[:-1] + (1,), q.dtype)
    dq, dk, _ = backward(dout, q, k, zeros, ones, lse, **kw)
    return dq, dk


def _add(a, b):
    """a + b accumulated in float32, in a's dtype."""
    return (a.astype(np.float32) + b.astype(np.float32)).astype(a.dtype)


from . import flash_attention_varlen_backward as _np_varlen_backward  # noqa: E402


_MASK_GRAD = ("flash_attention: gradients with mask= are not supported (fa2cpu's backward has no "
              "mask); use scaled_dot_product_attention (falls back to torch's for that), or "
              "causal=/window= instead of the mask")


def _bwd_impl(dout, q, k, v, out, lse, dlse, causal, scale, window, softcap, alibi_slopes, layout,
              num_threads, has_mask):
    """(dq, dk, dv) tensors of flash_attention, gradients of out and (if nonzero) of lse."""
    if has_mask:
        raise NotImplementedError(_MASK_GRAD)
    arrs = [_np(n, t) for n, t in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse))]
    kw = dict(causal=causal, scale=scale, window=window, softcap=softcap,
              alibi_slopes=_np_opt("alibi_slopes", alibi_slopes), layout=layout, num_threads=num_threads)
    dq, dk, dv = _np_backward(*arrs, **kw)
    if dlse is not None and bool(dlse.any()):
        dl = _np("dlse", dlse)
        rows = dl.transpose(0, 2, 1)[..., None] if layout == "bshd" else dl[..., None]
        gq, gk = _lse_grad_pass(_np_backward, rows, arrs[1], arrs[2], arrs[3], arrs[5], **kw)
        dq, dk = _add(dq, gq), _add(dk, gk)
    return _tensor(dq), _tensor(dk), _tensor(dv)


def _varlen_bwd_impl(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, causal, scale, window, softcap, alibi_slopes, num_threads):
    arrs = [_np(n, t) for n, t in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse))]
    cu = (_np("cu_seqlens_q", cu_seqlens_q), _np("cu_seqlens_k", cu_seqlens_k))
    kw = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal, scale=scale,
              window=window, softcap=softcap, alibi_slopes=_np_opt("alibi_slopes", alibi_slopes),
              num_threads=num_threads)
    dq, dk, dv = _np_varlen_backward(*arrs, *cu, **kw)
    if dlse is not None and bool(dlse.any()):
        rows = _np("dlse", dlse).T[..., None]                        # (total_q, Hq, 1)
        bwd = lambda do, q_, k_, v_, o, l, **kw_: _np_varlen_backward(do, q_, k_, v_, o, l, *cu, **kw_)  # noqa: E731
        gq, gk = _lse_grad_pass(bwd, rows, arrs[1], arrs[2], arrs[3], arrs[5], **kw)
        dq, dk = _add(dq, gq), _add(dk, gk)
    return _tensor(dq), _tensor(dk), _tensor(dv)


# ---------------------------------------------------------------------------------------------
# Custom operators (torch.library), their fake implementations and autograd
#
# Defined with torch.library.Library rather than @torch.library.custom_op: custom_op's Python
# layers cost 60-170 us per call (its ADInplaceOrView kernel rebuilds the schema's argument
# list once per argument), which a compiled decode step would pay per layer; a plain CPU kernel
# costs ~9 us. The CPU kernels bump the version counters of the tensors they mutate.
# ---------------------------------------------------------------------------------------------
_LIB = torch.library.Library("fa2cpu", "DEF")

_OPTIONS = "bool causal, float? scale, int[] window, float? softcap, Tensor? alibi_slopes"
_SCHEMAS = {
    "flash_attention":
        f"(Tensor q, Tensor k, Tensor v, {_OPTIONS}, Tensor? mask, str layout, int? num_threads)"
        " -> (Tensor out, Tensor lse)",
    "flash_attention_out":
        f"(Tensor q, Tensor k, Tensor v, {_OPTIONS}, Tensor? mask, str layout, int? num_threads,"
        " bool return_lse, Tensor(a!) out) -> Tensor lse",
    "flash_attention_backward":
        f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, {_OPTIONS},"
        " str layout, int? num_threads, bool has_mask) -> (Tensor dq, Tensor dk, Tensor dv)",
    "flash_attention_varlen":
        "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int? max_seqlen_q,"
        f" int? max_seqlen_k, {_OPTIONS}, int? num_threads) -> (Tensor out, Tensor lse)",
    "flash_attention_varlen_out":
        "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int? max_seqlen_q,"
        f" int? max_seqlen_k, {_OPTIONS}, int? num_threads, bool return_lse, Tensor(a!) out) -> Tensor lse",
    "flash_attention_varlen_backward":
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse,"
        " Tensor cu_seqlens_q, Tensor cu_seqlens_k, int? max_seqlen_q, int? max_seqlen_k,"
        f" {_OPTIONS}, int? num_threads) -> (Tensor dq, Tensor dk, Tensor dv)",
    # cache_seqlens / cache_seqlens_int: the tensor and int forms of the public argument.
    "flash_attention_with_kvcache":
        "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor? cache_seqlens,"
        f" int? cache_seqlens_int, Tensor? block_table, {_OPTIONS}, bool return_lse, int num_splits,"
        " int? num_threads, Tensor(c!) out, str layout) -> Tensor lse",
}


def _define(name, cpu, fake):
    _LIB.define(name + _SCHEMAS[name])
    _LIB.impl(name, cpu, "CPU")
    torch.library.register_fake(f"fa2cpu::{name}", fake, lib=_LIB)


def _lse_shape(q, layout):
    """Shape of flash_attention's lse for q: (B, Hq, Nq), (Hq, Nq) or (Nq,)."""
    if layout == "bshd":
        return (q.shape[0], q.shape[2], q.shape[1])
    return tuple(q.shape[:-1])


def _no_lse(q):
    """The lse result of an out= operator called without return_lse."""
    return q.new_empty((0,), dtype=torch.float32)


# flash_attention ------------------------------------------------------------------------------
def _cpu_fa(q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout, num_threads):
    return _fa_impl(q, k, v, causal, scale, tuple(window), softcap, alibi_slopes, mask, layout,
                    num_threads, True, None)


def _fake_fa(q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout, num_threads):
    return (q.new_empty(q.shape[:-1] + v.shape[-1:]),
            q.new_empty(_lse_shape(q, layout), dtype=torch.float32))


def _cpu_fa_out(q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout, num_threads,
                return_lse, out):
    _, lse = _fa_impl(q, k, v, causal, scale, tuple(window), softcap, alibi_slopes, mask, layout,
                      num_threads, return_lse, out)
    return lse if return_lse else _no_lse(q)


def _fake_fa_out(q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout, num_threads,
                 return_lse, out):
    return q.new_empty(_lse_shape(q, layout), dtype=torch.float32) if return_lse else _no_lse(q)


def _cpu_fa_bwd(dout, q, k, v, out, lse, dlse, causal, scale, window, softcap, alibi_slopes,
                layout, num_threads, has_mask):
    return _bwd_impl(dout, q, k, v, out, lse, dlse, causal, scale, tuple(window), softcap,
                     alibi_slopes, layout, num_threads, has_mask)


def _fake_bwd(dout, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fa_setup_context(ctx, inputs, output):
    q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout, num_threads = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
    ctx.options = (causal, scale, window, softcap, layout, num_threads, mask is not None)


def _fa_backward(ctx, dout, dlse):
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    causal, scale, window, softcap, layout, num_threads, has_mask = ctx.options
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.fa2cpu.flash_attention_backward(
        dout, q, k, v, out, lse, dlse, causal, scale, window, softcap, alibi_slopes, layout,
        num_threads, has_mask)
    return (dq, dk, dv) + (None,) * 8


_define("flash_attention", _cpu_fa, _fake_fa)
_define("flash_attention_out", _cpu_fa_out, _fake_fa_out)
_define("flash_attention_backward", _cpu_fa_bwd, _fake_bwd)
torch.library.register_autograd("fa2cpu::flash_attention", _fa_backward,
                                setup_context=_fa_setup_context, lib=_LIB)


# flash_attention_varlen -----------------------------------------------------------------------
def _cpu_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                window, softcap, alibi_slopes, num_threads):
    return _varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                        scale, tuple(window), softcap, alibi_slopes, num_threads, True, None)


def _fake_varlen(q, k, v, *rest):
    return (q.new_empty(q.shape[:-1] + v.shape[-1:]),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


def _cpu_varlen_out(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                    window, softcap, alibi_slopes, num_threads, return_lse, out):
    _, lse = _varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                          scale, tuple(window), softcap, alibi_slopes, num_threads, return_lse, out)
    return lse if return_lse else _no_lse(q)


def _fake_varlen_out(q, k, v, *rest):
    return_lse = rest[-2]
    return q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32) if return_lse else _no_lse(q)


def _cpu_varlen_bwd(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, causal, scale, window, softcap, alibi_slopes, num_threads):
    return _varlen_bwd_impl(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, causal, scale, tuple(window), softcap, alibi_slopes,
                            num_threads)


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap, alibi_slopes,
     num_threads) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi_slopes)
    ctx.options = (max_q, max_k, causal, scale, window, softcap, num_threads)


def _varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes = ctx.saved_tensors
    max_q, max_k, causal, scale, window, softcap, num_threads = ctx.options
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.fa2cpu.flash_attention_varlen_backward(
        dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap,
        alibi_slopes, num_threads)
    return (dq, dk, dv) + (None,) * 10


_define("flash_attention_varlen", _cpu_varlen, _fake_varlen)
_define("flash_attention_varlen_out", _cpu_varlen_out, _fake_varlen_out)
_define("flash_attention_varlen_backward", _cpu_varlen_bwd, _fake_bwd)
torch.library.register_autograd("fa2cpu::flash_attention_varlen", _varlen_backward,
                                setup_context=_varlen_setup_context, lib=_LIB)


# flash_attention_with_kvcache -----------------------------------------------------------------
def _cpu_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, block_table, causal,
                 scale, window, softcap, alibi_slopes, return_lse, num_splits, num_threads, out,
                 layout):
    seqlens = cache_seqlens if cache_seqlens is not None else cache_seqlens_int
    _, lse = _kvcache_impl(q, k_cache, v_cache, k, v, seqlens, block_table, causal, scale,
                           tuple(window), softcap, alibi_slopes, return_lse, num_splits,
                           num_threads, out, layout)
    return lse if return_lse else _no_lse(q)


def _fake_kvcache(q, *rest):
    return_lse, layout = rest[-5], rest[-1]
    if not return_lse:
        return _no_lse(q)
    return q.new_empty(_lse_shape(q, "bshd" if layout == "bshd" else "bhsd"), dtype=torch.float32)


_define("flash_attention_with_kvcache", _cpu_kvcache, _fake_kvcache)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------
def flash_attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=None,
                    alibi_slopes=None, mask=None, return_lse=False, layout="bhsd",
                    num_threads=None, out=None):
    """:func:`fa2cpu.flash_attention` on tensors: exact attention, results are tensors.

    Same arguments, shapes, layouts (``"bhsd"`` (B, H, N, D) with 3-D/2-D also accepted, or
    ``"bshd"``) and semantics as the NumPy function (bottom-right causal/window, GQA without
    repeating K/V, softcap, ALiBi, bool/float ``mask`` broadcast through strides); q, k, v are
    CPU tensors of one dtype (float32, float16 or bfloat16) with any strides, read in place.
    ``alibi_slopes`` (float32) and ``mask`` are tensors too. ``out`` (a tensor of the exact shape
    and dtype) is written in place and returned.

    Differentiable in q, k and v (``torch.ops.fa2cpu.flash_attention`` with
    ``torch.library.register_autograd``; the backward is ``fa2cpu.flash_attention_backward``,
    gradients in the input dtype, float32 accumulation; a gradient flowing into the returned lse
    is included). Not differentiable with ``mask=`` (the backward raises NotImplementedError) or
    with ``out=`` (RuntimeError, as torch's ``out=`` functions). Works under
    ``torch.compile(fullgraph=True)``.

    Returns ``out`` (q's shape with last dim Dv), or ``(out, lse)`` with lse float32 ``(B, Hq, Nq)``
    (``(Hq, Nq)`` / ``(Nq,)`` for 3-D / 2-D inputs).
    """
    if _direct(q, k, v):
        o, lse = _fa_impl(q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout,
                          num_threads, return_lse, out)
        return (o, lse) if return_lse else o
    _check_tensors(q=q, k=k, v=v, alibi_slopes=alibi_slopes, mask=mask, out=out)
    args = (q, k, v, _bool_arg("causal", causal), _float_arg("scale", scale), _window_arg(window),
            _float_arg("softcap", softcap), alibi_slopes, mask, layout,
            _int_arg("num_threads", num_threads, 1))
    if out is not None:
        _no_grad_out("flash_attention", q, k, v)
        lse = torch.ops.fa2cpu.flash_attention_out(*args, bool(return_lse), out)
        return (out, lse) if return_lse else out
    o, lse = torch.ops.fa2cpu.flash_attention(*args)
    return (o, lse) if return_lse else o


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                           max_seqlen_k=None, causal=False, scale=None, window=(-1, -1),
                           softcap=None, alibi_slopes=None, return_lse=False,
                           num_threads=None, out=None):
    """:func:`fa2cpu.flash_attention_varlen` on tensors: attention over packed ragged sequences.

    q ``(total_q, Hq, D)``, k ``(total_k, Hk, D)``, v ``(total_k, Hk, Dv)`` CPU tensors of one
    kernel dtype; ``cu_seqlens_q``/``cu_seqlens_k`` int32/int64 tensors ``(B+1,)`` (start 0,
    non-decreasing, last = total); masks aligned per sequence (bottom-right). Other arguments as
    in :func:`flash_attention`. Differentiable in q, k, v (per-sequence FlashAttention-2
    backward). Returns ``out (total_q, Hq, Dv)`` or ``(out, lse)`` with lse float32
    ``(Hq, total_q)``.
    """
    if _direct(q, k, v):
        o, lse = _varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal, scale, window, softcap, alibi_slopes, num_threads,
                              return_lse, out)
        return (o, lse) if return_lse else o
    _check_tensors(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   alibi_slopes=alibi_slopes, out=out)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, _int_arg("max_seqlen_q", max_seqlen_q, 0),
            _int_arg("max_seqlen_k", max_seqlen_k, 0), _bool_arg("causal", causal),
            _float_arg("scale", scale), _window_arg(window), _float_arg("softcap", softcap),
            alibi_slopes, _int_arg("num_threads", num_threads, 1))
    if out is not None:
        _no_grad_out("flash_attention_varlen", q, k, v)
        lse = torch.ops.fa2cpu.flash_attention_varlen_out(*args, bool(return_lse), out)
        return (out, lse) if return_lse else out
    o, lse = torch.ops.fa2cpu.flash_attention_varlen(*args)
    return (o, lse) if return_lse else o


def flash_attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
                                 block_table=None, causal=False, scale=None, window=(-1, -1),
                                 softcap=None, alibi_slopes=None, return_lse=False,
                                 num_splits=0, num_threads=None, out=None, layout="bshd"):
    """:func:`fa2cpu.flash_attention_with_kvcache` on tensors: decode / chunked prefill.

    ``layout="bshd"`` (flash-attn order, the default): q ``(B, Nq, Hq, D)``; contiguous cache
    ``k_cache (B, Ncap, Hk, D)``, ``v_cache (B, Ncap, Hk, Dv)`` or paged cache ``(num_blocks,
    block_size, Hk, D|Dv)`` with an int32 ``block_table`` tensor ``(B, max_blocks)``; new ``k``,
    ``v`` ``(B, Nnew, Hk, D|Dv)``; out ``(B, Nq, Hq, Dv)``. ``layout="bhsd"`` (PyTorch order)
    swaps the head and position axes of all of them. ``cache_seqlens``: int or int32/int64
    tensor ``(B,)`` (under ``torch.compile`` prefer a tensor: an int is a constant of the
    compiled graph). New k/v are written **in place** into the cache tensors (their autograd
    version counters are bumped) before attention over ``[0, cache_seqlens[b] + Nnew)``; nothing
    is written if any check fails. Same semantics as the NumPy function; not differentiable.

    The common decode case (no alibi, Python scalars for the options) takes a lean path that
    checks the arguments with tensor metadata and calls the kernels directly. Returns ``out`` or
    ``(out, lse)`` with lse float32 ``(B, Hq, Nq)``.
    """
    if _direct(q, k_cache, v_cache, differentiable=False):   # (_direct checked the types)
        r = None if alibi_slopes is not None else _kvcache_lean(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window, softcap,
            return_lse, num_splits, num_threads, out, layout)
        if r is None:
            r = _kvcache_general(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal,
                                 scale, window, softcap, alibi_slopes, return_lse, num_splits,
                                 num_threads, out, layout)
        return r if return_lse else r[0]
    if isinstance(cache_seqlens, torch.Tensor) or cache_seqlens is None:
        seqlens, seqlens_int = cache_seqlens, None
    else:
        seqlens, seqlens_int = None, _int("cache_seqlens", cache_seqlens)
    _check_tensors(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, block_table=block_table,
                   alibi_slopes=alibi_slopes, out=out)
    if out is None:
        out = q.new_empty(q.shape[:-1] + v_cache.shape[-1:])
    lse = torch.ops.fa2cpu.flash_attention_with_kvcache(
        q, k_cache, v_cache, k, v, seqlens, seqlens_int, block_table, _bool_arg("causal", causal),
        _float_arg("scale", scale), _window_arg(window), _float_arg("softcap", softcap),
        alibi_slopes, bool(return_lse), _int("num_splits", num_splits, 0),
        _int_arg("num_threads", num_threads, 1), out, layout)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# torch.nn.functional.scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------
def _sdpa_supported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
    """True when fa2cpu computes exactly what torch's SDPA would for these arguments."""
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
            and isinstance(value, torch.Tensor)):
        return False
    if dropout_p != 0.0 or query.is_nested or key.is_nested or value.is_nested:
        return False
    if not torch.compiler.is_compiling() and torch.overrides.has_torch_function((query, key, value, attn_mask)):
        return False
    dt = query.dtype
    if dt not in _FLOATS or key.dtype != dt or value.dtype != dt:
        return False
    if query.device.type != "cpu" or key.device.type != "cpu" or value.device.type != "cpu":
        return False
    rank = query.dim()
    if rank < 2 or key.dim() != rank or value.dim() != rank:
        return False
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-3] != value.shape[:-3]:
        return False  # broadcast batch dims: torch's
    L, E = query.shape[-2:]
    S, Ev = value.shape[-2:]
    if key.shape[-2] != S or key.shape[-1] != E or not (0 < E <= _MAX_HEAD_DIM) \
            or not (0 < Ev <= _MAX_HEAD_DIM) or L == 0 or S == 0 or query.numel() == 0:
        return False
    if rank >= 3:
        hq, hk = query.shape[-3], key.shape[-3]
        if value.shape[-3] != hk or (hq != hk and not (enable_gqa and hk > 0 and hq % hk == 0)):
            return False
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor) or attn_mask.device.type != "cpu":
            return False
        if attn_mask.dtype != torch.bool and attn_mask.dtype != dt:
            return False
        if attn_mask.requires_grad or rank > 4 or attn_mask.dim() > rank:
            return False
        target = query.shape[:-1] + (S,)
        if any(m != 1 and m != t for m, t in zip(reversed(attn_mask.shape), reversed(target))):
            return False
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
            return False  # fa2cpu's backward has no mask
    return True


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` computed by fa2cpu.

    Same signature and semantics as torch's: query ``(..., Hq, L, E)``, key ``(..., Hk, S, E)``,
    value ``(..., Hk, S, Ev)`` -> ``(..., Hq, L, Ev)``; ``attn_mask`` bool (True = attend) or
    float (added to the scores), broadcastable to ``(..., Hq, L, S)``; ``is_causal`` is torch's
    **top-left** aligned mask (query i sees key j iff ``j <= i``) for any L, S; ``scale`` defaults
    to ``1/sqrt(E)``; ``enable_gqa`` allows ``Hq % Hk == 0`` (K/V are not repeated). Differentiable
    in query, key and value (without attn_mask).

    Top-left causal in fa2cpu's bottom-right terms: L == S is ``causal=True``; L > S is
    ``window=(-1, L - S)`` (row i sees j <= i + S - L + (L - S) = i); L < S sees no key j >= L,
    so key/value (and attn_mask's last axis) are trimmed (views) to their first L rows and
    causal=True applies. ``attn_mask`` with ``is_causal`` applies both, as torch 2.13 does.

    Falls back to torch's own implementation for what fa2cpu cannot compute exactly:
    ``dropout_p > 0``, dtypes other than float32/float16/bfloat16, non-CPU or nested tensors,
    head dims above 256, empty inputs, batch dims that differ (broadcast), ``Hq != Hk`` without
    ``enable_gqa``, an ``attn_mask`` with a dtype other than bool or the query's, of more than 4
    dims, or on inputs that need gradients (fa2cpu's backward has no mask), and tensor
    subclasses with ``__torch_function__``.
    """
    if not _sdpa_supported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        return _torch_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                           is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    window = (-1, -1)
    causal = False
    if is_causal:
        L, S = query.shape[-2], key.shape[-2]
        if L > S:
            window = (-1, L - S)
        else:
            causal = True
            if L < S:
                key, value = key[..., :L, :], value[..., :L, :]
                if attn_mask is not None and attn_mask.dim() and attn_mask.shape[-1] == S:
                    attn_mask = attn_mask[..., :L]
    batch = query.shape[:-3]
    if len(batch) > 1:  # fold leading dims into one batch dim (views where strides allow)
        query, key, value = (t.reshape((-1,) + t.shape[-3:]) for t in (query, key, value))
    out = flash_attention(query, key, value, causal=causal, scale=scale, window=window, mask=attn_mask)
    return out.reshape(batch + out.shape[-3:]) if len(batch) > 1 else out


class _SdpaPatch:
    """Handle returned by :func:`patch_sdpa`: ``undo()`` restores the previous function (once;
    later calls do nothing); also a context manager that undoes on exit."""

    def __init__(self):
        import torch.nn.functional as F
        self._module = F
        self._previous = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = scaled_dot_product_attention
        self.active = True

    def undo(self):
        if self.active:
            self._module.scaled_dot_product_attention = self._previous
            self.active = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()
        return False

    def __repr__(self):
        return f"<fa2cpu.torch SDPA patch, {'active' if self.active else 'undone'}>"


def patch_sdpa():
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through
    :func:`scaled_dot_product_attention` (code that looks the function up in
    ``torch.nn.functional`` at call time, as transformers and ``nn.MultiheadAttention`` do).

    Returns a handle whose ``.undo()`` restores the function that was installed before; usable as
    a context manager: ``with fa2cpu.torch.patch_sdpa(): model(x)``. Nested patches must be
    undone in reverse order.
    """
    return _SdpaPatch()
