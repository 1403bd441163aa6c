"""A/B of two fa2cpu builds in ONE process: each build's package directory (an in-place build's
`fa2cpu/`, or `<pip --target dir>/fa2cpu`) is copied under its own package name and imported, and
their calls alternate, so a noisy machine's drift hits both alike (processes alternated by
bench/ab.sh cannot remove drift within a run). Prints the median of each and base / new (> 1: the
second build is faster) and the largest difference between their outputs.

    PYTHONPATH=$PWD python bench/ab_inproc.py BASE_PKG NEW_PKG THREADS HEADS N CAUSAL(0|1) DTYPE REPS [LAYOUT [HK [NQ]]]
    PYTHONPATH=$PWD python bench/ab_inproc.py BASE_PKG NEW_PKG THREADS decode CACHE REPS
    PYTHONPATH=$PWD python bench/ab_inproc.py BASE_PKG NEW_PKG THREADS backward HEADS N CAUSAL DTYPE REPS

e.g. `PYTHONPATH=$PWD python bench/ab_inproc.py /tmp/base/fa2cpu fa2cpu 1 4 2048 0 fp32 9` (B=1,
D=128; DTYPE and the FLOP count as fa2cpu-bench takes them, from the checkout's fa2cpu.bench).
LAYOUT bshd passes contiguous (B, N, H, D) arrays (default bhsd), HK kv heads (default HEADS),
NQ query rows (default N; causal then bottom-right aligned, as the API's).
The decode form times `flash_attention_with_kvcache` on issue 13's case (B=16 Hq=32 Hk=8
Nk=8192 D=128, bf16 q) with a CACHE of bf16, fp32, int8 or fp8 (uniform codes, scales U(0, 0.02)).
The backward form times flash_attention_backward alone (from the base build's forward out / lse;
GFLOP/s count its five products, 10 * heads * visible pairs * 128).
Works because the extension's init symbol depends only on the module's last name (`_core`) and the
package imports itself relatively.
"""
import importlib
import shutil
import statistics
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

from fa2cpu.bench import DTYPES, dtype_name, visible_pairs


def load(pkg_dir, name, root):
    shutil.copytree(pkg_dir, f"{root}/{name}", ignore=shutil.ignore_patterns("__pycache__"))
    return importlib.import_module(name)


def decode_case(cache, rng, B=16, N=8192):
    """Arguments of flash_attention_with_kvcache for issue 13's decode case (B sequences, N cached
    tokens) with a `cache` cache."""
    Hq, Hk, D = 32, 8, 128
    q = rng.standard_normal((B, 1, Hq, D), dtype=np.float32).astype(ml_dtypes.bfloat16)
    if cache in ("int8", "fp8"):
        if cache == "int8":
            kc, vc = (rng.integers(-127, 128, (B, N, Hk, D), dtype=np.int8) for _ in range(2))
        else:  # every finite code (the two NaN codes, 0x7f and 0xff, left out)
            kc, vc = (rng.integers(0, 127, (B, N, Hk, D), dtype=np.uint8) | (rng.integers(0, 2, (B, N, Hk, D),
                      dtype=np.uint8) << 7) for _ in range(2))
            kc, vc = (x.view(ml_dtypes.float8_e4m3fn) for x in (kc, vc))
        ks, vs = (rng.random((B, N, Hk), dtype=np.float32) * np.float32(0.02) for _ in range(2))
        return (q, kc, vc), dict(k_scale=ks, v_scale=vs)
    if cache not in ("bf16", "fp32"):
        raise SystemExit(f"decode CACHE: bf16, fp32, int8 or fp8, not {cache!r}")
    dt = ml_dtypes.bfloat16 if cache == "bf16" else np.float32
    kc, vc = (rng.standard_normal((B, N, Hk, D), dtype=np.float32).astype(dt) for _ in range(2))
    return (q.astype(dt), kc, vc), {}  # a float cache takes q of its dtype


