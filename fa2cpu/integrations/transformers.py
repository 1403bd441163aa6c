"""fa2cpu as a Hugging Face transformers attention backend, and a preallocated KV cache.

::

    import fa2cpu.integrations.transformers as fa2hf

    fa2hf.register()                      # once per process: attn_implementation="fa2cpu"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="fa2cpu")
    cache = fa2hf.KVCache(model.config, max_batch_size=4, max_cache_len=4096, dtype=model.dtype)
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)   # past_key_values= before 5.x
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
them in place and attends in one ``flash_attention_with_kvcache`` call, so ``generate`` never
concatenates K/V. Left padding (what ``generate`` uses for batches) is dropped when the prompt is
stored: each sequence keeps only its real tokens and its own length (``cache_seqlens``), which is
exact because pads sit before every real token (causal and sliding-window distances between real
tokens are unchanged). Any other padding pattern switches that layer's storage to transformers'
positions (pads kept, masked by the padding row), also exact.
"""

import numpy as np
import torch
from transformers import masking_utils as _mu
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

# The kernels as torch custom ops (autograd, torch.compile). Called as ``_ft.<name>`` at call time,
# so a spy on ``fa2cpu.torch.flash_attention`` (tests) sees every call.
from fa2cpu import torch as _ft
from fa2cpu._validate import MAX_HEAD_DIM

__all__ = ["register", "fa2cpu_attention_forward", "fa2cpu_mask", "KVCache", "MaskSpec"]

_SPEC_ATTR = "_fa2cpu_mask_spec"       # attribute of a mask descriptor tensor
_PENDING_ATTR = "_fa2cpu_kvcache_layer"  # attribute of the key tensor KVCache.update returns
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = MAX_HEAD_DIM  # the kernels' limit (fa2cpu/_validate.py)
_REGISTERED = set()


# ---------------------------------------------------------------------------------------------
# Mask descriptors
# ---------------------------------------------------------------------------------------------
class MaskSpec:
    """What a mask descriptor means, in transformers' positions.

    Query row ``i`` sits at key index ``i + delta`` (``delta = q_offset - kv_offset``) and may see
    key ``j`` iff ``i + delta - lo <= j <= i + delta + hi`` (``-1`` = unbounded) and the padding
    row allows ``j``. Causal: ``hi = 0``; sliding window ``W``: ``lo = W - 1``.
    ``has_padding``: some key that a query could see is padding (else the row is not passed on).
    """
    __slots__ = ("lo", "hi", "delta", "has_padding", "q_length", "kv_length", "memo")

    def __init__(self, lo, hi, delta, has_padding, q_length, kv_length):
        self.lo, self.hi, self.delta = lo, hi, delta
        self.has_padding, self.q_length, self.kv_length = has_padding, q_length, kv_length
        self.memo = {}  # KVCache padding analysis, shared by the layers that get this descriptor

    def __repr__(self):
        return (f"MaskSpec(lo={self.lo}, hi={self.hi}, delta={self.delta}, has_padding={self.has_padding}, "
                f"q_length={self.q_length}, kv_length={self.kv_length})")


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
        has_padding = False
    else:
        padding = padding[:, kv_offset:kv_offset + kv_length].to(device=device, dtype=torch.bool)
        if padding.shape[0] != batch_size:
            padding = padding.expand(batch_size, -1)
        first = 0 if lo < 0 else min(kv_length, max(0, delta - lo))
        last = kv_length if hi < 0 else min(kv_length, max(0, q_length + delta + hi))
        has_padding = first < last and not bool(padding[:, first:last].all())
        row = padding[:, None, None, :].contiguous()
    setattr(row, _SPEC_ATTR, MaskSpec(lo, hi, delta, has_padding, q_length, kv_length))
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


# ---------------------------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------------------------
def _reference_attention(query, key, value, mask, scaling, softcap, dropout=0.0, training=False):
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
    p = torch.softmax(s, dim=-1)
    if seen is not None:
        p = p * seen  # rows that see no key: 0, like the kernels (and finite gradients)
    if dropout and training:
        p = torch.nn.functional.dropout(p, p=dropout, training=True)
    return torch.matmul(p.to(value.dtype), value).transpose(1, 2).contiguous()


