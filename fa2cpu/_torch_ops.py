"""fa2cpu's functions as PyTorch custom operators (``torch.library`` namespace ``fa2cpu``): their
implementations on CPU tensors (also called directly by fa2cpu.torch in eager mode), fake
implementations for ``torch.compile`` and autograd. See fa2cpu/torch.py for the list."""
import threading
import weakref

import numpy as np
import torch

from . import _core
from . import attention as _api
from ._torch_bridge import _CODES, _borrowed_view, _np, _np_opt, _result, _tensor, _cache_view
from ._validate import _threads, lean_scale
from .backward import flash_attention_backward as _np_backward
from .backward import flash_attention_varlen_backward as _np_varlen_backward


# ---------------------------------------------------------------------------------------------
# Implementations on real CPU tensors (called directly in eager mode and by the operators)
# ---------------------------------------------------------------------------------------------
def _through_numpy(function, q, v, out, return_lse, *args, **kwargs):
    """Calls the NumPy API's ``function(*args, **kwargs)`` (NumPy views of the tensors) writing
    ``out`` (None = a new tensor of q's rows and v's head dim) -> (out, lse tensor or None)."""
    if out is None:
        out, out_view = _result(q, v)
    else:
        out_view = _np("out", out)
        torch._C._increment_version((out,))   # written by the call (if every check passes)
    result = function(*args, return_lse=return_lse, out=out_view, **kwargs)
    if out is None:  # the NumPy API allocated it (only when the shapes were already invalid)
        out = _tensor(result[0] if return_lse else result)
    return (out, _tensor(result[1])) if return_lse else (out, None)


def _fa_impl(q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout, num_threads,
             return_lse, out, sinks=None):
    """flash_attention on tensors -> (out, lse or None); ``out`` None = a new tensor."""
    return _through_numpy(_api.flash_attention, q, v, out, return_lse, _np("q", q), _np("k", k), _np("v", v),
                          causal=causal, scale=scale, window=window, softcap=softcap,
                          alibi_slopes=_np_opt("alibi_slopes", alibi_slopes), mask=_np_opt("mask", mask),
                          layout=layout, num_threads=num_threads, sinks=_np_opt("sinks", sinks))


def _varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                 window, softcap, alibi_slopes, num_threads, return_lse, out, sinks=None):
    """flash_attention_varlen on tensors -> (out, lse or None)."""
    return _through_numpy(_api.flash_attention_varlen, q, v, out, return_lse, _np("q", q), _np("k", k),
                          _np("v", v), _np("cu_seqlens_q", cu_seqlens_q), _np("cu_seqlens_k", cu_seqlens_k),
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal, scale=scale,
                          window=window, softcap=softcap, alibi_slopes=_np_opt("alibi_slopes", alibi_slopes),
                          num_threads=num_threads, sinks=_np_opt("sinks", sinks))


def _kvcache_impl(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window,
                  softcap, alibi_slopes, return_lse, num_splits, num_threads, out, layout, sinks=None,
                  k_scale=None, v_scale=None):
    """flash_attention_with_kvcache on tensors -> (out, lse or None): NumPy views (memoised for
    the long-lived caches and their scales), then the NumPy API's one validation, append (the
    quantizing one for an int8 / float8_e4m3fn cache, writing codes and scales through the
    views) and launch. A new out is allocated by NumPy and wrapped (half the cost of
    torch.empty on the decode path)."""
    if type(cache_seqlens) is not int and isinstance(cache_seqlens, torch.Tensor):  # (an int: the decode case)
        cache_seqlens = _np("cache_seqlens", cache_seqlens)
    if k is not None:  # views of one tensor have distinct owners in NumPy: the pointers tell
        for (kn, kt), (vn, vt) in ((("k_cache", k_cache), ("v_cache", v_cache)),
                                   (("k_scale", k_scale), ("v_scale", v_scale))):
            if isinstance(kt, torch.Tensor) and isinstance(vt, torch.Tensor) and kt.numel() \
                    and kt.data_ptr() == vt.data_ptr():
                raise ValueError(f"{vn}: the same memory as {kn}; the append would write v over k")
    out_view, lse = _api._with_kvcache(
        _np("q", q), _cache_view("k_cache", k_cache), _cache_view("v_cache", v_cache),
        None if k is None else _np("k", k), None if v is None else _np("v", v), cache_seqlens,
        None if block_table is None else _np("block_table", block_table), causal, scale, window, softcap,
        _np_opt("alibi_slopes", alibi_slopes), return_lse, num_splits, num_threads,
        None if out is None else _np("out", out), layout, _np_opt("sinks", sinks),
        None if k_scale is None else _cache_view("k_scale", k_scale),
        None if v_scale is None else _cache_view("v_scale", v_scale))
    if k is not None:  # appended (every check passed): caches and, with them, their scales
        torch._C._increment_version((k_cache, v_cache) if k_scale is None and v_scale is None else
                                    tuple(t for t in (k_cache, v_cache, k_scale, v_scale) if t is not None))
    if out is None:
        out = _tensor(out_view)
    else:
        torch._C._increment_version((out,))
    return out, (None if lse is None else torch.from_numpy(lse))


