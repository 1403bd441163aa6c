# Session 59. PYTHONPATH=$PWD python bench/tools/s59/fuzz/varlen.py SEED SECONDS (from the checkout's root); prints FAIL / EXC lines and a count.
# Random fuzz of flash_attention_varlen (+ its backward when available) against the float64 reference,
# with non-contiguous / negative-stride / broadcast views.
import sys, time, traceback, numpy as np, ml_dtypes, fa2cpu
from _common import masking, seqlens  # noqa: E402 (also puts tests/ on sys.path)
from conftest import TOL
from fa2cpu import _reference as R
seed0, seconds = int(sys.argv[1]), float(sys.argv[2])
fams = ("avx512bf16", "avx512", "avx2", "generic")
DT = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
t_end = time.time() + seconds; n = 0; fails = 0
def view(x, rng):
    r = rng.random()
    if r < 0.15: return x[::-1].copy()[::-1]                       # negative stride rows
    if r < 0.3:
        y = np.empty(x.shape[:-1] + (x.shape[-1] * 2,), x.dtype); y[..., ::2] = x; return y[..., ::2]  # feature stride 2
    if r < 0.4 and x.shape[1] > 1:
        return np.broadcast_to(x[:, :1], x.shape)                  # heads broadcast (stride 0)
    return x
while time.time() < t_end:
    rng = np.random.default_rng(seed0 * 100000 + n); n += 1
    fam = fams[rng.integers(len(fams))]; fa2cpu.set_isa(fam)
    name = ["float32", "float16", "bfloat16"][rng.integers(3)]; dt = DT[name]
    B = int(rng.integers(1, 5)); hk = int(rng.choice([1, 2, 3])); g = int(rng.choice([1, 2, 4])); hq = hk * g
    lq, lk, cq, ck = seqlens(rng, B, [0, 1, 5, 16, 17, 33, 100, 130], [0, 1, 7, 64, 65, 200])
    D = int(rng.choice([8, 64, 100, 128])); Dv = D
    causal, window, softcap, alibi = masking(rng, hq, 50)
    sinks = None if rng.random() < 0.75 else rng.standard_normal(hq).astype(np.float32)
    thr = int(rng.integers(1, 3))
    q = view(rng.standard_normal((int(cq[-1]), hq, D)).astype(dt), rng)
    k = view(rng.standard_normal((int(ck[-1]), hk, D)).astype(dt), rng); v = view(rng.standard_normal((int(ck[-1]), hk, Dv)).astype(dt), rng)
    opts = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=alibi, sinks=sinks)
    cfg = dict(fam=fam, dt=name, B=B, hq=hq, hk=hk, lq=lq.tolist(), lk=lk.tolist(), D=D, thr=thr, causal=causal, window=window,
               softcap=softcap, alibi=alibi is not None, sinks=sinks is not None, strides=(q.strides, k.strides), seed=seed0 * 100000 + n - 1)
    try:
        o, lse = fa2cpu.flash_attention_varlen(q, k, v, cq, ck, return_lse=True, num_threads=thr, **opts)
        ro, rl = R.varlen_ref(q, k, v, cq, ck, **opts)
        fin = np.isfinite(rl)
        ok = np.allclose(np.asarray(o, np.float64), ro, **TOL[name]) and np.array_equal(np.isneginf(lse), np.isneginf(rl)) \
             and np.allclose(np.asarray(lse, np.float64)[fin], rl[fin], **TOL[name])
        if not ok:
            fails += 1; print("FAIL", cfg, "maxdiff", np.nanmax(np.abs(np.asarray(o, np.float64) - ro)), flush=True)
    except (ValueError, TypeError) as e:
        print("REJECT", cfg, e, flush=True)
    except Exception:
        fails += 1; print("EXC", cfg, traceback.format_exc(), flush=True)
print(f"varlen seed {seed0}: {n} cases, {fails} failures", flush=True)
