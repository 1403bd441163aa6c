# In-process decode A/B of several builds (issue 13's case): python decode_multi.py THREADS CACHE REPS PKG_DIR... (each PKG_DIR an in-place build's fa2cpu/, named by its parent folder)
import sys, tempfile, numpy as np
import os; _root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..'); sys.path.insert(0, os.path.join(_root, 'bench')); sys.path.append(_root)  # PYTHONPATH's / the installed fa2cpu first
import ab_inproc as ab
T, cache, reps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
root = tempfile.mkdtemp(); sys.path.insert(0, root)
mods = {d.rstrip('/').split('/')[-2]: ab.load(d, 'm_' + d.rstrip('/').split('/')[-2], root) for d in sys.argv[4:]}
args, kw = ab.decode_case(cache, np.random.default_rng(0))
outs, med = ab.alternate(mods, lambda m: m.flash_attention_with_kvcache(*args, num_threads=T, **kw), reps)
first = list(mods)[0]
for n in mods:
    print(f"{cache} T={T} {n}: {med[n]*1e3:.2f} ms  base/this {med[first]/med[n]:.3f} maxdiff {np.abs(outs[n]-outs[first]).max():.1e}")
