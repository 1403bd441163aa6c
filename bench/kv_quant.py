"""Decode with a quantized KV cache against the float caches, alternated in one process: B
sequences, Hq/Hk heads, Nk cached tokens, D=128 (issue 13's case by default). Per cache: median ms,
GB/s of cache bytes actually read (codes + float32 scales for int8/fp8; q and out included), % of
the read bandwidth probed in the same process, tokens/s, and tokens/s over the bf16 cache's.

    python bench/kv_quant.py [--threads 2] [--batch 16] [--nk 8192] [--reps 15] [--caches bf16,int8,fp8]
"""
import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import fa2cpu
from fa2cpu import _core
from fa2cpu.bench.cases import Case, make_inputs


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
    runs = {}
    for name in a.caches.split(","):
        quant = name in ("int8", "fp8")
        case = Case("decode", a.q_dtype if quant else name, False, a.batch, a.heads, a.kv_heads, 1, a.nk,
                    a.dim, a.dim, None, name if quant else None)
        x = make_inputs(case, 0)
        q = x.q if not quant or a.q_dtype == "bf16" else x.q.astype(np.float32)
        if not quant and a.q_dtype != name:  # q in the cache's dtype: one dtype for q and a float cache
            q = x.q.astype(x.k.dtype)
        runs[name] = (case, lambda q=q, x=x: fa2cpu.flash_attention_with_kvcache(
            q, x.k, x.v, k_scale=x.k_scale, v_scale=x.v_scale, num_threads=a.threads))
    times = {n: [] for n in runs}
    for _ in range(a.reps):
        for name, (_, call) in runs.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["bf16"]) if "bf16" in times else None
    for name, (case, _) in runs.items():
        t = statistics.median(times[name])
        gbs = case.bytes / t / 1e9
        line = (f"{name:5s} cache  {t * 1e3:8.2f} ms  [{min(times[name]) * 1e3:.2f}..{max(times[name]) * 1e3:.2f}]"
                f"  {gbs:6.1f} GB/s  {100 * gbs / bw:4.0f}% bw  {a.batch / t:8.0f} tok/s")
        if base:
            line += f"  x{base / t:.2f} bf16's tok/s"
        print(line, flush=True)


if __name__ == "__main__":
    main()
