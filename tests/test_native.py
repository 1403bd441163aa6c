"""Native checks of SIMD helpers that only run on some machines (the AMX V packing's 16 x 16
transpose runs only on AMX machines; it is checked wherever AVX-512 runs), and of V512's
vectorised output conversions and exponentials."""
import pathlib
import shutil
import subprocess

import pytest

import fa2cpu

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.skipif("avx512" not in fa2cpu.available_isas(), reason="needs an AVX-512 machine")
@pytest.mark.parametrize("check", ["transpose_check", "store_row_check", "exp2_check"])
def test_avx512_helper(tmp_path, check):
    """transpose_check: the 16 x 16 transpose; store_row_check: V512::store_row's bf16 / fp16
    conversions bit for bit against the scalar ones; exp2_check: V512::exp2 / exp2_bf16p's error
    bounds and special values."""
    exe = tmp_path / check
    subprocess.run(["g++", "-std=c++17", "-O2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
                    "-mf16c", f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc'}",
                    str(ROOT / "tests" / "native" / f"{check}.cpp"), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("ok")


def test_env_family_in_use():
    """With FA2CPU_ISA set (as on the AMX machine run), that family is the one in use."""
    import os
    want = os.environ.get("FA2CPU_ISA")
    if not want:
        pytest.skip("FA2CPU_ISA not set")
    assert fa2cpu.get_isa() == want
