"""Thread scaling of fa2cpu's forward and backward (B=1, H=16, N=2048, D=128, full attention):
GFLOP/s in total and per thread at each thread count, so a backward that scales worse than the
forward shows as a falling bwd/fwd column. Run under taskset so T threads get T cores:
    for t in 1 2 4 8 16; do taskset -c 0-$((t-1)) python3 bench/tools/s46/scaling.py $t fp32 bf16; done
"""
import sys, time, statistics
import numpy as np, ml_dtypes
import fa2cpu, fa2cpu._core

T = int(sys.argv[1])
H, N, D = 16, 2048, 128
flops_f = 4 * H * N * N * D
for name in sys.argv[2:]:
    dt = {'fp32': np.float32, 'bf16': ml_dtypes.bfloat16}[name]
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, H, N, D), dtype=np.float32).astype(dt) for _ in range(4))
    out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True, num_threads=T)
    tf, tb = [], []
    for _ in range(5 if T > 2 else 3):
        t0 = time.perf_counter(); fa2cpu.flash_attention(q, k, v, num_threads=T); t1 = time.perf_counter()
        fa2cpu.flash_attention_backward(do, q, k, v, out, lse, num_threads=T); t2 = time.perf_counter()
        tf.append(t1 - t0); tb.append(t2 - t1)
    f, b = statistics.median(tf), statistics.median(tb)
    print(f"{name} family={fa2cpu._core.get_isa()} T={T}: fwd {f*1e3:.1f} ms {flops_f/f/1e9:.0f} GF/s "
          f"({flops_f/f/1e9/T:.0f}/thr), bwd {b*1e3:.1f} ms {2.5*flops_f/b/1e9:.0f} GF/s ({2.5*flops_f/b/1e9/T:.0f}/thr), bwd/fwd {b/f:.2f}", flush=True)
