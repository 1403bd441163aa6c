"""A/B of two fa2cpu builds in ONE process: each build's package directory (an in-place build's
`fa2cpu/`, or `<pip --target dir>/fa2cpu`) is copied under its own package name and imported, and
their forward calls alternate, so a noisy machine's drift hits both alike (processes alternated by
bench/ab.sh cannot remove drift within a run). Prints the median of each and base / new (> 1: the
second build is faster) and the largest difference between their outputs.

    PYTHONPATH=$PWD python bench/ab_inproc.py BASE_PKG NEW_PKG THREADS HEADS N CAUSAL(0|1) DTYPE REPS

e.g. `PYTHONPATH=$PWD python bench/ab_inproc.py /tmp/base/fa2cpu fa2cpu 1 4 2048 0 fp32 9` (B=1,
D=128; DTYPE and the FLOP count as fa2cpu-bench takes them, from the checkout's fa2cpu.bench).
Works because the extension's init symbol depends only on the module's last name (`_core`) and the
package imports itself relatively.
"""
import importlib
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from fa2cpu.bench import DTYPES, dtype_name, visible_pairs


def load(pkg_dir, name, root):
    shutil.copytree(pkg_dir, f"{root}/{name}", ignore=shutil.ignore_patterns("__pycache__"))
    return importlib.import_module(name)


def main():
    base_dir, new_dir = sys.argv[1], sys.argv[2]
    threads, heads, n = (int(x) for x in sys.argv[3:6])
    causal, dtype, reps = sys.argv[6] == "1", dtype_name(sys.argv[7]), int(sys.argv[8])
    root = tempfile.mkdtemp(prefix="fa2cpu_ab_")
    sys.path.insert(0, root)
    mods = {"base": load(base_dir, "fa2cpu_ab_base", root), "new": load(new_dir, "fa2cpu_ab_new", root)}
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, heads, n, 128), dtype=np.float32).astype(DTYPES[dtype]) for _ in range(3))
    outs, times = {}, {name: [] for name in mods}
    for name, m in mods.items():  # warm-up, and the outputs compared below
        outs[name] = m.flash_attention(q, k, v, causal=causal, num_threads=threads).astype(np.float64)
    for _ in range(reps):
        for name, m in mods.items():
            t = time.perf_counter()
            m.flash_attention(q, k, v, causal=causal, num_threads=threads)
            times[name].append(time.perf_counter() - t)
    flops = 4 * heads * visible_pairs(n, n, causal) * 128
    mb, mn = statistics.median(times["base"]), statistics.median(times["new"])
    print(f"{dtype} T={threads} H={heads} N={n} causal={causal}: base {mb * 1e3:.1f} ms {flops / mb / 1e9:.1f} GF/s, "
          f"new {mn * 1e3:.1f} ms {flops / mn / 1e9:.1f} GF/s, base/new {mb / mn:.3f}; "
          f"max|diff| {np.abs(outs['base'] - outs['new']).max():.2e}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
