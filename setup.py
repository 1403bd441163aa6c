"""Build of fa2cpu's extension.

Each kernel family is compiled with its own target flags (never -march=native): one build runs on
any x86-64 and picks the best family at run time. The dispatcher and driver are built with the
baseline flags only. A non-x86 build compiles the generic family alone.

The build checks what it needs before compiling: a C++17 compiler and OpenMP (a clear error names
the missing piece), and each family's -m flags (a family the compiler cannot build is left out,
with one printed line). `FA2CPU_DISABLE=amx,avx512bf16` leaves families out on purpose. Files are
compiled in parallel (`FA2CPU_BUILD_JOBS`, default: the CPUs available); `FA2CPU_EXTRA_CFLAGS`
adds flags to every file (e.g. sanitizers).
"""
import glob
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:  # setuptools' vendored distutils
    from distutils.errors import CompileError, LinkError
except ImportError:  # pragma: no cover
    from setuptools._distutils.errors import CompileError, LinkError

X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _openmp_flags():
    """(compile flags, link flags) for OpenMP. gcc and clang take -fopenmp; Apple's clang needs
    -Xpreprocessor -fopenmp and libomp (Homebrew's, or LIBOMP_PREFIX)."""
    if sys.platform != "darwin":
        return ["-fopenmp"], ["-fopenmp"]
    prefix = os.environ.get("LIBOMP_PREFIX")
    if not prefix:
        try:
            prefix = subprocess.run(["brew", "--prefix", "libomp"], capture_output=True, text=True,
                                    check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            prefix = None
    if not prefix:
        return ["-Xpreprocessor", "-fopenmp"], ["-lomp"]
    return (["-Xpreprocessor", "-fopenmp", f"-I{prefix}/include"],
            [f"-L{prefix}/lib", "-lomp", f"-Wl,-rpath,{prefix}/lib"])


OMP_COMPILE, OMP_LINK = _openmp_flags()
COMMON = ["-std=c++17", "-O3", "-fno-math-errno", "-fvisibility=hidden"] + OMP_COMPILE
CATALOGUE = "csrc/include/fa2cpu/catalogue.def"


def _catalogue():
    """The families of csrc/include/fa2cpu/catalogue.def, best first: [(name, flags)]. Its row
    index is the family's code (the bit of FA2CPU_BUILT_FAMILIES)."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, CATALOGUE)) as f:
        rows = re.findall(r'^FA2CPU_FAMILY\((\w+),\s*"([^"]*)"\)', f.read(), re.M)
    if not rows or rows[-1][0] != "generic":
        sys.exit(f"fa2cpu: {CATALOGUE} must list the families with 'generic' last")
    return [(name, flags.split()) for name, flags in rows]


# family -> (source, flags, code). Only these files get ISA flags; families with flags are
# x86-only, and the generic family is always built (the only one off x86).
FAMILIES = {name: (f"csrc/kernels/{name}.cpp", flags, code) for code, (name, flags) in enumerate(_catalogue())
            if not flags or (X86 and not os.environ.get("FA2CPU_FORCE_GENERIC"))}
INCLUDES = ["csrc/include", "csrc", np.get_include()]


def _jobs():
    try:
        n = int(os.environ.get("FA2CPU_BUILD_JOBS", "0"))
    except ValueError:
        n = 0
    if n <= 0:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, n)


def _parallel_compile(compiler, jobs):
    """Replaces compiler.compile with one that compiles the files of a call in parallel."""
    serial = compiler.compile

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0, extra_preargs=None,
                extra_postargs=None, depends=None):
        if len(sources) < 2 or jobs < 2:
            return serial(sources, output_dir, macros, include_dirs, debug, extra_preargs, extra_postargs, depends)
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

        def one(obj):
            src, ext = build[obj]
            compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

        with ThreadPoolExecutor(jobs) as ex:
            list(ex.map(one, objects))
        return objects

    compiler.compile = compile


class BuildExt(build_ext):
    """Checks the toolchain and each family's flags, compiles the family files (each with its own
    flags) and the extension's own files in parallel, then links them into the extension."""

    def _try(self, code, flags, link=False):
        tmp = tempfile.mkdtemp(prefix="fa2cpu-probe-")
        try:
            src = os.path.join(tmp, "probe.cpp")
            with open(src, "w") as f:
                f.write(code)
            objs = self.compiler.compile([src], output_dir=tmp, extra_postargs=flags)
            if link:
                self.compiler.link_executable(objs, "probe", output_dir=tmp, extra_postargs=flags)
            return True
        except (CompileError, LinkError):
            return False
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _check_toolchain(self):
        if not self._try("#include <optional>\nint main() { std::optional<int> x = 1; return *x - 1; }\n",
                         ["-std=c++17"], link=True):
            sys.exit("fa2cpu: building needs a C++17 compiler (g++ >= 8 or clang++ >= 7); the compiler "
                     f"{self.compiler.compiler_so[0]!r} could not build a C++17 program. Install one (e.g. "
                     "`apt install g++`) or point CXX/CC at it.")
        if not self._try("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n",
                         ["-std=c++17"] + OMP_COMPILE + OMP_LINK, link=True):
            sys.exit("fa2cpu: building needs OpenMP (the compiler flag -fopenmp and omp.h / libgomp or "
                     f"libomp); {self.compiler.compiler_so[0]!r} could not build an OpenMP program. With gcc "
                     "install libgomp (part of gcc); with clang install libomp-dev (Debian/Ubuntu) or "
                     "`brew install libomp` (macOS).")

    def _families(self):
        disabled = {x.strip() for x in os.environ.get("FA2CPU_DISABLE", "").split(",") if x.strip()}
        unknown = disabled - {name for name, _ in _catalogue()}
        if unknown:
            sys.exit(f"fa2cpu: FA2CPU_DISABLE names unknown families {sorted(unknown)}")
        if "generic" in disabled:
            sys.exit("fa2cpu: the generic family cannot be disabled (it is the fallback on every CPU)")
        chosen = {}
        for name, (src, flags, code) in FAMILIES.items():
            if name in disabled:
                print(f"fa2cpu: leaving out family {name!r} (FA2CPU_DISABLE)")
            elif flags and not self._try("int main() { return 0; }\n", COMMON + flags):
                print(f"fa2cpu: leaving out family {name!r}: the compiler rejects {' '.join(flags)}")
            else:
                chosen[name] = (src, flags, code)
        return chosen

    def build_extension(self, ext):
        self._check_toolchain()
        jobs = _jobs()
        _parallel_compile(self.compiler, jobs)
        extra_debug = os.environ.get("FA2CPU_EXTRA_CFLAGS", "").split()
        families = self._families()
        built = sum(1 << code for _, _, code in families.values())
        macros = [("FA2CPU_BUILT_FAMILIES", f"{built}ull")]
        ext.define_macros = list(ext.define_macros or []) + macros

        def family_objects(item):
            src, flags, _ = item
            return self.compiler.compile([src], output_dir=self.build_temp, include_dirs=INCLUDES, macros=macros,
                                         extra_postargs=COMMON + flags + extra_debug)

        with ThreadPoolExecutor(jobs) as ex:
            objects = [o for objs in ex.map(family_objects, families.values()) for o in objs]
        ext.extra_objects = objects
        ext.extra_compile_args = COMMON + extra_debug
        ext.extra_link_args = OMP_LINK + extra_debug
        super().build_extension(ext)


ext = Extension(
    "fa2cpu._core",
    sources=["fa2cpu/_core.pyx", "csrc/dispatch/cpu_features.cpp", "csrc/dispatch/registry.cpp",
             "csrc/driver/driver.cpp", "csrc/driver/backward.cpp", "csrc/driver/pool.cpp"],
    include_dirs=INCLUDES,
    language="c++",
    # Every C++ file: a changed header or family file must rebuild the extension (the family
    # objects are compiled in build_extension, which setuptools skips when only `sources` are
    # compared with the built .so).
    depends=sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/**/*.cpp", recursive=True)
                   + glob.glob("csrc/**/*.def", recursive=True)),
)

setup(
    ext_modules=cythonize([ext], language_level=3, compiler_directives={"boundscheck": False, "wraparound": False}),
    cmdclass={"build_ext": BuildExt},
)
