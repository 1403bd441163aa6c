"""Helpers shared by the torch test modules (imported after pytest.importorskip("torch"))."""
import numpy as np
import torch

import fa2cpu.torch as ft
from conftest import rand

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
torch_sdpa = torch._C._nn.scaled_dot_product_attention  # torch's own, whatever is patched


def T(a):
    """Tensor sharing the memory of NumPy array ``a`` (bfloat16 through int16)."""
    return ft._tensor(a)


def N(t):
    """NumPy view of tensor ``t`` (bfloat16 -> ml_dtypes.bfloat16)."""
    return ft._np("t", t)


def trand(rng, shape, dtype="float32"):
    return T(rand(rng, shape, dtype))


def same(a, b):
    """Bitwise-equal results (the same kernels ran on the same memory)."""
    np.testing.assert_array_equal(np.asarray(N(a) if isinstance(a, torch.Tensor) else a).astype(np.float64),
                                  np.asarray(N(b) if isinstance(b, torch.Tensor) else b).astype(np.float64))
