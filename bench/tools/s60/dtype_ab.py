"""fp32 against bf16 inputs through the same float32 family, alternating in one process (session 60,
2-core Intel Ice Lake-SP: bf16 read 73-75 % of the FMA probe, fp32 65 %).
    PYTHONPATH=$PWD python bench/tools/s60/dtype_ab.py THREADS H N CAUSAL REPS [ENV=VAL ...]"""
import os
import statistics
import sys
import time

import ml_dtypes
import numpy as np

import fa2cpu

T, H, N, causal, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
rng = np.random.default_rng(0)
arrs = {dt: [rng.standard_normal((1, H, N, 128), dtype=np.float32).astype(dt) for _ in range(3)]
        for dt in (np.float32, ml_dtypes.bfloat16)}
flops = 4.0 * H * N * N * 128 / (2 if causal else 1)
times = {dt: [] for dt in arrs}
for _ in range(reps):
    for dt, (q, k, v) in arrs.items():
        fa2cpu.flash_attention(q, k, v, causal=causal, num_threads=T)
        t0 = time.perf_counter()
        fa2cpu.flash_attention(q, k, v, causal=causal, num_threads=T)
        times[dt].append(time.perf_counter() - t0)
pk = fa2cpu._core.peak_gflops(fa2cpu.get_isa(), "fp32", T, 0.2)
for dt, ts in times.items():
    m = statistics.median(ts)
    print(f"{np.dtype(dt).name:9s} {m * 1e3:9.2f} ms {flops / m / 1e9:7.1f} GF/s {100 * flops / m / 1e9 / pk:5.1f}% of {pk:.0f}")
