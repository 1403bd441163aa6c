"""Decode with a quantized KV cache against the float caches, alternated in one process: B
sequences, Hq/Hk heads, Nk cached tokens, D=128 (issue 13's case by default). Per cache: median ms,
GB/s of cache bytes actually read (codes + float32 scales for int8/fp8; q and out included), % of
the read bandwidth probed in the same process, tokens/s, and tokens/s over the bf16 cache's.
Float caches need nothing beyond the float API (the script also runs against older builds).

    python bench/kv_quant.py [--threads 2] [--batch 16] [--nk 8192] [--reps 15] [--caches bf16,int8,fp8]
"""
import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import fa2cpu
from fa2cpu import _core


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--nk", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--q-dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--caches", default="bf16,int8,fp8", help="among fp32, bf16, int8, fp8")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    bw = _core.read_bandwidth_gbs(a.threads)
    print(f"# fa2cpu {fa2cpu.get_isa()}, {a.threads} threads, B={a.batch} Hq={a.heads} Hk={a.kv_heads} "
          f"Nk={a.nk} D={a.dim}, q {a.q_dtype}; read bandwidth probe {bw:.1f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    qdt = {"bf16": ml_dtypes.bfloat16, "fp32": np.float32}[a.q_dtype]
    B, Hk, N, D = a.batch, a.kv_heads, a.nk, a.dim
    runs = {}
    for name in a.caches.split(","):
        if name in ("int8", "fp8"):   # codes + float32 scales, by the library's append rule
            from fa2cpu.attention import _quantize
            code = np.dtype(np.int8) if name == "int8" else np.dtype(ml_dtypes.float8_e4m3fn)
            kv = []
            for _ in range(2):
                c, s = np.empty((B, N, Hk, D), code), np.empty((B, N, Hk), np.float32)
                for b in range(B):
                    c[b], s[b] = _quantize(rng.standard_normal((N, Hk, D), np.float32), c, True)
                kv += [c, s]
            q = rng.standard_normal((B, 1, a.heads, D), np.float32).astype(qdt)
            cache_bytes = 2 * B * N * Hk * (D + 4)
            runs[name] = (q.nbytes * 2 + cache_bytes, lambda q=q, kv=kv: fa2cpu.flash_attention_with_kvcache(
                q, kv[0], kv[2], k_scale=kv[1], v_scale=kv[3], num_threads=a.threads))
        else:                         # a float cache: q, K, V in one dtype
            dt = {"bf16": ml_dtypes.bfloat16, "fp32": np.float32}[name]
            k, v = (rng.standard_normal((B, N, Hk, D), np.float32).astype(dt) for _ in range(2))
            q = rng.standard_normal((B, 1, a.heads, D), np.float32).astype(dt)
            runs[name] = (q.nbytes * 2 + k.nbytes + v.nbytes, lambda q=q, k=k, v=v: fa2cpu.flash_attention_with_kvcache(
                q, k, v, num_threads=a.threads))
    times = {n: [] for n in runs}
    for _ in range(a.reps):
        for name, (_, call) in runs.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["bf16"]) if "bf16" in times else None
    for name, (nbytes, _) in runs.items():
        t = statistics.median(times[name])
        gbs = nbytes / t / 1e9
        line = (f"{name:5s} cache  {t * 1e3:8.2f} ms  [{min(times[name]) * 1e3:.2f}..{max(times[name]) * 1e3:.2f}]"
                f"  {gbs:6.1f} GB/s  {100 * gbs / bw:4.0f}% bw  {a.batch / t:8.0f} tok/s")
        if base:
            line += f"  x{base / t:.2f} bf16's tok/s"
        print(line, flush=True)


if __name__ == "__main__":
    main()
