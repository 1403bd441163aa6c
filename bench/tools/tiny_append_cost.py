"""Per-call time of a tiny decode step with an append (B=1, Nk=17 of a 64-row cache, one head,
D=16, fp32, 1 thread): what the Python checks and the append cost around a trivial kernel call.
Prints three best-of-5 means (us per call) of 2000 calls each.

    PYTHONPATH=$PWD python bench/tools/tiny_append_cost.py

For an A/B of the Python side only, swap fa2cpu/*.py of another commit in (same extension)."""
import timeit

import numpy as np

import fa2cpu

q = np.ones((1, 1, 1, 16), np.float32)
kc = np.zeros((1, 64, 1, 16), np.float32)
vc = np.zeros_like(kc)
kn = np.ones((1, 1, 1, 16), np.float32)
vn = kn.copy()


def call():
    fa2cpu.flash_attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=16, num_threads=1)


for _ in range(2000):
    call()
print("us per call", [round(min(timeit.repeat(call, number=2000, repeat=5)) / 2000 * 1e6, 2) for _ in range(3)])
