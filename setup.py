"""Build of fa2cpu's extension.

Each kernel family is compiled with its own target flags (never -march=native): one build runs on
any x86-64 and picks the best family at run time. The dispatcher and driver are built with the
baseline flags only. A non-x86 build compiles the generic family alone.
"""
import os
import platform
import sys

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
COMMON = ["-std=c++17", "-O3", "-fopenmp", "-fno-math-errno", "-fvisibility=hidden"]

# family source -> extra flags; only these files get ISA flags.
FAMILIES = [("csrc/kernels/generic.cpp", [])]
if X86:
    FAMILIES += [
        ("csrc/kernels/avx2.cpp", ["-mavx2", "-mfma", "-mf16c"]),
        ("csrc/kernels/avx512.cpp", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]),
        ("csrc/kernels/avx512bf16.cpp",
         ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mf16c"]),
        ("csrc/kernels/amx.cpp",
         ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
          "-mfma", "-mf16c"]),
    ]
FAMILIES = [(src, flags) for src, flags in FAMILIES if os.path.exists(src)]
DEFINES = []
if X86:
    DEFINES.append(("FA2CPU_X86", "1"))
    if any(src.endswith("avx512bf16.cpp") for src, _ in FAMILIES):
        DEFINES.append(("FA2CPU_HAVE_AVX512BF16", "1"))
    if any(src.endswith("amx.cpp") for src, _ in FAMILIES):
        DEFINES.append(("FA2CPU_HAVE_AMX", "1"))
INCLUDES = ["csrc/include", "csrc", np.get_include()]


class BuildExt(build_ext):
    """Compiles each family file with its own flags, then links them into the extension."""

    def build_extension(self, ext):
        extra_debug = os.environ.get("FA2CPU_EXTRA_CFLAGS", "").split()
        objects = []
        for src, flags in FAMILIES:
            objects += self.compiler.compile(
                [src], output_dir=self.build_temp, include_dirs=INCLUDES, macros=DEFINES,
                extra_postargs=COMMON + flags + extra_debug)
        ext.extra_objects = objects
        ext.extra_compile_args = COMMON + extra_debug
        ext.extra_link_args = ["-fopenmp"] + extra_debug
        super().build_extension(ext)


ext = Extension(
    "fa2cpu._core",
    sources=["fa2cpu/_core.pyx", "csrc/dispatch/cpu_features.cpp", "csrc/dispatch/registry.cpp",
             "csrc/driver/driver.cpp", "csrc/driver/pool.cpp"],
    include_dirs=INCLUDES,
    define_macros=DEFINES,
    language="c++",
)

setup(
    ext_modules=cythonize([ext], language_level=3, compiler_directives={"boundscheck": False, "wraparound": False}),
    cmdclass={"build_ext": BuildExt},
)
