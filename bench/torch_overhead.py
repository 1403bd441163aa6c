"""Python overhead of a tiny decode call: fa2cpu.torch / NumPy API vs the raw kernel call.

One decode step, flash_attention_with_kvcache with B=1, Nq=1, Hq=Hk=8, D=64, a 256-slot cache
(by default). "raw" is fa2cpu._core.run with every argument prepared in advance (the kernels and
the Cython bridge only); each other row is a public entry point on the same memory. Rows are
timed in interleaved rounds (timeit, `--number` calls per round, best of `--rounds`), so machine
noise hits them alike; overhead = best time - best raw time.

    python bench/torch_overhead.py [--dtype float32|bfloat16|float16] [--seqlen 256] [--threads 1]
"""
import argparse
import platform
import timeit

import numpy as np
import torch

import fa2cpu
import fa2cpu.torch as ft
from fa2cpu import _core
from fa2cpu.bench import long_dtype_arg


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", type=long_dtype_arg,
                   help="float32, bfloat16, float16 (or fp32, bf16, fp16)")
    p.add_argument("--cap", type=int, default=256, help="cache capacity (slots)")
    p.add_argument("--seqlen", type=int, default=256, help="valid cache rows attended (1 isolates overhead)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="num_threads passed to every call")
    p.add_argument("--number", type=int, default=2000, help="calls per round")
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()

    dt = getattr(torch, a.dtype)
    B, H, D, cap, L, nt = 1, a.heads, a.head_dim, a.cap, a.seqlen, a.threads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 1, H, D, generator=g).to(dt)
    kc, vc = (torch.randn(B, cap, H, D, generator=g).to(dt) for _ in range(2))
    kn, vn = (torch.randn(B, 1, H, D, generator=g).to(dt) for _ in range(2))
    out = torch.empty(B, 1, H, D, dtype=dt)
    seq_t = torch.tensor([L], dtype=torch.int32)
    qa, kca, vca, kna, vna, oa = (ft._np(n, t) for n, t in
                                  (("q", q), ("k_cache", kc), ("v_cache", vc), ("k", kn), ("v", vn), ("out", out)))
    views = [x.transpose(0, 2, 1, 3) for x in (qa, kca, vca, oa)]
    total = np.full(B, L, np.int64)
    code = {"float32": 0, "float16": 1, "bfloat16": 2}[a.dtype]

    def raw():
        _core.run(*views, None, dtype=code, batch=B, hq=H, hk=H, nq=1, nk=cap, scale=D ** -0.5,
                  softcap=0.0, win_left=-1, win_right=-1, alibi=None, mask=None, mask_kind=0,
                  cu_q=None, cu_k=None, seqlen_k=total, block_table=None, block_size=cap,
                  num_threads=nt, num_splits=0)

    rows = {
        "raw _core.run (kernels + Cython bridge)": raw,
        "numpy API, int cache_seqlens, out=": lambda: fa2cpu.flash_attention_with_kvcache(
            qa, kca, vca, cache_seqlens=L, num_threads=nt, out=oa),
        "numpy API, append k/v (seqlens L-1)": lambda: fa2cpu.flash_attention_with_kvcache(
            qa, kca, vca, kna, vna, cache_seqlens=L - 1, num_threads=nt, out=oa),
        "torch, int cache_seqlens": lambda: ft.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=L, num_threads=nt),
        "torch, int cache_seqlens, out=": lambda: ft.flash_attention_with_kvcache(
            q, kc, vc, cache_seqlens=L, num_threads=nt, out=out),
        "torch, tensor cache_seqlens, causal": lambda: ft.flash_attention_with_kvcache(
            q, kc, vc, cache_seqlens=seq_t, causal=True, num_threads=nt),
        "torch, append k/v (seqlens L-1)": lambda: ft.flash_attention_with_kvcache(
            q, kc, vc, kn, vn, cache_seqlens=L - 1, num_threads=nt),
        "torch.ops.fa2cpu (dispatcher, compile path)": lambda: torch.ops.fa2cpu.flash_attention_with_kvcache(
            q, kc, vc, None, None, None, L, None, False, None, [-1, -1], None, None, False, 0, nt, out, "bshd"),
    }
    best = {name: float("inf") for name in rows}
    for _ in range(a.rounds):
        for name, fn in rows.items():
            t = timeit.timeit(fn, number=a.number) / a.number
            best[name] = min(best[name], t)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, numpy {np.__version__}, "
          f"isa {fa2cpu.get_isa()}, dtype {a.dtype}, B=1 Nq=1 Hq=Hk={H} D={D} cap={cap} seqlen={L} "
          f"threads={nt}; best of {a.rounds} rounds x {a.number} calls")
    base = best["raw _core.run (kernels + Cython bridge)"]
    for name, t in best.items():
        print(f"{name:45s} {t * 1e6:8.2f} us   overhead {(t - base) * 1e6:7.2f} us")


if __name__ == "__main__":
    main()
