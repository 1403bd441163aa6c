"""The backward's cost of non-finite inputs, two builds in one process (base, new): causal bf16
(B=1 H=16 N=2048 D=128), clean, with NaN in q rows (every 97th), in k keys (every 211th) and
inf in dout rows (every 97th); median of 5 calls each, new / base. The forward's out / lse come
from the base build.

    python nan_cost_bwd.py BASE_PKG NEW_PKG [THREADS]   (run from outside the checkout)
"""
import importlib
import shutil
import statistics
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

root = tempfile.mkdtemp()
mods = {}
for name, d in (("base", sys.argv[1]), ("new", sys.argv[2])):
    shutil.copytree(d, f"{root}/{name}")
    sys.path.insert(0, root)
    mods[name] = importlib.import_module(name)
T = int(sys.argv[3]) if len(sys.argv) > 3 else 2
rng = np.random.default_rng(0)
dt = ml_dtypes.bfloat16
q, k, v, do = (rng.standard_normal((1, 16, 2048, 128)).astype(dt) for _ in range(4))
cases = {"clean": {}}
x = q.copy(); x[0, :, ::97, 5] = np.nan; cases["NaN q rows"] = {"q": x}
x = k.copy(); x[0, :, 1::211, 7] = np.nan; cases["NaN k keys"] = {"k": x}
x = do.copy(); x[0, :, ::97, 9] = np.inf; cases["inf dout rows"] = {"do": x}
for label, over in cases.items():
    a = {**dict(q=q, k=k, v=v, do=do), **over}
    out, lse = mods["base"].flash_attention(a["q"], a["k"], a["v"], causal=True, return_lse=True, num_threads=T)
    t = {n: [] for n in mods}
    for _ in range(5):
        for n, m in mods.items():
            t0 = time.perf_counter()
            m.flash_attention_backward(a["do"], a["q"], a["k"], a["v"], out, lse, causal=True, num_threads=T)
            t[n].append(time.perf_counter() - t0)
    b, w = statistics.median(t["base"]), statistics.median(t["new"])
    print(f"{label:14s} base {b * 1e3:6.1f} ms  new {w * 1e3:6.1f} ms  new/base {w / b:.3f}", flush=True)
