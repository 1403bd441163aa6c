# kstride.py H N REPS: fp32 forward with contiguous K/V, K/V (and Q) rows 544 B apart, and bf16, one thread, interleaved medians (session 56, Zen 3)
import sys, time, numpy as np, ml_dtypes, fa2cpu
H, N, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
q = rng.standard_normal((1, H, N, 128)).astype(np.float32)
k = rng.standard_normal((1, H, N, 128)).astype(np.float32); v = rng.standard_normal((1, H, N, 128)).astype(np.float32)
kb = np.zeros((1, H, N, 136), np.float32); kb[..., :128] = k; ks = kb[..., :128]
vb = np.zeros((1, H, N, 136), np.float32); vb[..., :128] = v; vs = vb[..., :128]
qb = np.zeros((1, H, N, 136), np.float32); qb[..., :128] = q; qs = qb[..., :128]
kbf, vbf, qbf = (x.astype(ml_dtypes.bfloat16) for x in (k, v, q))
cases = {"fp32": (q, k, v), "fp32 K,V stride 136": (q, ks, vs), "fp32 Q,K,V stride 136": (qs, ks, vs), "bf16": (qbf, kbf, vbf)}
T = {c: [] for c in cases}
for _ in range(reps):
    for c, (a, b, d) in cases.items():
        t = time.perf_counter(); fa2cpu.flash_attention(a, b, d, num_threads=1); T[c].append(time.perf_counter() - t)
fl = 4 * N * N * 128 * H
for c in cases: print(f"{c:24s} {1e3*np.median(T[c]):8.1f} ms {fl/np.median(T[c])/1e9:6.1f} GFLOP/s")
