"""Cost of first-touch page faults of fresh output arrays at many threads (session 46): a fresh
np.zeros of MB megabytes, touched once per 4 KB page (a) by one thread, (b) by THREADS Python
threads (numpy's strided assignment releases the GIL), (c) written whole by np.ones; medians.
    python3 bench/tools/s46/prefault_probe.py THREADS MB
"""
import sys, time, statistics
from concurrent.futures import ThreadPoolExecutor
import numpy as np
T, MB = int(sys.argv[1]), int(sys.argv[2])
n = MB << 18  # float32 elements
pool = ThreadPoolExecutor(T)
def touch(a, parts):
    per = -(-a.size // parts)
    def one(i):
        a[i * per:(i + 1) * per:1024] = 0.0  # one element per 4 KB page
    list(pool.map(one, range(parts)))
res = {}
for name, fn in (("zeros+touch 1 thread", lambda: touch(np.zeros(n, np.float32), 1)),
                 (f"zeros+touch {T} threads", lambda: touch(np.zeros(n, np.float32), T)),
                 ("ones (one thread writes all)", lambda: np.ones(n, np.float32)),
                 ("zeros untouched", lambda: np.zeros(n, np.float32))):
    ts = []
    for _ in range(9):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    print(f"{MB} MB {name}: {statistics.median(ts)*1e3:.2f} ms", flush=True)
