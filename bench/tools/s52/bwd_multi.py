# bwd_multi.py T H N CAUSAL DTYPE REPS PKG_DIR...: in-process backward A/B of several builds (base = the first). Copies of one build read within +-3 % here, and the build loaded first read up to 4-5 % slow in some runs: load a sacrificial copy first and run both orders.
import sys, tempfile, numpy as np, ml_dtypes, os
_root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..'); sys.path.insert(0, os.path.join(_root, 'bench')); sys.path.append(_root)
import ab_inproc as ab
T, H, N, causal, dtype, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5], int(sys.argv[6])
root = tempfile.mkdtemp(); sys.path.insert(0, root)
mods = {d.rstrip('/').split('/')[-2]: ab.load(d, 'm_' + d.rstrip('/').split('/')[-2], root) for d in sys.argv[7:]}
dt = ml_dtypes.bfloat16 if dtype == "bf16" else np.float32
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((1, H, N, 128)).astype(dt) for _ in range(4))
first = list(mods.values())[0]
o, lse = first.flash_attention(q, k, v, causal=causal, return_lse=True, num_threads=T)
outs, med = ab.alternate(mods, lambda m: m.flash_attention_backward(do, q, k, v, o, lse, causal=causal, num_threads=T), reps)
f = list(mods)[0]
for n in mods:
    print(f"bwd {dtype} T={T} H={H} N={N} causal={int(causal)} {n}: {med[n]*1e3:.1f} ms base/this {med[f]/med[n]:.3f} maxdiff {np.abs(outs[n]-outs[f]).max():.1e}")
