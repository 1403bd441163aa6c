"""fa2cpu's C++ backward vs torch autograd through scaled_dot_product_attention, same process.

Torch's backward alone is measured as (forward + backward) - forward: both timed here with
requires_grad inputs, so torch runs the same forward kernel in both. fa2cpu's backward is timed
on its own (flash_attention_backward from the forward's out / lse), and fa2cpu's forward beside
it. The four measurements are interleaved per repetition (drift on a shared machine hits all of
them alike), with one untimed forward of ours between torch's and ours (see `case`), and the median
of the repetitions is reported.

    PYTHONPATH=$PWD python bench/backward_vs_torch.py      # B=1 H=16 N=2048 D=128, fp32+bf16,
                                                           # causal and not, 1 and 2 threads
    python bench/backward_vs_torch.py --threads 16 --n 4096 --heads 32 --markdown

(PYTHONPATH=$PWD from the checkout: a script in bench/ would otherwise import whatever fa2cpu is
installed.) Columns: ms of torch's backward, ours, ratio torch/ours (> 1: we are faster), our forward and
our backward / our forward.
"""
import argparse
import platform
import statistics
import subprocess
import time

import ml_dtypes
import numpy as np
import torch

import fa2cpu


def _cpu():
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _time(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def case(B, H, N, D, dtype, causal, threads, reps, rng):
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    ndt = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16}[dtype]
    torch.set_num_threads(threads)
    q, k, v, do = (torch.from_numpy(rng.standard_normal((B, H, N, D), dtype=np.float32)).to(tdt) for _ in range(4))
    tq, tk, tv = (x.clone().requires_grad_(True) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def torch_fwd():
        sdpa(tq, tk, tv, is_causal=causal)

    def torch_fwd_bwd():
        sdpa(tq, tk, tv, is_causal=causal).backward(do)

    # torch tensors -> NumPy arrays (bf16 through a 16-bit view)
    def arr(x):
        return x.view(torch.int16).numpy().view(ndt) if dtype == "bf16" else x.numpy()
    nq, nk, nv, ndo = (arr(x) for x in (q, k, v, do))
    out, lse = fa2cpu.flash_attention(nq, nk, nv, causal=causal, return_lse=True, num_threads=threads)

    def ours_fwd():
        fa2cpu.flash_attention(nq, nk, nv, causal=causal, num_threads=threads)

    def ours_bwd():
        fa2cpu.flash_attention_backward(ndo, nq, nk, nv, out, lse, causal=causal, num_threads=threads)

    for f in (torch_fwd, torch_fwd_bwd, ours_fwd, ours_bwd):  # warm-up
        f()
    t = {name: [] for name in ("tf", "tfb", "of", "ob")}
    for _ in range(reps):
        t["tf"].append(_time(torch_fwd))
        t["tfb"].append(_time(torch_fwd_bwd))
        # Our first call after torch's ran up to 1.5x slower at 16 threads (H=16 N=2048 bf16 on the
        # AMX test machine: forward 15.8 ms right after torch's fwd+bwd, 10.5 ms after our own
        # backward; bench/RESULTS.md, session 42). Timed right after torch, our forward looked slow
        # and bwd / fwd small. This untimed call takes that hit, so both our timings follow our own.
        ours_fwd()
        t["of"].append(_time(ours_fwd))
        t["ob"].append(_time(ours_bwd))
    med = {name: statistics.median(x) for name, x in t.items()}
    torch_bwd = med["tfb"] - med["tf"]
    return dict(torch_bwd=torch_bwd, ours_bwd=med["ob"], ratio=torch_bwd / med["ob"], ours_fwd=med["of"],
                bwd_over_fwd=med["ob"] / med["of"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--causal", default="0,1", help="comma list of 0/1")
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--isa", default=None, help="fa2cpu family (default: the automatic choice)")
    args = ap.parse_args()
    if args.isa:
        fa2cpu.set_isa(args.isa)
    rng = np.random.default_rng(0)
    print(f"# CPU: {_cpu()}; fa2cpu {fa2cpu.__version__} family {fa2cpu.get_isa()}; torch {torch.__version__}")
    print(f"# B={args.batch} H={args.heads} N={args.n} D={args.d}, median of {args.reps} interleaved repetitions")
    print("| dtype | causal | threads | torch bwd ms | fa2cpu bwd ms | torch/fa2cpu | fa2cpu fwd ms | bwd/fwd |")
    print("|---|---|--:|--:|--:|--:|--:|--:|")
    for threads in (int(x) for x in args.threads.split(",")):
        for dtype in args.dtypes.split(","):
            for causal in (bool(int(x)) for x in args.causal.split(",")):
                r = case(args.batch, args.heads, args.n, args.d, dtype, causal, threads, args.reps, rng)
                print(f"| {dtype} | {causal} | {threads} | {r['torch_bwd']:.0f} | {r['ours_bwd']:.0f} | "
                      f"{r['ratio']:.2f}x | {r['ours_fwd']:.0f} | {r['bwd_over_fwd']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
