"""fa2cpu as a Hugging Face transformers attention backend, and a preallocated KV cache.

::

    import fa2cpu.integrations.transformers as fa2hf

    fa2hf.register()                      # once per process: attn_implementation="fa2cpu"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="fa2cpu")
    cache = fa2hf.KVCache(model.config, max_batch_size=4, max_cache_len=4096, dtype=model.dtype)
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)   # past_key_values= in 5.17 and older
    cache.reset()                         # the same buffers serve the next batch

Importing this module imports torch and transformers (``import fa2cpu`` never does).

How masks reach the kernels
---------------------------
transformers builds one mask per layer type (full, sliding, bidirectional) through the *mask
function* registered under the implementation's name, then hands each layer's mask to the
*attention function*. :func:`fa2cpu_mask` recognises the standard patterns exactly (by the identity
of transformers' own mask primitives, never by names): causal, sliding-window causal, bidirectional
and bidirectional sliding window, each with a 2-D padding mask. For these it returns a **mask
descriptor** instead of a dense ``(B, 1, Nq, Nk)`` mask: the per-sequence padding row as a bool
tensor of shape ``(B, 1, 1, Nk)`` (True = real token) carrying a :class:`MaskSpec` (the window
bounds and the query/key position offset). :func:`fa2cpu_attention_forward` turns the spec into the
kernels' ``window=(left, right)`` (bottom-right aligned, so transformers' sliding window ``W`` is
``(W - 1, 0)``) after trimming keys no query can see (static caches). Padding, when some visible
key is padding: a padded batch without cache offset (prefill, encoders) whose sequences are each
one block of real tokens (left and/or right padding) runs as packed sequences through
``flash_attention_varlen`` (cu_seqlens from the padding row; padded tiles are never computed,
outputs at padding positions are 0 as with transformers' flash_attention_2); otherwise (decode
against a padded cache, holes in the mask) the row goes to ``flash_attention`` as a broadcast
``mask`` (read through zero strides, never expanded). The descriptor is a 4-D tensor, so
transformers treats it as an already prepared mask wherever it passes it on (``generate`` with
static caches, models that build masks once).

Anything else (packed sequences detected from ``position_ids``, chunked attention, custom
``or_mask_function``/``and_mask_function`` overlays, user-supplied 4-D masks) gets the dense bool
mask of transformers' ``sdpa_mask``: still exact, just without tile skipping.

The KV cache
------------
:class:`KVCache` preallocates every layer's keys and values in flash-attn layout
``(B, Ncap, Hk, D)`` (or paged blocks ``(num_blocks, block_size, Hk, D)`` with a block table).
Its ``update`` does not copy: it hands the new keys/values to the attention function, which appends
them in place and attends in one core call (``flash_attention_with_kvcache``'s, prepared once per
layer), so ``generate`` never concatenates K/V. Left padding (what ``generate`` uses for batches) is dropped when the prompt is
stored: each sequence keeps only its real tokens and its own length (``cache_seqlens``), which is
exact because pads sit before every real token (causal and sliding-window distances between real
tokens are unchanged). Any other padding pattern switches that layer's storage to transformers'
positions (pads kept, masked by the padding row), also exact. ``kv_dtype=torch.int8`` (or
``torch.float8_e4m3fn``) stores codes plus float32 per-token, per-head scales, quantized by the
kernels' append and dequantized in registers (only the general path, which needs a mask, hands
``flash_attention`` a dequantized copy).

Code: this module holds the attention function and register(); _hf_masks.py the mask function and
descriptors; _hf_cache.py the KV cache.
"""

import torch
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

# The kernels as torch custom ops (autograd, torch.compile). Called as ``_ft.<name>`` at call time,
# so a spy on ``fa2cpu.torch.flash_attention`` (tests) sees every call.
from fa2cpu import torch as _ft
from fa2cpu._torch_bridge import _FLOATS
from fa2cpu._checks import MAX_HEAD_DIM

# _KVLayer and _recognise are also reached from here by tests and bench/hf_attention.py.
from ._hf_cache import _PENDING_ATTR, _REGISTERED, KVCache, _KVLayer  # noqa: F401
from ._hf_masks import (MaskSpec, _dense_from_spec, _kernel_window, _recognise, fa2cpu_mask, mask_spec,  # noqa: F401
                        padding_row_spec)

__all__ = ["register", "fa2cpu_attention_forward", "fa2cpu_mask", "KVCache", "MaskSpec"]