def alternate(mods, call, reps):
    """call(module) for each build, alternated `reps` times after one warm-up each: the warm-up
    outputs (float64, several arrays flattened into one) and each build's median seconds (of the
    call alone: outputs are converted only after the warm-up)."""
    def flat(r):
        return np.concatenate([x.astype(np.float64).ravel() for x in r]) if isinstance(r, tuple) else r.astype(np.float64)
    outs = {name: flat(call(m)) for name, m in mods.items()}
    times = {name: [] for name in mods}
    for _ in range(reps):
        for name, m in mods.items():
            t = time.perf_counter()
            call(m)
            times[name].append(time.perf_counter() - t)
    return outs, {name: statistics.median(t) for name, t in times.items()}


def main_decode(mods, threads, cache, reps):
    args, kw = decode_case(cache, np.random.default_rng(0))
    outs, med = alternate(mods, lambda m: m.flash_attention_with_kvcache(*args, num_threads=threads, **kw), reps)
    mb, mn = med["base"], med["new"]
    print(f"decode {cache} cache T={threads}: base {mb * 1e3:.2f} ms, new {mn * 1e3:.2f} ms, base/new {mb / mn:.3f}; "
          f"max|diff| {np.abs(outs['base'] - outs['new']).max():.2e}")


def main():
    base_dir, new_dir = sys.argv[1], sys.argv[2]
    root = tempfile.mkdtemp(prefix="fa2cpu_ab_")
    sys.path.insert(0, root)
    mods = {"base": load(base_dir, "fa2cpu_ab_base", root), "new": load(new_dir, "fa2cpu_ab_new", root)}
    if sys.argv[4] == "decode":
        main_decode(mods, int(sys.argv[3]), sys.argv[5], int(sys.argv[6]))
    elif sys.argv[4] == "backward":
        main_prefill(mods, sys.argv[3:4] + sys.argv[5:], backward=True)
    else:
        main_prefill(mods, sys.argv[3:])
    shutil.rmtree(root, ignore_errors=True)


def main_prefill(mods, argv, backward=False):
    threads, heads, n = (int(x) for x in argv[:3])
    causal, dtype, reps = argv[3] == "1", dtype_name(argv[4]), int(argv[5])
    layout = argv[6] if len(argv) > 6 else "bhsd"
    hk = int(argv[7]) if len(argv) > 7 else heads
    nq = int(argv[8]) if len(argv) > 8 else n
    rng = np.random.default_rng(0)
    q, do = (rng.standard_normal((1, heads, nq, 128), dtype=np.float32).astype(DTYPES[dtype]) for _ in range(2))
    k, v = (rng.standard_normal((1, hk, n, 128), dtype=np.float32).astype(DTYPES[dtype]) for _ in range(2))
    if layout == "bshd":  # contiguous (B, N, H, D) arrays: rows H * D apart
        q, k, v, do = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v, do))
    if backward:
        out, lse = mods["base"].flash_attention(q, k, v, causal=causal, return_lse=True, num_threads=threads)

        def call(m):
            return tuple(m.flash_attention_backward(do, q, k, v, out, lse, causal=causal, layout=layout,
                                                    num_threads=threads))
    else:
        def call(m):
            return m.flash_attention(q, k, v, causal=causal, layout=layout, num_threads=threads)
    outs, med = alternate(mods, call, reps)
    flops = (10 if backward else 4) * heads * visible_pairs(nq, n, causal) * 128
    mb, mn = med["base"], med["new"]
    shape = f"H={heads} N={n}" + (f" {layout}" if layout != "bhsd" else "") + (f" Hk={hk}" if hk != heads else "") + \
        (f" Nq={nq}" if nq != n else "")
    print(f"{'backward ' if backward else ''}{dtype} T={threads} {shape} causal={causal}: base {mb * 1e3:.1f} ms {flops / mb / 1e9:.1f} GF/s, "
          f"new {mn * 1e3:.1f} ms {flops / mn / 1e9:.1f} GF/s, base/new {mb / mn:.3f}; "
          f"max|diff| {np.abs(outs['base'] - outs['new']).max():.2e}")


if __name__ == "__main__":
    main()
