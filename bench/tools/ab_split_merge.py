"""In-process A/B of two builds on a split-KV decode call (the merge of split partials), B=1
Hq=16 Hk=4 N=2048 D=128 bf16, interleaved (B, N, H, D) cache (the transformers KVCache's layout),
NumPy API: 15 alternated blocks of 100 calls per build, median of the block medians.

    python bench/tools/ab_split_merge.py BASE_PKG NEW_PKG THREADS SPLITS   # SPLITS 0: automatic

BASE_PKG / NEW_PKG as bench/ab_inproc.py takes them (a build's package directory).
"""
import os, sys, tempfile, time, statistics
import numpy as np, ml_dtypes
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ab_inproc import load
base_dir, new_dir, T, S = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
root = tempfile.mkdtemp(); sys.path.insert(0, root)
mods = [load(base_dir, "fa_base", root), load(new_dir, "fa_new", root)]
rng = np.random.default_rng(0); bf = ml_dtypes.bfloat16; N = 2048
q = rng.standard_normal((1, 1, 16, 128)).astype(bf)
kc = rng.standard_normal((1, N, 4, 128)).astype(bf); vc = rng.standard_normal((1, N, 4, 128)).astype(bf)
outs = [np.empty((1, 1, 16, 128), bf) for _ in mods]
res = [[], []]
for rep in range(15):
    for j, m in enumerate(mods):
        ts = []
        for i in range(100):
            t0 = time.perf_counter()
            m.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=N, num_splits=S, num_threads=T, out=outs[j])
            ts.append(time.perf_counter() - t0)
        res[j].append(statistics.median(ts))
b, n = statistics.median(res[0]) * 1e6, statistics.median(res[1]) * 1e6
d = np.abs(outs[0].astype(np.float32) - outs[1].astype(np.float32)).max()
print(f"T={T} S={S}: base {b:.1f} us new {n:.1f} us base/new {b/n:.3f} maxdiff {d:.2e}")
