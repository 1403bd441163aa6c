# scaling.py H N CAUSAL DTYPE REPS T1,T2,...: forward and backward medians (ms) of one build at each
# thread count, interleaved per repetition; prints per-thread-count time, speedup over the first
# count and bwd / fwd (is the 16-thread bwd / fwd miss a scaling loss of the backward?).
import sys, time, numpy as np, ml_dtypes, fa2cpu
H, N, causal, dtype, reps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4], int(sys.argv[5])
threads = [int(t) for t in sys.argv[6].split(",")]
dt = ml_dtypes.bfloat16 if dtype == "bf16" else np.float32
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((1, H, N, 128)).astype(dt) for _ in range(4))
o, lse = fa2cpu.flash_attention(q, k, v, causal=causal, return_lse=True)
t = {(T, w): [] for T in threads for w in ("fwd", "bwd")}
for _ in range(reps):
    for T in threads:
        a = time.perf_counter(); fa2cpu.flash_attention(q, k, v, causal=causal, num_threads=T); b = time.perf_counter()
        fa2cpu.flash_attention_backward(do, q, k, v, o, lse, causal=causal, num_threads=T); c = time.perf_counter()
        t[T, "fwd"].append(b - a); t[T, "bwd"].append(c - b)
m = {key: 1e3 * float(np.median(x)) for key, x in t.items()}
T0 = threads[0]
for T in threads:
    print(f"{dtype} H={H} N={N} causal={int(causal)} T={T}: fwd {m[T,'fwd']:.2f} ms (x{m[T0,'fwd']/m[T,'fwd']:.2f} of T={T0}), "
          f"bwd {m[T,'bwd']:.2f} ms (x{m[T0,'bwd']/m[T,'bwd']:.2f}), bwd/fwd {m[T,'bwd']/m[T,'fwd']:.2f}")
