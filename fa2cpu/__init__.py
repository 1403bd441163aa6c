"""fa2cpu: FlashAttention-2 for CPUs.

Exact attention computed tile by tile with an online softmax by C++ SIMD kernels (AVX2, AVX-512,
AVX-512-BF16, AMX-BF16) parallelised with OpenMP. See ``flash_attention``.
"""
import os as _os
import sys as _sys
import warnings as _warnings

try:
    from . import _core
except ImportError as _e:  # pragma: no cover - exercised by tests/test_hardening.py in a subprocess
    import glob as _glob
    _here = _os.path.dirname(_os.path.abspath(__file__))
    # Only a checkout without a built extension: any other failure (a broken NumPy, a second
    # interpreter) keeps its own message.
    if _os.path.exists(_os.path.join(_here, "_core.pyx")) and _os.path.exists(_os.path.join(_here, "..", "setup.py")) \
            and not _glob.glob(_os.path.join(_here, "_core*.so")) and not _glob.glob(_os.path.join(_here, "_core*.pyd")):
        raise ImportError(
            f"fa2cpu's compiled extension (fa2cpu._core) is not built in the source checkout at "
            f"{_os.path.dirname(_here)}, and Python imported fa2cpu from there (the current directory "
            f"comes first on sys.path). Either run from another directory after `pip install .`, or "
            f"build in place: `pip install --no-build-isolation -e .` "
            f"(or `python setup.py build_ext --inplace`).") from _e
    raise
from .attention import flash_attention, flash_attention_varlen, flash_attention_with_kvcache
from .backward import flash_attention_backward, flash_attention_varlen_backward

__version__ = "0.1.0"
__all__ = ["flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache", "flash_attention_backward",
           "flash_attention_varlen_backward",
           "available_isas", "get_isa", "set_isa", "show_config", "__version__"]

ISA_FAMILIES = _core.ISA_NAMES  # best first (csrc/include/fa2cpu/catalogue.def)


def available_isas():
    """Kernel families this build has and this CPU/OS can run, best first (``"generic"`` last)."""
    return _core.available_isas()


def get_isa():
    """The kernel family in use."""
    return _core.get_isa()


def set_isa(name):
    """Select the kernel family by name; ``None`` restores the automatic (best usable) choice.

    Raises ValueError for a name outside ``ISA_FAMILIES`` and RuntimeError for a family this
    build or machine cannot run. Applies process-wide, to calls that start afterwards.
    """
    if name is None:
        _core.reset_isa()
        return
    if not isinstance(name, str) or name not in ISA_FAMILIES:
        raise ValueError(f"name: unknown ISA family {name!r}; expected one of {ISA_FAMILIES} or None")
    if name not in _core.available_isas():
        why = "not compiled into this build" if name not in _core.compiled_isas() else "not supported by this CPU/OS"
        raise RuntimeError(f"ISA family {name!r} is {why}; usable here: {_core.available_isas()}")
    _core.set_isa(name)


def show_config(file=None):
    """Print version, compiler, OpenMP, compiled and usable families, the family in use, the
    thread count and ``threadpoolctl.threadpool_info()``."""
    import platform
    import numpy
    out = file or _sys.stdout
    try:
        from threadpoolctl import threadpool_info
        pools = threadpool_info()
    except Exception as e:  # noqa: BLE001 - show_config must not fail
        pools = f"unavailable ({e})"
    lines = [
        f"fa2cpu {__version__}",
        f"python {platform.python_version()}, numpy {numpy.__version__}, machine {platform.machine()}",
        f"compiler: {_core.compiler_info()}",
        f"openmp: {_core.openmp_info()}",
        f"compiled families: {', '.join(_core.compiled_isas())}",
        f"usable families:   {', '.join(_core.available_isas())}",
        f"family in use:     {_core.get_isa()}",
        f"threads (OpenMP max): {_core.max_threads()}, usable CPUs: {_core.max_useful_threads()}",
        f"parallel backend: {_core.parallel_backend()} (pool helpers alive: {_core.pool_threads()})",
        "threadpool_info:",
    ]
    print("\n".join(lines), file=out)
    if isinstance(pools, str):
        print(f"  {pools}", file=out)
    else:
        for p in pools:
            print("  " + ", ".join(f"{k}={p[k]}" for k in ("user_api", "internal_api", "num_threads",
                                                           "prefix", "filepath", "version") if k in p), file=out)


def _user_stacklevel():
    """stacklevel for a warning raised while fa2cpu is being imported that points at the user's
    `import fa2cpu` line: frames inside this package are counted and skipped; importlib's frames
    are skipped by the warnings module itself, so they are not counted."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    frame, level = _sys._getframe(1), 1
    while frame is not None:
        fn = frame.f_code.co_filename
        if fn.startswith("<frozen importlib"):
            frame = frame.f_back
            continue
        if not fn.startswith(here):
            return level
        frame, level = frame.f_back, level + 1
    return 1


def _isa_from_env():
    name = _os.environ.get("FA2CPU_ISA", "").strip()
    if not name:
        return
    try:
        set_isa(name)
    except (ValueError, RuntimeError) as e:
        _warnings.warn(f"FA2CPU_ISA={name!r} ignored: {e}", RuntimeWarning, stacklevel=_user_stacklevel())


_isa_from_env()
