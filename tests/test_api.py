"""Introspection and control: ISA vocabulary and selection, FA2CPU_ISA, show_config, __version__,
and the public signatures fixed by API.md."""

import inspect
import os
import re

import numpy as np
import pytest

import fa2cpu
from conftest import run_python

VOCABULARY = ["amx", "avx512bf16", "avx512", "avx2", "generic"]


def test_available_isas_vocabulary_and_order():
    isas = fa2cpu.available_isas()
    assert isinstance(isas, list) and all(isinstance(x, str) for x in isas)
    assert set(isas) <= set(VOCABULARY), isas
    assert len(set(isas)) == len(isas), "duplicates"
    assert isas == sorted(isas, key=VOCABULARY.index), "not best first"
    assert isas[-1] == "generic"


def test_available_isas_returns_a_fresh_list():
    a = fa2cpu.available_isas()
    a.append("bogus")
    assert "bogus" not in fa2cpu.available_isas()


@pytest.mark.skipif("FA2CPU_ISA" in os.environ, reason="FA2CPU_ISA overrides the automatic choice")
def test_default_isa_is_best_available():
    fa2cpu.set_isa(None)
    assert fa2cpu.get_isa() == fa2cpu.available_isas()[0]


def test_set_isa_each_family_and_restore():
    auto = fa2cpu.get_isa()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 9, 16), dtype=np.float32)
    try:
        for name in fa2cpu.available_isas():
            fa2cpu.set_isa(name)
            assert fa2cpu.get_isa() == name
            assert fa2cpu.flash_attention(q, q, q).shape == q.shape
    finally:
        fa2cpu.set_isa(None)
    assert fa2cpu.get_isa() == auto


def _child(code, **env):
    res = run_python(code, env={"FA2CPU_ISA": None, **env})
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip()


@pytest.mark.parametrize("name", fa2cpu.available_isas())
def test_env_var_selects_isa_at_import(name):
    code = ("import fa2cpu, numpy as np; q = np.ones((1, 1, 3, 4), np.float32); "
            "fa2cpu.flash_attention(q, q, q); print(fa2cpu.get_isa())")
    assert _child(code, FA2CPU_ISA=name).splitlines()[-1] == name


def test_env_var_absent_gives_best():
    out = _child("import fa2cpu; print(fa2cpu.get_isa(), fa2cpu.available_isas()[0])")
    got, best = out.splitlines()[-1].split()
    assert got == best


def test_show_config(capsys):
    fa2cpu.show_config()
    text = capsys.readouterr().out
    low = text.lower()
    assert fa2cpu.__version__ in text
    for name in fa2cpu.available_isas():
        assert name in text
    assert fa2cpu.get_isa() in text
    assert "compiler" in low
    assert "openmp" in low
    assert "thread" in low
    # threadpoolctl.threadpool_info() is reported: its openmp entry names a library file
    import threadpoolctl
    infos = [i for i in threadpoolctl.threadpool_info() if i.get("user_api") == "openmp"]
    assert infos, "no OpenMP runtime visible to threadpoolctl"
    assert any(os.path.basename(i["filepath"]) in text for i in infos), "threadpool_info() not shown"


def test_version():
    v = fa2cpu.__version__
    assert isinstance(v, str) and re.match(r"^\d+\.\d+(\.\d+)?", v), v
    try:
        from importlib.metadata import version
        assert version("fa2cpu") == v
    except ImportError:
        pass


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


P, K = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
E = inspect.Parameter.empty

