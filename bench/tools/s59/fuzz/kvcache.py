# Session 59. PYTHONPATH=$PWD python bench/tools/s59/fuzz/kvcache.py SEED SECONDS (from the checkout's root); prints FAIL / EXC lines and a count.
# Random-option differential fuzz of flash_attention_with_kvcache (float and quantized caches).
import sys, time, traceback, numpy as np, ml_dtypes, fa2cpu
import _common  # noqa: F401 (puts tests/ on sys.path)
from conftest import TOL
from fa2cpu import _reference as R
from fa2cpu.attention import _quantize
seed0, seconds = int(sys.argv[1]), float(sys.argv[2])
fams = ("avx512bf16", "avx512", "avx2", "generic")
DT = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
t_end = time.time() + seconds; n = 0; fails = 0
while time.time() < t_end:
    rng = np.random.default_rng(seed0 * 100000 + n); n += 1
    fam = fams[rng.integers(len(fams))]; fa2cpu.set_isa(fam)
    qname = ["float32", "float16", "bfloat16"][rng.integers(3)]; qdt = DT[qname]
    cache = rng.choice(["same", "int8", "fp8"])
    B = int(rng.integers(1, 4)); hk = int(rng.choice([1, 2, 8])); g = int(rng.choice([1, 4, 5])); hq = hk * g
    nq = int(rng.choice([1, 1, 1, 2, 4, 7, 16, 17, 33]))
    D = int(rng.choice([16, 64, 96, 128, 130])); Dv = D
    paged = bool(rng.random() < 0.4); bs = int(rng.choice([16, 64]))
    cap = int(rng.choice([17, 64, 300, 1000, 2100]))
    lens = rng.integers(0, cap + 1, B); lens = np.maximum(lens, 1 if rng.random() < 0.9 else 0).astype(np.int32)
    causal = bool(rng.random() < 0.5)
    window = (-1, -1) if rng.random() < 0.7 else (int(rng.integers(-1, 300)), int(rng.integers(-1, 5)))
    softcap = None if rng.random() < 0.8 else float(rng.uniform(5, 30))
    sinks = None if rng.random() < 0.7 else rng.standard_normal(hq).astype(np.float32)
    splits = int(rng.choice([0, 0, 1, 3, 8])); thr = int(rng.integers(1, 3))
    cfg = dict(fam=fam, q=qname, cache=str(cache), B=B, hq=hq, hk=hk, nq=nq, D=D, paged=paged, bs=bs, cap=cap, lens=lens.tolist()[:3],
               causal=causal, window=window, softcap=softcap, sinks=sinks is not None, splits=splits, thr=thr, seed=seed0 * 100000 + n - 1)
    kf = rng.standard_normal((B, cap, hk, D)).astype(np.float32); vf = rng.standard_normal((B, cap, hk, Dv)).astype(np.float32)
    if cache == "same":
        kc, vc = kf.astype(qdt), vf.astype(qdt); ks = vs = None
        kd, vd = kc.astype(np.float64), vc.astype(np.float64)
    else:
        cd = np.dtype(np.int8) if cache == "int8" else np.dtype(ml_dtypes.float8_e4m3fn)
        kc, ks = _quantize(kf, np.empty(0, cd), True); vc, vs = _quantize(vf, np.empty(0, cd), True)
        ks = ks.astype(np.float32); vs = vs.astype(np.float32)
        kd = kc.astype(np.float64) * ks[..., None]; vd = vc.astype(np.float64) * vs[..., None]
    q = rng.standard_normal((B, nq, hq, D)).astype(qdt)
    args = dict(cache_seqlens=lens, causal=causal, window=window, softcap=softcap, sinks=sinks)
    try:
        if paged:
            nb = (cap + bs - 1) // bs; perm = rng.permutation(B * nb).astype(np.int32)
            bt = perm.reshape(B, nb)
            def page(x):
                pad = np.zeros((B, nb * bs) + x.shape[2:], x.dtype); pad[:, :cap] = x
                out = np.empty((B * nb, bs) + x.shape[2:], x.dtype)
                out[bt.reshape(-1)] = pad.reshape((B * nb, bs) + x.shape[2:]); return out
            kcp, vcp = page(kc), page(vc)
            kw = dict(block_table=bt, k_scale=None if ks is None else page(ks), v_scale=None if vs is None else page(vs))
            o, lse = fa2cpu.flash_attention_with_kvcache(q, kcp, vcp, return_lse=True, num_splits=splits, num_threads=thr, **kw, **args)
        else:
            o, lse = fa2cpu.flash_attention_with_kvcache(q, kc, vc, return_lse=True, num_splits=splits, num_threads=thr, k_scale=ks, v_scale=vs, **args)
        ro, rl = R.kvcache_ref(q, kd, vd, **args)
        name = qname if cache == "same" or qname != "float32" else "float32"
        tol = dict(TOL[name]) if cache == "same" else dict(TOL["bfloat16"] if qname != "float32" else TOL["float16"])
        fin = np.isfinite(rl)
        ok = np.allclose(np.asarray(o, np.float64), ro, **tol) and np.array_equal(np.isneginf(lse), np.isneginf(rl)) and np.allclose(np.asarray(lse, np.float64)[fin], rl[fin], **tol)
        if not ok:
            fails += 1; print("FAIL", cfg, "maxdiff", np.nanmax(np.abs(np.asarray(o, np.float64) - ro)), flush=True)
    except (ValueError, TypeError) as e:
        if "window" not in str(e) and "sinks" not in str(e): print("REJECT", cfg, e, flush=True)
    except Exception:
        fails += 1; print("EXC", cfg, traceback.format_exc(), flush=True)
print(f"kv seed {seed0}: {n} cases, {fails} failures", flush=True)
