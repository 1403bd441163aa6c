#!/usr/bin/env python
"""A small continuous-batching inference server loop on top of fa2cpu, with a paged KV cache.

What an LLM inference server does
---------------------------------
Requests (prompts) arrive at any time. For every request the server keeps the keys and values of
all tokens seen so far (the *KV cache*), so producing the next token costs one new row of K/V per
layer instead of recomputing the whole sequence. The engine runs in *steps*; in each step it

1. **schedules**: admits waiting requests first come, first served, while the batch has room and
   the KV pool has free blocks for their prompts;
2. **prefills** the admitted prompts: one forward pass over all their tokens at once, which writes
   their K/V into the cache and yields each request's first output token;
3. **decodes** every running request by one token: the new token's q/k/v are computed, its k/v are
   appended to the request's cache and its q attends over the whole cache;
4. **retires** requests that reached their token limit and returns their cache blocks to the pool.

Requests join and leave the running batch at every step ("continuous batching"), so a short
request never waits for a long one to finish. KV memory is *paged* (as in vLLM's PagedAttention):
the cache is a pool of fixed-size blocks of ``block_size`` token rows; a request owns a list of
blocks (its *block table*) that grows one block at a time as it generates, so memory is neither
reserved for the maximum length nor fragmented. When the pool runs dry during decode, the most
recently admitted request is *preempted*: its blocks are freed and it goes back to the front of
the queue, to be re-prefilled later from its prompt plus the tokens it already generated
("recompute" preemption).

How this maps onto fa2cpu
-------------------------
* KV block pool (per layer): ``k_cache[l]``, ``v_cache[l]``, ``(num_blocks, block_size, Hk, D)``
  arrays; free list and block tables: :class:`BlockAllocator` and ``Request.blocks``, packed into an
  int32 ``(B, max_blocks)`` ``block_table`` for each call.
* Prefill of ragged prompts: ``fa2cpu.flash_attention_varlen(q, k, v, cu, cu, causal=True)`` on the
  prompts packed end to end (``cu`` = cumulative prompt lengths), one call per layer; the prompt K/V
  go into the blocks through a per-token *slot mapping*, ``k_cache[l][block_of_token, row_of_token]
  = k`` (``flash_attention_with_kvcache``'s ``k``/``v`` append could do the same).
* Decode step (one token per request): ``fa2cpu.flash_attention_with_kvcache(q, k_cache[l],
  v_cache[l], k=new_k, v=new_v, cache_seqlens=lens, block_table=bt, causal=True)`` appends new_k/new_v
  in place at position ``lens[b]`` and attends over ``[0, lens[b] + 1)``; split-KV (flash-decoding)
  is picked automatically.
* GQA: Hq query heads share Hk K/V heads (default 8 and 2); the cache stores only the Hk heads.
* ``--kv-dtype int8`` / ``fp8``: a quantized KV cache, as llama.cpp and vLLM offer: the block pools
  hold int8 / float8_e4m3fn codes and ``k_scale[l]``, ``v_scale[l]`` ``(num_blocks, block_size, Hk)``
  float32 scales, one per token and head (the cached value is ``code * scale``). Decode passes them
  as ``k_scale=``/``v_scale=``: the append quantizes the new K/V in place (``scale = max|x| / 127``
  or ``/ 448``) and the kernels dequantize in registers, reading half the bytes of a bf16 cache.
  Prefill attends on the prompt's unquantized K/V (as servers do) and stores them quantized by
  the same rule (:func:`quantize`).

The model is a toy: random embeddings, ``--layers`` pre-norm attention blocks with random q/k/v/o
projections and rotary position embeddings, a random unembedding and greedy argmax over a small
vocabulary. The projections run in float32 NumPy; q/k/v are rounded to ``--dtype`` (bfloat16 by
default, as a server would store its cache) for the attention calls and the cache. The text it
produces is meaningless: the point is the attention calls and the cache management.

``--check`` verifies the first ``--check-steps`` prefill batches and decode steps (every layer):
the varlen prefill against the float64 oracle ``fa2cpu._reference.varlen_ref``, the paged decode
against ``fa2cpu._reference.kvcache_ref`` (float64, on copies of the cache; of the dequantized
cache, code * scale, with a quantized one) and against ``flash_attention_varlen`` on the K/V
gathered contiguously out of the blocks (dequantized), and that the K/V rows landed in the right
cache slots (quantized: the exact codes and scales of :func:`quantize`). It prints the max errors
and exits with status 1 on failure.

Usage::

    python examples/serve_loop.py                  # a few seconds on 2 cores
    python examples/serve_loop.py --check          # + correctness checks
    python examples/serve_loop.py --dtype fp32 --requests 64 --max-new-tokens 128 -v   # or float32
    python examples/serve_loop.py --num-blocks 40  # a small KV pool: watch preemptions happen
    python examples/serve_loop.py --kv-dtype int8 --check   # an int8 KV cache (or fp8)
"""
import argparse
import collections
import math
import sys
import time
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import threadpoolctl

