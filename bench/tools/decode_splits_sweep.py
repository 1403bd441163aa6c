"""Decode at T threads: B sequences of N keys (Hq=32 Hk=8 D=128, bf16 q), bf16 and int8 caches,
num_splits among SPLITS (0 = auto), interleaved; medians (bench/RESULTS.md session 43).

    PYTHONPATH=$PWD python bench/tools/decode_splits_sweep.py T B N REPS SPLITS
    e.g. PYTHONPATH=$PWD python bench/tools/decode_splits_sweep.py 16 16 8192 7 0,2,4,8,16,32
"""
import sys, time, statistics
import numpy as np
sys.path.insert(0, "bench")
import fa2cpu
from ab_inproc import decode_case
T, B, N, reps = (int(x) for x in sys.argv[1:5])
splits = [int(x) for x in sys.argv[5].split(",")]
rng = np.random.default_rng(0)
cases = {c: decode_case(c, rng, B=B, N=N) for c in ("bf16", "int8")}
times = {(c, s): [] for c in cases for s in splits}
for _ in range(reps):
    for c, (args, kw) in cases.items():
        for s in splits:
            fa2cpu.flash_attention_with_kvcache(*args, num_threads=T, num_splits=s, **kw)
            t = time.perf_counter()
            fa2cpu.flash_attention_with_kvcache(*args, num_threads=T, num_splits=s, **kw)
            times[(c, s)].append(time.perf_counter() - t)
med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
for c in cases:
    print(f"T={T} B={B} N={N} {c}: " + ", ".join(f"s{s} {med[(c, s)]:.2f}" for s in splits) + " ms")
