# Session 59. PYTHONPATH=$PWD python bench/tools/s59/fuzz/torch_varlen_grad.py SEED SECONDS (from the checkout's root); prints FAIL / EXC lines and a count.
# Random fuzz of fa2cpu.torch.flash_attention_varlen's autograd (q, k, v and sinks gradients) against
# fa2cpu._reference.attention_backward_ref per sequence, in float64.
import sys, time, traceback, numpy as np, torch, ml_dtypes, fa2cpu
import fa2cpu.torch as ft
from _common import masking, seqlens  # noqa: E402 (also puts tests/ on sys.path)
from conftest import TOL
from fa2cpu import _reference as R
seed0, seconds = int(sys.argv[1]), float(sys.argv[2])
fams = ("avx512bf16", "avx512", "avx2", "generic")
TD = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
t_end = time.time() + seconds; n = 0; fails = 0
torch.set_num_threads(1)
def f64(t): return t.detach().float().double().numpy()
while time.time() < t_end:
    rng = np.random.default_rng(seed0 * 100000 + n); n += 1
    fam = fams[rng.integers(len(fams))]; fa2cpu.set_isa(fam)
    name = ["float32", "float16", "bfloat16"][rng.integers(3)]; dt = TD[name]
    B = int(rng.integers(1, 4)); hk = int(rng.choice([1, 2])); g = int(rng.choice([1, 2, 4])); hq = hk * g
    lq, lk, cq, ck = seqlens(rng, B, [0, 1, 5, 17, 40, 70], [0, 1, 9, 33, 80])
    D = int(rng.choice([8, 32, 64, 96])); Dv = D
    causal, window, softcap, alibi = masking(rng, hq, 30)
    use_sinks = bool(rng.random() < 0.3); thr = int(rng.integers(1, 3))
    q = torch.from_numpy(rng.standard_normal((int(cq[-1]), hq, D)).astype(np.float32)).to(dt).requires_grad_()
    k = torch.from_numpy(rng.standard_normal((int(ck[-1]), hk, D)).astype(np.float32)).to(dt).requires_grad_()
    v = torch.from_numpy(rng.standard_normal((int(ck[-1]), hk, Dv)).astype(np.float32)).to(dt).requires_grad_()
    sinks = torch.from_numpy(rng.standard_normal(hq).astype(np.float32)).requires_grad_() if use_sinks else None
    do = torch.from_numpy(rng.standard_normal((int(cq[-1]), hq, Dv)).astype(np.float32)).to(dt)
    opts = dict(causal=causal, window=window, softcap=softcap)
    cfg = dict(fam=fam, dt=name, B=B, hq=hq, hk=hk, lq=lq.tolist(), lk=lk.tolist(), D=D, thr=thr, alibi=alibi is not None,
               sinks=use_sinks, seed=seed0 * 100000 + n - 1, **opts)
    try:
        o = ft.flash_attention_varlen(q, k, v, torch.from_numpy(cq), torch.from_numpy(ck), num_threads=thr,
                                      alibi_slopes=None if alibi is None else torch.from_numpy(alibi), sinks=sinks, **opts)
        o.backward(do)
        rq, rk, rv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape); rs = np.zeros(hq)
        for b in range(B):
            q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
            if q1 == q0: continue
            res = R.attention_backward_ref(f64(do[q0:q1])[None], f64(q[q0:q1])[None], f64(k[k0:k1])[None], f64(v[k0:k1])[None],
                                           layout="bshd", alibi_slopes=alibi, sinks=None if sinks is None else f64(sinks), **opts)
            rq[q0:q1] += res[0][0]; rk[k0:k1] += res[1][0]; rv[k0:k1] += res[2][0]
            if sinks is not None: rs += res[3]
        pairs = [("dq", q.grad, rq), ("dk", k.grad, rk), ("dv", v.grad, rv)] + ([("dsinks", sinks.grad, rs)] if sinks is not None else [])
        for nm, a, r in pairs:
            a = np.zeros(r.shape) if a is None else f64(a)
            sc = max(1.0, np.abs(r).max() if r.size else 0)
            if not np.allclose(a, r, atol=5 * TOL[name]["atol"] * sc, rtol=5 * TOL[name]["rtol"]):
                fails += 1; print("FAIL", nm, cfg, "maxdiff", np.abs(a - r).max(), "scale", sc, flush=True)
    except (ValueError, TypeError) as e:
        print("REJECT", cfg, e, flush=True)
    except Exception:
        fails += 1; print("EXC", cfg, traceback.format_exc()[-800:], flush=True)
print(f"torch varlen grad seed {seed0}: {n} cases, {fails} failures", flush=True)
