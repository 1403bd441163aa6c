"""Decode kernel time by thread count, B=1 Hq=16 Hk=4 Nk=2048 D=128 bf16, NumPy API timed hot
(median of 200 calls after 50), microseconds: a head-major cache (layout="bhsd": one item per kv
head, split by keys, 4 merge groups) against an interleaved one (bshd: items span the heads, one
merge group), num_splits auto / 8 / 16.

    python bench/decode_scaling.py torch   # fa2cpu on torch's OpenMP runtime (import fa2cpu.torch)
    python bench/decode_scaling.py pool    # fa2cpu's own thread pool
"""
import sys, time, statistics

import ml_dtypes
import numpy as np

import fa2cpu
if len(sys.argv) > 1 and sys.argv[1] == "torch":
    import fa2cpu.torch, torch
import fa2cpu._core as core
print("backend", core.parallel_backend(), flush=True)
rng = np.random.default_rng(0)
B, Hq, Hk, N, D = 1, 16, 4, 2048, 128
bf = ml_dtypes.bfloat16
kh = rng.standard_normal((B, Hk, N, D), np.float32).astype(bf); vh = rng.standard_normal((B, Hk, N, D), np.float32).astype(bf)
ki = np.ascontiguousarray(kh.transpose(0, 2, 1, 3)); vi = np.ascontiguousarray(vh.transpose(0, 2, 1, 3))
qh = rng.standard_normal((B, Hq, 1, D), np.float32).astype(bf); qi = np.ascontiguousarray(qh.transpose(0, 2, 1, 3))
def t(f):
    ts = []
    for i in range(250):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts[50:]) * 1e6
for T in (1, 2, 4, 8, 16):
    if "torch" in sys.argv: torch.set_num_threads(T)
    row = []
    for ns in (0, 8, 16):
        a = t(lambda: fa2cpu.flash_attention_with_kvcache(qh, kh, vh, layout="bhsd", num_splits=ns, num_threads=T))
        b = t(lambda: fa2cpu.flash_attention_with_kvcache(qi, ki, vi, num_splits=ns, num_threads=T))
        row.append(f"splits {ns:2d}: bhsd {a:5.0f} interleaved {b:5.0f}")
    print(f"threads {T:2d} | " + " | ".join(row), flush=True)
