"""The validation step of every public call: its arguments checked (fa2cpu/_checks.py) and turned
into one Problem, the description of a kernel launch that fa2cpu/attention.py's _launch hands to
``_core.run``. Nothing is written before every check has passed (the KV-cache append included:
kvcache_problem only describes it, as an Append).
"""
import math
import numbers
from typing import NamedTuple, Optional

import numpy as np

from . import _core
from ._checks import (_CODES, _DTYPES, _MAX_SPLITS, MAX_HEAD_DIM, _alibi, _append_target, _array, _cache_scale,
                      _cu_seqlens_pair, _data, _distinct_targets, _dtype_code, _head_dims, _heads, _int, _mask,
                      _max_seqlens, _Options, _out, _packed, _qkv, _same_dtype, _threads)

_INT64_MAX = 2**63 - 1  # positions and capacities the kernels address (int64)


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
    sinks: Optional[np.ndarray] = None       # float32 (q_heads,) attention sinks (_checks._sinks)
    kv_dtype_code: int = -1                  # k/v: a quantized cache's codes (_checks._CODES), -1 = dtype_code
    k_scale: Optional[np.ndarray] = None     # float32 (batch or block, kv_heads, position) scales of the codes
    v_scale: Optional[np.ndarray] = None


class Append(NamedTuple):
    """New keys and values a KV-cache call writes before its launch, all in (batch, position,
    head, feature) order (a paged cache: (block, row in block, head, feature))."""
    k_cache: np.ndarray
    v_cache: np.ndarray
    k: np.ndarray
    v: np.ndarray
    start: object                            # first position: int (every sequence) or int64 (B,)
    k_scale: Optional[np.ndarray] = None     # quantized cache: its scales (block, row in block, head)
    v_scale: Optional[np.ndarray] = None


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
    _max_seqlens(max_seqlen_q, max_seqlen_k, cu_q, cu_k)
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
                    alibi_slopes, num_splits, num_threads, out, layout, k_scale=None, v_scale=None):
    """flash_attention_with_kvcache's arguments -> (Problem, out in the caller's layout, Append or
    None), with every check (errors name the argument). A decode step first tries
    kvcache_problem_lean, which gives the same result for the common case in a few microseconds."""
    if layout == "bshd":
        return _kvcache_problem_bshd(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale,
                                window, softcap, alibi_slopes, num_splits, num_threads, out, layout, k_scale, v_scale)
    if layout != "bhsd":
        raise ValueError(f"layout: expected 'bshd' (flash-attn order) or 'bhsd' (PyTorch order), got {layout!r}")

    def swap(a):  # (B, H, N, D) <-> (B, N, H, D), scales (B, H, N) <-> (B, N, H); else left for the checks
        if isinstance(a, np.ndarray) and a.ndim in (3, 4):
            return a.transpose((0, 2, 1, 3)[:a.ndim])
        return a
    try:
        problem, new_out, append = _kvcache_problem_bshd(
            swap(q), swap(k_cache), swap(v_cache), swap(k), swap(v), cache_seqlens, block_table, causal,
            scale, window, softcap, alibi_slopes, num_splits, num_threads, swap(out), layout, swap(k_scale),
            swap(v_scale))
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
_F32 = np.dtype(np.float32)
_INDEX_DTYPES = (_INT32, np.dtype(np.int64))  # dtype instances: `in` then tests identity first (~0.05 us, not 0.5)


def _may_alias(a, b):
    """Whether two arrays may share memory, cheaply: one object, or views of one owner whose
    bounds overlap (arrays with other owners cannot; fa2cpu.torch compares its tensors' pointers)."""
    owner_a, owner_b = a.base, b.base
    if owner_a is None:
        owner_a = a
    if owner_b is None:
        owner_b = b
    return a is b or (owner_a is owner_b and np.may_share_memory(a, b))


def _contiguous_writable(flags):  # one flags object (each .flags access builds a new one)
    return flags.c_contiguous and flags.writeable and flags.aligned


def lean_scale(scale, D):
    """The score scale of a lean decode path: None -> 1/sqrt(D); a Python float within
    +-_LEAN_FLOAT_MAX as is; None for anything else (NaN too), which the full checks then word."""
    if scale is None:
        return 1.0 / math.sqrt(D)
    return scale if type(scale) is float and abs(scale) <= _LEAN_FLOAT_MAX else None


