"""Which property of the backward's output arrays costs time at many threads (session 46):
_core.run_backward into dq / dk / dv that are (a) reused np.ones, (b) reused np.zeros, (c) fresh
np.zeros, (d) fresh np.zeros touched by _core.touch_pages (if built), (e) fresh np.ones, (f) fresh
np.empty, (g) fresh np.zeros with 2 MB-aligned data (huge-page eligible), alternated per rep.
    python3 bench/tools/s46/out_alloc.py THREADS DTYPE H [N]
"""
import sys, time, statistics
import numpy as np, ml_dtypes
import fa2cpu, fa2cpu._core as _core, fa2cpu.backward as fb
T, name, H = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
N = int(sys.argv[4]) if len(sys.argv) > 4 else 2048
D = 128
dt = {'fp32': np.float32, 'bf16': ml_dtypes.bfloat16}[name]
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((1, H, N, D), dtype=np.float32).astype(dt) for _ in range(4))
out, lse = fa2cpu.flash_attention(q, k, v, return_lse=True, num_threads=T)
def run(g):
    _core.run_backward(do, q, k, v, out, lse, *g, dtype=fb._DTYPES[q.dtype], batch=1, hq=H, hk=H, nq=N, nk=N,
                       scale=D ** -0.5, softcap=0.0, win_left=-1, win_right=-1, alibi=None, cu_q=None, cu_k=None,
                       num_threads=T)
def aligned_zeros():
    n = q.nbytes
    raw = np.zeros(n + (2 << 20), np.uint8)
    off = (-raw.ctypes.data) % (2 << 20)
    return raw[off:off + n].view(dt).reshape(q.shape)
ones = [np.ones(q.shape, dt) for _ in range(3)]
zeros = [np.zeros(q.shape, dt) for _ in range(3)]
def touched():
    g = [np.zeros(q.shape, dt) for _ in range(3)]
    for a in g:
        if hasattr(_core, "touch_pages"): _core.touch_pages(a, T)
    return g
variants = {
    "reused ones": lambda: ones, "reused zeros": lambda: zeros,
    "fresh zeros": lambda: [np.zeros(q.shape, dt) for _ in range(3)], "fresh zeros touched": touched,
    "fresh ones": lambda: [np.ones(q.shape, dt) for _ in range(3)], "fresh empty": lambda: [np.empty(q.shape, dt) for _ in range(3)],
    "fresh 2MB-aligned zeros": lambda: [aligned_zeros() for _ in range(3)],
}
times = {k: [] for k in variants}
for _ in range(9):
    for key, make in variants.items():
        t0 = time.perf_counter(); g = make(); t1 = time.perf_counter(); run(g); t2 = time.perf_counter()
        times[key].append((t1 - t0, t2 - t1))
for key, ts in times.items():
    a = statistics.median(x for x, _ in ts); b = statistics.median(y for _, y in ts)
    print(f"{name} T={T} H={H} N={N} {key:24s}: alloc {a*1e3:6.2f} ms, backward {b*1e3:7.2f} ms", flush=True)
