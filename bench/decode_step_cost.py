"""Cost of one decode step through fa2cpu._core.DecodeStep (the transformers KVCache's decode
route: no Python checks), timed hot (the same cache every call), by cache length and thread count,
with torch SDPA on the same cache alongside.

    python bench/decode_step_cost.py                       # fa2cpu on torch's OpenMP threads
    FA2CPU_PARALLEL=pool python bench/decode_step_cost.py  # fa2cpu's own pool

Shape: B=1, Hq=16, Hk=4, D=128, bfloat16 (the Llama-style model of bench/hf_attention.py); the
threads are torch.set_num_threads(n) (fa2cpu follows torch's count on the openmp backend). Medians
of 150 calls after 50 warm-up calls; microseconds.
"""
import math
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import fa2cpu._core as core
from fa2cpu._torch_bridge import _np  # (importing fa2cpu.torch's bridge selects the openmp backend unless FA2CPU_PARALLEL=pool)
dt = torch.bfloat16
B, Hq, Hk, D = 1, 16, 4, 128
kc = torch.randn(B, 2100, Hk, D).to(dt); vc = torch.randn(B, 2100, Hk, D).to(dt)
q = torch.randn(B, Hq, 1, D).to(dt); kn = torch.randn(B, Hk, 1, D).to(dt); vn = torch.randn(B, Hk, 1, D).to(dt)
step = core.DecodeStep(_np("k", kc).transpose(0, 2, 1, 3), _np("v", vc).transpose(0, 2, 1, 3), None, 0, core.DTYPE_CODES["bfloat16"])
out = torch.empty(B, 1, Hq, D, dtype=dt)
def run(N):
    seq = np.array([N], np.int32)
    ts = []
    for i in range(200):
        seq[0] = N
        t0 = time.perf_counter()
        step(q.data_ptr(), *q.stride(), kn.data_ptr(), *kn.stride(), vn.data_ptr(), *vn.stride(), out.data_ptr(), B, Hq, 1, D, 0, seq, 1 / math.sqrt(D), 0.0, -1, 0)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[50:]) * 1e6
print("backend", core.parallel_backend())
for nt in (16, 8, 4, 2, 1):
    torch.set_num_threads(nt)
    res = {N: run(N) for N in (16, 512, 2048)}
    kt = kc[:, :2048].transpose(1, 2).contiguous(); vt = vc[:, :2048].transpose(1, 2).contiguous()
    ts = []
    for i in range(100):
        t0 = time.perf_counter(); F.scaled_dot_product_attention(q, kt, vt, enable_gqa=True); ts.append(time.perf_counter() - t0)
    print(f"threads {nt:2d}: DecodeStep N=16 {res[16]:.0f} us, N=512 {res[512]:.0f}, N=2048 {res[2048]:.0f}; sdpa N=2048 {statistics.median(ts[20:])*1e6:.0f}", flush=True)
