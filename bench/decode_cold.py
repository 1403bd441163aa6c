"""One decode step's attention, hot and cold: fa2cpu (fa2cpu.torch.flash_attention_with_kvcache on a
KVCache-like (B, N, Hk, D) bf16 cache) against torch SDPA (enable_gqa), B=1 Hq=16 Hk=4 N=2048
D=128, median microseconds of 50 calls, with this between calls:
  hot    nothing (K/V stay in the caches, threads spin)
  evict  an in-place add over 64 MB (K/V leave the caches)
  gemm   four (1 x 2048) x (2048 x 5632) bf16 matmuls (a model's MLP between two attentions)
  sleep  2 ms of sleep (OpenMP threads go idle)
In a model, decode attention runs in the cold states: this shows how far from its hot time.

    python bench/decode_cold.py 16          # threads
    python bench/decode_cold.py 16 huge     # K/V cache in transparent huge pages (madvise)
"""
import os, sys, time, statistics
T = int(sys.argv[1]); os.environ.setdefault("OMP_NUM_THREADS", str(T))
import numpy as np, ml_dtypes, torch
import fa2cpu.torch as ft
torch.set_num_threads(T)
B, Hq, Hk, N, D = 1, 16, 4, 2048, 128
g = torch.Generator().manual_seed(0)
import mmap
def alloc(shape, huge):
    n = int(np.prod(shape)) * 2
    if not huge: return torch.empty(shape, dtype=torch.bfloat16)
    m = mmap.mmap(-1, (n + (2 << 20) - 1) // (2 << 20) * (2 << 20))
    m.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(m, dtype=torch.bfloat16, count=n // 2).view(shape)
HUGE = len(sys.argv) > 2 and sys.argv[2] == "huge"
kc = alloc((B, N + 64, Hk, D), HUGE); kc.copy_(torch.randn(B, N + 64, Hk, D, generator=g))
vc = alloc((B, N + 64, Hk, D), HUGE); vc.copy_(torch.randn(B, N + 64, Hk, D, generator=g))
q = torch.randn(B, 1, Hq, D, generator=g).to(torch.bfloat16)
kt, vt = kc[:, :N].transpose(1, 2).contiguous(), vc[:, :N].transpose(1, 2).contiguous()
qt = q.transpose(1, 2).contiguous()
seqlens = torch.full((B,), N, dtype=torch.int32)
big = torch.randn(64 << 20 >> 2)          # 64 MB: evicts the L3
w = torch.randn(5632, 2048).to(torch.bfloat16); x = torch.randn(1, 2048).to(torch.bfloat16)
def fa(): ft.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
def sd(): torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
between = {"hot": lambda: None, "evict": lambda: big.add_(1.0), "gemm": lambda: [torch.mm(x, w.t()) for _ in range(4)],
           "sleep": lambda: time.sleep(0.002)}
for rnd in range(2):
    for mode, f in between.items():
        r = {}
        for name, fn in (("fa2cpu", fa), ("sdpa", sd)):
            ts = []
            for i in range(60):
                f()
                t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
            r[name] = statistics.median(ts[10:]) * 1e6
        print(f"{T} thr {'huge' if HUGE else '4k'} {mode:6s}: fa2cpu {r['fa2cpu']:7.1f} us  sdpa {r['sdpa']:7.1f} us  ratio {r['sdpa'] / r['fa2cpu']:.2f}", flush=True)
