"""Smoke check of one kernel family on this machine: max error against the float64 reference on
shapes that break tilings, then one timing against torch SDPA (when importable).

    python bench/check_family.py amx bf16        # family, dtype
"""
import sys

import numpy as np

import fa2cpu
from fa2cpu import _reference as ref
from fa2cpu.bench.cases import DTYPE_LONG_NAMES, DTYPES, dtype_name
from fa2cpu.bench.timing import median_time


def main(family="auto", dtype="bf16"):
    if family != "auto":
        fa2cpu.set_isa(family)
    dtype = dtype_name(dtype)
    dt = DTYPES[dtype]
    print(f"family in use: {fa2cpu.get_isa()}, dtype {dtype}, usable {fa2cpu.available_isas()}", flush=True)
    rng = np.random.default_rng(0)
    worst = 0.0
    for B, Hq, Hk, Nq, Nk, D, Dv in [(1, 2, 2, 1, 1, 1, 1), (1, 4, 2, 7, 7, 16, 16), (2, 4, 1, 33, 65, 64, 80),
                                     (1, 2, 2, 129, 257, 128, 128), (1, 8, 8, 200, 200, 80, 96),
                                     (1, 2, 2, 64, 1031, 256, 256), (1, 1, 1, 300, 300, 33, 7)]:
        for causal in (False, True):
            q = rng.standard_normal((B, Hq, Nq, D)).astype(dt)
            k = rng.standard_normal((B, Hk, Nk, D)).astype(dt)
            v = rng.standard_normal((B, Hk, Nk, Dv)).astype(dt)
            o, lse = fa2cpu.flash_attention(q, k, v, causal=causal, return_lse=True)
            r, rl = ref.attention_ref(q, k, v, causal=causal)
            err = max(np.abs(o.astype(np.float64) - r).max(), np.abs(lse - rl).max())
            worst = max(worst, err)
            print(f"B={B} Hq={Hq} Hk={Hk} Nq={Nq} Nk={Nk} D={D} Dv={Dv} causal={causal}: max err {err:.2e}", flush=True)
    print(f"worst error {worst:.2e}")
    try:
        import torch
    except ImportError:
        return
    threads = fa2cpu._core.max_threads()
    torch.set_num_threads(threads)
    B, H, N, D = 1, 32, 4096, 128
    q, k, v = (rng.standard_normal((B, H, N, D), dtype=np.float32) for _ in range(3))
    tdt = getattr(torch, DTYPE_LONG_NAMES[dtype])
    tq, tk, tv = (torch.from_numpy(x).to(tdt) for x in (q, k, v))
    q, k, v = (x.astype(dt) for x in (q, k, v))
    for causal in (False, True):
        a = median_time(lambda: fa2cpu.flash_attention(q, k, v, causal=causal), 3)
        b = median_time(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal), 3)
        fl = 4 * B * H * N * N * D / (2 if causal else 1)
        print(f"N={N} D={D} causal={causal} threads={threads}: fa2cpu {fl / a / 1e9:.0f} GFLOP/s, "
              f"torch {fl / b / 1e9:.0f} GFLOP/s, speedup {b / a:.2f}x", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
