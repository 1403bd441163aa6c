"""The preallocated KV cache of fa2cpu's transformers integration (:class:`KVCache`): each layer's
``update`` hands the new keys/values to the attention function, which appends them in place and
attends in one core call (``flash_attention_with_kvcache``'s, prepared once per layer: _step_attend).
Design notes: fa2cpu/integrations/transformers.py.
"""
import math

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

# The kernels as torch custom ops. Called as ``_ft.<name>`` at call time, so a spy on
# ``fa2cpu.torch.flash_attention`` (tests) sees every call.
from fa2cpu import torch as _ft
from fa2cpu._torch_bridge import _CODES, _FLOATS, _np, _tensor
from fa2cpu.attention import _quantize

from ._hf_masks import _SPEC_ATTR, padding_row_spec

_CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)  # kv_dtype of a quantized cache

_PENDING_ATTR = "_fa2cpu_kvcache_layer"  # attribute of the key tensor KVCache.update returns
_REGISTERED = set()                      # names given to register() (for KVCache's error message)


class _KVLayer(CacheLayerMixin):
    """One layer of :class:`KVCache`.

    State: ``length`` = positions seen so far (transformers' positions, pads included);
    ``offsets[b]`` = leading positions of sequence b not stored (dropped left padding), so
    position t of sequence b is stored at cache row ``t - offsets[b]`` and the sequence holds
    ``seqlens[b] = length - offsets[b]`` rows (int32, also the kernels' ``cache_seqlens``).

    A quantized layer (``k_scale`` not None) stores codes in ``k_cache``/``v_cache`` and one float32
    scale per stored token and head in ``k_scale``/``v_scale`` (the buffers' shape without the
    last axis). Storage moves (:meth:`_gather`/:meth:`_scatter`) carry codes and scales together,
    unchanged; new keys/values are quantized once, by the kernels' append rule (:meth:`_encode`).
    """
    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, owner, k_cache, v_cache, k_scale=None, v_scale=None):
        super().__init__()
        self._owner = owner
        self.k_cache, self.v_cache = k_cache, v_cache
        self.k_scale, self.v_scale = k_scale, v_scale  # quantized: float32 (B, Ncap, Hk) / (blocks, block_size, Hk)
        self.keys, self.values = k_cache, v_cache  # (B, Ncap, Hk, D) / paged (blocks, block_size, Hk, D)
        self.is_initialized = True
        self.device = k_cache.device
        n = owner.max_batch_size
        self.offsets = np.zeros(n, np.int64)
        self._seqlens = np.zeros(n, np.int32)
        self._seqlens_t = torch.from_numpy(self._seqlens)  # shares memory with _seqlens
        self._step = None  # the decode route's prepared call (_step_attend), made at first use
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
                       self._seqlens_t[:batch], self._seqlens[:batch],
                       # the scales, sliced like the caches (None for a float cache)
                       *(s if s is None or paged else s[:batch] for s in (self.k_scale, self.v_scale)))
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
        stored = self._gather(index, top)
        b = index.numel()
        self._owner._allocate(b, lens)
        self._scatter(stored, 0, torch.arange(b))
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

    def _buffers(self):
        """The layer's storage: (k_cache, v_cache), plus (k_scale, v_scale) when quantized."""
        if self.k_scale is None:
            return self.k_cache, self.v_cache
        return self.k_cache, self.v_cache, self.k_scale, self.v_scale

    def _gather(self, rows, n):
        """Copies of positions [0, n) of the given sequences, one (B', n, ...) tensor per buffer
        (see _buffers): codes and scales as stored, nothing re-quantized."""
        if not self._owner.paged:
            return tuple(buf[rows, :n] for buf in self._buffers())  # advanced indexing: copies
        idx = self._slots(rows, 0, n)
        return tuple(buf[idx] for buf in self._buffers())

    def _scatter(self, stored, start, rows):
        """Writes ``stored`` (one tensor per buffer, as _gather / _encode return) at positions
        [start, start + n) of the given sequences."""
        n = stored[0].shape[1]
        idx = (rows, slice(start, start + n)) if not self._owner.paged else self._slots(rows, start, start + n)
        for buf, x in zip(self._buffers(), stored):
            buf[idx] = x

    def _encode(self, k, v):
        """New keys/values (B', n, Hk, D) in the layout of the storage: (k, v) for a float cache;
        for a quantized one (codes_k, codes_v, scale_k, scale_v), quantized by the rule of
        ``flash_attention_with_kvcache``'s append (the same NumPy code: max|x| / 127 or / 448 per
        token and head, in float32), refusing inf/NaN as it does."""
        if self.k_scale is None:
            return k, v
        encoded = []
        for name, x, cache in (("k", k, self.k_cache), ("v", v, self.v_cache)):
            x_np = _np(name, x)
            if not np.isfinite(np.asarray(x_np, np.float32)).all():
                raise ValueError(f"KVCache: the new {'keys' if name == 'k' else 'values'} hold inf or NaN, which "
                                 f"cannot be quantized into the {cache.dtype} cache (per-token scale max|x| / "
                                 f"{127 if cache.dtype is torch.int8 else 448})")
            codes, scales = _quantize(x_np, _np(name + "_cache", cache[:0]), True)
            encoded.append((_tensor(codes), torch.from_numpy(scales)))
        (k_codes, k_scales), (v_codes, v_scales) = encoded
        return k_codes, v_codes, k_scales, v_scales

    def _decoded(self, stored):
        """Keys and values (B', n, Hk, D) in the model's dtype from ``stored`` (see _gather):
        code * scale in float32, rounded once to the dtype, for a quantized cache (a temporary
        copy: only the general path, which needs a mask, hands K/V to flash_attention this way)."""
        if self.k_scale is None:
            return stored
        k, v, ks, vs = stored
        dtype = self._owner.dtype
        return ((k.to(torch.float32) * ks[..., None]).to(dtype), (v.to(torch.float32) * vs[..., None]).to(dtype))

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
        k_cache = self.k_cache
        if key_states.dtype != self._owner.dtype:
            raise TypeError(f"KVCache: the model computes keys in {key_states.dtype} but the cache was made for "
                            f"{self._owner.dtype}; create it with dtype={key_states.dtype}")
        if (key_states.shape[1] != k_cache.shape[2] or key_states.shape[3] != k_cache.shape[3]
                or value_states.shape[3] != self.v_cache.shape[3]):
            raise ValueError(f"KVCache: keys of shape {tuple(key_states.shape)} (B, Hk, N, D) do not fit the cache "
                             f"built for Hk={k_cache.shape[2]}, D={k_cache.shape[3]}")
        self._pending = (key_states, value_states)
        setattr(key_states, _PENDING_ATTR, self)
        return key_states, value_states

    # --- attention ----------------------------------------------------------------------------
    def _padding_plan(self, spec, row):
        """-> ("append", None) | ("compact", leading_pads) | ("general", None), from the whole
        padding row (not just the visible part: dropped pads must stay masked everywhere)."""
        if spec is None:  # no mask at all: every position is a real token
            return _APPEND if self._uniform else _GENERAL
        if spec.all_real and self._uniform:  # the analysis below would find the same
            return _APPEND
        memo_key = (self.length, None if self._uniform else self.offsets[:self.batch].tobytes())
        plan = spec.memo.get(memo_key)
        if plan is not None:
            return plan
        B = self.batch
        real = row[:, 0, 0, :]
        pos = torch.arange(real.shape[1])[None, :]
        if self.length == 0:
            first = torch.where(real.any(dim=1), real.int().argmax(dim=1),
                                torch.full((B,), real.shape[1], dtype=torch.long))
            if not bool(first.any()):
                plan = _APPEND if bool(real.all()) else _GENERAL
            elif bool((real == (pos >= first[:, None])).all()):
                plan = ("compact", first.numpy().astype(np.int64))
            else:
                plan = _GENERAL
        else:
            expect = pos >= torch.from_numpy(self.offsets[:B])[:, None]
            plan = _APPEND if bool((real == expect).all()) else _GENERAL
        spec.memo[memo_key] = plan
        return plan

    def _attend(self, module, query, attention_mask, scaling, softcap, is_causal, sinks=None):
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
            attention_mask, spec = padding_row_spec(module, attention_mask, is_causal, query.shape[2], total,
                                                    self.length)
            lo, hi = spec.lo, spec.hi
        else:
            dense, lo, hi = attention_mask[..., :total], -1, -1
        plan = _GENERAL if dense is not None else self._padding_plan(spec, attention_mask)
        if plan is _APPEND and sinks is None and self._step is not False:
            out = self._step_attend(query, k_new, v_new, B, n_new, scaling, softcap, lo, hi)
            if out is not None:
                self.length = total
                return out
        q = query.transpose(1, 2)
        k_new_bshd, v_new_bshd = k_new.transpose(1, 2), v_new.transpose(1, 2)
        k_cache, v_cache, table, seqlens_t, seqlens, k_scale, v_scale = self._views
        paged = self._owner.paged
        if plan is _APPEND:  # the decode path: append in place (quantizing) and attend, one call
            if paged:
                self._owner._allocate(B, seqlens + n_new)
            out = _ft.flash_attention_with_kvcache(
                q, k_cache, v_cache, k_new_bshd, v_new_bshd,
                cache_seqlens=self.length if self._uniform else seqlens_t, block_table=table,
                scale=scaling, window=(lo, hi), softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
            seqlens += n_new
        elif plan[0] == "compact":  # left-padded prompt: store each sequence's real tokens only
            pads = plan[1]
            lens = n_new - pads
            encoded = self._encode(k_new_bshd, v_new_bshd)  # (checks first: nothing stored on error)
            self._owner._allocate(B, lens)
            for b in range(B):
                if lens[b]:
                    self._scatter([x[b:b + 1, pads[b]:] for x in encoded], 0, torch.tensor([b]))
            self.offsets[:B], seqlens[:] = pads, lens
            self._set_batch(B)
            out = _ft.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens_t, block_table=table,
                                                   scale=scaling, window=(lo, hi), softcap=softcap, sinks=sinks,
                                                   k_scale=k_scale, v_scale=v_scale)
        else:
            out = self._attend_general(q, k_new_bshd, v_new_bshd, attention_mask, spec, dense, lo, hi, scaling, softcap,
                                       sinks)
        self.length = total
        return out

    def _step_attend(self, query, k_new, v_new, B, n_new, scaling, softcap, lo, hi):
        """The decode route: one prepared core call (:class:`fa2cpu._core.DecodeStep`)
        appends and attends, so a step runs a few lines of Python instead of the NumPy API's checks
        and views. Why it matters: between two attention calls the model streams its weights
        through the caches, and cold Python costs ~10 us per call level (measured: the same
        decode spent ~450 us per layer outside the kernels on the 2-core VM; bench/RESULTS.md).
        -> out ``(B, Nq, Hq, Dv)``, or None when this call is outside the route (the general
        path then handles it)."""
        step = self._step
        if step is None:  # first decode: build it (or mark the layer as outside the route)
            step = self._step = self._make_step()
            if step is False:
                return None
        dtype = self._owner.dtype
        if query.dtype is not dtype or v_new.dtype is not dtype or not query.is_cpu:
            return None
        b, hq, m, d = query.shape
        if self._owner.paged:
            self._owner._allocate(B, self._seqlens[:B] + n_new)
        out = torch.empty((b, m, hq, self._dv), dtype=dtype)
        if not step(query.data_ptr(), *query.stride(), k_new.data_ptr(), *k_new.stride(), v_new.data_ptr(),
                    *v_new.stride(), out.data_ptr(), b, hq, m, d, n_new, self._seqlens,
                    1.0 / math.sqrt(d) if scaling is None else float(scaling), float(softcap or 0.0), lo, hi):
            return None  # inf / NaN for a quantized cache: nothing written; the general path raises
        torch._C._increment_version(self._buffers())
        return out

    def _make_step(self):
        """The layer's DecodeStep, or False for a cache outside the decode route (not on the CPU)."""
        from fa2cpu import _core
        if not self.k_cache.is_cpu:
            return False
        table = self._owner.block_table.numpy() if self._owner.paged else None
        k4 = _np("k_cache", self.k_cache).transpose(0, 2, 1, 3)  # the core's (batch|block, head, row, feature)
        v4 = _np("v_cache", self.v_cache).transpose(0, 2, 1, 3)
        self._dv = self.v_cache.shape[-1]
        dtype = _CODES[self._owner.dtype]
        if self.k_scale is None:
            return _core.DecodeStep(k4, v4, table, self._owner.block_size, dtype)
        # quantized: codes and their scales, (batch|block, head, row)
        scales = (_np("k_scale", self.k_scale).transpose(0, 2, 1), _np("v_scale", self.v_scale).transpose(0, 2, 1))
        return _core.DecodeStep(k4, v4, table, self._owner.block_size, dtype, _CODES[self.k_cache.dtype], *scales)

    def _to_positions(self, row):
        """Store sequences at transformers' positions again (undo dropped left padding)."""
        B = self.batch
        if self._uniform:
            return
        if row is not None:
            real = row[:, 0, 0, :]
            for b in range(B):
                if self.offsets[b] and bool(real[b, :self.offsets[b]].any()):
                    raise RuntimeError("KVCache: the attention mask now lets queries see left-padding tokens that "
                                       "were dropped when the prompt was stored")
        rows = torch.arange(B)
        lens = self._seqlens[:B].copy()
        top = int(lens.max())
        stored = self._gather(rows, top)
        self._owner._allocate(B, lens + self.offsets[:B])
        for b in range(B):
            off, n = int(self.offsets[b]), int(lens[b])
            if n:
                self._scatter([x[b:b + 1, :n] for x in stored], off, torch.tensor([b]))
            if off:  # the dropped pads' rows: zeros (codes and scales 0 in a quantized cache)
                self._scatter([x.new_zeros((1, off) + x.shape[2:]) for x in stored], 0, torch.tensor([b]))
        self._seqlens[:B] = lens + self.offsets[:B]
        self.offsets[:B] = 0
        self._set_batch(B)

    def _attend_general(self, q, k_new_bshd, v_new_bshd, row, spec, dense, lo, hi, scaling, softcap, sinks=None):
        """Any padding pattern or a dense mask: sequences stored at transformers' positions, new
        tokens written in place, then attention over [0, length + N) with the padding row (or the
        dense mask) through ``flash_attention``, which takes the mask (a quantized cache is
        dequantized into a temporary float copy of those positions for it: see _decoded)."""
        B, n_new = k_new_bshd.shape[0], k_new_bshd.shape[1]
        encoded = self._encode(k_new_bshd, v_new_bshd)  # (checks first: nothing stored on error)
        self._to_positions(row if spec is not None else None)
        total = self.length + n_new
        rows = torch.arange(B)
        self._owner._allocate(B, np.full(B, total))
        self._scatter(encoded, self.length, rows)
        if self._owner.paged:
            keys, values = self._decoded(self._gather(rows, total))
        else:  # views of the buffers (decoded into a copy when quantized)
            keys, values = self._decoded(tuple(buf[:B, :total] for buf in self._buffers()))
        self._seqlens[:B] = total
        if dense is not None:
            mask, window = dense, (-1, -1)
        else:
            mask, window = (row if spec is not None and spec.has_padding else None), (lo, hi)
        return _ft.flash_attention(q, keys, values, scale=scaling, window=window, softcap=softcap,
                                   mask=mask, layout="bshd", sinks=sinks)


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
    kv_dtype : torch.dtype, optional
        What the buffers store: None (default) = ``dtype``; ``torch.int8`` or
        ``torch.float8_e4m3fn`` = a quantized cache: codes of that dtype plus float32 scale
        buffers ``k_scale`` / ``v_scale`` (one scale per stored token and KV head, the buffers'
        shape without the last axis), filled by ``flash_attention_with_kvcache``'s quantizing
        append (``scale = max|x| / 127`` for int8, ``/ 448`` for float8, per token and head; the
        cached value is ``code * scale``) and read by the kernels in place, dequantized in
        registers: half (int8/float8 vs bf16) or a quarter (vs float32) of the K/V bytes, with an
        error of up to ``max|x| / 254`` per element for int8 (half a step), about 1/16 of the
        element's magnitude for float8 (3 mantissa bits). One exception: the general path
        (padding other than left padding, dense masks), which needs a mask and so calls
        ``flash_attention`` rather than ``flash_attention_with_kvcache``, hands it a temporary
        float copy of the sequences' dequantized K/V (code * scale in float32, rounded to
        ``dtype``). ``layers[i].keys`` / ``values`` are the code buffers.
    paged : bool
        Store K/V in blocks of ``block_size`` positions handed out on demand from a shared pool
        (``num_blocks``, default: enough for every sequence at full length) through a block
        table, as in vLLM; else one ``(max_batch_size, max_cache_len, Hk, D)`` buffer per layer.

    Buffers never move: ``layers[i].k_cache`` / ``v_cache`` (and ``k_scale`` / ``v_scale``) keep
    their storage across steps.
    Works only with ``attn_implementation`` set to a name registered by :func:`register`.
    """

    def __init__(self, config, max_batch_size, max_cache_len, dtype=None, *, kv_dtype=None, paged=False,
                 block_size=16, num_blocks=None, device="cpu"):
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if dtype is None:
            dtype = getattr(cfg, "dtype", None) or torch.float32
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype)
        if dtype not in _FLOATS:
            raise TypeError(f"dtype: {dtype} is not supported; expected torch.float32, float16 or bfloat16")
        if kv_dtype is not None and kv_dtype != dtype and kv_dtype not in _CODE_DTYPES:
            raise TypeError(f"kv_dtype: {kv_dtype} is not supported; expected None (= dtype), torch.int8 or "
                            f"torch.float8_e4m3fn")
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        quantized = self.kv_dtype in _CODE_DTYPES
        if int(max_batch_size) < 1 or int(max_cache_len) < 1:
            raise ValueError(f"max_batch_size and max_cache_len must be >= 1, got {max_batch_size}, {max_cache_len}")
        self._max_batch_size, self._max_cache_len = int(max_batch_size), int(max_cache_len)
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
        def buffers():  # one layer's (k_cache, v_cache[, k_scale, v_scale])
            caches = (torch.zeros(shape_k, dtype=self.kv_dtype, device=device),
                      torch.zeros(shape_v, dtype=self.kv_dtype, device=device))
            if not quantized:
                return caches
            return caches + tuple(torch.zeros(shape_k[:-1], dtype=torch.float32, device=device) for _ in range(2))
        layers = [_KVLayer(self, *buffers()) for _ in range(n_layers)]
        super().__init__(layers=layers)

    # Properties, not attributes: some transformers versions (5.17) define them read-only on Cache.
    @property
    def max_batch_size(self):
        return self._max_batch_size

    @property
    def max_cache_len(self):
        return self._max_cache_len

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

