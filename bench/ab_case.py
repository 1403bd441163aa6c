"""One timing for bench/ab.sh: median ms of `--calls` calls of one case (after a warm-up)."""
import argparse

import numpy as np

import fa2cpu
from fa2cpu.bench import DTYPES, dtype_arg, measure

ap = argparse.ArgumentParser()
ap.add_argument("--case", choices=["prefill", "decode"], default="prefill")
ap.add_argument("--dtype", default="bf16", type=dtype_arg)
ap.add_argument("--n", type=int, default=2048)
ap.add_argument("--heads", type=int, default=32)
ap.add_argument("--threads", type=int, default=16)
ap.add_argument("--causal", action="store_true")
ap.add_argument("--calls", type=int, default=15)
a = ap.parse_args()
dt = DTYPES[a.dtype]
rng = np.random.default_rng(0)
if a.case == "prefill":
    q, k, v = (rng.standard_normal((1, a.heads, a.n, 128), dtype=np.float32).astype(dt) for _ in range(3))
    call = lambda: fa2cpu.flash_attention(q, k, v, causal=a.causal, num_threads=a.threads)  # noqa: E731
else:
    q = rng.standard_normal((16, 1, 32, 128), dtype=np.float32).astype(dt)
    kc, vc = (rng.standard_normal((16, a.n, 8, 128), dtype=np.float32).astype(dt) for _ in range(2))
    call = lambda: fa2cpu.flash_attention_with_kvcache(q, kc, vc, num_threads=a.threads)  # noqa: E731
median_s = measure(call, warmup=1, repeat=a.calls)[0].median_s
print(f"{a.case} {a.dtype} n={a.n} thr={a.threads} causal={a.causal}: median {1e3 * median_s:.2f} ms")
