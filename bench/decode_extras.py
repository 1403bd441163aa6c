"""Decode measurements the CLI does not sweep: paged vs contiguous KV cache, B=1 (split-KV) vs
B=16 per byte, and the Python-side overhead of a tiny decode call.

    python bench/decode_extras.py [--threads N] [--repeat R] [--dtype fp32|bf16] [--kv-dtype int8|fp8]

Prints one table; every row is a median of --repeat timed samples after a warm-up (fa2cpu.bench's
timing routine), fa2cpu only. --kv-dtype: the paged / contiguous rows read a quantized cache
(codes + float32 scales, by the library's append rule; GB/s counts both) with --dtype queries.
"""
import argparse
import platform

import ml_dtypes
import numpy as np

import fa2cpu
from fa2cpu import _core
from fa2cpu.bench import DTYPES, dtype_name, median_time


def paged_copy(arrays, block_size, rng):
    """The same (B, N, ...) arrays as (num_blocks, block_size, ...) blocks in one shuffled order
    + block table."""
    B, N = arrays[0].shape[:2]
    nb = N // block_size
    table = rng.permutation(B * nb).astype(np.int32).reshape(B, nb)
    out = []
    for x in arrays:
        p = np.empty((B * nb, block_size) + x.shape[2:], x.dtype)
        p[table.ravel()] = x.reshape((B * nb, block_size) + x.shape[2:])
        out.append(p)
    return out, table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=_core.max_threads(), help="threads (default: OpenMP max)")
    ap.add_argument("--repeat", type=int, default=7, help="timed calls per row (default 7)")
    ap.add_argument("--dtype", default="fp32", type=dtype_name, help="cache dtype, fp32 or bf16 (default fp32)")
    ap.add_argument("--kv-dtype", default=None, choices=("int8", "fp8"),
                    help="a quantized cache for the paged / contiguous rows (queries: --dtype)")
    a = ap.parse_args(argv)
    dt = DTYPES[a.dtype]
    rng = np.random.default_rng(0)
    nt = a.threads
    print(f"# fa2cpu {fa2cpu.__version__}, family {fa2cpu.get_isa()}, {nt} threads, {platform.processor() or platform.machine()}")
    print(f"# read bandwidth probe: {_core.read_bandwidth_gbs(nt, 1 << 30):.1f} GB/s ({nt} threads, 1 GiB)")
    print("| case | shape | ms | GB/s | vs contiguous |")
    print("|---|---|--:|--:|--:|")

    B, Hq, Hk, N, D = 16, 32, 8, 8192, 128
    q = rng.standard_normal((B, 1, Hq, D), dtype=np.float32).astype(dt)
    if a.kv_dtype:
        from fa2cpu.attention import _quantize
        code = np.dtype(np.int8) if a.kv_dtype == "int8" else np.dtype(ml_dtypes.float8_e4m3fn)
        cache = []  # k, v codes, then k, v scales
        for _ in range(2):
            c, sc = np.empty((B, N, Hk, D), code), np.empty((B, N, Hk), np.float32)
            for b in range(B):
                c[b], sc[b] = _quantize(rng.standard_normal((N, Hk, D), np.float32), c, True)
            cache.append((c, sc))
        cache = [cache[0][0], cache[1][0], cache[0][1], cache[1][1]]
        kv_name = a.kv_dtype
    else:
        cache = [rng.standard_normal((B, N, Hk, D), dtype=np.float32).astype(dt) for _ in range(2)]
        kv_name = a.dtype

    def call(arrays, **kw):
        scales = dict(k_scale=arrays[2], v_scale=arrays[3]) if a.kv_dtype else {}
        return lambda: fa2cpu.flash_attention_with_kvcache(q, arrays[0], arrays[1], num_threads=nt, **scales, **kw)

    nbytes = sum(x.nbytes for x in cache)
    t_contig = median_time(call(cache), a.repeat)
    shape = f"B={B} Hq={Hq} Hk={Hk} Nk={N} D={D} {kv_name} cache" + (f", {a.dtype} q" if a.kv_dtype else "")
    print(f"| contiguous cache | {shape} | {t_contig * 1e3:.1f} | {nbytes / t_contig / 1e9:.1f} | 1.00x |")
    for bs in (16, 64, 256):
        paged, table = paged_copy(cache, bs, rng)
        t = median_time(call(paged, block_table=table, cache_seqlens=N), a.repeat)
        print(f"| paged, block {bs} | {shape} | {t * 1e3:.1f} | {nbytes / t / 1e9:.1f} | {t / t_contig:.2f}x |")
        del paged
    if a.kv_dtype:
        return
    per_byte16 = t_contig / nbytes
    del cache

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
