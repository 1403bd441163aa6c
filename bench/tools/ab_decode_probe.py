"""Builds of fa2cpu alternated in one process on an int8-cache decode (B sequences, Nk keys,
Hq=32 Hk=8 D=128, bf16 q, uniform codes): ns and cycles (at 3.45 GHz) per (key, kv head). Used
with timing-probe builds (session 26, bench/results/zen4_2core/int8_decode_probes_s26.*).

    python bench/tools/ab_decode_probe.py PKG_DIR[,PKG_DIR...] B NK REPS [THREADS]
"""
import os, sys, time, tempfile, statistics, numpy as np
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, 'bench')); sys.path.insert(0, _ROOT)
from ab_inproc import decode_case, load
root=tempfile.mkdtemp(); sys.path.insert(0,root)
pkgs=sys.argv[1].split(','); B=int(sys.argv[2]); N=int(sys.argv[3]); reps=int(sys.argv[4]); T=int(sys.argv[5]) if len(sys.argv)>5 else 1
mods=[load(p, f"m{i}", root) for i,p in enumerate(pkgs)]
(q,kc,vc),kw=decode_case("int8", np.random.default_rng(0), B, N)
Hk=kc.shape[2]
inner=max(1,int(2e6/(B*N*Hk)))
ts=[[] for _ in mods]
for r in range(reps):
    for i,m in enumerate(mods):
        t=time.perf_counter()
        for _ in range(inner): m.flash_attention_with_kvcache(q,kc,vc,num_threads=T,**kw)
        ts[i].append((time.perf_counter()-t)/inner)
kh=B*N*Hk
for p,t in zip(pkgs,ts): print(f"{p:40s} {statistics.median(t)/kh*1e9:6.2f} ns/key-head  {statistics.median(t)/kh*3.45e9:6.1f} cyc")