def _needs_fallback(query, key, value, dropout, training):
    if dropout and training:
        return True
    if query.dtype not in _DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return True
    if query.device.type != "cpu" or query.shape[-1] > _MAX_HEAD_DIM or value.shape[-1] > _MAX_HEAD_DIM:
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
    r = row[:, 0, 0, :]
    b = r.shape[0]
    count = r.sum(dim=1)
    first = torch.where(count > 0, r.int().argmax(dim=1), torch.full_like(count, n))
    last = first + count
    pos = torch.arange(n)[None, :]
    if not bool((r == ((pos >= first[:, None]) & (pos < last[:, None]))).all()):
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
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        row = attention_mask[:, -n:].to(torch.bool)[:, None, None, :]
        spec = MaskSpec(-1, 0 if causal else -1, n - m, not bool(row.all()), m, n)
        attention_mask = row
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
    """
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("fa2cpu: attention sinks (s_aux) are not supported through transformers yet")
    softcap = softcap if softcap else None
    layer = getattr(key, _PENDING_ATTR, None)
    if layer is not None and layer._pending is not None and layer._pending[0] is key:
        return layer._attend(module, query, attention_mask, scaling, softcap, is_causal), None

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
                                    dropout, training), None
    q, k, v = query.transpose(1, 2), key[:, :, :n_keys].transpose(1, 2), value[:, :, :n_keys].transpose(1, 2)
    if segments is not None:
        out = _ft.flash_attention_varlen(q.reshape(b * m, hq, q.shape[-1]), k.reshape(b * n, k.shape[2], k.shape[3]),
                                         v.reshape(b * n, v.shape[2], v.shape[3]), segments[0], segments[1],
                                         scale=scaling, window=window, softcap=softcap)
        return out.view(b, m, hq, out.shape[-1]), None
    out = _ft.flash_attention(q, k, v, scale=scaling, window=window, softcap=softcap, mask=kmask, layout="bshd")
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
# KVCache
# ---------------------------------------------------------------------------------------------
class _KVLayer(CacheLayerMixin):
    """One layer of :class:`KVCache`.

    State: ``length`` = positions seen so far (transformers' positions, pads included);
    ``offsets[b]`` = leading positions of sequence b not stored (dropped left padding), so
    position t of sequence b is stored at cache row ``t - offsets[b]`` and the sequence holds
    ``seqlens[b] = length - offsets[b]`` rows (int32, also the kernels' ``cache_seqlens``).
    """
    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, owner, k_cache, v_cache):
        super().__init__()
        self._owner = owner
        self.k_cache, self.v_cache = k_cache, v_cache
        self.keys, self.values = k_cache, v_cache  # (B, Ncap, Hk, D) / paged (blocks, block_size, Hk, D)
        self.is_initialized = True
        self.device = k_cache.device
        n = owner.max_batch_size
        self.offsets = np.zeros(n, np.int64)
        self._seqlens = np.zeros(n, np.int32)
        self._seqlens_t = torch.from_numpy(self._seqlens)  # shares memory with _seqlens
        self.reset()

    # --- bookkeeping -------------------------------------------------------------------------
    def reset(self):
        self.length = 0
        self._pending = None
        self._set_batch(0)

    def _set_batch(self, batch):
        """Per-batch views, made once (the decode path only reads them)."""
        if batch > self._owner.max_batch_size:
            raise ValueError(f"KVCache: batch size {batch} exceeds max_batch_size {self._owner.max_batch_size}")
        if batch != getattr(self, "batch", None) or self.length == 0:
            self.offsets[batch:] = 0
            self._seqlens[batch:] = 0
        self.batch = batch
        paged = self._owner.paged
        self._views = (self.k_cache if paged else self.k_cache[:batch],
                       self.v_cache if paged else self.v_cache[:batch],
                       self._owner.block_table[:batch] if paged else None,
                       self._seqlens_t[:batch], self._seqlens[:batch])
        self._uniform = not self.offsets[:batch].any()  # every sequence holds `length` rows

    @property
    def seqlens(self):
        return self._seqlens_t[:self.batch]

    def lazy_initialization(self, key_states, value_states):
        pass  # buffers are allocated up front

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0

    def get_seq_length(self):
        return self.length

    def get_max_length(self):
        return self._owner.max_cache_len

    def crop(self, tokens_to_remove):
        new_length = tokens_to_remove if tokens_to_remove >= 0 else max(0, self.length + tokens_to_remove)
        if new_length >= self.length:
            return
        b = self.batch
        self.offsets[:b] = np.minimum(self.offsets[:b], new_length)
        self._seqlens[:b] = new_length - self.offsets[:b]
        self.length = new_length
        self._set_batch(b)

    def reorder_cache(self, beam_idx):
        self._permute(beam_idx)

    def batch_select_indices(self, indices):
        self._permute(indices)

    def batch_repeat_interleave(self, repeats):
        self._permute(torch.arange(self.batch).repeat_interleave(repeats))

    def _permute(self, index):
        """New sequence i = old sequence index[i] (beam search, batch selection/expansion)."""
        index = torch.as_tensor(index).to("cpu", torch.int64)
        if self.length == 0:
            return
        if index.numel() > self._owner.max_batch_size:
            raise ValueError(f"KVCache: batch {index.numel()} exceeds max_batch_size {self._owner.max_batch_size}")
        idx = index.numpy()
        lens = self._seqlens[idx].copy()
        offsets = self.offsets[idx].copy()
        top = int(lens.max()) if lens.size else 0
        ks, vs = self._gather(index, top), self._gather(index, top, values=True)
        b = index.numel()
        self._owner._allocate(b, lens)
        self._scatter(ks, vs, 0, torch.arange(b))
        self.offsets[:b], self._seqlens[:b] = offsets, lens
        self._set_batch(b)

    # --- storage access (contiguous or paged) -------------------------------------------------
    def _slots(self, rows, start, stop):
        """Index into the buffers for positions [start, stop) of the given sequences: (B', n)."""
        pos = torch.arange(start, stop)
        if not self._owner.paged:
            return rows[:, None], pos[None, :]
        bs = self._owner.block_size
        return self._owner.block_table[rows[:, None], pos[None, :] // bs].long(), (pos % bs)[None, :]

    def _gather(self, rows, n, values=False):
        buf = self.v_cache if values else self.k_cache
        if not self._owner.paged:
            return buf[rows, :n]  # advanced indexing: a copy
        return buf[self._slots(rows, 0, n)]

    def _scatter(self, ks, vs, start, rows):
        n = ks.shape[1]
        if not self._owner.paged:
            self.k_cache[rows, start:start + n] = ks
            self.v_cache[rows, start:start + n] = vs
        else:
            idx = self._slots(rows, start, start + n)
            self.k_cache[idx] = ks
            self.v_cache[idx] = vs

    # --- transformers API ---------------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        """Hands the new keys/values (B, Hk, N, D) to the attention function, which appends them
        in place; nothing is copied here."""
        if self._pending is not None:
            self._pending = None
            raise RuntimeError(
                "KVCache: the keys/values of the previous forward were never stored. KVCache only works with an "
                "attention implementation registered by fa2cpu.integrations.transformers.register() "
                f"(registered: {sorted(_REGISTERED) or 'none'}).")
        kc = self.k_cache
        if key_states.dtype != kc.dtype:
            raise TypeError(f"KVCache: the model computes keys in {key_states.dtype} but the cache holds "
                            f"{kc.dtype}; create it with dtype={key_states.dtype}")
        if (key_states.shape[1] != kc.shape[2] or key_states.shape[3] != kc.shape[3]
                or value_states.shape[3] != self.v_cache.shape[3]):
            raise ValueError(f"KVCache: keys of shape {tuple(key_states.shape)} (B, Hk, N, D) do not fit the cache "
                             f"built for Hk={kc.shape[2]}, D={kc.shape[3]}")
        self._pending = (key_states, value_states)
        setattr(key_states, _PENDING_ATTR, self)
        return key_states, value_states

    # --- attention ----------------------------------------------------------------------------
    def _padding_plan(self, spec, row):
        """-> ("append", None) | ("compact", leading_pads) | ("general", None), from the whole
        padding row (not just the visible part: dropped pads must stay masked everywhere)."""
        if spec is None:  # no mask at all: every position is a real token
            return _APPEND if self._uniform else _GENERAL
        memo_key = (self.length, None if self._uniform else self.offsets[:self.batch].tobytes())
        plan = spec.memo.get(memo_key)
        if plan is not None:
            return plan
        B = self.batch
        r = row[:, 0, 0, :]
        pos = torch.arange(r.shape[1])[None, :]
        if self.length == 0:
            first = torch.where(r.any(dim=1), r.int().argmax(dim=1), torch.full((B,), r.shape[1], dtype=torch.long))
            if not bool(first.any()):
                plan = _APPEND if bool(r.all()) else _GENERAL
            elif bool((r == (pos >= first[:, None])).all()):
                plan = ("compact", first.numpy().astype(np.int64))
            else:
                plan = _GENERAL
        else:
            expect = pos >= torch.from_numpy(self.offsets[:B])[:, None]
            plan = _APPEND if bool((r == expect).all()) else _GENERAL
        spec.memo[memo_key] = plan
        return plan

    def _attend(self, module, query, attention_mask, scaling, softcap, is_causal):
        k_new, v_new = self._pending
        self._pending = None
        B = query.shape[0]
        n_new = k_new.shape[2]
        if self.length == 0:
            self.offsets[:] = 0
            self._seqlens[:] = 0
            self._set_batch(B)
        elif B != self.batch:
            raise ValueError(f"KVCache: batch size changed from {self.batch} to {B} without a reset()")
        total = self.length + n_new
        if total > self._owner.max_cache_len:
            raise ValueError(f"KVCache: {self.length} cached + {n_new} new tokens exceed max_cache_len "
                             f"{self._owner.max_cache_len}")
        spec = getattr(attention_mask, _SPEC_ATTR, None)
        dense = None
        if spec is not None:
            if spec.kv_length != total or spec.delta != self.length:
                raise RuntimeError(f"KVCache: the mask expects {spec.kv_length} keys at offset {spec.delta}, "
                                   f"the cache holds {self.length} + {n_new}")
            lo, hi = spec.lo, spec.hi
        elif attention_mask is None:
            causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
            lo, hi = -1, (0 if causal else -1)
        elif attention_mask.ndim == 2:  # a bare padding mask
            causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
            attention_mask = attention_mask[:, -total:].to(torch.bool)[:, None, None, :]
            spec = MaskSpec(-1, 0 if causal else -1, self.length, not bool(attention_mask.all()), query.shape[2], total)
            lo, hi = spec.lo, spec.hi
        else:
            dense, lo, hi = attention_mask[..., :total], -1, -1
        plan = _GENERAL if dense is not None else self._padding_plan(spec, attention_mask)
        q = query.transpose(1, 2)
        kn, vn = k_new.transpose(1, 2), v_new.transpose(1, 2)
        kc, vc, table, seqlens_t, seqlens = self._views
        paged = self._owner.paged
        if plan is _APPEND:  # the decode path: append in place and attend, one call
            if paged:
                self._owner._allocate(B, seqlens + n_new)
            out = _ft.flash_attention_with_kvcache(
                q, kc, vc, kn, vn, cache_seqlens=self.length if self._uniform else seqlens_t, block_table=table,
                scale=scaling, window=(lo, hi), softcap=softcap)
            seqlens += n_new
        elif plan[0] == "compact":  # left-padded prompt: store each sequence's real tokens only
            pads = plan[1]
            lens = n_new - pads
            self._owner._allocate(B, lens)
            for b in range(B):
                if lens[b]:
                    self._scatter(kn[b:b + 1, pads[b]:], vn[b:b + 1, pads[b]:], 0, torch.tensor([b]))
            self.offsets[:B], seqlens[:] = pads, lens
            self._set_batch(B)
            out = _ft.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens_t, block_table=table,
                                                   scale=scaling, window=(lo, hi), softcap=softcap)
        else:
            out = self._attend_general(q, kn, vn, attention_mask, spec, dense, lo, hi, scaling, softcap)
        self.length = total
        return out

    def _to_positions(self, row):
        """Store sequences at transformers' positions again (undo dropped left padding)."""
        B = self.batch
        if self._uniform:
            return
        if row is not None:
            r = row[:, 0, 0, :]
            for b in range(B):
                if self.offsets[b] and bool(r[b, :self.offsets[b]].any()):
                    raise RuntimeError("KVCache: the attention mask now lets queries see left-padding tokens that "
                                       "were dropped when the prompt was stored")
        rows = torch.arange(B)
        lens = self._seqlens[:B].copy()
        top = int(lens.max())
        ks, vs = self._gather(rows, top), self._gather(rows, top, values=True)
        self._owner._allocate(B, lens + self.offsets[:B])
        for b in range(B):
            off, n = int(self.offsets[b]), int(lens[b])
            if n:
                self._scatter(ks[b:b + 1, :n], vs[b:b + 1, :n], off, torch.tensor([b]))
            if off:
                self._scatter(torch.zeros((1, off) + ks.shape[2:], dtype=ks.dtype),
                              torch.zeros((1, off) + vs.shape[2:], dtype=vs.dtype), 0, torch.tensor([b]))
        self._seqlens[:B] = lens + self.offsets[:B]
        self.offsets[:B] = 0
        self._set_batch(B)

    def _attend_general(self, q, kn, vn, row, spec, dense, lo, hi, scaling, softcap):
        """Any padding pattern or a dense mask: sequences stored at transformers' positions, new
        tokens written in place, then attention over [0, length + N) with the padding row (or the
        dense mask)."""
        B, n_new = kn.shape[0], kn.shape[1]
        self._to_positions(row if spec is not None else None)
        total = self.length + n_new
        rows = torch.arange(B)
        self._owner._allocate(B, np.full(B, total))
        self._scatter(kn, vn, self.length, rows)
        if self._owner.paged:
            keys, values = self._gather(rows, total), self._gather(rows, total, values=True)
        else:
            keys, values = self.k_cache[:B, :total], self.v_cache[:B, :total]
        self._seqlens[:B] = total
        if dense is not None:
            mask, window = dense, (-1, -1)
        else:
            mask, window = (row if spec is not None and spec.has_padding else None), (lo, hi)
        return _ft.flash_attention(q, keys, values, scale=scaling, window=window, softcap=softcap,
                                   mask=mask, layout="bshd")


_APPEND, _GENERAL = ("append", None), ("general", None)


class KVCache(Cache):
    """A transformers ``Cache`` over preallocated buffers, filled in place by fa2cpu's kernels.

    Parameters
    ----------
    config : PreTrainedConfig
        The model's config (its text/decoder config is used): layers, KV heads, head dim.
    max_batch_size, max_cache_len : int
        Capacity: sequences and positions (prompt + generated tokens, pads included).
    dtype : torch.dtype, optional
        float32, float16 or bfloat16; default: the config's dtype, else float32. Must be the
        dtype the model computes keys in.
    paged : bool
        Store K/V in blocks of ``block_size`` positions handed out on demand from a shared pool
        (``num_blocks``, default: enough for every sequence at full length) through a block
        table, as in vLLM; else one ``(max_batch_size, max_cache_len, Hk, D)`` buffer per layer.

    Buffers never move: ``layers[i].k_cache`` / ``v_cache`` keep their storage across steps.
    Works only with ``attn_implementation`` set to a name registered by :func:`register`.
    """

    def __init__(self, config, max_batch_size, max_cache_len, dtype=None, *, paged=False, block_size=16,
                 num_blocks=None, device="cpu"):
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if dtype is None:
            dtype = getattr(cfg, "dtype", None) or torch.float32
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype)
        if dtype not in _DTYPES:
            raise TypeError(f"dtype: {dtype} is not supported; expected torch.float32, float16 or bfloat16")
        if int(max_batch_size) < 1 or int(max_cache_len) < 1:
            raise ValueError(f"max_batch_size and max_cache_len must be >= 1, got {max_batch_size}, {max_cache_len}")
        self.max_batch_size, self.max_cache_len = int(max_batch_size), int(max_cache_len)
        self.dtype, self.paged, self.block_size = dtype, bool(paged), int(block_size)
        n_layers = cfg.num_hidden_layers
        hq = cfg.num_attention_heads
        hk = getattr(cfg, "num_key_value_heads", None) or hq
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
        dv = getattr(cfg, "v_head_dim", None) or d
        if self.paged:
            if self.block_size < 1:
                raise ValueError(f"block_size must be >= 1, got {block_size}")
            per_seq = -(-self.max_cache_len // self.block_size)
            self.num_blocks = int(num_blocks) if num_blocks is not None else self.max_batch_size * per_seq
            shape_k = (self.num_blocks, self.block_size, hk, d)
            shape_v = (self.num_blocks, self.block_size, hk, dv)
            self.block_table = torch.zeros((self.max_batch_size, per_seq), dtype=torch.int32)
            self._nalloc = np.zeros(self.max_batch_size, np.int64)  # blocks owned per sequence
            self._free = list(range(self.num_blocks - 1, -1, -1))
        else:
            shape_k = (self.max_batch_size, self.max_cache_len, hk, d)
            shape_v = (self.max_batch_size, self.max_cache_len, hk, dv)
        layers = [_KVLayer(self, torch.zeros(shape_k, dtype=dtype, device=device),
                           torch.zeros(shape_v, dtype=dtype, device=device)) for _ in range(n_layers)]
        super().__init__(layers=layers)

    def _allocate(self, batch, lengths):
        """Paged: make sure sequence b owns blocks for lengths[b] positions (idempotent)."""
        if not self.paged:
            return
        need = -(-np.asarray(lengths, np.int64) // self.block_size)
        for b in range(batch):
            while self._nalloc[b] < need[b]:
                if not self._free:
                    raise RuntimeError(f"KVCache: out of blocks ({self.num_blocks} of {self.block_size} positions)")
                self.block_table[b, self._nalloc[b]] = self._free.pop()
                self._nalloc[b] += 1

    def reset(self):
        super().reset()
        if self.paged:
            self.block_table.zero_()
            self._nalloc[:] = 0
            self._free = list(range(self.num_blocks - 1, -1, -1))

    def seqlens(self, layer_idx=0):
        """Tokens stored per sequence (int32, left padding excluded)."""
        return self.layers[layer_idx].seqlens.clone()


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