# The eager decode call with new keys / values on tensors, as one prepared core call: a
# _core.DecodeStep per contiguous (k_cache, v_cache) pair and Python thread, over views that
# borrow the caches' memory (dropped with the tensors: weakref callbacks), so a step reads only
# the tensors' pointers, shapes and strides. The NumPy route (views of q, k, v, the lean checks,
# the append, the launch) costs 16.6 us (fp32) / 21.4 us (bf16) of Python per call on the 2-core
# Xeon, this one ~7 us (bench/torch_overhead.py; bench/RESULTS.md, session 39). Same core call,
# same bits (tests/test_torch.py); anything outside its case returns None for the general route.
_STEPS = threading.local()
_STEP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _decode_step(k_cache, v_cache):
    """This thread's DecodeStep over the (k_cache, v_cache) pair (bshd, contiguous caches); None
    for caches the append must not write (expanded views, one tensor as both): the general
    route's checks then refuse them."""
    steps = getattr(_STEPS, "steps", None)
    if steps is None:
        steps = _STEPS.steps = {}
    key = (id(k_cache), id(v_cache))
    now = (k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape, v_cache.shape, k_cache.stride(), v_cache.stride())
    entry = steps.get(key)
    if entry is not None and entry[0]() is k_cache and entry[1]() is v_cache and entry[2] == now:
        return entry[3]
    if k_cache.data_ptr() == v_cache.data_ptr() or any(
            st == 0 and n > 1 for c in (k_cache, v_cache) for n, st in zip(c.shape, c.stride())):
        return None
    forget = lambda _, key=key, steps=steps: steps.pop(key, None)  # noqa: E731
    k4 = _borrowed_view(k_cache).transpose(0, 2, 1, 3)  # the core's (batch, head, position, feature)
    v4 = _borrowed_view(v_cache).transpose(0, 2, 1, 3)
    step = _core.DecodeStep(k4, v4, None, 0, _CODES[k_cache.dtype])
    steps[key] = (weakref.ref(k_cache, forget), weakref.ref(v_cache, forget), now, step)
    return step