def kvcache_problem_lean(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window, softcap,
                         num_splits, num_threads, out, layout, k_scale=None, v_scale=None):
    """kvcache_problem for the common decode case, checked with cheap metadata tests (a decode step
    costs tens of microseconds; the full checks cost several). Returns None, having changed
    nothing, for anything outside it; kvcache_problem then checks everything and words the errors.

    Covered: q, caches (and k, v) plain ndarrays of one kernel dtype, 4-D, either layout, or
    int8 / float8 caches with both float32 scale arrays of the cache's shape without the last
    axis (finite k, v when appending); contiguous cache, or paged with an int32 block table; None,
    int or int32/int64 ``(B,)`` cache_seqlens; no alibi; Python scalars for the options; ``out`` None or a C-contiguous
    array that shares no memory with an input. Within that case the results equal
    kvcache_problem's (same normalisation of options, same core arguments)."""
    if type(q) is not np.ndarray or type(k_cache) is not np.ndarray or type(v_cache) is not np.ndarray:
        return None
    dtype = q.dtype
    dtype_code = _DTYPES.get(dtype)
    codes = None
    if k_cache.dtype is not dtype:
        codes = _CODES.get(k_cache.dtype)
        if codes is None or v_cache.dtype is not k_cache.dtype or type(k_scale) is not np.ndarray \
                or type(v_scale) is not np.ndarray or k_scale.dtype is not _F32 or v_scale.dtype is not _F32 \
                or k_scale.shape != k_cache.shape[:-1] or v_scale.shape != v_cache.shape[:-1] \
                or not (k_scale.flags.aligned and v_scale.flags.aligned):
            return None
    elif k_scale is not None or v_scale is not None:
        return None
    if dtype_code is None or v_cache.dtype is not k_cache.dtype \
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
    scale = lean_scale(scale, D)
    if scale is None:
        return None
    if softcap is None:
        softcap = 0.0
    elif type(softcap) is not float or not (softcap == 0.0 or (
            1.0 / _LEAN_FLOAT_MAX <= softcap <= _LEAN_FLOAT_MAX and abs(scale) / softcap <= _LEAN_FLOAT_MAX)):
        return None
    new_tokens = 0
    if k is not None or v is not None:
        if type(k) is not np.ndarray or type(v) is not np.ndarray or k.dtype is not dtype or v.dtype is not dtype \
                or k.ndim != 4 or v.ndim != 4 or not k_cache.flags.writeable or not v_cache.flags.writeable \
                or 0 in k_cache.strides or 0 in v_cache.strides or _may_alias(k_cache, v_cache):
            return None  # (the last three: maybe append targets that alias; the full checks decide)
        if layout == "bhsd":  # the append takes (batch, position, head, feature)
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        new_tokens = k.shape[1]
        if k.shape != (B, new_tokens, Hk, D) or v.shape != (B, new_tokens, Hk, Dv):
            return None
        if codes is not None and not (k_scale.flags.writeable and v_scale.flags.writeable
                                      and 0 not in k_scale.strides and 0 not in v_scale.strides
                                      and not _may_alias(k_scale, v_scale)
                                      and np.isfinite(k).all() and np.isfinite(v).all()):
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
        if capacity > _INT64_MAX:  # the full checks' error
            return None
    if type(cache_seqlens) is int:
        lengths, length = None, cache_seqlens
    elif cache_seqlens is None:  # the whole capacity (an append then fails the bound below)
        lengths, length = None, capacity
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
            or not _contiguous_writable(out.flags) or np.may_share_memory(out, q) or np.may_share_memory(out, k_cache) \
            or np.may_share_memory(out, v_cache) or (new_tokens and (
                np.may_share_memory(out, k) or np.may_share_memory(out, v))) or (codes is not None and (
                np.may_share_memory(out, k_scale) or np.may_share_memory(out, v_scale))):
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
    kv_code, k_scale4, v_scale4 = -1, None, None
    if codes is not None:  # scales in the core's (batch, head, position) order and the append's (b, n, h)
        kv_code = codes[0]
        if layout == "bshd":
            k_scale4, v_scale4 = k_scale.transpose(0, 2, 1), v_scale.transpose(0, 2, 1)
        else:
            k_scale4, v_scale4, k_scale, v_scale = k_scale, v_scale, k_scale.transpose(0, 2, 1), v_scale.transpose(0, 2, 1)
    if new_tokens:
        append = Append(k_cache if layout == "bshd" else k_cache.transpose(0, 2, 1, 3),
                        v_cache if layout == "bshd" else v_cache.transpose(0, 2, 1, 3),
                        k, v, length if lengths is None else lengths, k_scale if codes else None,
                        v_scale if codes else None)
    # _make of a tuple in field order: keywords would cost ~1.5 us on the per-token path.
    return Problem._make((q4, k_cache4, v_cache4, out.transpose(0, 2, 1, 3) if layout == "bshd" else out,
                          dtype_code, B, Hq, Hk, Nq, capacity, scale, softcap, left, right, None, None, 0, None,
                          None, kv_seqlens, table, block_size, threads, num_splits, None, kv_code, k_scale4,
                          v_scale4)), out, append


