"""fa2cpu on ``torch.Tensor``: the NumPy API's functions as PyTorch custom operators, and SDPA.

``import fa2cpu.torch`` imports torch (``import fa2cpu`` alone never does) and registers, in the
``torch.library`` namespace ``fa2cpu``:

====================================  ===========================================================
``fa2cpu::flash_attention``           functional forward -> (out, lse); autograd in q, k, v
``fa2cpu::flash_attention_out``       forward writing a caller's ``out`` (mutates it) -> lse
``fa2cpu::flash_attention_varlen``    functional packed forward -> (out, lse); autograd in q, k, v
``fa2cpu::flash_attention_varlen_out``  packed forward writing ``out`` -> lse
``fa2cpu::flash_attention_with_kvcache``  appends into k_cache/v_cache (and scales) and writes ``out`` -> lse
``fa2cpu::flash_attention_backward``  (dq, dk, dv) of ``flash_attention``
``fa2cpu::flash_attention_varlen_backward``  (dq, dk, dv) of ``flash_attention_varlen``
====================================  ===========================================================

each with a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` traces them without
graph breaks. The public functions below (same names, arguments and semantics as
``fa2cpu.flash_attention`` & co., see API.md) call these operators when torch needs to see them
(autograd, ``torch.compile``, fake/meta tensors, dispatch modes) and otherwise call the kernels
directly, which skips the dispatcher and torch.library's Python layers (10-40 us per call).

Zero copy both ways: a tensor's NumPy view shares its memory and strides (bfloat16 through an
``int16`` view re-typed as ``ml_dtypes.bfloat16``); results are torch tensors the kernels wrote
into. ``flash_attention_with_kvcache`` appends into the caller's cache tensors in place. (As
with any ``Tensor.numpy()``, a tensor viewed this way gets a non-resizable storage.)

:func:`scaled_dot_product_attention` is ``torch.nn.functional.scaled_dot_product_attention``
(same signature and semantics, torch's top-left causal alignment included) computed by fa2cpu,
falling back to torch's own implementation for what fa2cpu cannot compute; :func:`patch_sdpa`
installs it in ``torch.nn.functional``.

Code: this module holds the public functions and SDPA; fa2cpu/_torch_bridge.py the tensor <-> NumPy
views and the operator arguments' checks; fa2cpu/_torch_ops.py the operators (implementations,
fake implementations, autograd).
"""
import torch

# _np, _tensor, _CACHE_VIEWS and _use_torch_threads are used by tests and bench/ as fa2cpu.torch._<name>.
from ._torch_bridge import (_CACHE_VIEWS, _FLOATS, _check_tensors, _direct, _float_arg, _int_arg,  # noqa: F401
                            _no_grad_out, _np, _tensor, _use_torch_threads, _window_arg)
from ._torch_ops import _fa_impl, _kvcache_impl, _kvcache_step, _varlen_impl  # importing it defines torch.ops.fa2cpu
from ._checks import MAX_HEAD_DIM as _MAX_HEAD_DIM, _bool, _int, _Options, _threads
from ._torch_bridge import _CODES, _PLAIN
from . import _core

__all__ = ["flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache",
           "scaled_dot_product_attention", "patch_sdpa"]

# torch's own SDPA, taken from the C extension (not from torch.nn.functional, which patch_sdpa
# or someone else may have replaced before this module was imported).
_torch_sdpa = torch._C._nn.scaled_dot_product_attention


def _sinks_need_grad(sinks):
    """A sinks tensor that autograd must differentiate (the operator path records it)."""
    return sinks is not None and torch.is_grad_enabled() and getattr(sinks, "requires_grad", False)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------
