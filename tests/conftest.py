"""Shared test machinery: the ISA fixture, the one tolerance table, input helpers, subprocess runners.

Test modules import helpers with ``from conftest import ...`` (pytest puts this folder on
sys.path, the default "prepend" import mode).
"""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap

import ml_dtypes
import numpy as np
import pytest
import threadpoolctl

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_python(code, *argv, env=None, cwd=None, timeout=120):
    """Runs ``code`` (dedented) in a fresh interpreter with ``argv``; ``env`` entries are added to
    os.environ (a None value removes the variable); cwd defaults to the temp dir (outside the source
    tree, so the installed package is imported). Returns the CompletedProcess; a hang fails through
    the timeout."""
    full_env = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, argv)], capture_output=True,
                          text=True, timeout=timeout, env=full_env, cwd=cwd or tempfile.gettempdir())


# Prelude of a peak-memory script: hwm_kib() is the process's peak resident set (VmHWM) so far.
_PEAK_MEMORY_PRELUDE = """
import json, sys
import numpy as np
import fa2cpu

def hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
"""


def peak_memory_script(body, *argv, timeout=300):
    """Runs ``body`` after _PEAK_MEMORY_PRELUDE in a fresh interpreter (so the peak is this call's
    alone); ``body`` prints one JSON object on its last line, which is returned."""
    res = run_python(_PEAK_MEMORY_PRELUDE + textwrap.dedent(body), *argv, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _load_reference():
    """fa2cpu._reference, even when the compiled package does not import (oracle tests need no build)."""
    try:
        from fa2cpu import _reference
        return _reference
    except ImportError:
        spec = importlib.util.spec_from_file_location("fa2cpu_reference", REPO / "fa2cpu" / "_reference.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


ref = _load_reference()

# The oracle's matmuls are small: OpenBLAS threads contending with fa2cpu's OpenMP threads for the
# same cores made them 10-20x slower. One BLAS thread for the whole session (OpenMP is untouched).
_BLAS_ONE_THREAD = threadpoolctl.threadpool_limits(1, user_api="blas")

# ---------------------------------------------------------------------------------------------
# Tolerances: the ONE table. Kernel output vs the float64 reference computed from the same
# (already rounded) inputs, for outputs of magnitude ~1 (inputs ~ N(0, 1)).
#   float32:  fp32 accumulation + polynomial exp2 (~1-2 ulp) over up to ~1000 keys and D <= 256:
#             measured <= 1.5e-6 (out) and 1e-6 (lse); 2e-5 leaves room for larger scores.
#   float16:  output rounded to fp16 (half-ulp 2^-11 ~ 4.9e-4 relative, ~1e-3 at |out| ~ 2;
#             measured 9.8e-4), plus P possibly rounded before the PV product: 4e-3.
#   bfloat16: output rounded to bf16 (half-ulp 2^-9 ~ 2e-3 relative; measured 8e-3 at |out| ~ 2)
#             and P / pre-scaled Q may be rounded to bf16 for vdpbf16ps / AMX (~2^-9 each): 2e-2.
# Quantized KV caches (int8 / float8_e4m3fn codes x float32 scales) use the row of q's dtype,
# against the float64 reference on the dequantized cache (code * scale): the float32 routes
# dequantize exactly (a code times a float32 scale, rounded once to float32) and multiply in
# float32. Two exceptions, for 16-bit q only: an int8 cache's decode on the AVX-512 and avx2
# families (gemm_decode.h, Q16DecodeGemm<I8Int16Codes>; gemm_decode_avx2.h) rounds q to int16 per
# row (a power-of-two step, <= 2^-15 of the row's max |q|; bf16 values within 2^7 of it exact)
# and P x v_scale to int16 per (row, tile) (<= 2^-16 of the tile's largest weight): ~1e-4 relative at most, measured 1.7e-5 on
# the LSE, far inside the 16-bit rows; test_kvcache_quant.py checks it against a 4-8x tighter
# bound. A float8 cache's decode with bf16 q on AVX512-BF16 families (Q16DecodeGemm<F8Bf16Codes>)
# takes q and the codes exactly (every e4m3 value is a bf16) and rounds P x v_scale to bf16 (<= 2^-8
# relative per weight, as the bf16 row above allows for P); test_kvcache_quant.py checks exact code
# decoding and that bound.
# The LSE is float32 in every dtype but inherits the score error of a kernel that rounds
# pre-scaled Q to bf16, hence the same table. Because these bounds would hide one dropped key
# among a thousand, test_forward also has precision-free probes (TOL_ZERO_Q_LSE, visibility map).
# ---------------------------------------------------------------------------------------------
TOL = {
    "float32": dict(atol=2e-5, rtol=2e-5),
    "float16": dict(atol=4e-3, rtol=4e-3),
    "bfloat16": dict(atol=2e-2, rtol=2e-2),
}

# With q = 0 every score is exactly 0 (or exactly the alibi/mask bias) in any dtype, so the LSE
# is log(number of visible keys) up to float32 rounding of the sum: a tight bound for every dtype
# that exposes a key dropped or added at a tile edge (log(n+1) - log(n) ~ 1e-3 at n = 1000).
TOL_ZERO_Q_LSE = dict(atol=1e-5, rtol=1e-5)

DTYPES = ["float32", "float16", "bfloat16"]
NP_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
             "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def dtype_name(dtype):
    dtype = np.dtype(dtype)
    for name, dt in NP_DTYPES.items():
        if dt == dtype:
            return name
    raise KeyError(dtype)


def check_close(actual, ref_value, dtype, what="out"):
    """Assert ``actual`` (any float dtype) matches the float64 ``ref_value`` within TOL[dtype].

    -inf must sit exactly where the reference has -inf (rows that see no key); NaN anywhere in
    ``actual`` that the reference lacks is a failure.
    """
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    a = np.asarray(actual).astype(np.float64)
    r = np.asarray(ref_value, dtype=np.float64)
    assert a.shape == r.shape, f"{what}: shape {a.shape} != reference {r.shape}"
    np.testing.assert_allclose(a, r, err_msg=f"{what} ({name})", **TOL[name])


def check_same(a, b, dtype, ulps=2, what="out"):
    """Two kernel results that may differ only by float rounding (thread count, kv-splits):
    within ``ulps`` machine epsilons of ``dtype`` (bitwise equality passes trivially)."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    eps = float(ml_dtypes.finfo(NP_DTYPES[name]).eps)
    np.testing.assert_allclose(np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64),
                               rtol=ulps * eps, atol=ulps * eps, err_msg=what)


def arg(name):
    """Regex matching an argument name as a whole word (so 'k' does not match inside 'mask')."""
    return rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])"


def rand(rng, shape, dtype="float32", scale=1.0):
    """Normal(0, scale) values rounded to ``dtype`` (name or numpy dtype)."""
    dt = NP_DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(dt)


def qkv(rng, B, Hq, Hk, Nq, Nk, D, Dv=None, dtype="float32", layout="bhsd"):
    """Random q, k, v in ``layout`` (4-D)."""
    Dv = D if Dv is None else Dv
    if layout == "bhsd":
        shapes = (B, Hq, Nq, D), (B, Hk, Nk, D), (B, Hk, Nk, Dv)
    else:
        shapes = (B, Nq, Hq, D), (B, Nk, Hk, D), (B, Nk, Hk, Dv)
    return tuple(rand(rng, s, dtype) for s in shapes)


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------

def _usable_isas():
    try:
        import fa2cpu
        return list(fa2cpu.available_isas())
    except (ImportError, AttributeError) as exc:  # collection must still work so the oracle tests run
        return [f"fa2cpu-unusable:{type(exc).__name__}"]


# FA2CPU_ISA=<family> runs every numeric test on that family alone (e.g. on the AMX machine);
# unset, every usable family is tested.
ENV_ISA = os.environ.get("FA2CPU_ISA", "").strip() or None
ISAS = [ENV_ISA] if ENV_ISA else _usable_isas()


@pytest.fixture(params=ISAS)
def isa(request):
    """Run the test once per usable kernel family; proves that dispatch switched to it."""
    import fa2cpu
    name = request.param
    fa2cpu.set_isa(name)
    try:
        assert fa2cpu.get_isa() == name
        yield name
    finally:
        fa2cpu.set_isa(ENV_ISA)


@pytest.fixture
def rng(request):
    """A generator seeded from the test id, so every test case gets its own reproducible inputs."""
    import zlib
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def parallel_backend(request):
    """fa2cpu's own pool for every test, except in modules that set PARALLEL_BACKEND (the torch
    tests: importing fa2cpu.torch switches the process to the shared OpenMP runtime, and collection
    imports every module before the first test runs)."""
    try:
        from fa2cpu import _core
    except ImportError:
        yield None
        return
    def select(name):
        if name.startswith("openmp"):
            import fa2cpu.torch
            fa2cpu.torch._use_torch_threads()
        else:
            _core.set_parallel_backend("pool")

    want = getattr(request.module, "PARALLEL_BACKEND", "pool")
    before = _core.parallel_backend()
    select(want)
    try:
        yield want
    finally:
        select(before)