def _kvcache_problem_bshd(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window, softcap,
                     alibi_slopes, num_splits, num_threads, out, layout, k_scale=None, v_scale=None):
    """kvcache_problem on (B, N, H, D)-ordered arrays (scales (B, N, H)); ``layout`` only words
    the messages."""
    q = _data("q", q); k_cache = _data("k_cache", k_cache); v_cache = _data("v_cache", v_cache)
    dtype_code = _dtype_code("q", q)
    codes = _CODES.get(k_cache.dtype)
    if codes is None:
        _same_dtype("q", q, k_cache=k_cache, v_cache=v_cache)
    elif v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: dtype {v_cache.dtype} does not match k_cache's {k_cache.dtype}; a quantized "
                        f"cache holds K and V as codes of one dtype (int8 or float8_e4m3fn)")
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
    if k is not None:  # both caches are written by the append
        _append_target("k_cache", k_cache)
        _append_target("v_cache", v_cache)
        _distinct_targets("k_cache", k_cache, "v_cache", v_cache)

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
        if capacity > _INT64_MAX:
            raise ValueError(f"block_table: {table.shape[1]} blocks of {block_size} rows make a capacity of "
                             f"{capacity} keys, more than 2**63 - 1")
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
    k_scale = _cache_scale("k_scale", k_scale, "k_cache", k_cache, new_tokens > 0)
    v_scale = _cache_scale("v_scale", v_scale, "v_cache", v_cache, new_tokens > 0)
    if new_tokens > 0 and k_scale is not None and v_scale is not None:
        _distinct_targets("k_scale", k_scale, "v_scale", v_scale)
    if codes is not None and new_tokens:
        _quantizable(k=(k, k_cache, k_scale), v=(v, v_cache, v_scale))
    options = _Options(D, causal, scale, window, softcap, Nq, capacity)
    alibi = _alibi(alibi_slopes, B, Hq)
    threads = _threads(num_threads)
    splits = min(_int("num_splits", num_splits, 0), _MAX_SPLITS)
    out = _out(out, (B, Nq, Hq, Dv), q.dtype,
               {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "alibi_slopes": alibi,
                "k_scale": k_scale, "v_scale": v_scale})
    append = None
    if new_tokens:
        append = Append(k_cache, v_cache, k, v, length if lengths is None else lengths, k_scale, v_scale)
    quantized = {}
    if codes is not None:
        quantized = dict(kv_dtype_code=codes[0], k_scale=None if k_scale is None else k_scale.transpose(0, 2, 1),
                         v_scale=None if v_scale is None else v_scale.transpose(0, 2, 1))
    return Problem(q.transpose(0, 2, 1, 3), k_cache.transpose(0, 2, 1, 3), v_cache.transpose(0, 2, 1, 3),
                   out.transpose(0, 2, 1, 3), dtype_code=dtype_code, batch=B, q_heads=Hq, kv_heads=Hk, q_length=Nq,
                   kv_length=capacity, scale=options.scale, softcap=options.softcap, window_left=options.left,
                   window_right=options.right, alibi_slopes=alibi, mask=None, mask_kind=0, cu_seqlens_q=None,
                   cu_seqlens_k=None, kv_seqlens=kv_seqlens, block_table=table, block_size=block_size,
                   num_threads=threads, num_splits=splits, **quantized), out, append


def _quantizable(**appended):
    """New keys/values for a quantized cache must be finite where they get scales (int8, or
    float8 with scales): max|x| / 127 of a row holding inf or NaN is no scale. (Into a float8 cache
    without scales they are converted directly: NaN stays NaN, +-inf saturates to +-448.)"""
    for name, (x, cache, scales) in appended.items():
        if (cache.dtype == np.int8 or scales is not None) and not np.isfinite(x).all():
            raise ValueError(f"{name}: holds inf or NaN, which cannot be quantized into the {cache.dtype} cache "
                             f"(per-token scale max|x| / {int(_CODES[cache.dtype][1])}); the cache was left unchanged")
