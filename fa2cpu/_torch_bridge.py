"""Tensors <-> NumPy views for fa2cpu.torch, without copies, and the checks of operator arguments.

A CPU tensor's NumPy view shares its memory and strides (bfloat16 through an ``int16`` view
re-typed as ``ml_dtypes.bfloat16``); results are torch tensors the kernels wrote into. (As with any
``Tensor.numpy()``, a tensor viewed this way gets a non-resizable storage.) Values are checked by
the NumPy API (fa2cpu/_validate.py); here only what an operator schema needs before the call.

Importing this module imports torch and, unless ``FA2CPU_PARALLEL=pool``, runs fa2cpu's parallel
work on torch's OpenMP threads (see _use_torch_threads).
"""
import os
import weakref

import numpy as np
import torch

from . import _core
from ._checks import _f32_real, _int, _window_pair, ml_dtype

# Inside PyTorch, run fa2cpu's parallel work on torch's threads: torch and fa2cpu share the
# process's one libgomp (same soname), and torch's OpenMP threads keep spinning for milliseconds
# after each op, so a second pool beside them got only part of the cores (in-model attention
# 0.24-0.72x of sdpa on 16 cores; bench/RESULTS.md). FA2CPU_PARALLEL=pool keeps fa2cpu's own pool.
def _torch_openmp_runtime():
    """Addresses of GOMP_parallel and omp_get_max_threads in the OpenMP runtime torch loaded (its
    own copy in torch/lib), or (0, 0) to use the one this extension links. Needed when they differ:
    a repaired wheel bundles a renamed libgomp, a clang build links libomp."""
    import ctypes
    import glob
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for path in sorted(glob.glob(os.path.join(libdir, "lib*omp*.so*"))):
        try:  # only a library torch has already loaded (RTLD_NOLOAD): never load a second runtime
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 4) | getattr(os, "RTLD_LAZY", 1))
            return (ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value,
                    ctypes.cast(lib.omp_get_max_threads, ctypes.c_void_p).value)
        except (OSError, AttributeError):
            continue
    return 0, 0


def _use_torch_threads():
    """Run fa2cpu's parallel work on torch's OpenMP threads (done at import)."""
    _core.set_parallel_backend("openmp", *_torch_openmp_runtime())


if os.environ.get("FA2CPU_PARALLEL", "").strip().lower() != "pool":
    _use_torch_threads()


def _ml_dtypes():
    """(bfloat16, float8_e4m3fn) as NumPy dtypes, looked up on the first tensor of either dtype
    (_checks.ml_dtype: ml_dtypes is imported then, not at `import fa2cpu.torch`)."""
    global _ML
    if _ML is None:
        _ML = ml_dtype("bfloat16"), ml_dtype("float8_e4m3fn")
    return _ML


_ML = None
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)   # the kernels' dtypes
_CODES = {t: _core.DTYPE_CODES[str(t).split(".")[1]] for t in _FLOATS + (torch.int8, torch.float8_e4m3fn)}  # -> DType
_ACCEPTED = "torch.float32, torch.float16 or torch.bfloat16"
_PLAIN = (torch.Tensor, torch.nn.Parameter)                 # types the direct path may convert


# ---------------------------------------------------------------------------------------------
# Tensor <-> NumPy, without copies
# ---------------------------------------------------------------------------------------------
def _np(name, t):
    """NumPy view of a CPU tensor: same memory, same strides (bfloat16 -> ml_dtypes.bfloat16,
    float8_e4m3fn -> ml_dtypes.float8_e4m3fn, both through an integer view of the same width)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(f"{name}: expected a CPU tensor, got device {t.device}")
    if t.layout is not torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if t.requires_grad:
        t = t.detach()
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(_ml_dtypes()[0])
    if t.dtype is torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(_ml_dtypes()[1])
    try:
        return t.numpy()
    except TypeError:  # a dtype NumPy cannot view (other float8 kinds, complex32, ...)
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; expected torch.float32, float16 or "
                        f"bfloat16 (a KV cache also torch.int8 or float8_e4m3fn codes)") from None


def _np_opt(name, t):
    return None if t is None else _np(name, t)


def _tensor(a):
    """Tensor sharing the memory of the NumPy array ``a`` (bfloat16 through int16)."""
    if a.dtype.kind != "V":  # NumPy's own dtypes (dtype.name alone costs ~1.7 us)
        return torch.from_numpy(a)
    bf16, f8 = _ml_dtypes()
    if a.dtype == bf16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if a.dtype == f8:
        return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(a)


def _check_tensors(**named):
    """Before an operator call: tensors where the schema wants them (None allowed where it is
    optional), q of a kernel dtype, so the errors name the argument like the NumPy API's."""
    for name, t in named.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    q = named["q"]
    if q is None:
        raise TypeError("q: expected a torch.Tensor, got None")
    if q.dtype not in _FLOATS:
        raise TypeError(f"q: dtype {q.dtype} is not supported; expected {_ACCEPTED}")
    # One device for all (a meta tensor beside CPU ones would send the operator to its fake
    # implementation, which returns uninitialised memory).
    device = q.device.type
    for name, t in named.items():
        if t is not None and t.device.type != device:
            raise ValueError(f"{name}: on device {t.device.type}, q on {device}: every tensor must be on one "
                             f"device (fa2cpu runs on the CPU)")


