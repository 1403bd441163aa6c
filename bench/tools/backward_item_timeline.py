"""Backward item timeline (diagnostic build, never a release): bench/tools/backward_item_timeline.patch
makes csrc/driver/backward.cpp record each item's thread and TSC start / end and the spans of the
item region and the dq reduction, printed to stderr when FA2CPU_XTRACE is set. This script runs
flash_attention_backward REPS times and prints, per call after the first: the region, the
reduction, item times (min / median / max) and per-thread busy time. Session 42.

    mkdir /tmp/trc && git archive HEAD | tar -x -C /tmp/trc && cd /tmp/trc
    patch -p1 < bench/tools/backward_item_timeline.patch && python setup.py build_ext --inplace
    PYTHONPATH=/tmp/trc python bench/tools/backward_item_timeline.py T H N CAUSAL(0|1) fp32|bf16 REPS
"""
import os, sys, time, statistics, numpy as np, ml_dtypes, fa2cpu
T, H, N, causal, dt, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), bool(int(sys.argv[4])), sys.argv[5], int(sys.argv[6])
ndt = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16}[dt]
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((1, H, N, 128), dtype=np.float32).astype(ndt) for _ in range(4))
out, lse = fa2cpu.flash_attention(q, k, v, causal=causal, return_lse=True, num_threads=T)
path = f"/tmp/bwdtl_{os.getpid()}.txt"
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC); saved = os.dup(2); os.dup2(fd, 2)
os.environ["FA2CPU_XTRACE"] = "1"
walls = []
for _ in range(reps):
    t = time.perf_counter(); fa2cpu.flash_attention_backward(do, q, k, v, out, lse, causal=causal, num_threads=T); walls.append(time.perf_counter() - t)
os.environ.pop("FA2CPU_XTRACE"); os.dup2(saved, 2); os.close(fd)
calls, cur = [], None
for line in open(path):
    f = line.split()
    if f[0] == "BWD":
        cur = dict(r0=int(f[1]), r1=int(f[2]), r2=int(f[3]), items=[]); calls.append(cur)
    elif f[0] == "IT":
        cur["items"].append((int(f[1]), int(f[2]), int(f[3]), int(f[4]), int(f[5]), int(f[6])))
def rdtsc_ghz():
    # TSC rate taken as /proc/cpuinfo's "cpu MHz" (a constant TSC, as on the machines measured)
    for l in open("/proc/cpuinfo"):
        if l.startswith("cpu MHz"): return float(l.split(":")[1]) / 1e3
g = rdtsc_ghz()
print(f"# T={T} H={H} N={N} causal={causal} {dt}: wall median {statistics.median(walls)*1e3:.1f} ms; TSC taken at {g:.3f} GHz (cpu MHz)")
for c in calls[1:]:
    us = lambda x: x / g / 1e3
    its = c["items"]
    busy = {}
    for tid, i, a, b, keys, rows in its: busy[tid] = busy.get(tid, 0) + (b - a)
    first = min(a for _, _, a, _, _, _ in its) - c["r0"]; lastend = max(b for _, _, _, b, _, _ in its)
    durs = sorted(b - a for _, _, a, b, _, _ in its)
    print(f"region {us(c['r1']-c['r0']):8.0f} us (first item starts {us(first):.0f}, last item ends {us(c['r1']-lastend):.0f} before the end) reduce {us(c['r2']-c['r1']):6.0f} us | "
          f"{len(its)} items on {len(busy)} threads, item us min/med/max {us(durs[0]):.0f}/{us(durs[len(durs)//2]):.0f}/{us(durs[-1]):.0f}, "
          f"busy per thread min/max {us(min(busy.values())):.0f}/{us(max(busy.values())):.0f}, keys x rows {its[0][4]}x{its[0][5]}")
