# bwd_only.py H N CAUSAL(0|1) REPS bf16|fp32: the backward alone, median ms (threads from OMP_NUM_THREADS / the default)
import sys, time, numpy as np, ml_dtypes, fa2cpu
H, N, causal, reps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
dt = ml_dtypes.bfloat16 if sys.argv[5] == "bf16" else np.float32
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((1, H, N, 128)).astype(dt) for _ in range(4))
o, lse = fa2cpu.flash_attention(q, k, v, causal=causal, return_lse=True)
ts = []
for _ in range(reps):
    t = time.perf_counter(); fa2cpu.flash_attention_backward(do, q, k, v, o, lse, causal=causal); ts.append(time.perf_counter() - t)
print("bwd %.1f ms" % (1e3 * np.median(ts)))
