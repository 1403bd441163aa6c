"""fwd_pct.py T H N CAUSAL(0|1) fp32|bf16 ROUNDS: the amx family's multiply-add probe, then the best of 3
forward calls, as GFLOP/s and % of that probe, ROUNDS times (session 48)."""
import sys, time, numpy as np, ml_dtypes, fa2cpu
from fa2cpu import _core
T, H, N, causal, dt, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5], int(sys.argv[6])
ndt = ml_dtypes.bfloat16 if dt == "bf16" else np.float32
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, H, N, 128)).astype(ndt) for _ in range(3))
out = np.empty_like(q)
fl = 4.0 * H * N * N * 128 * (0.5 if causal else 1.0)
for r in range(reps):
    pk = _core.peak_gflops("amx", "fp32" if dt == "fp32" else "bf16", T, 0.2)
    ts = []
    for _ in range(3):
        t = time.perf_counter(); fa2cpu.flash_attention(q, k, v, causal=causal, num_threads=T, out=out); ts.append(time.perf_counter() - t)
    g = fl / min(ts) * 1e-9
    print(f"{dt} T={T} H={H} N={N} causal={causal}: {1e3*min(ts):.1f} ms {g:.0f} GFLOP/s, probe {pk:.0f}, {100*g/pk:.0f} %")
