# Shared by the session-59 fuzzers (imported from the script's own folder): the tests' folder on
# sys.path (conftest's TOL), and the random draws the two varlen fuzzers share, in a fixed order
# so a seed gives the same case.
import os, sys
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "tests"))


def seqlens(rng, B, q_lengths, k_lengths):
    """Per-sequence query / key lengths (keys equal the queries' in about half the sequences) and their cu_seqlens."""
    lq = rng.choice(q_lengths, B)
    lk = np.where(rng.random(B) < 0.5, lq, rng.choice(k_lengths, B))
    cu = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)
    return lq, lk, cu(lq), cu(lk)


def masking(rng, hq, window_max):
    """causal, window, softcap, alibi slopes (hq,) or None."""
    causal = bool(rng.random() < 0.5)
    window = (-1, -1) if rng.random() < 0.7 else (int(rng.integers(-1, window_max)), int(rng.integers(-1, window_max)))
    softcap = None if rng.random() < 0.8 else float(rng.uniform(5, 30))
    alibi = None if rng.random() < 0.8 else rng.uniform(0, 0.3, (hq,)).astype(np.float32)
    return causal, window, softcap, alibi
