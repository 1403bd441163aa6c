"""Timeline of the torch op decode (bench/timeline/README.md)."""
import os, sys, time, statistics, re
T = int(sys.argv[1]); os.environ.setdefault("OMP_NUM_THREADS", str(T))
import torch, fa2cpu.torch as ft
torch.set_num_threads(T)
B, Hq, Hk, N, D = 1, 16, 4, 2048, 128
g = torch.Generator().manual_seed(0)
kc = torch.randn(B, N + 64, Hk, D, generator=g).to(torch.bfloat16); vc = torch.randn(B, N + 64, Hk, D, generator=g).to(torch.bfloat16)
q = torch.randn(B, 1, Hq, D, generator=g).to(torch.bfloat16)
seqlens = torch.full((B,), N, dtype=torch.int32)
big = torch.randn(64 << 20 >> 2)
w = torch.randn(5632, 2048).to(torch.bfloat16); x = torch.randn(1, 2048).to(torch.bfloat16)
modes = {"hot": lambda: None, "evict": lambda: big.add_(1.0), "gemm": lambda: [torch.mm(x, w.t()) for _ in range(4)]}
mhz = float([l for l in open("/proc/cpuinfo") if l.startswith("cpu MHz")][0].split(":")[1])
for mode, f in modes.items():
    path = f"/tmp/xtrace_{mode}.txt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC); saved = os.dup(2); os.dup2(fd, 2)
    os.environ["FA2CPU_XTRACE"] = "1"
    wall = []
    for i in range(40):
        f(); t0 = time.perf_counter(); ft.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens); wall.append(time.perf_counter() - t0)
    os.environ.pop("FA2CPU_XTRACE"); os.dup2(saved, 2); os.close(fd)
    calls = []; cur = None
    for line in open(path):
        if line.startswith("XCALL"):
            cur = {"total": int(line.split()[1]), "items": []}; calls.append(cur)
        elif line.startswith("XI") and cur is not None:
            _, tid, item, a, b = line.split(); cur["items"].append((int(tid), int(item), int(a), int(b)))
    calls = calls[10:]
    us = lambda c: c / mhz
    tot = statistics.median(us(c["total"]) for c in calls)
    first = statistics.median(us(min(i[2] for i in c["items"])) for c in calls)
    last_start = statistics.median(us(max(i[2] for i in c["items"])) for c in calls)
    dur = statistics.median(us(i[3] - i[2]) for c in calls for i in c["items"])
    dmax = statistics.median(us(max(i[3] - i[2] for i in c["items"])) for c in calls)
    end = statistics.median(us(max(i[3] for i in c["items"])) for c in calls)
    nthr = statistics.median(len({i[0] for i in c["items"]}) for c in calls)
    nit = statistics.median(len(c["items"]) for c in calls)
    print(f"{T} thr {mode:5s}: wall {statistics.median(wall[10:])*1e6:6.1f} us, region {tot:6.1f} us (TSC {mhz:.0f} MHz), items {nit}, "
          f"threads used {nthr}, first item start {first:5.1f}, last item start {last_start:5.1f}, item median {dur:5.1f} max {dmax:5.1f}, last end {end:5.1f}", flush=True)
    ex = calls[len(calls) // 2]
    print("   example:", " ".join(f"t{t}:{us(a):.0f}-{us(b):.0f}" for t, _, a, b in sorted(ex["items"], key=lambda z: z[2])))
