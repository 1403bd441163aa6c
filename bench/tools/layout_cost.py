"""What memory layout costs the forward: the same fp32 (or bf16) problem (B=1, H heads, N=Nq=Nk, D=128)
with all of q, k, v contiguous bhsd, then q, then k and v, then all three as bhsd views of
contiguous bshd arrays (rows H * D apart), alternated in one process; median ms and the ratio to
contiguous. bench/RESULTS.md, session 33: strided K/V were what cost.

    python bench/tools/layout_cost.py THREADS H N [CAUSAL(0|1)] [REPS] [DTYPE(fp32|bf16)]
"""
import sys
import time

import numpy as np

import fa2cpu

T, H, N = (int(x) for x in sys.argv[1:4])
causal = len(sys.argv) > 4 and sys.argv[4] == "1"
reps = int(sys.argv[5]) if len(sys.argv) > 5 else 5
dtype = sys.argv[6] if len(sys.argv) > 6 else "fp32"
if dtype not in ("fp32", "bf16"):
    sys.exit(f"DTYPE: fp32 or bf16, not {dtype!r}")
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, H, N, 128), dtype=np.float32) for _ in range(3))
if dtype == "bf16":
    import ml_dtypes

    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
qs, ks, vs = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, k, v))
cases = {"contiguous": (q, k, v), "q strided": (qs, k, v), "k, v strided": (q, ks, vs), "all strided": (qs, ks, vs)}
times = {name: [] for name in cases}
for name, a in cases.items():
    fa2cpu.flash_attention(*a, causal=causal, num_threads=T)
for _ in range(reps):
    for name, a in cases.items():
        t = time.perf_counter()
        fa2cpu.flash_attention(*a, causal=causal, num_threads=T)
        times[name].append(time.perf_counter() - t)
base = np.median(times["contiguous"])
print(f"# fa2cpu {fa2cpu.get_isa()}, {T} threads, {dtype} B=1 H={H} N={N} D=128 causal={causal}, median of {reps}")
for name in cases:
    m = np.median(times[name])
    print(f"{name:14s} {m * 1e3:9.1f} ms  {m / base:.3f}x")
