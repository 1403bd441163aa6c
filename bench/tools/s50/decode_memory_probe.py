"""Where issue 13's decode time goes: the bf16 and int8 caches (B=16 Hq=32 Hk=8 Nk=8192 D=128,
bf16 q) timed alternately in one process in three forms:
  real  the cache as the benchmark reads it (bench/kv_quant.py);
  cold  the same, with the last-level cache flushed before every call (a write pass over an
        EVICT_MB buffer: what a server's decode step meets after the model's weights streamed by);
  l3    every sequence aliases the first (a zero batch stride: the same items and arithmetic
        over 16 / 32 MB of int8 / bf16 K and V, which stay in the last-level cache; a timing
        probe). (A zero stride along N would change the plan: a cache whose row stride is below
        its head stride is not read as interleaved, and items then hold one kv head.)
Prints per form the median ms, GB/s of cache bytes, cycles per (key, kv head) per thread at the
nominal GHz given, and int8's tokens/s over bf16's.

    python bench/tools/s50/decode_memory_probe.py THREADS REPS EVICT_MB [GHZ]
"""
import statistics
import sys
import time

import ml_dtypes
import numpy as np

import fa2cpu
from fa2cpu import _core
from fa2cpu.attention import _quantize

T, reps, evict_mb = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ghz = float(sys.argv[4]) if len(sys.argv) > 4 else 2.6
B, Hq, Hk, N, D = 16, 32, 8, 8192, 128
rng = np.random.default_rng(0)
q = rng.standard_normal((B, 1, Hq, D), np.float32).astype(ml_dtypes.bfloat16)
bf = [rng.standard_normal((B, N, Hk, D), np.float32).astype(ml_dtypes.bfloat16) for _ in range(2)]
i8 = []
for _ in range(2):
    c, s = np.empty((B, N, Hk, D), np.int8), np.empty((B, N, Hk), np.float32)
    for b in range(B):
        c[b], s[b] = _quantize(rng.standard_normal((N, Hk, D), np.float32), c, True)
    i8 += [c, s]
alias = lambda a: np.broadcast_to(a[:1], a.shape)
nbytes = {"bf16": 2 * B * N * Hk * D * 2, "int8": 2 * B * N * Hk * (D + 4)}


def call(kv):
    if len(kv) == 2:
        return lambda: fa2cpu.flash_attention_with_kvcache(q, kv[0], kv[1], num_threads=T)
    return lambda: fa2cpu.flash_attention_with_kvcache(q, kv[0], kv[2], k_scale=kv[1], v_scale=kv[3], num_threads=T)


big = np.zeros(evict_mb << 17) if evict_mb else None
runs = {("real", "bf16"): call(bf), ("real", "int8"): call(i8),
        ("l3", "bf16"): call([alias(x) for x in bf]), ("l3", "int8"): call([alias(x) for x in i8])}
if big is not None:
    runs[("cold", "bf16")] = runs[("real", "bf16")]
    runs[("cold", "int8")] = runs[("real", "int8")]
ts = {k: [] for k in runs}
for _ in range(reps):
    for key, f in runs.items():
        if key[0] == "cold":
            big += 1.0
        t0 = time.perf_counter()
        f()
        ts[key].append(time.perf_counter() - t0)
bw = _core.read_bandwidth_gbs(T)
print(f"# {fa2cpu.get_isa()}, {T} threads, read probe {bw:.1f} GB/s, evict {evict_mb} MB, reps {reps}")
for form in ("real", "cold", "l3"):
    m = {c: statistics.median(ts[(form, c)]) for c in ("bf16", "int8") if (form, c) in ts}
    if not m:
        continue
    for c, t in m.items():
        print(f"{form:4s} {c}  {t * 1e3:7.2f} ms  {nbytes[c] / t / 1e9:6.1f} GB/s  "
              f"{t * T / (B * N * Hk) * ghz * 1e9:6.1f} cycles/(key, kv head)/thread at {ghz} GHz")
    print(f"{form:4s} int8 / bf16 tokens/s {m['bf16'] / m['int8']:.2f}x")
