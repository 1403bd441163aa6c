"""Backward phase shares from a build with bench/tools/s58/backward_phases.patch applied (TSC per
phase of BackwardLoop::run_item, summed over threads, printed to stderr at exit), beside our
forward and backward medians. The shares cover the items only (not the driver's dq sums).

    git archive HEAD | tar -x -C /tmp/pt && cd /tmp/pt && patch -p1 < bench/tools/s58/backward_phases.patch
    python setup.py build_ext --inplace     # FA2CPU_DISABLE=... to build fewer families
    PYTHONPATH=/tmp/pt python bench/tools/s58/phases.py DTYPE THREADS HEADS N CAUSAL REPS
"""
import sys, time
import ml_dtypes
import numpy as np
import fa2cpu

dtype, T, H, N, causal, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1", int(sys.argv[6])
dt = ml_dtypes.bfloat16 if dtype == "bf16" else np.float32
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((1, H, N, 128)).astype(dt) for _ in range(4))
o, lse = fa2cpu.flash_attention(q, k, v, causal=causal, return_lse=True, num_threads=T)
fwd, bwd = [], []
for _ in range(reps):
    a = time.perf_counter(); fa2cpu.flash_attention(q, k, v, causal=causal, num_threads=T)
    b = time.perf_counter(); fa2cpu.flash_attention_backward(do, q, k, v, o, lse, causal=causal, num_threads=T)
    c = time.perf_counter(); fwd.append(b - a); bwd.append(c - b)
f, g = 1e3 * float(np.median(fwd)), 1e3 * float(np.median(bwd))
print(f"{fa2cpu.get_isa()} {dtype} T={T} H={H} N={N} causal={int(causal)}: fwd {f:.1f} ms, bwd {g:.1f} ms, bwd/fwd {g / f:.2f}", flush=True)
