"""Rows made NaN by a NaN in V at key j under causal, per family and dtype: the first NaN row minus j
(0: only rows that see j; negative: rows before j that cannot see it). Session 49 probe.

    python bench/tools/s49/hidden_probe.py
"""
import numpy as np, fa2cpu, ml_dtypes, sys
rng=np.random.default_rng(0)
for isa in fa2cpu.available_isas():
  fa2cpu.set_isa(isa)
  for dt in (np.float32, ml_dtypes.bfloat16):
    out=[]
    for (N,j,D) in [(300,150,64),(300,7,64),(200,101,128),(97,50,32),(64,33,128),(513,300,128)]:
        q=rng.standard_normal((1,1,N,D)).astype(dt); k=rng.standard_normal((1,1,N,D)).astype(dt); v=rng.standard_normal((1,1,N,D)).astype(dt)
        v[0,0,j,:]=np.nan
        o=np.asarray(fa2cpu.flash_attention(q,k,v,causal=True),np.float32)[0,0]
        bad=np.where(np.isnan(o).any(-1))[0]
        out.append(f"N{N}j{j}:{bad.min()-j if len(bad) else 'none'}")
    print(isa, np.dtype(dt).name, " ".join(out))