import fa2cpu
from fa2cpu import _reference
from fa2cpu._validate import MAX_HEAD_DIM
from fa2cpu.bench import DTYPES, dtype_arg, positive_int, usable_cpus

# Kernel vs float64 oracle on the same rounded inputs, outputs of magnitude ~1 (the test suite's
# table): float32 accumulation everywhere; the output (and P for bf16 kernels) rounded to dtype.
# A quantized cache is compared on its dequantized values (code * scale): the same table (the
# kernels dequantize in float32, or into bf16 for bf16 tiles, within the bf16 row).
TOL = {"fp32": (2e-5, 2e-5), "fp16": (4e-3, 4e-3), "bf16": (2e-2, 2e-2)}  # (atol, rtol)

# --kv-dtype: codes of a quantized KV cache and the largest code magnitude (scale = max|x| / limit)
KV_CODES = {"int8": (np.dtype(np.int8), 127.0), "fp8": (np.dtype(ml_dtypes.float8_e4m3fn), 448.0)}


def quantize(x, code_dtype):
    """K or V rows ``(..., D)`` -> (codes, float32 scales ``(...)``) by the rule of
    ``flash_attention_with_kvcache``'s quantizing append (API.md), per token and head in float32:
    ``scale = max|x| / limit``, codes ``x / scale`` rounded to nearest (even), a row of zeros gets
    scale 0 and codes 0."""
    limit = np.float32(KV_CODES["int8" if code_dtype == np.int8 else "fp8"][1])
    x = np.asarray(x, np.float32)
    scale = np.abs(x).max(axis=-1) / limit
    y = x / np.where(scale > 0, scale, np.float32(1))[..., None]
    if code_dtype == np.int8:
        y = np.rint(y)
    return np.clip(y, -limit, limit).astype(code_dtype), scale


def dequantize(codes, scale, dtype=np.float64):
    """code * scale (scale None: the cache holds the values themselves), in ``dtype``."""
    if scale is None:
        return codes.astype(dtype)
    if dtype == np.float64:
        return codes.astype(np.float64) * scale.astype(np.float64)[..., None]
    return (codes.astype(np.float32) * scale[..., None]).astype(dtype)


# ---- KV block allocator ---------------------------------------------------------------------
class OutOfBlocks(RuntimeError):
    """The KV pool has no free block."""


class BlockAllocator:
    """Free list of ``num_blocks`` fixed-size KV cache blocks, identified by ids ``0..num_blocks-1``.

    ``allocate()`` pops a block id (most recently freed first), ``free(ids)`` returns blocks;
    freeing a block that is not allocated raises ``ValueError`` (double free / foreign id).
    """

    def __init__(self, num_blocks):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first
        self._used = set()
        self.peak_used = 0

    @property
    def num_free(self):
        return len(self._free)

    @property
    def num_used(self):
        return len(self._used)

    def allocate(self):
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        b = self._free.pop()
        self._used.add(b)
        self.peak_used = max(self.peak_used, len(self._used))
        return b

    def free(self, blocks):
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated (double free?)")
            self._used.remove(b)
            self._free.append(b)

    def all_free(self):
        """True when every block is back on the free list (nothing leaked)."""
        return not self._used and len(self._free) == self.num_blocks and \
            sorted(self._free) == list(range(self.num_blocks))


