"""In-process A/B of the backward's gradient arrays: np.zeros (before session 47) against
np.empty (fa2cpu/backward.py _gradients), same build, calls alternated; prints medians and
zeros / empty (> 1: np.empty faster).

    PYTHONPATH=$PWD python bench/tools/s47/grad_alloc_ab.py THREADS HEADS N REPS [DTYPES] [CAUSAL]
"""
import statistics
import sys
import time

import ml_dtypes
import numpy as np

import fa2cpu
import fa2cpu.backward as bw

threads, heads, n, reps = (int(x) for x in sys.argv[1:5])
dtypes = sys.argv[5].split(",") if len(sys.argv) > 5 else ["fp32", "bf16"]
causals = [c == "1" for c in sys.argv[6].split(",")] if len(sys.argv) > 6 else [False, True]
empty = bw._gradients


def zeros(q, k, v):
    return np.zeros(q.shape, q.dtype), np.zeros(k.shape, q.dtype), np.zeros(v.shape, q.dtype)


rng = np.random.default_rng(0)
for dt in dtypes:
    npdt = ml_dtypes.bfloat16 if dt == "bf16" else np.float32
    q, k, v, do = (rng.standard_normal((1, heads, n, 128), dtype=np.float32).astype(npdt) for _ in range(4))
    for causal in causals:
        o, lse = fa2cpu.flash_attention(q, k, v, causal=causal, return_lse=True, num_threads=threads)
        ts = {"zeros": [], "empty": []}
        res = {}
        for i in range(2 * reps + 2):
            name = "zeros" if i % 2 == 0 else "empty"
            bw._gradients = zeros if name == "zeros" else empty
            t0 = time.perf_counter()
            res[name] = fa2cpu.flash_attention_backward(do, q, k, v, o, lse, causal=causal, num_threads=threads)
            if i >= 2:
                ts[name].append(time.perf_counter() - t0)
        same = all(a.tobytes() == b.tobytes() for a, b in zip(res["zeros"], res["empty"]))
        mz, me = statistics.median(ts["zeros"]), statistics.median(ts["empty"])
        print(f"{dt} T={threads} H={heads} N={n} causal={causal}: zeros {mz * 1e3:.1f} ms, empty {me * 1e3:.1f} ms, "
              f"zeros/empty {mz / me:.3f}; same bits {same}", flush=True)
bw._gradients = empty
