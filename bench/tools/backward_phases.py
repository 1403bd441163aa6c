"""Backward phase shares from a build with bench/tools/backward_phase_timers.patch applied (rdtsc
around each phase of BackwardLoop::run_item; the shares print to stderr at exit, one line per
products policy: "f32" = F32Products, "other" = the bf16 policies). Outputs are pre-faulted
(np.ones) and passed to _core.run_backward directly, so page faults of fresh outputs are left out.
Also prints our backward and forward times. Session 27.

    git archive HEAD | tar -x -C /tmp/pt && cd /tmp/pt && patch -p1 < bench/tools/backward_phase_timers.patch
    python setup.py build_ext --inplace   # (FA2CPU_DISABLE=... to build fewer families)
    PYTHONPATH=/tmp/pt python bench/tools/backward_phases.py DTYPE THREADS HEADS N REPS

Phases: 0 dK / dV rows stored, 1 row packing (Q, dO, D_i, LSE, panels), 2 the two score products,
3 the softmax gradient, 4 the three update products (also split into dV / dK / dQ on its own
line for F32Products, session 32), 5 K / V packing, 7 dq stored (6 unused). The
patch also carries two experiment knobs: FA2CPU_ROWPAD (pad the row-major Q / dO rows) and
FA2CPU_BWD_MAXNJ (feature vectors per dV / dK micro-tile), both measured no better on the Zen 4.
"""
import numpy as np, sys, time, ml_dtypes
import fa2cpu
from fa2cpu import _core
import fa2cpu.backward as fb
dt = {'fp32': np.float32, 'bf16': ml_dtypes.bfloat16}[sys.argv[1]]
T, H, N, reps = (int(x) for x in sys.argv[2:6])
rng = np.random.default_rng(0)
B, D = 1, 128
q, k, v, do = (rng.standard_normal((B, H, N, D), dtype=np.float32).astype(dt) for _ in range(4))
out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True, num_threads=T)
pre = [np.ones(q.shape, dt) for _ in range(3)]
def run():
    _core.run_backward(do, q, k, v, out, lse, *pre, dtype=fb._DTYPES[q.dtype], batch=B, hq=H, hk=H, nq=N, nk=N,
                       scale=D ** -0.5, softcap=0.0, win_left=-1, win_right=-1, alibi=None, cu_q=None, cu_k=None, num_threads=T)
ts = []
for _ in range(reps):
    t = time.perf_counter(); run(); ts.append(time.perf_counter() - t)
tf = []
for _ in range(reps):
    t = time.perf_counter(); fa2cpu.flash_attention(q, k, v, num_threads=T); tf.append(time.perf_counter() - t)
fl = 4 * H * N * N * D
print(f"{sys.argv[1]} T={T} H={H} N={N}: bwd {np.median(ts)*1e3:.1f} ms {2.5*fl/np.median(ts)/1e9:.0f} GF/s, fwd {np.median(tf)*1e3:.1f} ms {fl/np.median(tf)/1e9:.0f} GF/s, ratio {np.median(ts)/np.median(tf):.2f}", flush=True)
