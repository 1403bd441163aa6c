"""In-process A/B of two builds' public backward (fresh outputs each call), B=1 N=2048 D=128
full attention: python3 bench/tools/s46/touch_ab.py BASE_PKG NEW_PKG THREADS REPS H... (session 46:
the gradients' pages mapped by every thread before the call, fa2cpu/backward.py _gradients)."""
import os, sys, tempfile, statistics, time
import numpy as np, ml_dtypes
_root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '..')
sys.path.insert(0, os.path.join(_root, 'bench')); sys.path.append(_root)
import ab_inproc as ab
root = tempfile.mkdtemp(); sys.path.insert(0, root)
mods = {"base": ab.load(sys.argv[1], "t_base", root), "new": ab.load(sys.argv[2], "t_new", root)}
T, reps = int(sys.argv[3]), int(sys.argv[4])
for name, dt in (("fp32", np.float32), ("bf16", ml_dtypes.bfloat16)):
    for H in (int(x) for x in sys.argv[5:]):
        rng = np.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((1, H, 2048, 128), dtype=np.float32).astype(dt) for _ in range(4))
        out, lse = mods["base"].flash_attention(q, k, v, return_lse=True, num_threads=T)
        outs, med = ab.alternate(mods, lambda m: m.flash_attention_backward(do, q, k, v, out, lse, num_threads=T), reps)
        tf = []
        for _ in range(reps):
            t = time.perf_counter(); mods["new"].flash_attention(q, k, v, num_threads=T); tf.append(time.perf_counter() - t)
        f = statistics.median(tf)
        print(f"{name} T={T} H={H}: base {med['base']*1e3:.1f} ms, new {med['new']*1e3:.1f} ms, base/new {med['base']/med['new']:.3f}; "
              f"fwd {f*1e3:.1f} ms, bwd/fwd base {med['base']/f:.2f} new {med['new']/f:.2f}; "
              f"max|diff| {np.abs(outs['base'] - outs['new']).max():.1e}", flush=True)
# The forward's potential: fresh output per call vs a pre-faulted out= (new build alone).
m = mods["new"]
for name, dt in (("fp32", np.float32), ("bf16", ml_dtypes.bfloat16)):
    for H in (int(x) for x in sys.argv[5:]):
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, H, 2048, 128), dtype=np.float32).astype(dt) for _ in range(3))
        kept = np.ones(q.shape, dt)
        fresh, pre = [], []
        for _ in range(reps + 2):
            t = time.perf_counter(); m.flash_attention(q, k, v, num_threads=T); fresh.append(time.perf_counter() - t)
            t = time.perf_counter(); m.flash_attention(q, k, v, num_threads=T, out=kept); pre.append(time.perf_counter() - t)
        a, b = statistics.median(fresh), statistics.median(pre)
        print(f"forward {name} T={T} H={H}: fresh output {a*1e3:.2f} ms, pre-faulted out= {b*1e3:.2f} ms, fresh/pre {a/b:.3f}", flush=True)
