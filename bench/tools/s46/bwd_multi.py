"""In-process backward timing of several builds (each PKG_DIR an in-place build's fa2cpu/, named by
its parent folder), B=1 D=128: python3 bench/tools/s46/bwd_multi.py THREADS CAUSAL DTYPE REPS H N PKG_DIR...
Prints each build's median, the first build's time over it, and bwd / (first build's) fwd."""
import sys, tempfile, numpy as np, ml_dtypes, statistics, time
import os
_root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..')
sys.path.insert(0, os.path.join(_root, 'bench')); sys.path.append(_root)
import ab_inproc as ab
T, causal, dt, reps, H, N = int(sys.argv[1]), sys.argv[2] == '1', sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
root = tempfile.mkdtemp(); sys.path.insert(0, root)
names = [d.rstrip('/').split('/')[-2] for d in sys.argv[7:]]
mods = {n: ab.load(d, 'm_' + n, root) for n, d in zip(names, sys.argv[7:])}
t = ml_dtypes.bfloat16 if dt == 'bf16' else np.float32
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((1, H, N, 128), dtype=np.float32).astype(t) for _ in range(4))
m0 = mods[names[0]]
out, lse = m0.flash_attention(q, k, v, causal=causal, return_lse=True, num_threads=T)
outs, med = ab.alternate(mods, lambda m: m.flash_attention_backward(do, q, k, v, out, lse, causal=causal, num_threads=T), reps)
fwd = statistics.median([(lambda t0: (m0.flash_attention(q, k, v, causal=causal, num_threads=T), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(reps)])
for n in names:
    print(f"bwd {dt} T={T} causal={causal} H={H} N={N} {n}: {med[n]*1e3:.1f} ms  first/this {med[names[0]]/med[n]:.3f}  bwd/fwd {med[n]/fwd:.2f} maxdiff {np.abs(outs[n]-outs[names[0]]).max():.1e}")
