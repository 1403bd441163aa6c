"""In-process A/B of two builds on small prefill shapes (bf16 / fp16, 2 threads): copy each build's
fa2cpu package to /tmp/ab45/base and /tmp/ab45/new, then python bench/tools/small_shapes_ab.py.
Prints medians of three rounds, base / new, and whether the outputs have the same bits."""
import sys, importlib, time, numpy as np, ml_dtypes
sys.path.insert(0, "/tmp/ab45")
mods = {n: importlib.import_module(n) for n in ("base", "new")}
rng = np.random.default_rng(0)
def med(f, n):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return np.median(ts)
for dt in (ml_dtypes.bfloat16, np.float16):
    for (B, H, N, D) in [(1, 8, 16, 128), (1, 8, 17, 128), (1, 12, 32, 32), (1, 12, 128, 32), (4, 32, 64, 128), (1, 8, 256, 80), (1, 32, 1024, 128)]:
        q, k, v = (rng.standard_normal((B, H, N, D), dtype=np.float32).astype(dt) for _ in range(3))
        n = max(5, int(0.3 / max(1e-5, med(lambda: mods["base"].flash_attention(q, k, v, num_threads=2), 3))))
        n = min(n, 400)
        r = {m: [] for m in mods}
        for _ in range(3):
            for m, mod in mods.items():
                r[m].append(med(lambda: mod.flash_attention(q, k, v, num_threads=2), n))
        b, w = np.median(r["base"]), np.median(r["new"])
        same = np.array_equal(np.asarray(mods["base"].flash_attention(q, k, v, num_threads=2)).view(np.uint16), np.asarray(mods["new"].flash_attention(q, k, v, num_threads=2)).view(np.uint16))
        print(f"{np.dtype(dt).name:8s} B={B} H={H} N={N} D={D}: base {b*1e6:9.0f} us  new {w*1e6:9.0f} us  base/new {b/w:.3f}  same bits {same}", flush=True)
