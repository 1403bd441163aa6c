"""Cost of attention sinks in prefill: flash_attention with and without sinks=, alternated in one
process (B=1, D=128, Hq=Hk), median ms of each and the ratio.

    python bench/sinks_cost.py [--threads 2] [--heads 8] [--n 2048] [--reps 9]
"""
import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import fa2cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    sinks = rng.standard_normal(a.heads).astype(np.float32)
    print(f"# fa2cpu {fa2cpu.get_isa()}, {a.threads} threads, B=1 H={a.heads} N={a.n} D=128")
    for name, dt in (("fp32", np.float32), ("bf16", ml_dtypes.bfloat16)):
        q, k, v = (rng.standard_normal((1, a.heads, a.n, 128), dtype=np.float32).astype(dt) for _ in range(3))
        for causal in (False, True):
            times = {False: [], True: []}
            for _ in range(a.reps):
                for with_sinks in (False, True):
                    t0 = time.perf_counter()
                    fa2cpu.flash_attention(q, k, v, causal=causal, num_threads=a.threads,
                                           sinks=sinks if with_sinks else None)
                    times[with_sinks].append(time.perf_counter() - t0)
            plain, sunk = statistics.median(times[False]), statistics.median(times[True])
            print(f"{name} {'causal' if causal else 'full':6s}  no sinks {plain * 1e3:8.2f} ms   sinks {sunk * 1e3:8.2f} ms"
                  f"   sinks/no sinks {sunk / plain:.3f}", flush=True)


if __name__ == "__main__":
    main()
