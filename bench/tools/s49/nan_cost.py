"""The forward's cost of non-finite inputs, two builds in one process (base, new): a clean causal
bf16 call (B=1 H=16 N=2048 D=128), one with NaN query rows, one with inf in V at keys hidden from
earlier rows; median of 7, new / base.

    python nan_cost.py BASE_PKG NEW_PKG [THREADS]   (run from outside the checkout)
"""
import sys, time, statistics, numpy as np, ml_dtypes, importlib, shutil, tempfile
root = tempfile.mkdtemp()
mods = {}
for name, d in (("base", sys.argv[1]), ("new", sys.argv[2])):
    shutil.copytree(d, f"{root}/{name}"); sys.path.insert(0, root); mods[name] = importlib.import_module(name)
rng = np.random.default_rng(0)
dt = ml_dtypes.bfloat16
q, k, v = (rng.standard_normal((1, 16, 2048, 128)).astype(dt) for _ in range(3))
qn = q.copy(); qn[0, :, ::97, 5] = np.nan          # NaN query rows
vn = v.copy(); vn[0, :, 1::211, 7] = np.inf         # inf in v at keys hidden from earlier rows
THREADS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
for label, args in (("clean", (q, k, v)), ("NaN q rows", (qn, k, v)), ("inf v", (q, k, vn))):
    t = {n: [] for n in mods}
    for _ in range(7):
        for n, m in mods.items():
            t0 = time.perf_counter(); m.flash_attention(*args, causal=True, num_threads=THREADS); t[n].append(time.perf_counter() - t0)
    b, w = statistics.median(t["base"]), statistics.median(t["new"])
    print(f"{label:12s} base {b*1e3:6.1f} ms  new {w*1e3:6.1f} ms  new/base {w/b:.3f}")
