"""fa2cpu (the amx family) and torch SDPA, bf16 prefill (B=1, D=128), each batch of three calls
between two runs of the AMX tile-rate probe on the same threads: GFLOP/s as a share of the tile
rate measured around it (the lent AMX machine's rate moves up to 2x between calls minutes apart,
so a fixed peak from another run is no denominator). Needs torch and an AMX CPU.

    FA2CPU_ISA=amx python bench/tools/amx_bracket.py THREADS HEADS N CAUSAL(0|1) ROUNDS
"""
import statistics
import sys
import time

import ml_dtypes
import numpy as np
import torch

import fa2cpu
from fa2cpu import _core
T, H, N, causal, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
torch.set_num_threads(T)
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, H, N, 128), dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
tq, tk, tv = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in (q, k, v))
fl = 4 * H * (N * (N + 1) // 2 if causal else N * N) * 128
f = lambda: fa2cpu.flash_attention(q, k, v, causal=causal, num_threads=T)
g = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
f(); g()
print(f"# T={T} H={H} N={N} causal={causal} D=128 bf16, isa={fa2cpu.get_isa()}; per round: probe, fa2cpu x3, probe, torch x3, probe (GFLOP/s)")
rows = []
for r in range(rounds):
    p0 = _core.peak_gflops("amx", "bf16", T, 0.2)
    tf = []
    for _ in range(3):
        t = time.perf_counter(); f(); tf.append(time.perf_counter() - t)
    p1 = _core.peak_gflops("amx", "bf16", T, 0.2)
    tt = []
    for _ in range(3):
        t = time.perf_counter(); g(); tt.append(time.perf_counter() - t)
    p2 = _core.peak_gflops("amx", "bf16", T, 0.2)
    gf, gt = fl / min(tf) / 1e9, fl / min(tt) / 1e9
    a, b = gf / ((p0 + p1) / 2), gt / ((p1 + p2) / 2)
    rows.append((a, b, gf / gt))
    print(f"round {r}: probe {p0:7.0f} | fa2cpu {gf:6.0f} ({100*a:4.1f} % of probe) | probe {p1:7.0f} | torch {gt:6.0f} ({100*b:4.1f} %) | probe {p2:7.0f} | fa2cpu/torch {gf/gt:.2f}", flush=True)
share_f, share_t, ratio = (statistics.median(x) for x in zip(*rows))
print(f"median: fa2cpu {100 * share_f:.1f} % of the bracketing probe, torch {100 * share_t:.1f} %, fa2cpu/torch {ratio:.2f}")
