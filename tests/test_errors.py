"""Every error of API.md: the right exception type, a message naming the argument, nothing written.

Argument validation happens before dispatch, so these tests do not run per kernel family.
"""

import re

import ml_dtypes
import numpy as np
import pytest

import fa2cpu
from conftest import arg, rand

B, HQ, HK, NQ, NK, D, DV = 2, 4, 2, 5, 7, 8, 6
VOCABULARY = ["amx", "avx512bf16", "avx512", "avx2", "generic"]


def _qkv(dtype=np.float32, rng=None):
    rng = rng or np.random.default_rng(0)
    return (rand(rng, (B, HQ, NQ, D), dtype), rand(rng, (B, HK, NK, D), dtype),
            rand(rng, (B, HK, NK, DV), dtype))


def _mentions_shape(msg, shape):
    """Every dimension of the actual shape appears as a number in the message (format-agnostic)."""
    nums = set(re.findall(r"\d+", msg))
    return all(str(n) in nums for n in shape)


# ------------------------------------------------------------------------------ dtypes

@pytest.mark.parametrize("bad", [np.float64, np.int32, np.int64, np.uint8, np.bool_, np.complex64])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_bad_dtype_names_argument(bad, which):
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v}
    args[which] = args[which].astype(bad)
    with pytest.raises(TypeError, match=arg(which)) as info:
        fa2cpu.flash_attention(args["q"], args["k"], args["v"])
    msg = str(info.value)
    assert "float32" in msg and "bfloat16" in msg, f"message should list accepted dtypes: {msg}"


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_native_byte_order(which):
    """'>f4' is not float32 in memory: reject it rather than read garbage."""
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v}
    args[which] = args[which].astype(args[which].dtype.newbyteorder(">"))
    with pytest.raises(TypeError, match=arg(which)):
        fa2cpu.flash_attention(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("dtypes,which", [
    ((np.float32, np.float16, np.float32), "k"),
    ((np.float32, np.float32, ml_dtypes.bfloat16), "v"),
    ((np.float16, ml_dtypes.bfloat16, ml_dtypes.bfloat16), "k"),
    ((ml_dtypes.bfloat16, np.float32, np.float32), "k"),
])
def test_mixed_dtypes(dtypes, which):
    q, k, v = _qkv()
    q, k, v = (x.astype(dt) for x, dt in zip((q, k, v), dtypes))
    with pytest.raises(TypeError, match=arg(which)):
        fa2cpu.flash_attention(q, k, v)


def test_float64_not_silently_cast_to_any_dtype():
    q, k, v = (x.astype(np.float64) for x in _qkv())
    with pytest.raises(TypeError, match=arg("q")):
        fa2cpu.flash_attention(q, k, v)


# ------------------------------------------------------------------------------ shapes

def _shape_cases():
    """id -> (q, k, v, extra kwargs, names the message may use, the offending argument's shape, or a
    list of shapes any one of which may be shown)."""
    q, k, v = _qkv()
    rng = np.random.default_rng(1)
    q6 = rand(rng, (B, 6, NQ, D))
    k4, v4 = rand(rng, (B, 4, NK, D)), rand(rng, (B, 4, NK, DV))
    qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    return {
        "q-1d": (q[0, 0, 0], k[0, 0, 0], v[0, 0, 0], {}, ("q",), (D,)),
        "q-5d": (q[None], k[None], v[None], {}, ("q",), (1,) + q.shape),
        "k-rank": (q, k[0], v, {}, ("k",), k[0].shape),
        "v-rank": (q, k, v[0], {}, ("v",), v[0].shape),
        "bshd-3d": (q[0], k[0], v[0], {"layout": "bshd"}, ("q", "layout"), q[0].shape),
        # Hq % Hk != 0: either side may be blamed
        "heads-not-divisible": (q6, k4, v4, {}, ("q", "k"), [q6.shape, k4.shape]),
        "heads-not-divisible-3d": (q6[0, :5], k4[0, :2], v4[0, :2], {}, ("q", "k"),
                                   [q6[0, :5].shape, k4[0, :2].shape]),
        "k-head-dim": (q, k[..., :D - 1], v, {}, ("k",), k[..., :D - 1].shape),
        "v-seqlen": (q, k, v[:, :, :NK - 1], {}, ("v",), v[:, :, :NK - 1].shape),
        "k-batch": (q, k[:1], v[:1], {}, ("k",), k[:1].shape),
        "v-batch": (q, k, v[:1], {}, ("v",), v[:1].shape),
        "v-heads": (q, k, v[:, :1], {}, ("v",), v[:, :1].shape),
        "bshd-k-head-dim": (qt, kt[..., :3], vt, {"layout": "bshd"}, ("k",), kt[..., :3].shape),
        "bshd-v-heads": (qt, kt, vt[:, :, :1], {"layout": "bshd"}, ("v",), vt[:, :, :1].shape),
    }


SHAPE_CASES = list(_shape_cases())


@pytest.mark.parametrize("case", SHAPE_CASES)
def test_shape_error_names_argument(case):
    q, k, v, kw, names, _ = _shape_cases()[case]
    with pytest.raises(ValueError, match="|".join(arg(n) for n in names)):
        fa2cpu.flash_attention(q, k, v, **kw)


@pytest.mark.parametrize("case", SHAPE_CASES)
def test_shape_error_message_shows_actual_shape(case):
    """API.md: the message names the argument, the expected and the actual shape."""
    q, k, v, kw, _, shapes = _shape_cases()[case]
    shapes = shapes if isinstance(shapes, list) else [shapes]
    with pytest.raises(ValueError) as info:
        fa2cpu.flash_attention(q, k, v, **kw)
    msg = str(info.value)
    assert any(_mentions_shape(msg, s) for s in shapes), f"message lacks the actual shape {shapes}: {msg}"


@pytest.mark.parametrize("layout", ["BHSD", "bsdh", "", "nhd", None, 3])
def test_bad_layout(layout):
    q, k, v = _qkv()
    with pytest.raises((ValueError, TypeError), match=arg("layout")) as info:
        fa2cpu.flash_attention(q, k, v, layout=layout)
    if isinstance(layout, str):
        assert info.type is ValueError


@pytest.mark.parametrize("window", [(-2, 0), (0, -3), (1, 2, 3), (1,), (-5, -5)])
def test_bad_window(window):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=arg("window")):
        fa2cpu.flash_attention(q, k, v, window=window)


