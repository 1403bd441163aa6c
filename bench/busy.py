"""Call latency idle and on a busy machine (issue 8, "Calls on a busy machine").

A server shares its cores. This script times small and mid-sized calls at 1 and n threads, first on
an idle machine, then while `--hogs` other processes spin on the CPU (a competitor holding cores),
and prints median milliseconds per call. Run it against any fa2cpu install, e.g.:

    python bench/busy.py                      # the installed fa2cpu
    OMP_WAIT_POLICY=passive python bench/busy.py   # how an OpenMP build behaved with a passive wait
"""
import argparse
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

import fa2cpu


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cases(rng):
    f32 = np.float32
    q, k, v = (rng.standard_normal((1, 8, 64, 64), dtype=f32) for _ in range(3))
    yield "forward N=64 H=8 D=64", lambda nt: fa2cpu.flash_attention(q, k, v, causal=True, num_threads=nt)
    qd = rng.standard_normal((4, 1, 32, 128), dtype=f32)
    kc, vc = (rng.standard_normal((4, 2048, 8, 128), dtype=f32) for _ in range(2))
    yield "decode B=4 Hq=32/8 Nk=2048", lambda nt: fa2cpu.flash_attention_with_kvcache(qd, kc, vc, num_threads=nt)
    q2, k2, v2 = (rng.standard_normal((1, 8, 512, 128), dtype=f32) for _ in range(3))
    yield "forward N=512 H=8 D=128", lambda nt: fa2cpu.flash_attention(q2, k2, v2, num_threads=nt)


def median_ms(fn, nt, seconds):
    fn(nt)
    times = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 5:
        t0 = time.perf_counter()
        fn(nt)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), 1e3 * max(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--hogs", type=int, default=1, help="competing spinning processes in the busy runs")
    ap.add_argument("--seconds", type=float, default=1.5, help="time per measurement")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"# fa2cpu {fa2cpu.__version__} ({fa2cpu.__file__}), family {fa2cpu.get_isa()}, CPU: {cpu_model()}")
    print(f"# command: {' '.join([sys.executable.rsplit('/', 1)[-1]] + sys.argv)}")
    print("| case | threads | idle median ms (max) | busy median ms (max) | busy / idle |")
    print("|---|--:|--:|--:|--:|")
    for name, fn in cases(rng):
        for nt in a.threads:
            idle = median_ms(fn, nt, a.seconds)
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.hogs)]
            try:
                time.sleep(0.2)
                busy = median_ms(fn, nt, a.seconds)
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
            print(f"| {name} | {nt} | {idle[0]:.3f} ({idle[1]:.2f}) | {busy[0]:.3f} ({busy[1]:.2f}) | "
                  f"{busy[0] / idle[0]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