def _kvcache_step(q, k_cache, v_cache, k, v, length, causal, scale, softcap, num_threads):
    """flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=length, causal=causal)
    on plain CPU tensors in bshd order with contiguous float caches of q's dtype, through the
    layer's DecodeStep -> out; None (nothing written) for any call outside that case."""
    T = torch.Tensor
    if type(q) is not T or type(k_cache) is not T or type(v_cache) is not T or type(k) is not T or type(v) is not T:
        return None
    dtype = q.dtype
    if dtype not in _STEP_DTYPES or k_cache.dtype is not dtype or v_cache.dtype is not dtype \
            or k.dtype is not dtype or v.dtype is not dtype or not q.is_cpu or not k_cache.is_cpu \
            or not v_cache.is_cpu or not k.is_cpu or not v.is_cpu \
            or q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    B, M, Hq, D = q.shape
    Bc, capacity, Hk, Dk = k_cache.shape
    n, Dv = k.shape[1], v.shape[3]
    if B < 1 or M < 1 or n < 1 or Bc != B or Hk < 1 or Hq % Hk or Dk != D or not 0 < D <= 256 or not 0 < Dv <= 256 \
            or v_cache.shape != (B, capacity, Hk, Dv) or k.shape != (B, n, Hk, D) or v.shape != (B, n, Hk, Dv) \
            or length < 0 or length + n > capacity or k_cache.numel() == 0 or v_cache.numel() == 0:
        return None
    scale = lean_scale(scale, D)
    if scale is None:
        return None
    if softcap is not None and not (type(softcap) is float and softcap == 0.0):
        return None
    if num_threads is not None and (type(num_threads) is not int or num_threads < 1):
        return None
    threads = _threads(num_threads)  # (num_threads is None or an int >= 1 here)
    step = _decode_step(k_cache, v_cache)
    if step is None:
        return None
    lengths = np.full(B, length, np.int32)
    out = torch.empty((B, M, Hq, Dv), dtype=dtype)
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    step(q.data_ptr(), qs[0], qs[2], qs[1], qs[3], k.data_ptr(), ks[0], ks[2], ks[1], ks[3],
         v.data_ptr(), vs[0], vs[2], vs[1], vs[3], out.data_ptr(), B, Hq, M, D, n, lengths, scale, 0.0,
         -1, 0 if causal else -1, threads)
    torch._C._increment_version((k_cache, v_cache))
    return out


def _lse_grad_pass(backward, dlse_rows, q, k, v, lse, **options):
    """Gradients in q, k of ``sum(dlse * lse)`` from ``backward`` itself: with v = 0 (Dv = 1),
    out = 1 and dout = -dlse the backward's dS = P * (dP - rowsum(dout * out)) is exactly
    P * dlse = dlse * d lse / d s (softcap's chain rule included). ``dlse_rows``: dlse laid out
    like q's rows with a trailing axis of 1 (the shape of that fake out)."""
    dout = (-dlse_rows).astype(q.dtype)
    ones = np.ones(dout.shape, q.dtype)
    zeros = np.zeros(v.shape[:-1] + (1,), q.dtype)
    dq, dk, _, *dsinks = backward(dout, q, k, zeros, ones, lse, **options)
    return dq, dk, (dsinks[0] if dsinks else None)   # with sinks: d(sum dlse * lse)/d sinks too


def _add(a, b):
    """a + b accumulated in float32, in a's dtype."""
    return (a.astype(np.float32) + b.astype(np.float32)).astype(a.dtype)


def _gradient_tensors(backward, dout, q, k, v, out, lse, dlse_rows, options):
    """(dq, dk, dv, dsinks) tensors from the NumPy ``backward(dout, q, k, v, out, lse, **options)``,
    plus the gradients of ``sum(dlse * lse)`` when ``dlse_rows`` (see _lse_grad_pass) is given;
    dsinks is an empty float32 tensor without sinks."""
    arrays = [_np(name, t) for name, t in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse))]
    dq, dk, dv, *dsinks = backward(*arrays, **options)
    dsinks = dsinks[0] if dsinks else np.zeros(0, np.float32)
    if dlse_rows is not None:
        _, q_view, k_view, v_view, _, lse_view = arrays
        lse_dq, lse_dk, lse_dsinks = _lse_grad_pass(backward, dlse_rows, q_view, k_view, v_view, lse_view, **options)
        dq, dk = _add(dq, lse_dq), _add(dk, lse_dk)
        if lse_dsinks is not None:
            dsinks = dsinks + lse_dsinks
    return _tensor(dq), _tensor(dk), _tensor(dv), torch.from_numpy(np.ascontiguousarray(dsinks, np.float32))


_MASK_GRAD = ("flash_attention: gradients with mask= are not supported (fa2cpu's backward has no "
              "mask); use scaled_dot_product_attention (falls back to torch's for that), or "
              "causal=/window= instead of the mask")


