"""What fa2cpu is timed against, and fa2cpu itself, as prepared `Runner`s: the naive NumPy
baseline (also the untimed reference), torch SDPA, and fa2cpu's three entry points."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

import fa2cpu

from .cases import DTYPES, Case, Inputs, baseline_problems, canonical

BASELINES = ("numpy", "torch")
REFERENCE_CHUNK_BYTES = 64 << 20   # score-matrix slice of the untimed chunked NumPy reference


@dataclass
class Runner:
    """A prepared implementation: `call` is what is timed; `result` turns its return value into
    the canonical float32 layout (untimed)."""
    call: Callable[[], object]
    result: Callable[[object], np.ndarray]
    api: str
    note: str = ""
    limits: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def import_torch():
    """torch or None; importing it is slow, so only when the torch baseline is asked for."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def numpy_attention(q, k, v, causal: bool, scale: float, row_chunk: int | None = None) -> np.ndarray:
    """Naive attention in float32: materialised scores, softmax, P @ V. bhsd in and out;
    bottom-right causal; rows that see no key give 0. GQA: the G = Hq/Hk query heads of a group
    are stacked as rows of one matrix, so each K/V head is read once per matmul, never repeated."""
    b, hq, nq, d = q.shape
    hk, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hk
    q = q.astype(np.float32, copy=False).reshape(b, hk, g, nq, d)
    kt = np.swapaxes(k.astype(np.float32, copy=False), -1, -2)
    v = v.astype(np.float32, copy=False)
    out = np.empty((b, hk, g, nq, dv), np.float32)
    step = row_chunk or nq
    for r0 in range(0, nq, step):
        r1 = min(nq, r0 + step)
        rows = r1 - r0
        s = (q[..., r0:r1, :].reshape(b, hk, g * rows, d) @ kt).reshape(b, hk, g, rows, nk)
        s *= scale
        if causal:   # additive 0 / -inf bias, broadcast over batch and heads
            hidden = np.arange(nk)[None, :] > np.arange(r0, r1)[:, None] + (nk - nq)
            s += np.where(hidden, np.float32(-np.inf), np.float32(0))
        m = s.max(axis=-1, keepdims=True)
        m[~np.isfinite(m)] = 0.0
        s -= m
        np.exp(s, out=s)
        denom = s.sum(axis=-1, keepdims=True)
        denom[denom == 0] = 1.0
        o = (s.reshape(b, hk, g * rows, nk) @ v).reshape(b, hk, g, rows, dv)
        o /= denom
        out[..., r0:r1, :] = o
    return out.reshape(b, hq, nq, dv)


