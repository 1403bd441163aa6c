"""In-process A/B of several builds on a paged KV cache (issue 13's case B=16 Hq=32 Hk=8 Nk=8192
D=128; bf16 q for int8): python decode_paged_ab.py THREADS CACHE BLOCK REPS PKG_DIR... (each an
in-place build's fa2cpu/, named by its parent folder). CACHE fp32, bf16 or int8; BLOCK the block
size (the blocks in shuffled order, as bench/decode_extras.py lays them out)."""
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import ab_inproc as ab  # noqa: E402

T, cache, bs, reps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
root = tempfile.mkdtemp()
sys.path.insert(0, root)
mods = {d.rstrip('/').split('/')[-2]: ab.load(d, 'm_' + d.rstrip('/').split('/')[-2], root) for d in sys.argv[5:]}
rng = np.random.default_rng(0)
(q, k, v), kw = ab.decode_case(cache, rng)
B, N = k.shape[:2]
nb = N // bs
table = rng.permutation(B * nb).astype(np.int32).reshape(B, nb)


def paged(x):
    out = np.empty((B * nb, bs) + x.shape[2:], x.dtype)
    out[table.ravel()] = x.reshape((B * nb, bs) + x.shape[2:])
    return out


args = (q, paged(k), paged(v))
kw = {n: paged(s) for n, s in kw.items()}
seqlens = np.full(B, N, np.int32)
outs, med = ab.alternate(mods, lambda m: m.flash_attention_with_kvcache(*args, cache_seqlens=seqlens, block_table=table,
                                                                         num_threads=T, **kw), reps)
first = list(mods)[0]
for n in mods:
    print(f"{cache} block {bs} T={T} {n}: {med[n]*1e3:.2f} ms  base/this {med[first]/med[n]:.3f} "
          f"maxdiff {np.abs(outs[n]-outs[first]).max():.1e}")