def _bwd_impl(dout, q, k, v, out, lse, dlse, causal, scale, window, softcap, alibi_slopes, layout,
              num_threads, has_mask, sinks=None):
    """(dq, dk, dv, dsinks) tensors of flash_attention, gradients of out and (if nonzero) of lse."""
    if has_mask:
        raise NotImplementedError(_MASK_GRAD)
    dlse_rows = None
    if dlse is not None and bool(dlse.any()):
        dlse_view = _np("dlse", dlse)
        dlse_rows = dlse_view.transpose(0, 2, 1)[..., None] if layout == "bshd" else dlse_view[..., None]
    options = dict(causal=causal, scale=scale, window=window, softcap=softcap,
                   alibi_slopes=_np_opt("alibi_slopes", alibi_slopes), layout=layout, num_threads=num_threads,
                   sinks=_np_opt("sinks", sinks))
    return _gradient_tensors(_np_backward, dout, q, k, v, out, lse, dlse_rows, options)


def _varlen_bwd_impl(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, causal, scale, window, softcap, alibi_slopes, num_threads, sinks=None):
    """(dq, dk, dv, dsinks) tensors of flash_attention_varlen, gradients of out and (if nonzero) of lse."""
    offsets = (_np("cu_seqlens_q", cu_seqlens_q), _np("cu_seqlens_k", cu_seqlens_k))

    def backward(dout, q, k, v, out, lse, **options):  # the varlen backward with this call's offsets
        return _np_varlen_backward(dout, q, k, v, out, lse, *offsets, **options)
    dlse_rows = None
    if dlse is not None and bool(dlse.any()):
        dlse_rows = _np("dlse", dlse).T[..., None]                  # (total_q, Hq, 1)
    options = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal, scale=scale,
                   window=window, softcap=softcap, alibi_slopes=_np_opt("alibi_slopes", alibi_slopes),
                   num_threads=num_threads, sinks=_np_opt("sinks", sinks))
    return _gradient_tensors(backward, dout, q, k, v, out, lse, dlse_rows, options)


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
        f"(Tensor q, Tensor k, Tensor v, {_OPTIONS}, Tensor? mask, str layout, int? num_threads,"
        " Tensor? sinks=None) -> (Tensor out, Tensor lse)",
    "flash_attention_out":
        f"(Tensor q, Tensor k, Tensor v, {_OPTIONS}, Tensor? mask, str layout, int? num_threads,"
        " bool return_lse, Tensor(a!) out, Tensor? sinks=None) -> Tensor lse",
    "flash_attention_backward":
        f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, {_OPTIONS},"
        " str layout, int? num_threads, bool has_mask, Tensor? sinks=None)"
        " -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)",
    "flash_attention_varlen":
        "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int? max_seqlen_q,"
        f" int? max_seqlen_k, {_OPTIONS}, int? num_threads, Tensor? sinks=None) -> (Tensor out, Tensor lse)",
    "flash_attention_varlen_out":
        "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int? max_seqlen_q,"
        f" int? max_seqlen_k, {_OPTIONS}, int? num_threads, bool return_lse, Tensor(a!) out,"
        " Tensor? sinks=None) -> Tensor lse",
    "flash_attention_varlen_backward":
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse,"
        " Tensor cu_seqlens_q, Tensor cu_seqlens_k, int? max_seqlen_q, int? max_seqlen_k,"
        f" {_OPTIONS}, int? num_threads, Tensor? sinks=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)",
    # cache_seqlens / cache_seqlens_int: the tensor and int forms of the public argument;
    # k_scale / v_scale: a quantized cache's scales, written (like the caches) when k/v are appended.
    "flash_attention_with_kvcache":
        "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor? cache_seqlens,"
        f" int? cache_seqlens_int, Tensor? block_table, {_OPTIONS}, bool return_lse, int num_splits,"
        " int? num_threads, Tensor(c!) out, str layout, Tensor? sinks=None, Tensor(d!)? k_scale=None,"
        " Tensor(e!)? v_scale=None) -> Tensor lse",
}


