"""Extra memory is O(N*D): a 32k x 32k attention (and a broadcast 16k x 16k mask) stays far below
the 4 GiB an N x N float32 score matrix would take.

Each case runs in a fresh interpreter: inputs are allocated and one tiny warm-up call made before
the baseline peak RSS (VmHWM) is read, then the growth of the peak during the big call is the
extra memory the call needed (output included).
"""

import pytest

from conftest import peak_memory_script

LIMIT_MIB = 256

SCRIPT = """
    n, d, causal, mask_kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, n, d), dtype=np.float32) for _ in range(3))
    mask = None
    if mask_kind == "bool":
        mask = np.broadcast_to(rng.random(n) < 0.9, (1, 1, n, n))
    elif mask_kind == "float":
        mask = np.broadcast_to(rng.standard_normal(n, dtype=np.float32), (1, 1, n, n))
    elif mask_kind == "float64":  # another float dtype: any conversion must happen un-broadcast
        mask = np.broadcast_to(rng.standard_normal(n), (1, 1, n, n))
    small = [x[:, :, :64] for x in (q, k, v)]
    fa2cpu.flash_attention(*small, causal=causal, mask=None if mask is None else mask[:, :, :64, :64])
    base = hwm_kib()
    out = fa2cpu.flash_attention(q, k, v, causal=causal, mask=mask)
    peak = hwm_kib()
    ok = bool(np.isfinite(out).all())
    print(json.dumps({"extra_mib": (peak - base) / 1024, "finite": ok}))
"""


@pytest.mark.parametrize("n,d,causal,mask", [
    (32768, 64, False, "none"),
    (32768, 64, True, "none"),
    (16384, 64, False, "bool"),   # expanding this mask would take 256 MiB
    (16384, 64, True, "float"),   # expanding this one, 1 GiB
    (16384, 64, False, "float64"),  # converting the broadcast view to float32: 1 GiB
], ids=["32k", "32k-causal", "16k-bool-mask", "16k-float-mask", "16k-float64-mask"])
def test_peak_memory(n, d, causal, mask):
    info = peak_memory_script(SCRIPT, n, d, "1" if causal else "0", mask)
    assert info["finite"]
    assert info["extra_mib"] < LIMIT_MIB, f"peak grew by {info['extra_mib']:.0f} MiB"


def test_explicit_splits_keep_chunked_prefill_memory_bounded():
    """An explicit num_splits on a long chunked prefill: the split items' partial rows stay within
    the driver's budget (before: 16384 rows x 256 splits of partials, ~530 MiB)."""
    info = peak_memory_script("""
        n = 16384
        rng = np.random.default_rng(0)
        q = rng.standard_normal((1, n, 1, 64), dtype=np.float32)
        kc = rng.standard_normal((1, n, 1, 64), dtype=np.float32)
        small = fa2cpu.flash_attention_with_kvcache(q[:, :64], kc[:, :64], kc[:, :64], num_splits=4)
        base = hwm_kib()
        out = fa2cpu.flash_attention_with_kvcache(q, kc, kc, causal=True, num_splits=256)
        peak = hwm_kib()
        ref = fa2cpu.flash_attention_with_kvcache(q[:, -64:], kc, kc, causal=True, num_splits=1)
        ok = bool(np.isfinite(out).all()) and bool(np.allclose(out[:, -64:], ref, atol=1e-5))
        print(json.dumps({"extra_mib": (peak - base) / 1024, "finite": ok}))
    """)
    assert info["finite"]
    assert info["extra_mib"] < LIMIT_MIB, f"peak grew by {info['extra_mib']:.0f} MiB"