def flash_attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=None,
                    alibi_slopes=None, mask=None, return_lse=False, layout="bhsd",
                    num_threads=None, out=None, sinks=None):
    """:func:`fa2cpu.flash_attention` on tensors: exact attention, results are tensors.

    Same arguments, shapes, layouts (``"bhsd"`` (B, H, N, D) with 3-D/2-D also accepted, or
    ``"bshd"``) and semantics as the NumPy function (bottom-right causal/window, GQA without
    repeating K/V, softcap, ALiBi, bool/float ``mask`` broadcast through strides); q, k, v are
    CPU tensors of one dtype (float32, float16 or bfloat16) with any strides, read in place.
    ``alibi_slopes`` (float32) and ``mask`` are tensors too. ``out`` (a tensor of the exact shape
    and dtype) is written in place and returned.

    ``sinks``: float32 tensor ``(Hq,)`` of attention sinks (see the NumPy function).
    Differentiable in q, k, v and sinks (``torch.ops.fa2cpu.flash_attention`` with
    ``torch.library.register_autograd``; the backward is ``fa2cpu.flash_attention_backward``,
    gradients in the input dtype, float32 accumulation; a gradient flowing into the returned lse
    is included). Not differentiable with ``mask=`` (the backward raises NotImplementedError) or
    with ``out=`` (RuntimeError, as torch's ``out=`` functions). Works under
    ``torch.compile(fullgraph=True)``.

    Returns ``out`` (q's shape with last dim Dv), or ``(out, lse)`` with lse float32 ``(B, Hq, Nq)``
    (``(Hq, Nq)`` / ``(Nq,)`` for 3-D / 2-D inputs).
    """
    return_lse = _bool("return_lse", return_lse)
    if alibi_slopes is None and mask is None and out is None and sinks is None and not return_lse:
        o = _lean_flash_attention(q, k, v, causal, scale, window, softcap, layout, num_threads)
        if o is not None:
            return o
    if _direct(q, k, v) and not _sinks_need_grad(sinks):
        o, lse = _fa_impl(q, k, v, causal, scale, window, softcap, alibi_slopes, mask, layout,
                          num_threads, return_lse, out, sinks)
        return (o, lse) if return_lse else o
    _check_tensors(q=q, k=k, v=v, alibi_slopes=alibi_slopes, mask=mask, out=out, sinks=sinks)
    args = (q, k, v, _bool("causal", causal), _float_arg("scale", scale), _window_arg(window),
            _float_arg("softcap", softcap), alibi_slopes, mask, layout,
            _int_arg("num_threads", num_threads, 1))
    if out is not None:
        _no_grad_out("flash_attention", q, k, v)
        lse = torch.ops.fa2cpu.flash_attention_out(*args, bool(return_lse), out, sinks)
        return (out, lse) if return_lse else out
    o, lse = torch.ops.fa2cpu.flash_attention(*args, sinks)
    return (o, lse) if return_lse else o


