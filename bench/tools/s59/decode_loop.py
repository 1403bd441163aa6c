# decode_loop.py CACHE THREADS B NK REPS: one decode call (Hq=32 Hk=8 D=128, bf16 q) timed in a loop, for perf record (session 59).
import sys, time, numpy as np, ml_dtypes, fa2cpu
from fa2cpu.attention import _quantize
name, T, B, N, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
Hk, D, Hq = 8, 128, 32
rng = np.random.default_rng(0)
q = rng.standard_normal((B, 1, Hq, D), np.float32).astype(ml_dtypes.bfloat16)
if name == "int8":
    kv = []
    for _ in range(2):
        c, s = np.empty((B, N, Hk, D), np.int8), np.empty((B, N, Hk), np.float32)
        for b in range(B): c[b], s[b] = _quantize(rng.standard_normal((N, Hk, D), np.float32), c, True)
        kv += [c, s]
    f = lambda: fa2cpu.flash_attention_with_kvcache(q, kv[0], kv[2], k_scale=kv[1], v_scale=kv[3], num_threads=T)
else:
    k, v = (rng.standard_normal((B, N, Hk, D), np.float32).astype(ml_dtypes.bfloat16) for _ in range(2))
    f = lambda: fa2cpu.flash_attention_with_kvcache(q, k, v, num_threads=T)
f(); ts = []
for _ in range(reps):
    a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
m = float(np.median(ts)); print(f"{name} T={T} B={B} N={N}: {m*1e3:.3f} ms, {B*N*Hk*(2*D*(1 if name=='int8' else 2)+(8 if name=='int8' else 0))/m/1e9:.1f} GB/s, {B*N*Hk/m/1e9*1e3:.1f} M key-heads/s")
