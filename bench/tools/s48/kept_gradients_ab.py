"""In-process A/B, same build: a backward whose gradients come from np.empty against kept memory
(fa2cpu._core.gradient_array, the default), calls alternated; each form keeps its last result
alive until its next call returns (g = backward(...) in a loop).
    PYTHONPATH=$PWD python bench/tools/s48/kept_gradients_ab.py THREADS H N CAUSAL(0|1) bf16|fp32 REPS"""
import sys, time, numpy as np, ml_dtypes, fa2cpu, fa2cpu.backward as B
from fa2cpu import _core
T, H, N, causal, dt, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5], int(sys.argv[6])
dt = ml_dtypes.bfloat16 if dt == "bf16" else np.float32
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((1, H, N, 128)).astype(dt) for _ in range(4))
o, lse = fa2cpu.flash_attention(q, k, v, causal=causal, return_lse=True, num_threads=T)
last = {}
def run(name, alloc):
    B._uninitialised = alloc
    t = time.perf_counter(); g = fa2cpu.flash_attention_backward(do, q, k, v, o, lse, causal=causal, num_threads=T); el = time.perf_counter() - t
    last[name] = g
    return el, g
a, b = [], []
same = True
for i in range(reps):
    ta, ga = run("empty", np.empty); tb, gb = run("kept", _core.gradient_array)
    a.append(ta); b.append(tb)
    same &= all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(ga, gb))
print(f"T={T} H={H} N={N} causal={causal} {sys.argv[5]}: empty {1e3*np.median(a):.1f} ms, kept {1e3*np.median(b):.1f} ms, empty/kept {np.median(a)/np.median(b):.3f}; same bits {same}; kept now {_core.kept_gradient_bytes()>>20} MB")
