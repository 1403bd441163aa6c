"""fa2cpu.torch.scaled_dot_product_attention and patch_sdpa: torch's semantics (top-left causal,
masks, GQA, scale, ranks) computed by fa2cpu, torch's own SDPA for what fa2cpu cannot compute, and
the process-wide OpenMP runtime selection. Skipped cleanly when torch is not installed."""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

import fa2cpu  # noqa: E402
import fa2cpu.torch as ft  # noqa: E402
from _torch_helpers import N, torch_sdpa, trand  # noqa: E402
from conftest import TOL, check_close, ref  # noqa: E402

# fa2cpu.torch runs fa2cpu on the process's OpenMP runtime (torch's threads): test it that way.
PARALLEL_BACKEND = "openmp"


# ------------------------------------------------------------------------------ SDPA

def _spy(monkeypatch):
    """Counts calls of torch's own SDPA made by fa2cpu.torch (its fallbacks)."""
    calls = []

    def fallback(*args, **kwargs):
        calls.append(1)
        return torch_sdpa(*args, **kwargs)
    monkeypatch.setattr(ft, "_torch_sdpa", fallback)
    return calls


SDPA_CASES = {
    "plain": dict(shapes=((2, 3, 7, 16), (2, 3, 33, 16), (2, 3, 33, 16)), kw={}),
    "bool-mask": dict(shapes=((2, 3, 7, 16), (2, 3, 13, 16), (2, 3, 13, 8)), kw={}, mask=("bool", (2, 1, 7, 13))),
    "float-mask": dict(shapes=((2, 3, 7, 16), (2, 3, 13, 16), (2, 3, 13, 16)), kw={}, mask=("float", (7, 13))),
    "causal-nq=nk": dict(shapes=((1, 2, 31, 16), (1, 2, 31, 16), (1, 2, 31, 16)), kw=dict(is_causal=True)),
    "causal-nq<nk": dict(shapes=((1, 2, 7, 16), (1, 2, 33, 16), (1, 2, 33, 16)), kw=dict(is_causal=True)),
    "causal-nq>nk": dict(shapes=((1, 2, 33, 16), (1, 2, 7, 16), (1, 2, 7, 16)), kw=dict(is_causal=True)),
    "mask-and-causal": dict(shapes=((1, 2, 5, 16), (1, 2, 9, 16), (1, 2, 9, 16)), kw=dict(is_causal=True),
                            mask=("bool", (1, 2, 5, 9))),
    "causal-nq=1": dict(shapes=((1, 2, 1, 16), (1, 2, 13, 16), (1, 2, 13, 16)), kw=dict(is_causal=True)),
    "gqa": dict(shapes=((2, 8, 7, 32), (2, 2, 7, 32), (2, 2, 7, 32)), kw=dict(is_causal=True, enable_gqa=True)),
    "scale": dict(shapes=((1, 2, 5, 16), (1, 2, 9, 16), (1, 2, 9, 16)), kw=dict(scale=0.77)),
    "3d": dict(shapes=((3, 13, 16), (3, 17, 16), (3, 17, 16)), kw=dict(is_causal=True)),
    "2d": dict(shapes=((13, 16), (7, 16), (7, 16)), kw={}),
    "5d": dict(shapes=((2, 2, 3, 5, 16), (2, 2, 3, 5, 16), (2, 2, 3, 5, 16)), kw=dict(is_causal=True)),
}


@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_matches_torch(rng, monkeypatch, case):
    c = SDPA_CASES[case]
    q, k, v = (trand(rng, s) for s in c["shapes"])
    kw = dict(c["kw"])
    if "mask" in c:
        kind, shape = c["mask"]
        kw["attn_mask"] = torch.rand(shape) > 0.3 if kind == "bool" else torch.randn(shape)
    calls = _spy(monkeypatch)
    got = ft.scaled_dot_product_attention(q, k, v, **kw)
    assert not calls, "fell back to torch's SDPA"
    torch.testing.assert_close(got, torch_sdpa(q, k, v, **kw), **TOL["float32"])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sdpa_low_precision_vs_reference(rng, dtype):
    q, k, v = (trand(rng, (1, 4, n, 16), dtype) for n in (9, 13, 13))
    got = ft.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == q.dtype
    # top-left causal with Nq < Nk: the first Nq keys, bottom-right aligned
    want, _ = ref.attention_ref(N(q), N(k)[:, :, :9], N(v)[:, :, :9], causal=True)
    check_close(N(got), want, dtype)