def _define(name, cpu, fake):
    _LIB.define(name + _SCHEMAS[name])
    _LIB.impl(name, cpu, "CPU")

    def one_device(*args, **kwargs):
        # A meta tensor among CPU ones dispatches here, not to the CPU kernel: refuse, as the
        # CPU kernel's checks would, instead of returning uninitialised tensors.
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        for t in tensors[1:]:
            if t.device.type != tensors[0].device.type:
                raise ValueError(f"fa2cpu::{name}: tensors on devices {tensors[0].device.type} and {t.device.type}; "
                                 f"every tensor must be on one device (fa2cpu runs on the CPU)")
        return fake(*args, **kwargs)
    torch.library.register_fake(f"fa2cpu::{name}", one_device, lib=_LIB)


def _lse_shape(q, layout):
    """Shape of flash_attention's lse for q: (B, Hq, Nq), (Hq, Nq) or (Nq,)."""
    if layout == "bshd":
        return (q.shape[0], q.shape[2], q.shape[1])
    return tuple(q.shape[:-1])


def _no_lse(q):
    """The lse result of an out= operator called without return_lse."""
    return q.new_empty((0,), dtype=torch.float32)


# flash_attention ------------------------------------------------------------------------------
def _cpu_fa(q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout, num_threads, sinks=None):
    return _fa_impl(q, k, v, causal, scale, tuple(window), softcap, alibi_slopes, mask, layout,
                    num_threads, True, None, sinks)


def _fake_fa(q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout, num_threads, sinks=None):
    return (q.new_empty(q.shape[:-1] + v.shape[-1:]),
            q.new_empty(_lse_shape(q, layout), dtype=torch.float32))


def _cpu_fa_out(q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout, num_threads,
                return_lse, out, sinks=None):
    _, lse = _fa_impl(q, k, v, causal, scale, tuple(window), softcap, alibi_slopes, mask, layout,
                      num_threads, return_lse, out, sinks)
    return lse if return_lse else _no_lse(q)


def _fake_fa_out(q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout, num_threads,
                 return_lse, out, sinks=None):
    return q.new_empty(_lse_shape(q, layout), dtype=torch.float32) if return_lse else _no_lse(q)


def _cpu_fa_bwd(dout, q, k, v, out, lse, dlse, causal, scale, window, softcap, alibi_slopes,
                layout, num_threads, has_mask, sinks=None):
    return _bwd_impl(dout, q, k, v, out, lse, dlse, causal, scale, tuple(window), softcap,
                     alibi_slopes, layout, num_threads, has_mask, sinks)


def _fake_gradients(q, k, v, sinks):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((0 if sinks is None else sinks.shape[0],), dtype=torch.float32))


def _fake_fa_bwd(dout, q, k, v, out, lse, dlse, causal, scale, window, softcap, alibi_slopes, layout,
                 num_threads, has_mask, sinks=None):
    return _fake_gradients(q, k, v, sinks)


def _save_for_backward(ctx, q, k, v, out, lse, rest):
    """Autograd context of a forward operator: ``rest`` = the backward operator's arguments after
    ``dlse``; its tensors go through save_for_backward, everything else is kept as is."""
    ctx.tensor_slots = [isinstance(a, torch.Tensor) for a in rest]
    ctx.save_for_backward(q, k, v, out, lse, *(a for a, is_tensor in zip(rest, ctx.tensor_slots) if is_tensor))
    ctx.rest = [None if is_tensor else a for a, is_tensor in zip(rest, ctx.tensor_slots)]


def _backward_through(name, n_inputs):
    """Autograd formula of a forward operator with ``n_inputs`` inputs: the operator ``name``
    (dout, q, k, v, out, lse, dlse, *rest) -> (dq, dk, dv); no gradient for the other inputs."""
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *saved = ctx.saved_tensors
        saved = iter(saved)
        rest = [next(saved) if is_tensor else a for a, is_tensor in zip(ctx.rest, ctx.tensor_slots)]
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, dsinks = getattr(torch.ops.fa2cpu, name)(dout, q, k, v, out, lse, dlse, *rest)
        # the last input is sinks (None, or a tensor that may require grad)
        return (dq, dk, dv) + (None,) * (n_inputs - 4) + (dsinks if rest[-1] is not None else None,)
    return backward