@pytest.mark.parametrize("shape", [(HQ + 1,), (HK,), (B, HQ, 1), (B + 1, HQ), (1, HQ, 1), (HQ, B)])
def test_bad_alibi_shape(shape):
    q, k, v = _qkv()
    slopes = np.ones(shape, np.float32)
    with pytest.raises(ValueError, match=arg("alibi_slopes")):
        fa2cpu.flash_attention(q, k, v, alibi_slopes=slopes)


@pytest.mark.parametrize("shape", [(NQ, NK + 1), (NQ + 1, NK), (3, NQ, NK), (B + 1, 1, NQ, NK),
                                   (1, 1, 1, NQ, NK), (NK + 1,)])
@pytest.mark.parametrize("kind", [np.bool_, np.float32])
def test_bad_mask_shape(shape, kind):
    q, k, v = _qkv()
    mask = np.ones(shape, kind)
    with pytest.raises(ValueError, match=arg("mask")):
        fa2cpu.flash_attention(q, k, v, mask=mask)


@pytest.mark.parametrize("kind", [np.int32, np.uint8, np.int64, np.complex64])
def test_bad_mask_dtype(kind):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=arg("mask")):
        fa2cpu.flash_attention(q, k, v, mask=np.ones((NQ, NK), kind))


# ------------------------------------------------------------------------------ out=

@pytest.mark.parametrize("shape", [(B, HQ, NQ, D + 1), (B, HQ, NQ), (B, HQ, NQ + 1, DV), (B, NQ, HQ, DV),
                                   (1, HQ, NQ, DV)])
def test_out_wrong_shape(shape):
    q, k, v = _qkv()
    out = np.full(shape, 7, np.float32)
    with pytest.raises(ValueError, match=arg("out")):
        fa2cpu.flash_attention(q, k, v, out=out)
    assert np.all(out == 7), "out was written before the error"


@pytest.mark.parametrize("dtype", [np.float64, np.float16, ml_dtypes.bfloat16, np.int32])
def test_out_wrong_dtype(dtype):
    q, k, v = _qkv()
    out = np.full((B, HQ, NQ, DV), 7, dtype)
    with pytest.raises(TypeError, match=arg("out")):
        fa2cpu.flash_attention(q, k, v, out=out)
    assert np.all(out.astype(np.float64) == 7), "out was written before the error"


def test_out_untouched_when_other_argument_is_bad():
    q, k, v = _qkv()
    out = np.full((B, HQ, NQ, DV), 7, np.float32)
    with pytest.raises(ValueError):
        fa2cpu.flash_attention(q, k, v[:, :, :3], out=out)
    with pytest.raises(ValueError):
        fa2cpu.flash_attention(q, k, v, out=out, mask=np.ones((3, 3), bool))
    assert np.all(out == 7)


def test_out_readonly():
    q, k, v = _qkv()
    out = np.full((B, HQ, NQ, DV), 7, np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match=arg("out")):
        fa2cpu.flash_attention(q, k, v, out=out)
    assert np.all(out == 7)


# ------------------------------------------------------------------------------ threads, ISA

@pytest.mark.parametrize("n", [0, -1, -8])
def test_bad_num_threads(n):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=arg("num_threads")):
        fa2cpu.flash_attention(q, k, v, num_threads=n)


def test_set_isa_unknown_name():
    before = fa2cpu.get_isa()
    for bad in ["bogus", "sse2", "avx-512", ""]:
        with pytest.raises(ValueError):
            fa2cpu.set_isa(bad)
    assert fa2cpu.get_isa() == before


def test_set_isa_not_supported_here():
    usable = fa2cpu.available_isas()
    missing = [name for name in VOCABULARY if name not in usable]
    if not missing:
        pytest.skip("every family is usable on this machine")
    before = fa2cpu.get_isa()
    for name in missing:
        with pytest.raises(RuntimeError, match=name):
            fa2cpu.set_isa(name)
    assert fa2cpu.get_isa() == before
