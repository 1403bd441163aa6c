"""Decode measurements the CLI does not sweep: paged vs contiguous KV cache, B=1 (split-KV) vs
B=16 per byte, and the Python-side overhead of a tiny decode call.

    python bench/decode_extras.py [--threads N] [--repeat R]

Prints one table; every row is a median of --repeat timed samples after a warm-up (fa2cpu.bench's
timing routine), fa2cpu only.
"""
import argparse
import platform

import numpy as np

import fa2cpu
from fa2cpu import _core
from fa2cpu.bench import DTYPES, dtype_name, median_time


def paged_copy(k_cache, v_cache, block_size, rng):
    """The same cache as (num_blocks, block_size, Hk, D) blocks in shuffled order + block table."""
    B, N, Hk, D = k_cache.shape
    nb = N // block_size
    perm = rng.permutation(B * nb).astype(np.int32)
    table = perm.reshape(B, nb)
    kp = np.empty((B * nb, block_size, Hk, D), k_cache.dtype)
    vp = np.empty_like(kp)
    kp[table.ravel()] = k_cache.reshape(B * nb, block_size, Hk, D)
    vp[table.ravel()] = v_cache.reshape(B * nb, block_size, Hk, D)
    return kp, vp, table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=_core.max_threads(), help="threads (default: OpenMP max)")
    ap.add_argument("--repeat", type=int, default=7, help="timed calls per row (default 7)")
    ap.add_argument("--dtype", default="fp32", type=dtype_name, help="cache dtype, fp32 or bf16 (default fp32)")
    a = ap.parse_args(argv)
    dt = DTYPES[a.dtype]
    rng = np.random.default_rng(0)
    nt = a.threads
    print(f"# fa2cpu {fa2cpu.__version__}, family {fa2cpu.get_isa()}, {nt} threads, {platform.processor() or platform.machine()}")
    print(f"# read bandwidth probe: {_core.read_bandwidth_gbs(nt, 1 << 30):.1f} GB/s ({nt} threads, 1 GiB)")
    print("| case | shape | ms | GB/s | vs contiguous |")
    print("|---|---|--:|--:|--:|")

    B, Hq, Hk, N, D = 16, 32, 8, 8192, 128
    k = rng.standard_normal((B, N, Hk, D), dtype=np.float32).astype(dt)
    v = rng.standard_normal((B, N, Hk, D), dtype=np.float32).astype(dt)
    q = rng.standard_normal((B, 1, Hq, D), dtype=np.float32).astype(dt)
    nbytes = k.nbytes + v.nbytes
    t_contig = median_time(lambda: fa2cpu.flash_attention_with_kvcache(q, k, v, num_threads=nt), a.repeat)
    shape = f"B={B} Hq={Hq} Hk={Hk} Nk={N} D={D} {a.dtype}"
    print(f"| contiguous cache | {shape} | {t_contig * 1e3:.1f} | {nbytes / t_contig / 1e9:.1f} | 1.00x |")
    for bs in (16, 256):
        kp, vp, table = paged_copy(k, v, bs, rng)
        t = median_time(lambda: fa2cpu.flash_attention_with_kvcache(q, kp, vp, block_table=table,
                                                                   cache_seqlens=N, num_threads=nt), a.repeat)
        print(f"| paged, block {bs} | {shape} | {t * 1e3:.1f} | {nbytes / t / 1e9:.1f} | {t / t_contig:.2f}x |")
        del kp, vp
    per_byte16 = t_contig / nbytes
    del k, v

    B1, H1 = 1, 32
    k = rng.standard_normal((B1, N, H1, D), dtype=np.float32).astype(dt)
    v = rng.standard_normal((B1, N, H1, D), dtype=np.float32).astype(dt)
    q = rng.standard_normal((B1, 1, H1, D), dtype=np.float32).astype(dt)
    nb1 = k.nbytes + v.nbytes
    t1 = median_time(lambda: fa2cpu.flash_attention_with_kvcache(q, k, v, num_threads=nt), a.repeat)
    t1s = median_time(lambda: fa2cpu.flash_attention_with_kvcache(q, k, v, num_threads=nt, num_splits=1), a.repeat)
    shape1 = f"B=1 Hq=Hk={H1} Nk={N} D={D} {a.dtype}"
    print(f"| B=1, split-KV auto | {shape1} | {t1 * 1e3:.2f} | {nb1 / t1 / 1e9:.1f} | per byte {t1 / nb1 / per_byte16:.2f}x of B=16 |")
    print(f"| B=1, num_splits=1 | {shape1} | {t1s * 1e3:.2f} | {nb1 / t1s / 1e9:.1f} | per byte {t1s / nb1 / per_byte16:.2f}x of B=16 |")

    # Tiny call: Python-side overhead = whole call - the same kernel call made directly on _core.
    Nk = 16
    k = rng.standard_normal((1, Nk, 32, D), dtype=np.float32)
    v = k.copy()
    q = rng.standard_normal((1, 1, 32, D), dtype=np.float32)
    out = np.empty_like(q)
    whole = median_time(lambda: fa2cpu.flash_attention_with_kvcache(q, k, v, num_threads=1, out=out), 21, 200)
    sl = np.full(1, Nk, np.int64)
    args = (q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), out.transpose(0, 2, 1, 3), None)
    kw = dict(dtype=0, batch=1, hq=32, hk=32, nq=1, nk=Nk, scale=D ** -0.5, softcap=0.0, win_left=-1, win_right=-1,
              alibi=None, mask=None, mask_kind=0, cu_q=None, cu_k=None, seqlen_k=sl, block_table=None,
              block_size=Nk, num_threads=1, num_splits=0)
    kernel = median_time(lambda: _core.run(*args, **kw), 21, 200)
    print(f"| tiny decode, whole call | B=1 H=32 Nk={Nk} D={D} fp32, 1 thread | {whole * 1e3:.4f} | | |")
    print(f"| tiny decode, kernel only (_core.run) | same | {kernel * 1e3:.4f} | | Python overhead {1e6 * (whole - kernel):.1f} us |")


if __name__ == "__main__":
    main()