def _result(q, v):
    """New (tensor, NumPy view) for the output of q's rows with v's head dim; (None, None) when
    the ranks are too low to say (the NumPy API then reports the bad shape)."""
    if q.dim() < 1 or v.dim() < 1:
        return None, None
    o = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    return o, _np("out", o)


def _direct(q, k, v, differentiable=True):
    """True when the kernels may be called directly on these tensors: plain CPU tensors, eager
    mode, no torch.compile tracing, no fake/meta/dispatch modes, and (for a ``differentiable``
    operator) no autograd graph to record. Otherwise the call goes through the torch.ops
    operator, which handles all of those."""
    if torch.compiler.is_compiling():
        return False
    if type(q) not in _PLAIN or type(k) not in _PLAIN or type(v) not in _PLAIN or not q.is_cpu:
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    return not (differentiable and torch.is_grad_enabled()
                and (q.requires_grad or k.requires_grad or v.requires_grad))


# Normalisers of scalar arguments for the operator schemas (the NumPy API checks values).
def _float_arg(name, x):
    return None if x is None else _f32_real(name, x)


def _window_arg(window):
    return list(_window_pair(window))


def _int_arg(name, x, minimum):
    return None if x is None else _int(name, x, minimum)


def _no_grad_out(name, *tensors):
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(f"{name}(): out= does not support automatic differentiation (as in torch); "
                           f"call it without out= or under torch.no_grad()")


class _Memory:
    """A NumPy ``__array_interface__`` (pointer, shape, strides, item type) and nothing else: the
    array made from it neither owns nor keeps alive the tensor it describes."""
    __slots__ = ("__array_interface__",)


_TYPESTR = {torch.float32: np.dtype(np.float32).str, torch.float16: np.dtype(np.float16).str,
            torch.bfloat16: np.dtype(np.int16).str,       # bfloat16: int16 items, re-typed below
            torch.int8: np.dtype(np.int8).str,            # quantized caches' codes
            torch.float8_e4m3fn: np.dtype(np.uint8).str}  # float8: uint8 items, re-typed below

# id(cache tensor) -> [weakref, data_ptr, shape, stride, dtype, NumPy view or None]. KV caches
# are long-lived: a tensor seen a second time gets a view made once (a bfloat16 view costs ~3 us
# per call otherwise), re-checked per call against the tensor's pointer, shape, strides and
# dtype. A tensor seen once (e.g. a fresh slice per call) only gets a plain view, as building
# the memoised one costs more. Memoised views are built from the tensor's metadata (pointer and
# strides), so they do not keep the tensor alive; entries leave with their tensor (weakref
# callback).
_CACHE_VIEWS = {}


def _cache_view(name, t):
    """_np for a KV cache tensor (or a quantized cache's scales): memoised (see _CACHE_VIEWS) for
    a plain CPU tensor of a kernel or code dtype (_TYPESTR), else _np's view and checks."""
    if type(t) not in _PLAIN or t.dtype not in _TYPESTR or not t.is_cpu:
        return _np(name, t)
    key = id(t)
    entry = _CACHE_VIEWS.get(key)
    if entry is None or entry[0]() is not t:
        forget = lambda _, key=key: _CACHE_VIEWS.pop(key, None)  # noqa: E731
        _CACHE_VIEWS[key] = [weakref.ref(t, forget), 0, None, None, None, None]
        return _np(name, t)
    pointer, shape, stride, dtype = t.data_ptr(), t.shape, t.stride(), t.dtype
    if entry[5] is not None and entry[1] == pointer and entry[2] == shape and entry[3] == stride \
            and entry[4] is dtype:
        return entry[5]
    if t.numel() == 0:
        return _np(name, t)
    view = _borrowed_view(t)
    entry[1:] = pointer, shape, stride, dtype, view
    return view


def _borrowed_view(t):
    """NumPy view of a non-empty plain CPU tensor of a _TYPESTR dtype that does not keep the
    tensor alive (built from its pointer, shape and strides): its holder must drop it with the
    tensor (_cache_view, _torch_ops' decode steps: weakref callbacks)."""
    dtype, item_size = t.dtype, t.element_size()
    memory = _Memory()
    memory.__array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape),
                                  "strides": tuple(step * item_size for step in t.stride()),
                                  "typestr": _TYPESTR[dtype], "version": 3}
    view = np.asarray(memory)
    if dtype is torch.bfloat16 or dtype is torch.float8_e4m3fn:
        view = view.view(_ml_dtypes()[dtype is torch.float8_e4m3fn])
    return view
