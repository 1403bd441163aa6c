"""Decode on a DynamicCache-like K/V, B=1 Hq=16 Hk=4 D=128 bf16, 2048+ keys, THREADS threads:
fa2cpu.torch.flash_attention (its lean route, given the bshd views that the transformers
integration passes) against torch SDPA, median microseconds of 50 steps; the second pass also
times the part inside the core call (_core.run_strided). Scenarios: hot (the same K/V every
step), cat (fresh K/V from torch.cat each step, as DynamicCache makes them), cat+stream (also a
96 MB torch write between the calls, like a layer's weights streaming through the caches).

    python bench/dynamic_cache_decode.py THREADS
"""
import sys, time, statistics, math
import torch, numpy as np
import torch.nn.functional as F
import fa2cpu.torch as ft
import fa2cpu._core as core
T = int(sys.argv[1]); torch.set_num_threads(T)
print("threads", T, "backend", core.parallel_backend(), "max_threads", core.max_threads(), flush=True)
KT = [0.0]
raw = core.run_strided
def timed_raw(*a, **k):
    t = time.perf_counter(); r = raw(*a, **k); KT[0] += time.perf_counter() - t; return r

dt = torch.bfloat16; B, Hq, Hk, D = 1, 16, 4, 128
buf = torch.zeros(96 << 18)  # 96 MB float32
def scen(kind, steps=60):
    K = torch.randn(B, Hk, 2048, D).to(dt); V = torch.randn(B, Hk, 2048, D).to(dt)
    q = torch.randn(B, Hq, 1, D).to(dt)
    tf, ts, tk = [], [], []
    for s in range(steps):
        if kind != "hot":
            K = torch.cat([K, torch.randn(B, Hk, 1, D).to(dt)], dim=2); V = torch.cat([V, torch.randn(B, Hk, 1, D).to(dt)], dim=2)
        if kind == "cat+stream": buf.add_(1.0)
        KT[0] = 0.0
        t0 = time.perf_counter()
        ft.flash_attention(q.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2), scale=1 / math.sqrt(D), layout="bshd")
        tf.append(time.perf_counter() - t0); tk.append(KT[0])
        if kind == "cat+stream": buf.add_(1.0)
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, K, V, enable_gqa=True)
        ts.append(time.perf_counter() - t0)
    f, k, sd = (statistics.median(x[10:]) * 1e6 for x in (tf, tk, ts))
    print(f"{kind:11s} fa2cpu {f:7.0f} us (in run_strided {k:6.0f}) sdpa {sd:7.0f} us  sdpa/fa2cpu {sd/f:4.2f}", flush=True)
for patched in (False, True):
    if patched: core.run_strided = timed_raw  # fa2cpu.torch looks it up on the module per call
    for kind in ("hot", "cat", "cat+stream"): scen(kind)
