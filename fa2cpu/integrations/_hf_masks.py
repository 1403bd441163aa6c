"""Mask descriptors for fa2cpu's transformers integration: the mask function registered with
``AttentionMaskInterface`` (:func:`fa2cpu_mask`) and what the attention function and the KV cache
read back from it (:class:`MaskSpec`). How masks reach the kernels: fa2cpu/integrations/transformers.py.
"""
import torch
from transformers import masking_utils as _mu

_SPEC_ATTR = "_fa2cpu_mask_spec"       # attribute of a mask descriptor tensor


# ---------------------------------------------------------------------------------------------
# Mask descriptors
# ---------------------------------------------------------------------------------------------
class MaskSpec:
    """What a mask descriptor means, in transformers' positions.

    Query row ``i`` sits at key index ``i + delta`` (``delta = q_offset - kv_offset``) and may see
    key ``j`` iff ``i + delta - lo <= j <= i + delta + hi`` (``-1`` = unbounded) and the padding
    row allows ``j``. Causal: ``hi = 0``; sliding window ``W``: ``lo = W - 1``.
    ``has_padding``: some key that a query could see is padding (else the row is not passed on).
    ``all_real``: no key of the whole row is padding (False where that was not established), so
    the KV cache needs no padding analysis (a decode step without padding costs no tensor op).
    """
    __slots__ = ("lo", "hi", "delta", "has_padding", "q_length", "kv_length", "all_real", "memo")

    def __init__(self, lo, hi, delta, has_padding, q_length, kv_length, all_real=False):
        self.lo, self.hi, self.delta = lo, hi, delta
        self.has_padding, self.q_length, self.kv_length = has_padding, q_length, kv_length
        self.all_real = all_real
        self.memo = {}  # KVCache padding analysis, shared by the layers that get this descriptor

    def __repr__(self):
        return (f"MaskSpec(lo={self.lo}, hi={self.hi}, delta={self.delta}, has_padding={self.has_padding}, "
                f"q_length={self.q_length}, kv_length={self.kv_length})")


def padding_row_spec(module, attention_mask, is_causal, q_length, kv_length, delta):
    """A bare 2-D padding mask (FA2 style, ``(B, >= kv_length)``, its last ``kv_length`` keys) ->
    ``(row, spec)``: the bool row ``(B, 1, 1, kv_length)`` and its :class:`MaskSpec`, causal per
    ``is_causal`` or else the module (bottom-right aligned: query 0 at key ``delta``)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    row = attention_mask[:, -kv_length:].to(torch.bool)[:, None, None, :]
    all_real = bool(row.all())
    return row, MaskSpec(-1, 0 if causal else -1, delta, not all_real, q_length, kv_length, all_real)


def mask_spec(mask):
    """The :class:`MaskSpec` of a mask descriptor, or None for any other mask."""
    return getattr(mask, _SPEC_ATTR, None)


def _closure(fn):
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


# Code objects of transformers' mask primitives: a closure is recognised by its code object (exact),
# and its parameters are read from its cells. Anything unrecognised gets the dense mask.
_AND_CODE = _mu.and_masks(_mu.causal_mask_function).__code__
_SLIDING_CODE = _mu.sliding_window_overlay(1).__code__
_SLIDING_BI_CODE = _mu.sliding_window_bidirectional_overlay(1).__code__


def _tighter(bound, value):
    return value if bound < 0 else min(bound, value)


def _recognise(fn, depth=0):
    """``(lo, hi)`` window bounds of an index-only transformers mask function, or None."""
    if fn is _mu.causal_mask_function:
        return -1, 0
    if fn is _mu.bidirectional_mask_function:
        return -1, -1
    code = getattr(fn, "__code__", None)
    if code is None or depth > 8:
        return None
    try:
        cells = _closure(fn)
    except (ValueError, AttributeError):  # an empty cell
        return None
    if code is _SLIDING_CODE or code is _SLIDING_BI_CODE:
        w = cells.get("sliding_window")
        if isinstance(w, torch.Tensor) and w.numel() == 1:
            w = int(w)
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            return None
        return (w - 1, -1) if code is _SLIDING_CODE else (w, w)  # kv > q - W  |  |q - kv| <= W
    if code is _AND_CODE:
        lo = hi = -1
        for part in cells.get("mask_functions", ()):
            sub = _recognise(part, depth + 1)
            if sub is None:
                return None
            if sub[0] >= 0:
                lo = _tighter(lo, sub[0])
            if sub[1] >= 0:
                hi = _tighter(hi, sub[1])
        return lo, hi
    return None


def fa2cpu_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                attention_mask=None, use_vmap=False, device="cpu", **kwargs):
    """Mask function registered with ``AttentionMaskInterface`` (same arguments as transformers'
    ``sdpa_mask``). Returns a mask descriptor (see the module docstring) for causal, sliding,
    bidirectional and bidirectional-sliding patterns with 2-D padding, else transformers' dense
    bool mask ``(B, 1, q_length, kv_length)``."""
    if mask_function is None:
        mask_function = _mu.causal_mask_function
    bounds = None if use_vmap else _recognise(mask_function)
    if bounds is None:
        return _mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                             kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                             allow_is_causal_skip=False, allow_is_bidirectional_skip=False, use_vmap=use_vmap,
                             device=device)
    lo, hi = bounds
    delta = int(q_offset) - int(kv_offset)
    padding = _mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is None:
        row = torch.ones((batch_size, 1, 1, kv_length), dtype=torch.bool, device=device)
        has_padding, all_real = False, True
    else:
        padding = padding[:, kv_offset:kv_offset + kv_length].to(device=device, dtype=torch.bool)
        if padding.shape[0] != batch_size:
            padding = padding.expand(batch_size, -1)
        first = 0 if lo < 0 else min(kv_length, max(0, delta - lo))
        last = kv_length if hi < 0 else min(kv_length, max(0, q_length + delta + hi))
        has_padding = first < last and not bool(padding[:, first:last].all())
        all_real = first == 0 and last == kv_length and not has_padding  # the checked range is the row
        row = padding[:, None, None, :].contiguous()
    setattr(row, _SPEC_ATTR, MaskSpec(lo, hi, delta, has_padding, q_length, kv_length, all_real))
    return row


def _dense_from_spec(spec, row, m, n):
    """The bool (B, 1, m, n) mask a descriptor stands for (fallback paths only)."""
    i = torch.arange(m, device=row.device)[:, None] + spec.delta
    j = torch.arange(n, device=row.device)[None, :]
    ok = torch.ones((m, n), dtype=torch.bool, device=row.device)
    if spec.hi >= 0:
        ok &= j <= i + spec.hi
    if spec.lo >= 0:
        ok &= j >= i - spec.lo
    return ok[None, None] & row[..., :n]


def _kernel_window(spec, m, n):
    """-> (n_keys, (left, right)) for the kernels' bottom-right convention, or None when the
    geometry has no such form (then the dense mask is used)."""
    lo, hi, delta = spec.lo, spec.hi, spec.delta
    if hi >= 0:
        n = min(n, m + delta + hi)  # keys past this are invisible to every query (static caches)
        if n < 1:
            return None
    o = n - m
    right = -1 if hi < 0 else hi + delta - o
    left = -1 if lo < 0 else lo + o - delta
    if (lo >= 0 and left < 0) or (hi >= 0 and right < 0):
        return None
    return n, (left, right)

