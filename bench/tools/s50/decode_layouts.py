"""In-process decode A/B of several builds (issue 13's case, B=16 Hq=32 Hk=8 Nk=8192 D=128, bf16 q for
quantized caches): python decode_layouts.py THREADS CACHE LAYOUT REPS PKG_DIR... (each an in-place
build's fa2cpu/, named by its parent folder). LAYOUT bnhd: the issue's (B, N, Hk, D) cache (items span
kv heads); bhnd: a head-major cache passed as a transposed view (one kv head per item)."""
import sys, tempfile, numpy as np, ml_dtypes
import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import ab_inproc as ab
T, cache, layout, reps = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
root = tempfile.mkdtemp(); sys.path.insert(0, root)
mods = {d.rstrip('/').split('/')[-2]: ab.load(d, 'm_' + d.rstrip('/').split('/')[-2], root) for d in sys.argv[5:]}
args, kw = ab.decode_case(cache, np.random.default_rng(0))
if layout == "bhnd":
    q, k, v = args
    args = (q, np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3), np.ascontiguousarray(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3))
    kw = {n: np.ascontiguousarray(s.transpose(0, 2, 1)).transpose(0, 2, 1) for n, s in kw.items()}
outs, med = ab.alternate(mods, lambda m: m.flash_attention_with_kvcache(*args, num_threads=T, **kw), reps)
first = list(mods)[0]
for n in mods:
    print(f"{cache} {layout} T={T} {n}: {med[n]*1e3:.2f} ms  base/this {med[first]/med[n]:.3f} maxdiff {np.abs(outs[n]-outs[first]).max():.1e}")