@pytest.mark.parametrize("case", ["dropout", "float64", "head-dim-300", "mask-with-grad", "hk-broadcast"])
def test_sdpa_fallbacks_give_torchs_result(rng, monkeypatch, case):
    q, k, v = (trand(rng, (1, 2, 5, 16)) for _ in range(3))
    kw = {}
    if case == "dropout":
        kw = dict(dropout_p=0.5)
    elif case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "head-dim-300":
        q, k, v = (trand(rng, (1, 2, 5, 300)) for _ in range(3))
    elif case == "mask-with-grad":
        q.requires_grad_()
        kw = dict(attn_mask=torch.rand(5, 5) > 0.2)
    else:  # Hq != Hk without enable_gqa: torch broadcasts Hk = 1
        k, v = k[:, :1], v[:, :1]
    calls = _spy(monkeypatch)
    torch.manual_seed(0)
    got = ft.scaled_dot_product_attention(q, k, v, **kw)
    assert calls, "expected the fallback"
    torch.manual_seed(0)
    torch.testing.assert_close(got, torch_sdpa(q, k, v, **kw), rtol=0, atol=0)


def test_patch_sdpa_handle_and_context_manager(rng):
    import torch.nn.functional as F
    original = F.scaled_dot_product_attention
    handle = ft.patch_sdpa()
    try:
        assert F.scaled_dot_product_attention is ft.scaled_dot_product_attention
    finally:
        handle.undo()
    assert F.scaled_dot_product_attention is original
    handle.undo()  # a second undo does nothing
    assert F.scaled_dot_product_attention is original

    # training mode (dropout 0): nn.MultiheadAttention calls F.scaled_dot_product_attention
    # (in eval mode under no_grad it takes its fused fast path instead)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).train()
    x = trand(rng, (2, 7, 16))
    with torch.no_grad():
        want = mha(x, x, x, need_weights=False)[0]
        with ft.patch_sdpa() as h, pytest.MonkeyPatch.context() as mp:
            seen = []
            mp.setattr(ft, "flash_attention", lambda *a, **kw: seen.append(1) or fa2cpu_torch_fa(*a, **kw))
            got = mha(x, x, x, need_weights=False)[0]
            assert h.active and seen, "nn.MultiheadAttention did not go through fa2cpu"
    assert F.scaled_dot_product_attention is original and not h.active
    torch.testing.assert_close(got, want, **TOL["float32"])


fa2cpu_torch_fa = ft.flash_attention


def test_patched_sdpa_compiles_fullgraph(rng):
    q, k, v = trand(rng, (1, 4, 9, 16)), trand(rng, (1, 2, 13, 16)), trand(rng, (1, 2, 13, 16))
    import torch.nn.functional as F
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    with ft.patch_sdpa():
        fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                           fullgraph=True, backend=backend)
        got = fn(q, k, v)
    assert any("fa2cpu.flash_attention" in str(n.target) for g in graphs for n in g.graph.nodes)
    torch.testing.assert_close(got, torch_sdpa(q, k, v, is_causal=True, enable_gqa=True), **TOL["float32"])


def test_importing_fa2cpu_torch_selects_the_shared_openmp_runtime():
    code = textwrap.dedent("""
        import fa2cpu, numpy as np
        from fa2cpu import _core
        assert _core.parallel_backend() == "pool"
        q = np.random.default_rng(0).standard_normal((2, 4, 300, 32), dtype=np.float32)
        want = fa2cpu.flash_attention(q, q, q, num_threads=2)
        import fa2cpu.torch, torch
        assert _core.parallel_backend().startswith("openmp")
        assert np.array_equal(fa2cpu.flash_attention(q, q, q, num_threads=2), want)
        t = torch.from_numpy(q)
        assert np.array_equal(fa2cpu.torch.flash_attention(t, t, t, num_threads=2).numpy(), want)
        # fork after torch and fa2cpu ran threads: the child goes back to fa2cpu's pool and completes
        import os, time
        pid = os.fork()
        if pid == 0:
            ok = _core.parallel_backend() == "pool" and np.array_equal(fa2cpu.flash_attention(q, q, q, num_threads=2), want)
            os._exit(0 if ok else 3)
        t0 = time.time()
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.time() - t0 > 60:
                os.kill(pid, 9)
                raise SystemExit("child hung")
            time.sleep(0.05)
        print("ok")
    """)
    env = dict(os.environ, FA2CPU_PARALLEL="")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                       cwd=pathlib.Path(fa2cpu.__file__).parents[1].parent)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    env["FA2CPU_PARALLEL"] = "pool"
    r = subprocess.run([sys.executable, "-c", "import fa2cpu.torch; from fa2cpu import _core; "
                        "assert _core.parallel_backend() == 'pool'"], capture_output=True, text=True, timeout=120,
                       env=env, cwd=pathlib.Path(fa2cpu.__file__).parents[1].parent)
    assert r.returncode == 0, r.stderr
