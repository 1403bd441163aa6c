"""fa2cpu against torch SDPA, interleaved in one process: median ms of each and the ratio
(torch / fa2cpu, > 1 means fa2cpu is faster) for a fixed list of prefill and decode cases.
Prefill rows also give both GFLOP/s as % of the chosen family's multiply-add probe
(`fa2cpu._core.peak_gflops`, fp32 FMA or bf16 tile / dot product) measured between the
repetitions, so the denominator comes from the same minutes as the times: this VM's speed moved
~35 % within an hour (bench/RESULTS.md, session 38), which made a probe taken once at the start a
poor denominator.

    python bench/vs_torch.py --threads 16 [--cases prefill,decode] [--reps 7]

Used for before/after comparisons of kernel changes: run it under each build's PYTHONPATH, or
with --ab-env NAME to time fa2cpu with NAME=1 and NAME=0 alternately in one process (for switches
the core reads per call, e.g. FA2CPU_SHARED_TILES)."""
import argparse
import os
import statistics
import time

import ml_dtypes
import numpy as np
import torch

import fa2cpu
from fa2cpu.bench import visible_pairs

PREFILL = [("bf16", 2048, False), ("bf16", 2048, True), ("bf16", 4096, False), ("bf16", 4096, True),
           ("fp32", 2048, False), ("fp32", 4096, False), ("fp32", 4096, True)]
DECODE = [("bf16", 8192), ("fp32", 8192)]
NP = {"bf16": ml_dtypes.bfloat16, "fp32": np.float32}
TORCH = {"bf16": torch.bfloat16, "fp32": torch.float32}


def to_torch(a, dt):
    if dt == "bf16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def timed(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--cases", default="prefill,decode")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--max-n", type=int, default=4096, help="skip prefill cases longer than this")
    ap.add_argument("--ab-env", help="also time fa2cpu with this environment variable set to 0")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    print(f"# fa2cpu {fa2cpu.get_isa()}, torch {torch.__version__}, {a.threads} threads")
    ab = f" {a.ab_env + '=0 ms':>22s} {'ratio':>6s}" if a.ab_env else ""
    print(f"{'case':40s} {'fa2cpu ms':>10s} {'torch ms':>10s} {'ratio':>6s} {'probe GF/s':>10s} "
          f"{'% fa2cpu':>8s} {'% torch':>7s}{ab}")
    rows = []
    if "prefill" in a.cases:
        for dt, n, causal in [c for c in PREFILL if c[1] <= a.max_n]:
            q, k, v = (rng.standard_normal((1, a.heads, n, 128), dtype=np.float32).astype(NP[dt]) for _ in range(3))
            tq, tk, tv = (to_torch(x, dt) for x in (q, k, v))
            def ours(q=q, k=k, v=v, causal=causal):
                return fa2cpu.flash_attention(q, k, v, causal=causal, num_threads=a.threads)

            def theirs(q=tq, k=tk, v=tv, causal=causal):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

            flops = 4.0 * a.heads * visible_pairs(n, n, causal) * 128
            rows.append((f"prefill {dt} H={a.heads} N={n} D=128 {'causal' if causal else 'full'}", ours, theirs,
                         dt, flops))
    if "decode" in a.cases:
        for dt, nk in DECODE:
            B, Hq, Hk = 16, 32, 8
            q = rng.standard_normal((B, 1, Hq, 128), dtype=np.float32).astype(NP[dt])
            kc, vc = (rng.standard_normal((B, nk, Hk, 128), dtype=np.float32).astype(NP[dt]) for _ in range(2))
            # torch gets its own (B, H, N, D) contiguous copies: its fastest layout
            tq = to_torch(q, dt).transpose(1, 2).contiguous()
            tk, tv = (to_torch(x, dt).transpose(1, 2).contiguous() for x in (kc, vc))
            def ours(q=q, kc=kc, vc=vc):
                return fa2cpu.flash_attention_with_kvcache(q, kc, vc, num_threads=a.threads)

            def theirs(q=tq, k=tk, v=tv):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            rows.append((f"decode {dt} B=16 H=32/8 Nk={nk} D=128", ours, theirs, dt, None))
    family = fa2cpu.get_isa()
    for name, ours, theirs, dt, flops in rows:
        to, tt, tb, peaks = [], [], [], []
        for _ in range(3):  # alternate, so drift hits all
            if flops:
                peaks.append(fa2cpu._core.peak_gflops(family, dt, a.threads, 0.1))
            if a.ab_env:
                os.environ[a.ab_env] = "1"
            to.append(timed(ours, a.reps))
            tt.append(timed(theirs, a.reps))
            if a.ab_env:
                os.environ[a.ab_env] = "0"
                tb.append(timed(ours, a.reps))
                os.environ[a.ab_env] = "1"
        mo, mt = statistics.median(to), statistics.median(tt)
        line = f"{name:40s} {mo * 1e3:10.2f} {mt * 1e3:10.2f} {mt / mo:6.2f}"
        if flops:
            pk = statistics.median(peaks)
            line += f" {pk:10.0f} {100 * flops / mo / 1e9 / pk:7.0f}% {100 * flops / mt / 1e9 / pk:6.0f}%"
        else:
            line += f" {'':10s} {'':8s} {'':7s}"
        if tb:
            mb = statistics.median(tb)
            line += f" {mb * 1e3:22.2f} {mt / mb:6.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
