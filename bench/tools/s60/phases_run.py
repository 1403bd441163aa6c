"""Session 60: one forward call timed 4 times, for a build with forward_phase_timers.patch (rdtsc per
phase of TileLoop::run_item, printed to stderr as "PHASE name cycles" at exit when FA2CPU_PHASES=1;
PH_KHOT / PH_VHOT compile flags read every K / V tile from the item's first tile: wrong results).
    FA2CPU_PHASES=1 PYTHONPATH=BUILD python bench/tools/s60/phases_run.py THREADS H N CAUSAL fp32|bf16"""
import sys, time, numpy as np, fa2cpu, ml_dtypes
T,H,N,causal,dt=int(sys.argv[1]),int(sys.argv[2]),int(sys.argv[3]),sys.argv[4]=='1',sys.argv[5]
rng=np.random.default_rng(0)
q,k,v=(rng.standard_normal((1,H,N,128),dtype=np.float32).astype(ml_dtypes.bfloat16 if dt=='bf16' else np.float32) for _ in range(3))
fa2cpu.flash_attention(q,k,v,causal=causal,num_threads=T)
t0=time.perf_counter()
for _ in range(4): fa2cpu.flash_attention(q,k,v,causal=causal,num_threads=T)
el=(time.perf_counter()-t0)/4
fl=4.0*H*N*N*128/(2 if causal else 1)
print(f"{el*1e3:.1f} ms {fl/el/1e9:.1f} GF/s", file=sys.stderr)