API = {
    "flash_attention": [
        ("q", P, E), ("k", P, E), ("v", P, E), ("causal", K, False), ("scale", K, None),
        ("window", K, (-1, -1)), ("softcap", K, None), ("alibi_slopes", K, None), ("mask", K, None),
        ("return_lse", K, False), ("layout", K, "bhsd"), ("num_threads", K, None), ("out", K, None)],
    "flash_attention_varlen": [
        ("q", P, E), ("k", P, E), ("v", P, E), ("cu_seqlens_q", P, E), ("cu_seqlens_k", P, E),
        ("max_seqlen_q", K, None), ("max_seqlen_k", K, None), ("causal", K, False), ("scale", K, None),
        ("window", K, (-1, -1)), ("softcap", K, None), ("alibi_slopes", K, None),
        ("return_lse", K, False), ("num_threads", K, None), ("out", K, None)],
    "flash_attention_with_kvcache": [
        ("q", P, E), ("k_cache", P, E), ("v_cache", P, E), ("k", P, None), ("v", P, None),
        ("cache_seqlens", K, None), ("block_table", K, None), ("causal", K, False), ("scale", K, None),
        ("window", K, (-1, -1)), ("softcap", K, None), ("alibi_slopes", K, None),
        ("return_lse", K, False), ("num_splits", K, 0), ("num_threads", K, None), ("out", K, None)],
    "flash_attention_backward": [
        ("dout", P, E), ("q", P, E), ("k", P, E), ("v", P, E), ("out", P, E), ("lse", P, E),
        ("causal", K, False), ("scale", K, None), ("window", K, (-1, -1)), ("softcap", K, None),
        ("alibi_slopes", K, None), ("layout", K, "bhsd"), ("num_threads", K, None)],
}


@pytest.mark.parametrize("name", list(API))
def test_signature(name):
    if not hasattr(fa2cpu, name):
        pytest.fail(f"fa2cpu.{name} is missing")
    got = _params(getattr(fa2cpu, name))
    want = API[name]
    # Adding keyword-only options is allowed: the fixed ones come first, in order, with their defaults.
    assert got[:len(want)] == want
    assert all(kind == K for _, kind, _ in got[len(want):])
    assert getattr(fa2cpu, name).__doc__, "public functions need a docstring"


def test_import_fa2cpu_does_not_import_ml_dtypes_and_bfloat16_still_works():
    # `import ml_dtypes` costs ~1 s with NumPy 2.4; fa2cpu loads its dtypes on the first array of
    # one (an ml_dtypes array exists only once ml_dtypes is imported). The same process then runs
    # bfloat16 and a float8 cache through the checks that look those dtypes up.
    res = run_python("""
        import sys
        import numpy as np
        import fa2cpu
        assert "ml_dtypes" not in sys.modules, "import fa2cpu imported ml_dtypes"
        import ml_dtypes
        from fa2cpu._reference import attention_ref
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 5, 2, 8)).astype(ml_dtypes.bfloat16) for _ in range(3))
        out = fa2cpu.flash_attention(q, k, v, causal=True)
        assert out.dtype == ml_dtypes.bfloat16
        ref = attention_ref(q, k, v, causal=True)[0]
        assert np.abs(out.astype(np.float64) - ref).max() < 2e-2
        mask = np.zeros((2, 2), ml_dtypes.bfloat16)
        out2 = fa2cpu.flash_attention(q, k, v, mask=mask)
        assert np.abs(out2.astype(np.float64) - attention_ref(q, k, v, mask=mask)[0]).max() < 2e-2
        kc = np.zeros((1, 8, 2, 8), ml_dtypes.float8_e4m3fn)
        vc = np.zeros((1, 8, 2, 8), ml_dtypes.float8_e4m3fn)
        ks, vs = np.zeros((1, 8, 2), np.float32), np.zeros((1, 8, 2), np.float32)
        kn = rng.standard_normal((1, 3, 2, 8)).astype(ml_dtypes.bfloat16)
        vn = rng.standard_normal((1, 3, 2, 8)).astype(ml_dtypes.bfloat16)
        qd = rng.standard_normal((1, 1, 2, 8)).astype(ml_dtypes.bfloat16)
        o = fa2cpu.flash_attention_with_kvcache(qd, kc, vc, k=kn, v=vn, k_scale=ks, v_scale=vs,
                                                cache_seqlens=np.zeros(1, np.int32))
        assert np.any(kc.view(np.uint8) != 0) and np.isfinite(o.astype(np.float32)).all()
        print("ok")
    """)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
