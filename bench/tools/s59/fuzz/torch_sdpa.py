# Session 59. PYTHONPATH=$PWD python bench/tools/s59/fuzz/torch_sdpa.py SEED SECONDS (from the checkout's root); prints FAIL / EXC lines and a count.
# Random fuzz of fa2cpu.torch.scaled_dot_product_attention against torch's SDPA on float64 copies.
import sys, time, traceback, numpy as np, torch, fa2cpu
import fa2cpu.torch as ft
import torch.nn.functional as F
seed0, seconds = int(sys.argv[1]), float(sys.argv[2])
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
fams = ("avx512bf16", "avx512", "avx2", "generic")
t_end = time.time() + seconds; n = 0; fails = 0; skipped = 0
torch.set_num_threads(1)
while time.time() < t_end:
    rng = np.random.default_rng(seed0 * 100000 + n); n += 1
    g = torch.Generator().manual_seed(int(seed0 * 100000 + n))
    fam = fams[rng.integers(len(fams))]; fa2cpu.set_isa(fam)
    dt = [torch.float32, torch.float16, torch.bfloat16][rng.integers(3)]
    lead = [(), (2,), (2, 3)][rng.integers(3)]
    hk = int(rng.choice([1, 2])); gq = int(rng.choice([1, 2, 4])); hq = hk * gq; gqa = gq > 1
    L = int(rng.choice([1, 5, 16, 33, 70])); S = int(rng.choice([1, 5, 16, 33, 70, 100])); E = int(rng.choice([8, 32, 64, 80])); Ev = E if rng.random() < 0.8 else 16
    is_causal = bool(rng.random() < 0.4); scale = None if rng.random() < 0.7 else float(rng.uniform(0.5, 2) / E ** 0.5)
    mk = rng.choice(["none", "none", "bool", "float"]); grad = bool(rng.random() < 0.35) and mk == "none"
    q = torch.randn(lead + (hq, L, E), generator=g).to(dt); k = torch.randn(lead + (hk, S, E), generator=g).to(dt); v = torch.randn(lead + (hk, S, Ev), generator=g).to(dt)
    mask = None
    if mk == "bool":
        shp = [(L, S), (1, L, S), (hq, L, S), (1, S)][rng.integers(4)]
        mask = torch.rand(shp, generator=g) < 0.8
    elif mk == "float":
        mask = (torch.randn((L, S), generator=g) * 2).to(dt)
    cfg = dict(fam=fam, dt=str(dt), lead=lead, hq=hq, hk=hk, L=L, S=S, E=E, Ev=Ev, causal=is_causal, scale=scale, mask=str(mk), grad=grad, seed=seed0 * 100000 + n - 1)
    try:
        qs, ks, vs = (t.clone().requires_grad_(grad) for t in (q, k, v))
        try:
            o = ft.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
        except RuntimeError as e:
            if "Explicit attn_mask" in str(e): skipped += 1; continue
            raise
        q64, k64, v64 = (t.double().requires_grad_(grad) for t in (q, k, v))
        m64 = None if mask is None else (mask if mask.dtype == torch.bool else mask.double())
        try:
            r = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=m64, is_causal=is_causal, scale=scale, enable_gqa=gqa)
        except RuntimeError as e:
            skipped += 1; continue  # torch's own path rejects it (mask + is_causal on its math path)
        tol = TOL[dt]
        a, b = o.detach().double(), r.detach()
        nan_ok = torch.equal(torch.isnan(a), torch.isnan(b))
        if not nan_ok or not torch.allclose(torch.nan_to_num(a), torch.nan_to_num(b), atol=tol, rtol=tol):
            fails += 1; print("FAIL fwd", cfg, "maxdiff", (torch.nan_to_num(a) - torch.nan_to_num(b)).abs().max().item(), "nan", torch.isnan(a).sum().item(), torch.isnan(b).sum().item(), flush=True)
        if grad:
            do = torch.randn(o.shape, generator=g)
            o.backward(do.to(dt)); r.backward(do.to(dt).double())
            for nm, x, y in (("dq", qs, q64), ("dk", ks, k64), ("dv", vs, v64)):
                gx, gy = x.grad.double(), y.grad
                sc = max(1.0, gy.abs().max().item())
                if not torch.allclose(gx, gy, atol=5 * tol * sc, rtol=5 * tol):
                    fails += 1; print("FAIL", nm, cfg, "maxdiff", (gx - gy).abs().max().item(), "scale", sc, flush=True)
    except Exception:
        fails += 1; print("EXC", cfg, traceback.format_exc()[-600:], flush=True)
print(f"torch seed {seed0}: {n} cases, {skipped} skipped, {fails} failures", flush=True)
