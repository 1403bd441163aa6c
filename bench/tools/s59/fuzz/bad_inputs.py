# Session 59. PYTHONPATH=$PWD python bench/tools/s59/fuzz/bad_inputs.py SEED SECONDS (from the checkout's root).
# Hostile-argument fuzz: a valid call of flash_attention / _varlen / _with_kvcache / _backward with one
# argument replaced by a wrong type, shape, dtype, value or view. The library must answer with
# TypeError / ValueError (or succeed), never another exception; a crash ends the process (rc != 0).
# kvcache calls also check that a rejected call left the caches byte-identical.
import sys, time, traceback, numpy as np, ml_dtypes, fa2cpu
seed0, seconds = int(sys.argv[1]), float(sys.argv[2])
t_end = time.time() + seconds; n = 0; fails = 0; outcomes = {}
BAD = [None, 0, -1, 1.5, float("nan"), float("inf"), "x", (), (1, 2, 3), [1], True, np.float64(2.0),
       np.zeros(0, np.float32), np.zeros((2, 2), np.int64), np.zeros((1, 1, 1, 1), np.float64), object()]
def mutate(rng, x):
    r = rng.random()
    if r < 0.35: return BAD[rng.integers(len(BAD))]
    if isinstance(x, np.ndarray) and x.size:
        c = rng.integers(7)
        if c == 0: return x.astype(rng.choice([np.float64, np.int32, np.int8, np.float16, np.uint8, ml_dtypes.bfloat16]))
        if c == 1: return x[..., :max(1, x.shape[-1] - int(rng.integers(1, 3)))]
        if c == 2: return x.reshape(x.shape + (1,))
        if c == 3: return x.reshape(-1)
        if c == 4: y = x.copy(); y.flat[int(rng.integers(y.size))] = rng.choice([np.nan, np.inf, -np.inf, 1e30, -5]) if y.dtype.kind == "f" else -5; return y
        if c == 5: return np.broadcast_to(x, (2,) + x.shape)
        return x[::-1] if x.ndim else x
    if isinstance(x, (tuple, list)): return type(x)(int(v) - int(rng.integers(-3, 1e6)) for v in x)
    if isinstance(x, (int, float)) and not isinstance(x, bool): return rng.choice([-1, 0, 2**31, 2**63 - 1, -2**63, 1e300])
    return BAD[rng.integers(len(BAD))]
while time.time() < t_end:
    rng = np.random.default_rng(seed0 * 100000 + n); n += 1
    dt = [np.float32, ml_dtypes.bfloat16][rng.integers(2)]
    kind = ["fwd", "varlen", "kv", "kvq", "bwd"][rng.integers(5)]
    B, H, Hk, N, D = 2, 4, 2, 9, 16
    q = rng.standard_normal((B, H, N, D)).astype(dt); k = rng.standard_normal((B, Hk, N, D)).astype(dt); v = k.copy()
    if kind == "fwd":
        args = dict(q=q, k=k, v=v, causal=False, scale=None, window=(-1, -1), softcap=None, alibi_slopes=np.ones(H, np.float32),
                    mask=None, layout="bhsd", num_threads=2, sinks=np.zeros(H, np.float32), out=np.empty((B, H, N, D), dt))
        fn = lambda a: fa2cpu.flash_attention(a.pop("q"), a.pop("k"), a.pop("v"), **a)
    elif kind == "varlen":
        args = dict(q=q[0].transpose(1, 0, 2).copy(), k=k[0].transpose(1, 0, 2).copy(), v=v[0].transpose(1, 0, 2).copy(),
                    cu_seqlens_q=np.array([0, 4, 9], np.int32), cu_seqlens_k=np.array([0, 5, 9], np.int32), max_seqlen_q=5,
                    causal=True, window=(-1, -1), num_threads=2, sinks=None)
        fn = lambda a: fa2cpu.flash_attention_varlen(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("cu_seqlens_q"), a.pop("cu_seqlens_k"), **a)
    elif kind in ("kv", "kvq"):
        cap = 32
        if kind == "kv":
            kc = rng.standard_normal((B, cap, Hk, D)).astype(dt); vc = kc.copy(); ks = vs = None
        else:
            kc = rng.integers(-127, 128, (B, cap, Hk, D)).astype(np.int8); vc = kc.copy()
            ks = rng.uniform(0, 0.1, (B, cap, Hk)).astype(np.float32); vs = ks.copy()
        args = dict(q=rng.standard_normal((B, 1, H, D)).astype(dt), k_cache=kc, v_cache=vc,
                    k=rng.standard_normal((B, 1, Hk, D)).astype(dt), v=rng.standard_normal((B, 1, Hk, D)).astype(dt),
                    cache_seqlens=np.array([3, 7], np.int32), causal=True, num_splits=0, num_threads=2, k_scale=ks, v_scale=vs)
        fn = lambda a: fa2cpu.flash_attention_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), a.pop("k"), a.pop("v"), **a)
    else:
        o, lse = fa2cpu.flash_attention(q, k, v, causal=True, return_lse=True)
        args = dict(dout=rng.standard_normal(o.shape).astype(dt), q=q, k=k, v=v, out=o, lse=lse, causal=True, num_threads=2)
        fn = lambda a: fa2cpu.flash_attention_backward(a.pop("dout"), a.pop("q"), a.pop("k"), a.pop("v"), a.pop("out"), a.pop("lse"), **a)
    key = list(args)[rng.integers(len(args))]
    args[key] = mutate(rng, args[key])
    before = {nm: (args[nm].tobytes() if isinstance(args.get(nm), np.ndarray) else None) for nm in ("k_cache", "v_cache", "k_scale", "v_scale")}
    try:
        fn(dict(args)); res = "ok"
    except (TypeError, ValueError) as e:
        res = type(e).__name__
        for nm, b in before.items():
            if b is not None and args[nm].tobytes() != b:
                fails += 1; print("FAIL rejected call changed", nm, kind, key, e, flush=True)
    except Exception as e:
        res = type(e).__name__; fails += 1
        print("FAIL", kind, key, repr(args[key])[:80], type(e).__name__, str(e)[:200], flush=True)
    outcomes[(kind, res)] = outcomes.get((kind, res), 0) + 1
print(sorted(outcomes.items()))
print(f"bad inputs seed {seed0}: {n} cases, {fails} failures", flush=True)
