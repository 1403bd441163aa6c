"""In-process A/B of two builds' fp32-cache decode on the shapes the prefetch distance touches
(session 61): paged caches of block 16 and 256 (blocks shuffled), a head-major (bhsd) cache (one
kv head per item), and Hk = 2 (items of 2 kv heads). B=16 Hq=32 Nk=8192 D=128, q fp32.

    PYTHONPATH=$PWD python bench/tools/s61/decode_shapes_ab.py BASE_PKG NEW_PKG THREADS REPS [DTYPE]
"""
import sys
import tempfile

import ml_dtypes
import numpy as np

sys.path.insert(0, ".")
from bench.ab_inproc import alternate, load  # noqa: E402


def cases(dt, rng, B=16, N=8192, D=128):
    q = rng.standard_normal((B, 1, 32, D), dtype=np.float32).astype(dt)
    for bs in (16, 256):
        nb = B * N // bs
        kc, vc = (rng.standard_normal((nb, bs, 8, D), dtype=np.float32).astype(dt) for _ in range(2))
        bt = rng.permutation(nb).astype(np.int32).reshape(B, N // bs)
        yield f"paged block {bs}", (q, kc, vc), dict(block_table=bt)
        del kc, vc
    kc, vc = (rng.standard_normal((B, 8, N, D), dtype=np.float32).astype(dt) for _ in range(2))
    yield "bhsd Hk=8", (np.ascontiguousarray(q.transpose(0, 2, 1, 3)), kc, vc), dict(layout="bhsd")
    del kc, vc
    kc, vc = (rng.standard_normal((B, N, 2, D), dtype=np.float32).astype(dt) for _ in range(2))
    yield "bshd Hk=2", (q, kc, vc), {}


def main():
    base_dir, new_dir, threads, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dt = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16}[sys.argv[5] if len(sys.argv) > 5 else "fp32"]
    root = tempfile.mkdtemp(prefix="fa2cpu_ab_")
    sys.path.insert(0, root)
    mods = {"base": load(base_dir, "fa2cpu_ab_base", root), "new": load(new_dir, "fa2cpu_ab_new", root)}
    for name, args, kw in cases(dt, np.random.default_rng(0)):
        outs, med = alternate(mods, lambda m: m.flash_attention_with_kvcache(*args, num_threads=threads, **kw), reps)
        print(f"{name} T={threads}: base {med['base'] * 1e3:.2f} ms, new {med['new'] * 1e3:.2f} ms, "
              f"base/new {med['base'] / med['new']:.3f}; max|diff| {np.abs(outs['base'] - outs['new']).max():.2e}",
              flush=True)


if __name__ == "__main__":
    main()
