"""N builds in one process, calls alternated: python multi.py THREADS H N CAUSAL REPS name=pkgdir ...
(bf16, B=1, D=128, bhsd). Prints each build's median ms, GFLOP/s, first/this ratio, max |diff| vs first."""
import importlib, shutil, statistics, sys, tempfile, time
import ml_dtypes, numpy as np
T, H, N, C, REPS = (int(x) for x in sys.argv[1:6])
root = tempfile.mkdtemp()
sys.path.insert(0, root)
mods = {}
for a in sys.argv[6:]:
    name, d = a.split("=")
    shutil.copytree(d, f"{root}/{name}", ignore=shutil.ignore_patterns("__pycache__"))
    mods[name] = importlib.import_module(name)
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, H, N, 128), dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
outs, times = {}, {n: [] for n in mods}
for n, m in mods.items():
    outs[n] = np.asarray(m.flash_attention(q, k, v, causal=bool(C), num_threads=T), dtype=np.float32)
for _ in range(REPS):
    for n, m in mods.items():
        t0 = time.perf_counter(); m.flash_attention(q, k, v, causal=bool(C), num_threads=T); times[n].append(time.perf_counter() - t0)
pairs = N * N if not C else N * (N + 1) / 2
first = next(iter(mods))
b = statistics.median(times[first])
for n in mods:
    md = statistics.median(times[n])
    print(f"T={T} H={H} N={N} causal={C} {n:6s} {md*1e3:8.2f} ms {4*H*pairs*128/md*1e-9:8.0f} GFLOP/s  {first}/this {b/md:.3f}  maxdiff {np.abs(outs[n]-outs[first]).max():.3g}", flush=True)
