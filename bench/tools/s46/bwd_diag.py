"""Where the backward's per-thread speed goes at many threads (session 46): for each H (B=1,
N=2048, D=128, full attention) at THREADS threads, our forward, the public backward, and the same
backward writing into pre-faulted outputs (fa2cpu._core.run_backward, as
bench/tools/backward_phases.py calls it): the difference is the page faults of fresh dq / dk / dv;
the H sweep changes the items per thread (the plan splits each kv head into the same key ranges
for every H >= 16 here), which shows load imbalance of the last round of items.
    python3 bench/tools/s46/bwd_diag.py THREADS DTYPE H...   (-THREADS: the pre-faulted backward first)
"""
import sys, time, statistics
import numpy as np, ml_dtypes
import fa2cpu, fa2cpu._core as _core, fa2cpu.backward as fb

T, name = int(sys.argv[1]), sys.argv[2]
SWAP = T < 0  # a negative thread count: the two backwards in the other order (see the loop)
T = abs(T)
dt = {'fp32': np.float32, 'bf16': ml_dtypes.bfloat16}[name]
N, D = 2048, 128
for H in (int(x) for x in sys.argv[3:]):
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, H, N, D), dtype=np.float32).astype(dt) for _ in range(4))
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True, num_threads=T)
    pre = [np.ones(q.shape, dt) for _ in range(3)]
    def kept():
        _core.run_backward(do, q, k, v, out, lse, *pre, dtype=fb._DTYPES[q.dtype], batch=1, hq=H, hk=H, nq=N, nk=N,
                           scale=D ** -0.5, softcap=0.0, win_left=-1, win_right=-1, alibi=None, cu_q=None, cu_k=None,
                           num_threads=T)
    tf, tb, tk = [], [], []
    for _ in range(7):
        if SWAP:  # the pre-faulted backward first, right after the forward
            t0 = time.perf_counter(); fa2cpu.flash_attention(q, k, v, num_threads=T)
            t1 = time.perf_counter(); kept()
            t2 = time.perf_counter(); fa2cpu.flash_attention_backward(do, q, k, v, out, lse, num_threads=T)
            t3 = time.perf_counter()
            tf.append(t1 - t0); tk.append(t2 - t1); tb.append(t3 - t2)
            continue
        t0 = time.perf_counter(); fa2cpu.flash_attention(q, k, v, num_threads=T)
        t1 = time.perf_counter(); fa2cpu.flash_attention_backward(do, q, k, v, out, lse, num_threads=T)
        t2 = time.perf_counter(); kept(); t3 = time.perf_counter()
        tf.append(t1 - t0); tb.append(t2 - t1); tk.append(t3 - t2)
    f, b, kk = (statistics.median(x) for x in (tf, tb, tk))
    fl = 4 * H * N * N * D
    print(f"{name} T={T} H={H}: fwd {f*1e3:.1f} ms ({fl/f/1e9/T:.0f} GF/s/thr), bwd {b*1e3:.1f} ms ({2.5*fl/b/1e9/T:.0f}/thr, "
          f"bwd/fwd {b/f:.2f}), bwd into pre-faulted outputs {kk*1e3:.1f} ms ({2.5*fl/kk/1e9/T:.0f}/thr, {kk/f:.2f})", flush=True)