def reference_output(case: Case, x: Inputs) -> np.ndarray:
    """Untimed float32 reference, computed in row chunks so memory stays bounded."""
    scale = 1.0 / math.sqrt(case.head_dim)
    outs = []
    for q, k, v in baseline_problems(case, x):
        rows = max(1, REFERENCE_CHUNK_BYTES // (4 * q.shape[0] * q.shape[1] * k.shape[2]))
        outs.append(numpy_attention(q, k, v, case.causal, scale, row_chunk=rows))
    return canonical(case, outs)


def fa2cpu_runner(case: Case, x: Inputs, threads: int) -> Runner:
    t = threads
    if case.mode == "prefill":
        return Runner(lambda: fa2cpu.flash_attention(x.q, x.k, x.v, causal=case.causal, num_threads=t),
                      lambda o: np.asarray(o, np.float32), "fa2cpu.flash_attention")
    if case.mode == "decode":
        return Runner(lambda: fa2cpu.flash_attention_with_kvcache(x.q, x.k, x.v, causal=case.causal,
                                                                  num_threads=t, k_scale=x.k_scale,
                                                                  v_scale=x.v_scale),
                      lambda o: np.asarray(o, np.float32).transpose(0, 2, 1, 3),
                      "fa2cpu.flash_attention_with_kvcache")
    n = max(case.seqlens)
    return Runner(lambda: fa2cpu.flash_attention_varlen(
                      x.q, x.k, x.v, x.cu_seqlens, x.cu_seqlens, max_seqlen_q=n, max_seqlen_k=n,
                      causal=case.causal, num_threads=t),
                  lambda o: np.asarray(o, np.float32), "fa2cpu.flash_attention_varlen")


def numpy_runner(case: Case, x: Inputs, threads: int, max_bytes: int) -> Runner | str:
    """The naive baseline, or the reason it is skipped."""
    if case.score_bytes > max_bytes:
        return (f"numpy skipped: its score matrix needs {case.score_bytes >> 20} MiB "
                f"(limit --numpy-max-mib {max_bytes >> 20})")
    from threadpoolctl import threadpool_limits
    scale = 1.0 / math.sqrt(case.head_dim)
    problems = baseline_problems(case, x)
    note = "" if case.dtype == "fp32" else "numpy computes in float32 (inputs upcast inside the timed call)"
    return Runner(lambda: [numpy_attention(q, k, v, case.causal, scale) for q, k, v in problems],
                  lambda outs: canonical(case, outs), "numpy naive (matmul, softmax, matmul)", note,
                  lambda: threadpool_limits(limits=threads, user_api="blas"))


def to_torch(torch, a: np.ndarray):
    """A torch tensor sharing a's memory and values (bf16 by bit pattern: no rounding)."""
    if a.dtype == DTYPES["bf16"]:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def torch_threads(torch, threads: int):
    """A context manager running torch on `threads` threads."""
    @contextlib.contextmanager
    def limits():
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)
    return limits


def torch_runner(case: Case, x: Inputs, threads: int, torch) -> Runner:
    """torch SDPA on contiguous bhsd tensors, its preferred layout (see baseline_problems)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    note = ""
    problems = []
    for q, k, v in baseline_problems(case, x):
        kw = {"scale": 1.0 / math.sqrt(case.head_dim), "enable_gqa": case.heads_q != case.heads_kv}
        nq, nk = q.shape[2], k.shape[2]
        if case.causal and nq == nk:
            kw["is_causal"] = True
        elif case.causal:   # is_causal is top-left aligned when Nq != Nk: pass the bottom-right mask
            kw["attn_mask"] = torch.from_numpy(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq)
            note = "torch: explicit bottom-right causal mask (is_causal is top-left aligned when Nq != Nk)"
        problems.append(tuple(to_torch(torch, a) for a in (q, k, v)) + (kw,))

    def call():
        with torch.inference_mode():
            return [sdpa(tq, tk, tv, **kw) for tq, tk, tv, kw in problems]

    api = "torch.nn.functional.scaled_dot_product_attention"
    return Runner(call, lambda outs: canonical(case, [o.float().numpy() for o in outs]),
                  api if case.mode != "varlen" else api + " (loop over sequences)", note,
                  torch_threads(torch, threads))


def warm_up(isas: list[str], dtypes: list[str], threads: list[int], torch) -> None:
    """Untimed calls of every implementation before the first timed row, so that none of them
    pays its one-time costs there (thread start-up, first-touch page faults of scratch buffers,
    torch's lazy initialisation, CPU frequency ramp-up)."""
    from .timing import measure
    rng = np.random.default_rng(0)
    before = fa2cpu.get_isa()
    try:
        for dtype in dtypes:
            q, k, v = (rng.standard_normal((1, 4, 256, 64), dtype=np.float32).astype(DTYPES[dtype])
                       for _ in range(3))
            for t in threads:
                for isa in isas:
                    fa2cpu.set_isa(isa)
                    measure(lambda: fa2cpu.flash_attention(q, k, v, causal=True, num_threads=t), 1, 1)
                if torch is not None:
                    tq, tk, tv = (to_torch(torch, a) for a in (q, k, v))
                    with torch_threads(torch, t)(), torch.inference_mode():
                        measure(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv), 1, 1)
    finally:
        fa2cpu.set_isa(before)