# ---- Toy model ------------------------------------------------------------------------------
class ToyModel:
    """Random-weight decoder: embeddings, ``layers`` x (RMSNorm -> GQA attention with RoPE ->
    residual), RMSNorm -> unembedding. All weights float32; attention runs in fa2cpu."""

    def __init__(self, rng, *, vocab, layers, hq, hk, head_dim):
        if head_dim % 2:
            raise ValueError("head_dim must be even (rotary embeddings)")
        self.vocab, self.layers, self.hq, self.hk, self.d = vocab, layers, hq, hk, head_dim
        dm = hq * head_dim
        f32 = np.float32
        w = lambda *shape: (rng.standard_normal(shape, dtype=f32) / f32(math.sqrt(shape[-2])))  # noqa: E731
        self.embed = rng.standard_normal((vocab, dm), dtype=f32)
        self.wq, self.wk, self.wv, self.wo = ([w(*shape) for _ in range(layers)] for shape in
                                              [(dm, hq * head_dim), (dm, hk * head_dim), (dm, hk * head_dim),
                                               (hq * head_dim, dm)])
        self.unembed = w(dm, vocab)
        self.inv_freq = (10000.0 ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))

    @staticmethod
    def _rmsnorm(x):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-6))

    def _rope(self, x, pos):
        """Rotary embedding (GPT-NeoX half split) of x (T, H, D) at positions pos (T,)."""
        ang = pos[:, None].astype(np.float64) * self.inv_freq[None, :]
        cos, sin = (f(ang).astype(np.float32)[:, None, :] for f in (np.cos, np.sin))
        x1, x2 = x[..., :self.d // 2], x[..., self.d // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

    def qkv(self, layer, x, pos, dtype):
        """x (T, dm) float32, pos (T,) -> q (T, Hq, D), k (T, Hk, D), v (T, Hk, D) in ``dtype``."""
        t = x.shape[0]
        h = self._rmsnorm(x)
        q = self._rope((h @ self.wq[layer]).reshape(t, self.hq, self.d), pos)
        k = self._rope((h @ self.wk[layer]).reshape(t, self.hk, self.d), pos)
        v = (h @ self.wv[layer]).reshape(t, self.hk, self.d)
        return q.astype(dtype), k.astype(dtype), v.astype(dtype)

    def residual(self, layer, x, attn):
        """x + attn (T, Hq, D) @ Wo."""
        return x + attn.reshape(x.shape[0], -1).astype(np.float32) @ self.wo[layer]

    def next_tokens(self, x):
        """Greedy decoding: argmax of the logits of each row of x (T, dm)."""
        return np.argmax(self._rmsnorm(x) @ self.unembed, axis=-1)


# ---- Requests and the engine ----------------------------------------------------------------
@dataclass
class Request:
    rid: int
    prompt_len: int
    max_new_tokens: int
    arrival_step: int
    tokens: list                                  # prompt + generated so far
    blocks: list = field(default_factory=list)    # block table: KV block ids, in position order
    seqlen: int = 0                               # tokens whose K/V are in the cache
    num_generated: int = 0
    preemptions: int = 0
    t_arrival: float = 0.0
    t_first_token: float = None
    t_done: float = None


class Engine:
    """Continuous-batching engine: scheduler, paged KV cache, prefill and decode steps."""

    def __init__(self, model, requests, *, dtype, block_size, num_blocks, max_batch,
                 max_prefill_tokens, num_threads=None, check_steps=0, verbose=False, kv_dtype=None):
        self.model, self.dtype, self.bs = model, np.dtype(dtype), block_size
        self.dtype_name = next(n for n, d in DTYPES.items() if d == self.dtype)
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self.nt, self.verbose = num_threads, verbose
        self.allocator = BlockAllocator(num_blocks)
        shape = (model.layers, num_blocks, block_size, model.hk, model.d)
        # kv_dtype None: the cache holds K/V in dtype; "int8" / "fp8": codes + float32 scales
        self.kv_dtype = self.dtype if kv_dtype is None else KV_CODES[kv_dtype][0]
        self.quantized = kv_dtype is not None
        self.k_cache = np.zeros(shape, self.kv_dtype)   # k_cache[l] is layer l's block pool
        self.v_cache = np.zeros(shape, self.kv_dtype)
        # k_scale[l] (num_blocks, block_size, Hk): one scale per cached token and head, or None
        self.k_scale = np.zeros(shape[:-1], np.float32) if self.quantized else None
        self.v_scale = np.zeros(shape[:-1], np.float32) if self.quantized else None
        self.watermark = max(1, num_blocks // 100)    # blocks kept free at admission (fewer preemptions)
        longest = max((r.prompt_len + r.max_new_tokens for r in requests), default=0)
        if math.ceil(longest / block_size) > num_blocks:
            raise ValueError(f"--num-blocks {num_blocks} cannot hold one request of {longest} tokens "
                             f"({math.ceil(longest / block_size)} blocks of {block_size})")
        self.pending = collections.deque(sorted(requests, key=lambda r: (r.arrival_step, r.rid)))
        self.waiting, self.running, self.finished = collections.deque(), [], []
        self.step_no = 0
        self.stats = collections.Counter()
        self.times = collections.defaultdict(float)
        self.check_prefill_left = self.check_decode_left = check_steps
        errors = ("prefill_max_err prefill_err_over_tol decode_max_err decode_err_over_tol "
                  "decode_vs_gathered_max_err decode_gathered_err_over_tol").split()
        self.check = {**dict.fromkeys(errors, 0.0), "cache_slots_ok": True, "prefill_checked": 0,
                      "decode_checked": 0}

    # ---- bookkeeping ------------------------------------------------------------------------
    def _scales(self, layer):
        """(k_scale, v_scale) of a layer's block pool; (None, None) for a float cache."""
        return (None, None) if not self.quantized else (self.k_scale[layer], self.v_scale[layer])

    def _store(self, layer, blk, off, k, v):
        """Write K/V rows (T, Hk, D) into the slots (blk[t], off[t]) of layer's pool (quantized
        by :func:`quantize` into a quantized cache, with their scales)."""
        if not self.quantized:
            self.k_cache[layer][blk, off] = k
            self.v_cache[layer][blk, off] = v
            return
        for cache, scales, x in ((self.k_cache, self.k_scale, k), (self.v_cache, self.v_scale, v)):
            cache[layer][blk, off], scales[layer][blk, off] = quantize(x, self.kv_dtype)

    def _slots_hold(self, layer, blk, off, k, v):
        """True when the slots (blk[t], off[t]) hold exactly K/V rows (T, Hk, D) (quantized: the
        codes and scales :func:`quantize` gives them)."""
        ok = True
        for cache, scales, x in ((self.k_cache, self.k_scale, k), (self.v_cache, self.v_scale, v)):
            if not self.quantized:
                ok &= np.array_equal(cache[layer][blk, off].astype(np.float32), x.astype(np.float32))
                continue
            codes, scale = quantize(x, self.kv_dtype)
            ok &= (np.array_equal(cache[layer][blk, off].view(np.uint8), codes.view(np.uint8))
                   and np.array_equal(scales[layer][blk, off], scale))
        return bool(ok)

    def _emit(self, r, token, now):
        r.tokens.append(int(token))
        r.num_generated += 1
        self.stats["generated"] += 1
        if r.t_first_token is None:
            r.t_first_token = now
        if r.num_generated >= r.max_new_tokens:
            self._retire(r, now)

    def _retire(self, r, now):
        self.allocator.free(r.blocks)     # blocks go back to the free list
        r.blocks = []
        r.t_done = now
        self.running.remove(r)
        self.finished.append(r)

    def _preempt(self, r):
        """Recompute preemption: drop r's cache, requeue it first; it is re-prefilled later from
        prompt + generated tokens (its tokens list already holds both)."""
        self.allocator.free(r.blocks)
        r.blocks, r.seqlen = [], 0
        r.preemptions += 1
        self.stats["preemptions"] += 1
        self.running.remove(r)
        self.waiting.appendleft(r)

    @property
    def done(self):
        return not (self.pending or self.waiting or self.running)

    def _block_table(self, batch):
        bt = np.zeros((len(batch), max(len(r.blocks) for r in batch)), np.int32)
        for i, r in enumerate(batch):
            bt[i, :len(r.blocks)] = r.blocks
        return bt

    # ---- one engine step --------------------------------------------------------------------
    def step(self):
        now = time.perf_counter()
        if not (self.waiting or self.running) and self.pending:       # idle: jump to next arrival
            self.step_no = max(self.step_no, self.pending[0].arrival_step)
        arrived = 0
        while self.pending and self.pending[0].arrival_step <= self.step_no:
            r = self.pending.popleft()
            r.t_arrival = now
            self.waiting.append(r)
            arrived += 1
        n_fin = len(self.finished)
        batch = self._schedule()
        if batch:
            self._prefill(batch)
        n_dec = self._decode() if self.running else 0
        self.stats["steps"] += 1
        self.stats["peak_batch"] = max(self.stats["peak_batch"], n_dec)
        if self.verbose:
            print(f"step {self.step_no:5d}: +{arrived} arrived, prefill {len(batch):2d} req "
                  f"({sum(r.seqlen for r in batch):5d} tok), decode {n_dec:2d} req, "
                  f"{len(self.finished) - n_fin} finished, waiting {len(self.waiting):2d}, "
                  f"KV blocks used {self.allocator.num_used}/{self.allocator.num_blocks}")
        self.step_no += 1

    def _schedule(self):
        """FCFS admission while the batch has room, the prefill token budget allows (the first
        request is always taken) and the pool has blocks for the whole prompt."""
        batch, budget = [], self.max_prefill_tokens
        while self.waiting and len(self.running) + len(batch) < self.max_batch:
            r = self.waiting[0]
            n = len(r.tokens)
            need = -(-n // self.bs)
            reserve = self.watermark if (batch or self.running) else 0   # no watermark when idle
            if (batch and n > budget) or need + reserve > self.allocator.num_free:
                break
            self.waiting.popleft()
            r.blocks = [self.allocator.allocate() for _ in range(need)]
            batch.append(r)
            budget -= n
        return batch

    def _prefill(self, batch):
        """One varlen attention call per layer over the packed prompts; K/V scattered into the
        requests' blocks through a slot mapping; one new token per request."""
        t0 = time.perf_counter()
        m, bs = self.model, self.bs
        lens = np.array([len(r.tokens) for r in batch])
        cu = np.zeros(len(batch) + 1, np.int32)
        np.cumsum(lens, out=cu[1:])
        tokens = np.concatenate([np.asarray(r.tokens) for r in batch])
        pos = np.concatenate([np.arange(n) for n in lens])
        # slot mapping: token t of the packed batch lives in block blk[t], row off[t]
        blk = np.concatenate([np.asarray(r.blocks)[np.arange(n) // bs] for r, n in zip(batch, lens)])
        off = pos % bs
        check = self.check_prefill_left > 0
        x = m.embed[tokens]
        for layer in range(m.layers):
            q, k, v = m.qkv(layer, x, pos, self.dtype)
            ta = time.perf_counter()
            o = fa2cpu.flash_attention_varlen(q, k, v, cu, cu, max_seqlen_q=int(lens.max()),
                                              max_seqlen_k=int(lens.max()), causal=True,
                                              num_threads=self.nt)
            self.times["prefill_attn"] += time.perf_counter() - ta
            self._store(layer, blk, off, k, v)         # write the prompt K/V into the paged cache
            if check:
                tc = time.perf_counter()
                self._check_prefill(layer, q, k, v, o, cu, blk, off)
                t0 += self._check_time(tc)              # checks are not part of the timings
            x = m.residual(layer, x, o)
        nxt = m.next_tokens(x[cu[1:] - 1])                # logits of each prompt's last token
        now = time.perf_counter()
        for r, n, t in zip(batch, lens, nxt):
            r.seqlen = int(n)
            self.running.append(r)
            self._emit(r, t, now)
        self.check_prefill_left -= check
        self.stats["prefill_batches"] += 1
        self.stats["prefill_tokens"] += int(lens.sum())
        self.stats["prefill_first_tokens"] += len(batch)
        self.times["prefill"] += now - t0

    def _reserve_decode_slots(self):
        """Every running request needs a cache row for the token it is about to append: allocate
        a new block when its last one is full; preempt the newest request when the pool is dry."""
        i = 0
        while i < len(self.running):
            r = self.running[i]
            if r.seqlen == len(r.blocks) * self.bs:
                victim = None
                while self.allocator.num_free == 0 and victim is not r:
                    victim = self.running[-1]
                    self._preempt(victim)
                if victim is r:            # r itself was the newest: it waits for a later step
                    break
                r.blocks.append(self.allocator.allocate())
            i += 1

    def _decode(self):
        """One token for every running request: one paged-KV attention call per layer that
        appends the new K/V in place."""
        t0 = time.perf_counter()
        self._reserve_decode_slots()
        batch = list(self.running)
        if not batch:
            return 0
        m = self.model
        tok = np.array([r.tokens[-1] for r in batch])
        seqlens = np.array([r.seqlen for r in batch], np.int32)   # K/V rows already cached
        bt = self._block_table(batch)
        check = self.check_decode_left > 0
        x = m.embed[tok]
        for layer in range(m.layers):
            q, k, v = m.qkv(layer, x, seqlens, self.dtype)         # new token at position seqlen
            q, k, v = q[:, None], k[:, None], v[:, None]           # (B, 1, H, D)
            k_scale, v_scale = self._scales(layer)
            if check:   # float64 oracle on copies of the cache, before the in-place append
                tc = time.perf_counter()
                if self.quantized:  # on the dequantized cache, appending what the append stores
                    ref, _ = _reference.kvcache_ref(
                        q, dequantize(self.k_cache[layer], k_scale), dequantize(self.v_cache[layer], v_scale),
                        dequantize(*quantize(k, self.kv_dtype)), dequantize(*quantize(v, self.kv_dtype)),
                        cache_seqlens=seqlens, block_table=bt, causal=True)
                else:
                    ref, _ = _reference.kvcache_ref(q, self.k_cache[layer], self.v_cache[layer], k, v,
                                                    cache_seqlens=seqlens, block_table=bt, causal=True)
                t0 += self._check_time(tc)
            ta = time.perf_counter()
            o = fa2cpu.flash_attention_with_kvcache(q, self.k_cache[layer], self.v_cache[layer],
                                                    k=k, v=v, cache_seqlens=seqlens,
                                                    block_table=bt, causal=True,
                                                    num_threads=self.nt, k_scale=k_scale, v_scale=v_scale)
            self.times["decode_attn"] += time.perf_counter() - ta
            if check:
                tc = time.perf_counter()
                self._check_decode(layer, q, k, v, o, ref, seqlens, bt)
                t0 += self._check_time(tc)
            x = m.residual(layer, x, o[:, 0])
        nxt = m.next_tokens(x)
        now = time.perf_counter()
        for r, t in zip(batch, nxt):
            r.seqlen += 1
            self._emit(r, t, now)
        self.check_decode_left -= check
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(batch)
        self.times["decode"] += now - t0
        return len(batch)

    # ---- --check ----------------------------------------------------------------------------
    def _check_time(self, since):
        self.times["check"] += (dt := time.perf_counter() - since)
        return dt

    def _compare(self, key, ratio_key, actual, ref):
        """Raise check[key] to max|actual - ref| and check[ratio_key] to the largest error over
        its tolerance (inf when anything is not finite)."""
        atol, rtol = TOL[self.dtype_name]
        ref = np.asarray(ref, np.float64)
        diff = np.abs(np.asarray(actual, np.float64) - ref)
        err = ((float(diff.max(initial=0.0)), float((diff / (atol + rtol * np.abs(ref))).max(initial=0.0)))
               if np.all(np.isfinite(diff)) else (math.inf, math.inf))
        self.check[key] = max(self.check[key], err[0])
        self.check[ratio_key] = max(self.check[ratio_key], err[1])

    def _check_prefill(self, layer, q, k, v, o, cu, blk, off):
        ref, _ = _reference.varlen_ref(q, k, v, cu, cu, causal=True)
        self._compare("prefill_max_err", "prefill_err_over_tol", o, ref)
        self.check["cache_slots_ok"] &= self._slots_hold(layer, blk, off, k, v)
        self.check["prefill_checked"] += 1

    def _check_decode(self, layer, q, k, v, o, ref, seqlens, bt):
        self._compare("decode_max_err", "decode_err_over_tol", o, ref)
        # the appended rows must sit at position seqlen of each request
        rows = np.arange(len(seqlens))
        blk, off = bt[rows, seqlens // self.bs], seqlens % self.bs
        self.check["cache_slots_ok"] &= self._slots_hold(layer, blk, off, k[:, 0], v[:, 0])
        # the same attention through the contiguous path: gather each request's K/V out of its
        # blocks, pack them, and run varlen with one query row per sequence
        total = seqlens.astype(np.int64) + 1
        pos = np.concatenate([np.arange(n) for n in total])
        which = np.repeat(rows, total)
        gb, go = bt[which, pos // self.bs], pos % self.bs
        cu_k = np.concatenate([[0], np.cumsum(total)]).astype(np.int32)
        cu_q = np.arange(len(total) + 1, dtype=np.int32)
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        k_scale, v_scale = self._scales(layer)
        if self.quantized:  # varlen takes float K/V: code * scale in float32, rounded to dtype
            kg = dequantize(kc[gb, go], k_scale[gb, go], self.dtype)
            vg = dequantize(vc[gb, go], v_scale[gb, go], self.dtype)
        else:
            kg, vg = kc[gb, go], vc[gb, go]
        og = fa2cpu.flash_attention_varlen(q[:, 0], kg, vg, cu_q, cu_k, causal=True, num_threads=self.nt)
        self._compare("decode_vs_gathered_max_err", "decode_gathered_err_over_tol", o[:, 0], og)
        self.check["decode_checked"] += 1

    def check_ok(self):
        c = self.check
        return bool(c["cache_slots_ok"] and c["prefill_err_over_tol"] <= 1 and
                    c["decode_err_over_tol"] <= 1 and c["decode_gathered_err_over_tol"] <= 1)


# ---- Driver ---------------------------------------------------------------------------------
def make_requests(rng, n, *, min_prompt, max_prompt, max_new_tokens, arrival_rate, vocab):
    """n requests with random prompts; arrivals a Poisson process of ``arrival_rate`` per step."""
    gaps = rng.exponential(1.0 / arrival_rate, size=n) if arrival_rate > 0 else np.zeros(n)
    # Steps past 2^62 (a rate near 0) are clipped: int64 holds them, and the idle engine jumps there.
    arrivals = np.minimum(np.floor(np.cumsum(np.r_[0.0, gaps[1:]])), 2.0 ** 62).astype(np.int64) if n else []
    out = []
    for i in range(n):
        plen = int(rng.integers(min_prompt, max_prompt + 1))
        new = int(rng.integers(max(1, max_new_tokens // 4), max_new_tokens + 1))
        out.append(Request(i, plen, new, int(arrivals[i]), rng.integers(0, vocab, size=plen).tolist()))
    return out


# Options that take a positive integer: (name, default, help); default None = derived.
POSITIVE_INT_OPTIONS = [
    ("--requests", 64, "number of requests to serve"),
    ("--max-new-tokens", 128, "per-request limit is drawn from [max/4, max]"),
    ("--min-prompt", 16, "shortest prompt (tokens)"),
    ("--max-prompt", 512, "longest prompt (tokens)"),
    ("--block-size", 16, "tokens per KV cache block"),
    ("--num-blocks", None, "KV pool size in blocks; None = enough for --max-batch of the longest requests"),
    ("--max-batch", 16, "most requests running at once"),
    ("--max-prefill-tokens", 2048, "prefill token budget per step"),
    ("--layers", 2, "attention layers of the toy model"),
    ("--heads-q", 8, "query heads"),
    ("--heads-kv", 2, "key/value heads (GQA)"),
    ("--head-dim", 64, f"head dimension D (even, at most {MAX_HEAD_DIM})"),
    ("--vocab", 512, "vocabulary size"),
    ("--threads", None, "fa2cpu threads; None = OpenMP's maximum (OMP_NUM_THREADS)"),
    ("--blas-threads", 1, "threads for the NumPy projections. 1 keeps OpenBLAS and fa2cpu's threads "
                          "from spinning against each other: with both at 2 on 2 cores, decode ran "
                          "~30x slower (OMP_WAIT_POLICY=passive also avoids it)"),
    ("--steps", None, "stop after this many engine steps; None = until every request is done"),
    ("--check-steps", 3, "prefill batches and decode steps verified by --check"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for name, default, text in POSITIVE_INT_OPTIONS:
        p.add_argument(name, type=positive_int, default=default, help=text)
    p.add_argument("--arrival-rate", type=float, default=1.0,
                   help="mean new requests per engine step (Poisson); 0 = all at once")
    p.add_argument("--dtype", type=dtype_arg, default="bf16",
                   help="dtype of q/k/v and of the KV cache: fp32, bf16, fp16 (or float32, bfloat16, float16)")
    p.add_argument("--kv-dtype", choices=["same", *KV_CODES], default="same",
                   help="what the KV cache stores: same = --dtype; int8 / fp8 = int8 / float8_e4m3fn codes "
                        "with float32 scales per token and head (a quantized cache)")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights, prompts and arrivals")
    p.add_argument("--check", action="store_true",
                   help="verify the attention outputs and cache writes of the first steps")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per engine step")
    a = p.parse_args(argv)
    if a.max_prompt < a.min_prompt:
        p.error("--max-prompt must be >= --min-prompt")
    if a.head_dim % 2 or a.head_dim > MAX_HEAD_DIM:
        p.error(f"--head-dim {a.head_dim}: must be even (rotary embeddings) and at most {MAX_HEAD_DIM}")
    if a.heads_q % a.heads_kv:
        p.error("--heads-q must be a multiple of --heads-kv (GQA)")
    if not a.arrival_rate >= 0 or a.seed < 0:
        p.error("--arrival-rate and --seed must be >= 0")
    if a.num_blocks is None:
        a.num_blocks = a.max_batch * -(-(a.max_prompt + a.max_new_tokens) // a.block_size)
    return a


def main(argv=None):
    """Run the server loop; prints a summary and returns it as a dict."""
    a = parse_args(argv)
    rng = np.random.default_rng(a.seed)
    model = ToyModel(rng, vocab=a.vocab, layers=a.layers, hq=a.heads_q, hk=a.heads_kv,
                     head_dim=a.head_dim)
    requests = make_requests(rng, a.requests, min_prompt=a.min_prompt, max_prompt=a.max_prompt,
                             max_new_tokens=a.max_new_tokens, arrival_rate=a.arrival_rate,
                             vocab=a.vocab)
    try:
        eng = Engine(model, requests, dtype=DTYPES[a.dtype], block_size=a.block_size,
                     num_blocks=a.num_blocks, max_batch=a.max_batch,
                     max_prefill_tokens=a.max_prefill_tokens, num_threads=a.threads,
                     check_steps=a.check_steps if a.check else 0, verbose=a.verbose,
                     kv_dtype=None if a.kv_dtype == "same" else a.kv_dtype)
    except ValueError as e:
        raise SystemExit(f"serve_loop.py: error: {e}") from None
    threads = min(a.threads or fa2cpu._core.max_threads(), usable_cpus())   # fa2cpu caps it too
    print(f"fa2cpu {fa2cpu.__version__} serve loop: {a.requests} requests, {a.layers} layer{'s' * (a.layers > 1)}, "
          f"Hq={a.heads_q} Hk={a.heads_kv} D={a.head_dim}, {a.dtype}, KV pool {a.num_blocks} blocks "
          f"x {a.block_size} tokens"
          + ("" if a.kv_dtype == "same" else f" of {a.kv_dtype} codes + float32 scales")
          + f", max batch {a.max_batch}, kernels {fa2cpu.get_isa()}, "
          f"{threads} threads")

    with threadpoolctl.threadpool_limits(a.blas_threads, user_api="blas"):
        t0 = time.perf_counter()
        while not eng.done and (a.steps is None or eng.stats["steps"] < a.steps):
            eng.step()
        wall = time.perf_counter() - t0
    unfinished = len(eng.running) + len(eng.waiting) + len(eng.pending)
    blocks_in_use_at_end = eng.allocator.num_used     # held by unfinished requests only
    for r in eng.running:                             # --steps cut the run short: abort the rest
        eng.allocator.free(r.blocks)
        r.blocks = []
    eng.running, eng.waiting, eng.pending = [], collections.deque(), collections.deque()

    st, tm = eng.stats, eng.times
    rate = lambda n, t: n / t if t > 0 else 0.0   # noqa: E731
    ttft = [r.t_first_token - r.t_arrival for r in eng.finished]
    summary = {
        "requests": a.requests, "completed": len(eng.finished), "unfinished": unfinished, "kv_dtype": a.kv_dtype,
        "tokens_generated": st["generated"], **{k: st[k] for k in (
            "steps prefill_first_tokens prefill_tokens prefill_batches decode_tokens decode_steps "
            "preemptions peak_batch").split()},
        **{f"{k}_s": tm[k] for k in ("prefill", "prefill_attn", "decode", "decode_attn", "check")},
        "prefill_tok_s": rate(st["prefill_tokens"], tm["prefill"]),
        "decode_tok_s": rate(st["decode_tokens"], tm["decode"]), "wall_s": wall,
        "num_blocks": a.num_blocks, "peak_blocks_used": eng.allocator.peak_used,
        "blocks_in_use_at_end": blocks_in_use_at_end, "blocks_free": eng.allocator.num_free,
        "all_blocks_free": eng.allocator.all_free(),
        "mean_ttft_s": float(np.mean(ttft)) if ttft else 0.0,
        "check": dict(eng.check) if a.check else None,
        "check_ok": eng.check_ok() if a.check else None,
    }
    s, c = summary, summary["check"]
    print(f"requests completed: {s['completed']}/{s['requests']} in {s['steps']} steps, {wall:.2f} s"
          + (f" ({tm['check']:.2f} s of it in --check)" if a.check else "")
          + (f" ({unfinished} unfinished, aborted at --steps {a.steps})" if unfinished else ""))
    print(f"tokens generated:   {s['tokens_generated']} ({s['prefill_first_tokens']} first tokens "
          f"from prefill + {s['decode_tokens']} decoded), mean time to first token "
          f"{1e3 * s['mean_ttft_s']:.1f} ms")
    print(f"prefill: {s['prefill_tokens']:6d} prompt tokens in {s['prefill_batches']:3d} batches, "
          f"{s['prefill_s']:.3f} s -> {s['prefill_tok_s']:8.0f} tok/s "
          f"(attention {s['prefill_attn_s']:.3f} s)")
    print(f"decode:  {s['decode_tokens']:6d} tokens in {s['decode_steps']:4d} steps "
          f"(mean batch {rate(s['decode_tokens'], s['decode_steps']):.1f}, peak {s['peak_batch']}), "
          f"{s['decode_s']:.3f} s -> {s['decode_tok_s']:8.0f} tok/s (attention {s['decode_attn_s']:.3f} s)")
    print(f"KV blocks: peak {s['peak_blocks_used']}/{s['num_blocks']} in use, {s['preemptions']} "
          f"preemptions; at exit {s['blocks_free']}/{s['num_blocks']} free"
          + (" (all returned)" if s["all_blocks_free"] else " (LEAK)"))
    if a.check:
        print(f"check ({c['prefill_checked']} prefill and {c['decode_checked']} decode layer-calls, "
              f"tol {TOL[a.dtype][0]:g} + {TOL[a.dtype][1]:g}*|ref|): "
              f"prefill vs float64 max|err| {c['prefill_max_err']:.2e}; paged decode vs float64 "
              f"{c['decode_max_err']:.2e}, vs varlen on gathered K/V {c['decode_vs_gathered_max_err']:.2e}; "
              f"cache slots {'ok' if c['cache_slots_ok'] else 'WRONG'} -> "
              f"{'PASS' if s['check_ok'] else 'FAIL'}")
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["check_ok"] in (None, True) else 1)