def _fa_setup_context(ctx, inputs, output):
    q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout, num_threads, *sinks = inputs
    sinks = sinks[0] if sinks else None
    _save_for_backward(ctx, q, k, v, *output,
                       (causal, scale, window, softcap, alibi_slopes, layout, num_threads, mask is not None, sinks))


_define("flash_attention", _cpu_fa, _fake_fa)
_define("flash_attention_out", _cpu_fa_out, _fake_fa_out)
_define("flash_attention_backward", _cpu_fa_bwd, _fake_fa_bwd)
torch.library.register_autograd("fa2cpu::flash_attention", _backward_through("flash_attention_backward", 12),
                                setup_context=_fa_setup_context, lib=_LIB)


# flash_attention_varlen -----------------------------------------------------------------------
def _cpu_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                window, softcap, alibi_slopes, num_threads, sinks=None):
    return _varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                        scale, tuple(window), softcap, alibi_slopes, num_threads, True, None, sinks)


def _fake_varlen(q, k, v, *rest):
    return (q.new_empty(q.shape[:-1] + v.shape[-1:]),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


def _cpu_varlen_out(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                    window, softcap, alibi_slopes, num_threads, return_lse, out, sinks=None):
    _, lse = _varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                          scale, tuple(window), softcap, alibi_slopes, num_threads, return_lse, out, sinks)
    return lse if return_lse else _no_lse(q)


def _fake_varlen_out(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                     window, softcap, alibi_slopes, num_threads, return_lse, out, sinks=None):
    return q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32) if return_lse else _no_lse(q)


def _cpu_varlen_bwd(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, causal, scale, window, softcap, alibi_slopes, num_threads, sinks=None):
    return _varlen_bwd_impl(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, causal, scale, tuple(window), softcap, alibi_slopes,
                            num_threads, sinks)


def _fake_varlen_bwd(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     causal, scale, window, softcap, alibi_slopes, num_threads, sinks=None):
    return _fake_gradients(q, k, v, sinks)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs   # cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, num_threads[, sinks]
    _save_for_backward(ctx, q, k, v, *output, rest + [None] * (11 - len(rest)))


_define("flash_attention_varlen", _cpu_varlen, _fake_varlen)
_define("flash_attention_varlen_out", _cpu_varlen_out, _fake_varlen_out)
_define("flash_attention_varlen_backward", _cpu_varlen_bwd, _fake_varlen_bwd)
torch.library.register_autograd("fa2cpu::flash_attention_varlen",
                                _backward_through("flash_attention_varlen_backward", 14),
                                setup_context=_varlen_setup_context, lib=_LIB)


# flash_attention_with_kvcache -----------------------------------------------------------------
def _cpu_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, block_table, causal,
                 scale, window, softcap, alibi_slopes, return_lse, num_splits, num_threads, out,
                 layout, sinks=None, k_scale=None, v_scale=None):
    seqlens = cache_seqlens if cache_seqlens is not None else cache_seqlens_int
    _, lse = _kvcache_impl(q, k_cache, v_cache, k, v, seqlens, block_table, causal, scale,
                           tuple(window), softcap, alibi_slopes, return_lse, num_splits,
                           num_threads, out, layout, sinks, k_scale, v_scale)
    return lse if return_lse else _no_lse(q)


def _fake_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, block_table, causal,
                  scale, window, softcap, alibi_slopes, return_lse, num_splits, num_threads, out,
                  layout, sinks=None, k_scale=None, v_scale=None):
    if not return_lse:
        return _no_lse(q)
    return q.new_empty(_lse_shape(q, "bshd" if layout == "bshd" else "bhsd"), dtype=torch.float32)


_define("flash_attention_with_kvcache", _cpu_kvcache, _fake_kvcache)