# ---------------------------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------------------------
def _reference_attention(query, key, value, mask, scaling, softcap, dropout=0.0, training=False, sinks=None):
    """Plain torch attention (dense scores) for what the kernels do not cover: dropout in
    training, float64, head dims > 256, gradients through a padding mask without a kernel backward.
    mask: None, bool (True = attend) or float (added), broadcastable to (B, Hq, m, n)."""
    hq, hk = query.shape[1], key.shape[1]
    if hq != hk:
        key = key.repeat_interleave(hq // hk, dim=1)
        value = value.repeat_interleave(hq // hk, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    s = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    seen = None
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
            seen = mask.any(dim=-1, keepdim=True)
        else:
            s = s + mask.float()
    if sinks is not None:  # one more logit per head with no value (gpt-oss)
        column = sinks.float().reshape(1, -1, 1, 1).expand(s.shape[0], s.shape[1], s.shape[2], 1)
        p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    if seen is not None:
        p = p * seen  # rows that see no key: 0, like the kernels (and finite gradients)
    if dropout and training:
        p = torch.nn.functional.dropout(p, p=dropout, training=True)
    return torch.matmul(p.to(value.dtype), value).transpose(1, 2).contiguous()


def _needs_fallback(query, key, value, dropout, training):
    if dropout and training:
        return True
    if query.dtype not in _FLOATS or key.dtype != query.dtype or value.dtype != query.dtype:
        return True
    if query.device.type != "cpu" or query.shape[-1] > MAX_HEAD_DIM or value.shape[-1] > MAX_HEAD_DIM:
        return True
    return False


def _wants_grad(*tensors):
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _segments(spec, row, n):
    """Packed-sequence boundaries for a padded batch without cache offset (Nq = Nk, delta 0):
    -> (cu_seqlens_q, cu_seqlens_k) int32 over the (B * n) rows, or None when some sequence's
    real tokens are not one contiguous block. Five segments per sequence, in row order: leading
    pad queries (no keys: output 0), leading pad keys (no queries), the real tokens (queries and
    keys, masks aligned within them), trailing pad queries (no keys), trailing pad keys.
    Memoised on the spec: every layer of the forward shares it."""
    hit = spec.memo.get("segments")
    if hit is not None:
        return hit or None
    real = row[:, 0, 0, :]
    b = real.shape[0]
    count = real.sum(dim=1)
    first = torch.where(count > 0, real.int().argmax(dim=1), torch.full_like(count, n))
    last = first + count
    pos = torch.arange(n)[None, :]
    if not bool((real == ((pos >= first[:, None]) & (pos < last[:, None]))).all()):
        spec.memo["segments"] = False
        return None
    base = torch.arange(b)[:, None] * n
    ends_q = base + torch.stack([first, first, last, torch.full_like(first, n), torch.full_like(first, n)], 1)
    ends_k = base + torch.stack([torch.zeros_like(first), first, last, last, torch.full_like(first, n)], 1)
    zero = torch.zeros(1, dtype=torch.int32)
    cu = (torch.cat([zero, ends_q.flatten().to(torch.int32)]), torch.cat([zero, ends_k.flatten().to(torch.int32)]))
    spec.memo["segments"] = cu
    return cu


def _plan(module, attention_mask, is_causal, m, n):
    """-> (n_keys, window, kernel_mask, dense, segments) for m query rows and n keys: the
    kernels' arguments (segments: varlen boundaries replacing the padding row), plus the dense
    equivalent mask (or None) for fallbacks."""
    spec = mask_spec(attention_mask)
    if spec is None and attention_mask is not None and attention_mask.ndim == 2:
        # A bare 2-D padding mask (FA2 style): causal per the module, bottom-right aligned.
        attention_mask, spec = padding_row_spec(module, attention_mask, is_causal, m, n, n - m)
    if spec is not None:
        if spec.kv_length != n or spec.q_length != m:
            raise RuntimeError(f"fa2cpu: the mask was built for {spec.q_length} queries x {spec.kv_length} keys, "
                               f"the layer has {m} x {n}")
        geometry = _kernel_window(spec, m, n)
        if geometry is None:
            dense = _dense_from_spec(spec, attention_mask, m, n)
            return n, (-1, -1), dense, dense, None
        n_keys, window = geometry
        if not spec.has_padding:
            return n_keys, window, None, None, None
        if spec.delta == 0 and m == n == n_keys:  # prefill / encoder: padding as packed sequences
            segments = _segments(spec, attention_mask, n)
            if segments is not None:
                return n_keys, window, None, None, segments
        return n_keys, window, attention_mask[..., :n_keys], None, None
    if attention_mask is None:
        # What transformers' sdpa integration does without a mask: torch's top-left causal for
        # m > 1 (the keys past the m-th are invisible), full attention for a single query.
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if causal and m > 1:
            if n >= m:
                return m, (-1, 0), None, None, None
            return n, (-1, m - n), None, None, None
        return n, (-1, -1), None, None, None
    # A dense mask (custom patterns, user 4-D masks): everything is in it.
    dense = attention_mask[..., :n] if attention_mask.shape[-1] > n else attention_mask
    return n, (-1, -1), dense, dense, None


def fa2cpu_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """Attention function registered with ``AttentionInterface``.

    query ``(B, Hq, Nq, D)``, key/value ``(B, Hk, Nk, D|Dv)`` (GQA: never repeated);
    ``attention_mask``: a descriptor from :func:`fa2cpu_mask`, a dense 4-D mask, a 2-D padding
    mask or None. Returns ``(out (B, Nq, Hq, Dv), None)`` (no attention weights). A padded batch
    without cache offset (prefill, encoders) runs as packed sequences (``flash_attention_varlen``:
    padded tiles are never computed; outputs at padding positions are 0, as with transformers'
    flash_attention_2); otherwise padding reaches the kernels as a broadcast row.
    ``sliding_window`` is not read: the mask of the layer's type carries the window.
    ``s_aux`` (gpt-oss's attention sinks, one logit per query head) reaches the kernels as
    ``sinks`` (float32; differentiable).
    """
    sinks = kwargs.get("s_aux")  # gpt-oss: the attention module's sinks, one logit per query head
    if sinks is not None and sinks.dtype != torch.float32:
        sinks = sinks.float()
    softcap = softcap if softcap else None
    layer = getattr(key, _PENDING_ATTR, None)
    if layer is not None and layer._pending is not None and layer._pending[0] is key:
        return layer._attend(module, query, attention_mask, scaling, softcap, is_causal, sinks), None

    b, hq, m, _ = query.shape
    n = key.shape[2]
    n_keys, window, kmask, dense, segments = _plan(module, attention_mask, is_causal, m, n)
    training = getattr(module, "training", False)
    if _needs_fallback(query, key, value, dropout, training) or (kmask is not None
                                                                and _wants_grad(query, key, value)):
        if dense is None:
            dense = _window_mask(window, m, n_keys, query.device)
            if kmask is not None:
                dense = dense & kmask
            elif segments is not None:
                dense = dense & attention_mask[..., :n_keys]
        return _reference_attention(query, key[:, :, :n_keys], value[:, :, :n_keys], dense, scaling, softcap,
                                    dropout, training, sinks), None
    q, k, v = query.transpose(1, 2), key[:, :, :n_keys].transpose(1, 2), value[:, :, :n_keys].transpose(1, 2)
    if segments is not None:
        out = _ft.flash_attention_varlen(q.reshape(b * m, hq, q.shape[-1]), k.reshape(b * n, k.shape[2], k.shape[3]),
                                         v.reshape(b * n, v.shape[2], v.shape[3]), segments[0], segments[1],
                                         scale=scaling, window=window, softcap=softcap, sinks=sinks)
        return out.view(b, m, hq, out.shape[-1]), None
    out = _ft.flash_attention(q, k, v, scale=scaling, window=window, softcap=softcap, mask=kmask, layout="bshd",
                              sinks=sinks)
    return out, None


def _window_mask(window, m, n, device):
    left, right = window
    i = torch.arange(m, device=device)[:, None] + (n - m)
    j = torch.arange(n, device=device)[None, :]
    ok = torch.ones((m, n), dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    return ok[None, None]


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------
def register(name="fa2cpu"):
    """Register the attention function and its mask function under ``name`` (process-wide), so
    ``attn_implementation=name`` works in ``from_pretrained`` / ``from_config`` /
    ``set_attn_implementation``. Returns ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty str, got {name!r}")
    AttentionInterface.register(name, fa2cpu_attention_forward)
    AttentionMaskInterface.register(name, fa2cpu_mask)
    _REGISTERED.add(name)
    return name
