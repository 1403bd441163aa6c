"""Native checks of SIMD helpers that only run on some machines (the AMX V packing's 16 x 16
transpose runs only on AMX machines; it is checked wherever AVX-512 runs)."""
import pathlib
import shutil
import subprocess

import pytest

import fa2cpu

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.skipif("avx512" not in fa2cpu.available_isas(), reason="needs an AVX-512 machine")
def test_transpose16x16(tmp_path):
    exe = tmp_path / "transpose_check"
    subprocess.run(["g++", "-std=c++17", "-O2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
                    "-mf16c", f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc'}",
                    str(ROOT / "tests" / "native" / "transpose_check.cpp"), "-o", str(exe)], check=True)
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
