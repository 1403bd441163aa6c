# ftcheck.py PKG_DIR: backward of PKG_DIR's build against a float64 reference on shapes where the fine schedule tail changes the plan when forced on (-DFA2CPU_BWD_FINE_TAIL_CPUS=1), and 1 vs default threads bit-identical (session 56)
import sys, numpy as np
sys.path.insert(0, sys.argv[1]); import fa2cpu; print(fa2cpu.__file__)
from fa2cpu._reference import attention_backward_ref  # the tests' float64 oracle
rng = np.random.default_rng(1)
for (B, H, Hk, N, causal) in [(1, 4, 4, 1500, False), (2, 3, 3, 1100, True), (1, 8, 4, 2000, True), (1, 6, 3, 1031, False), (3, 2, 1, 1300, False)]:
    q = rng.standard_normal((B, H, N, 64)).astype(np.float32); k, v = (rng.standard_normal((B, Hk, N, 64)).astype(np.float32) for _ in range(2)); do = rng.standard_normal(q.shape).astype(np.float32)
    o, lse = fa2cpu.flash_attention(q, k, v, causal=causal, return_lse=True)
    g = fa2cpu.flash_attention_backward(do, q, k, v, o, lse, causal=causal)
    g1 = fa2cpu.flash_attention_backward(do, q, k, v, o, lse, causal=causal, num_threads=1)
    r = attention_backward_ref(do, q, k, v, causal=causal)
    print(B, H, Hk, N, causal, "err", [float(np.abs(a - b).max()) for a, b in zip(g, r)], "1thr same", all(np.array_equal(a, b) for a, b in zip(g, g1)))