def _lean_flash_attention(q, k, v, causal, scale, window, softcap, layout, num_threads):
    """flash_attention's common case on plain tensors, straight into the kernels -> a new out
    tensor, or None (nothing done) for anything else, which the general path then handles and,
    if wrong, words the error. Covered: 4-D CPU tensors of one kernel dtype, any strides, element
    aligned, equal batch / kv shapes, no autograd to record, eager mode; options normalised by the
    same code as the NumPy API (_Options, _threads), so the kernels get the same call. Why: the
    general path's NumPy views and checks cost ~80 us of Python per call, several hundred when a
    model's weights have just streamed through the caches (bench/RESULTS.md, issue 9)."""
    if type(q) not in _PLAIN or type(k) not in _PLAIN or type(v) not in _PLAIN:
        return None
    dtype = q.dtype
    code = _CODES.get(dtype) if dtype in _FLOATS else None
    if code is None or k.dtype is not dtype or v.dtype is not dtype or not (q.is_cpu and k.is_cpu and v.is_cpu):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() \
            or torch._C._is_torch_function_mode_enabled():
        return None
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return None
    try:  # sparse / mkldnn tensors have no strides or data pointer: the general path words that
        qst, kst, vst = q.stride(), k.stride(), v.stride()
        qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    except RuntimeError:
        return None
    if layout == "bshd":
        B, Nq, Hq, D = qs
        _, Nk, Hk, _ = ks
        (qb, qn, qh, qd), (kb, kn, kh, kd), (vb, vn, vh, vd) = qst, kst, vst
        out_shape = (B, Nq, Hq, vs[3])
    elif layout == "bhsd":
        B, Hq, Nq, D = qs
        _, Hk, Nk, _ = ks
        (qb, qh, qn, qd), (kb, kh, kn, kd), (vb, vh, vn, vd) = qst, kst, vst
        out_shape = (B, Hq, Nq, vs[3])
    else:
        return None
    Dv = vs[3]
    if ks[0] != B or vs[0] != B or vs[1] != ks[1] or vs[2] != ks[2] or ks[3] != D or min(B, Hq, Hk, Nq, Nk) < 1 \
            or Hq % Hk or not (0 < D <= _MAX_HEAD_DIM and 0 < Dv <= _MAX_HEAD_DIM):
        return None
    size = q.element_size()
    if qp % size or kp % size or vp % size:
        return None
    if not ((scale is None or type(scale) is float) and (softcap is None or type(softcap) is float)):
        return None
    options = _Options(D, causal, scale, window, softcap, Nq, Nk)
    out = torch.empty(out_shape, dtype=dtype)
    if layout == "bshd":  # out (B, Nq, Hq, Dv), C-contiguous
        ob, on, oh = Nq * Hq * Dv, Hq * Dv, Dv
    else:                 # out (B, Hq, Nq, Dv)
        ob, oh, on = Hq * Nq * Dv, Nq * Dv, Dv
    _core.run_strided(qp, qb, qh, qn, qd, kp, kb, kh, kn, kd, vp, vb, vh, vn, vd, out.data_ptr(), ob, oh, on, 1,
                      dtype=code, batch=B, hq=Hq, hk=Hk, nq=Nq, nk=Nk, d=D, dv=Dv, scale=options.scale,
                      softcap=options.softcap, win_left=options.left, win_right=options.right,
                      num_threads=_threads(num_threads))
    return out


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                           max_seqlen_k=None, causal=False, scale=None, window=(-1, -1),
                           softcap=None, alibi_slopes=None, return_lse=False,
                           num_threads=None, out=None, sinks=None):
    """:func:`fa2cpu.flash_attention_varlen` on tensors: attention over packed ragged sequences.

    q ``(total_q, Hq, D)``, k ``(total_k, Hk, D)``, v ``(total_k, Hk, Dv)`` CPU tensors of one
    kernel dtype; ``cu_seqlens_q``/``cu_seqlens_k`` int32/int64 tensors ``(B+1,)`` (start 0,
    non-decreasing, last = total); masks aligned per sequence (bottom-right). Other arguments as
    in :func:`flash_attention` (``sinks`` included). Differentiable in q, k, v and sinks
    (per-sequence FlashAttention-2 backward). Returns ``out (total_q, Hq, Dv)`` or ``(out, lse)`` with lse float32
    ``(Hq, total_q)``.
    """
    return_lse = _bool("return_lse", return_lse)
    if _direct(q, k, v) and not _sinks_need_grad(sinks):
        o, lse = _varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal, scale, window, softcap, alibi_slopes, num_threads,
                              return_lse, out, sinks)
        return (o, lse) if return_lse else o
    _check_tensors(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   alibi_slopes=alibi_slopes, out=out, sinks=sinks)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, _int_arg("max_seqlen_q", max_seqlen_q, 0),
            _int_arg("max_seqlen_k", max_seqlen_k, 0), _bool("causal", causal),
            _float_arg("scale", scale), _window_arg(window), _float_arg("softcap", softcap),
            alibi_slopes, _int_arg("num_threads", num_threads, 1))
    if out is not None:
        _no_grad_out("flash_attention_varlen", q, k, v)
        lse = torch.ops.fa2cpu.flash_attention_varlen_out(*args, bool(return_lse), out, sinks)
        return (out, lse) if return_lse else out
    o, lse = torch.ops.fa2cpu.flash_attention_varlen(*args, sinks)
    return (o, lse) if return_lse else o


def flash_attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
                                 block_table=None, causal=False, scale=None, window=(-1, -1),
                                 softcap=None, alibi_slopes=None, return_lse=False,
                                 num_splits=0, num_threads=None, out=None, layout="bshd", sinks=None,
                                 k_scale=None, v_scale=None):
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

    **Quantized cache**: ``k_cache`` / ``v_cache`` may be ``torch.int8`` or
    ``torch.float8_e4m3fn`` tensors of codes (q, k, v stay float32/float16/bfloat16), with
    float32 ``k_scale`` / ``v_scale`` tensors of the cache's shape without the last axis (one
    scale per stored token and head; the cached value is ``code * scale``; int8 requires them,
    float8 accepts None = scale 1). Read in place, zero-copy (a float8 tensor through a uint8
    view re-typed as ``ml_dtypes.float8_e4m3fn``). Appended k/v are quantized into the cache
    tensors and their scales written into ``k_scale`` / ``v_scale``, in place, by the NumPy
    function's rule (``scale = max|x| / 127`` for int8, ``/ 448`` for float8, per token and head);
    the operator's schema declares the scales mutated, like the caches.

    In eager mode the call skips the dispatcher: NumPy views of the tensors (memoised for the
    caches) go through the NumPy API's checks, append and launch. Returns ``out`` or
    ``(out, lse)`` with lse float32 ``(B, Hq, Nq)``.
    """
    return_lse = _bool("return_lse", return_lse)
    if (k is not None and type(cache_seqlens) is int and type(causal) is bool and layout == "bshd"
            and block_table is None and out is None and not return_lse and alibi_slopes is None and sinks is None
            and k_scale is None and v_scale is None and type(num_splits) is int and num_splits == 0 and type(window) is tuple
            and window == (-1, -1) and _direct(q, k_cache, v_cache, differentiable=False)):
        o = _kvcache_step(q, k_cache, v_cache, k, v, cache_seqlens, causal, scale, softcap, num_threads)
        if o is not None:  # the decode step with an append, one prepared core call
            return o
    if _direct(q, k_cache, v_cache, differentiable=False):
        o, lse = _kvcache_impl(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window,
                               softcap, alibi_slopes, return_lse, num_splits, num_threads, out, layout, sinks,
                               k_scale, v_scale)
        return (o, lse) if return_lse else o
    if isinstance(cache_seqlens, torch.Tensor) or cache_seqlens is None:
        seqlens, seqlens_int = cache_seqlens, None
    else:
        seqlens, seqlens_int = None, _int("cache_seqlens", cache_seqlens)
    _check_tensors(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, block_table=block_table,
                   alibi_slopes=alibi_slopes, out=out, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                   cache_seqlens=seqlens)
    if out is None:
        out = q.new_empty(q.shape[:-1] + v_cache.shape[-1:])
    lse = torch.ops.fa2cpu.flash_attention_with_kvcache(
        q, k_cache, v_cache, k, v, seqlens, seqlens_int, block_table, _bool("causal", causal),
        _float_arg("scale", scale), _window_arg(window), _float_arg("softcap", softcap),
        alibi_slopes, bool(return_lse), _int("num_splits", num_splits, 0),
        _int_arg("num_threads", num_threads, 1), out, layout, sinks, k_scale, v_scale)
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
    dtype = query.dtype
    if dtype not in _FLOATS or key.dtype != dtype or value.dtype != dtype:
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
        if attn_mask.dtype != torch.bool and attn_mask.dtype != dtype:
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
