"""examples/serve_loop.py: the continuous-batching server loop runs, its paged prefill/decode
attention matches the references (--check) and every KV block returns to the free list."""
import importlib.util
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from conftest import REPO

EXAMPLE = REPO / "examples" / "serve_loop.py"
TINY = ["--requests", "6", "--max-new-tokens", "8", "--min-prompt", "3", "--max-prompt", "40",
        "--layers", "1", "--vocab", "64", "--arrival-rate", "2", "--seed", "3"]


@pytest.fixture(scope="module")
def serve_loop():
    spec = importlib.util.spec_from_file_location("serve_loop_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(mod, argv):
    t0 = time.perf_counter()
    s = mod.main(argv)
    elapsed = time.perf_counter() - t0
    print(f"serve_loop {' '.join(argv)}: {elapsed:.2f} s, prefill {s['prefill_tok_s']:.0f} tok/s, "
          f"decode {s['decode_tok_s']:.0f} tok/s")
    return s, elapsed


def _assert_clean_finish(s, n_requests):
    assert s["completed"] == n_requests and s["unfinished"] == 0
    assert s["tokens_generated"] == s["prefill_first_tokens"] + s["decode_tokens"] >= n_requests
    assert s["blocks_in_use_at_end"] == 0, "finished requests did not return their KV blocks"
    assert s["all_blocks_free"] and s["blocks_free"] == s["num_blocks"]
    assert s["prefill_tok_s"] > 0 and s["decode_tok_s"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_serve_loop_check(serve_loop, dtype):
    s, elapsed = _run(serve_loop, TINY + ["--dtype", dtype, "--check", "--check-steps", "3"])
    assert elapsed < 20
    _assert_clean_finish(s, 6)
    c = s["check"]
    assert c["prefill_checked"] >= 1 and c["decode_checked"] >= 3
    assert c["cache_slots_ok"]
    assert s["check_ok"], c
    # errors relative to the test suite's tolerance table (1.0 = at the bound)
    assert c["prefill_err_over_tol"] <= 1 and c["decode_err_over_tol"] <= 1
    assert c["decode_gathered_err_over_tol"] <= 1
    bound = {"float32": 1e-4, "bfloat16": 1e-1}[dtype]
    assert max(c["prefill_max_err"], c["decode_max_err"], c["decode_vs_gathered_max_err"]) < bound


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_serve_loop_quantized_cache(serve_loop, dtype, kv_dtype):
    """--kv-dtype int8 / fp8: block pools of codes with float32 scales. --check compares the paged
    decode with the float64 oracle on the dequantized cache (code * scale) and with varlen on the
    gathered dequantized K/V (the test suite's tolerance row of q's dtype), and the cache slots with
    the exact codes and scales of API.md's rule (prefill stores them, decode's append writes them)."""
    s, elapsed = _run(serve_loop, TINY + ["--dtype", dtype, "--kv-dtype", kv_dtype, "--check", "--check-steps", "3"])
    assert elapsed < 20
    _assert_clean_finish(s, 6)
    c = s["check"]
    assert s["kv_dtype"] == kv_dtype
    assert c["prefill_checked"] >= 1 and c["decode_checked"] >= 3
    assert c["cache_slots_ok"]
    assert s["check_ok"], c
    assert c["decode_err_over_tol"] <= 1 and c["decode_gathered_err_over_tol"] <= 1


def test_quantized_cache_codes_and_scales(serve_loop):
    """The example's quantize() is API.md's rule, and an int8 engine's pools are codes + scales."""
    x = np.array([[[0.0, 0.0], [1.0, -0.5]]], np.float32)
    codes, scales = serve_loop.quantize(x, np.dtype(np.int8))
    assert codes.dtype == np.int8 and scales.dtype == np.float32
    assert codes.tolist() == [[[0, 0], [127, -64]]] and scales.tolist() == [[0.0, np.float32(1.0) / np.float32(127)]]
    a = serve_loop.parse_args(["--kv-dtype", "int8"])
    model = serve_loop.ToyModel(np.random.default_rng(0), vocab=8, layers=1, hq=2, hk=1, head_dim=4)
    eng = serve_loop.Engine(model, [], dtype=np.float32, block_size=4, num_blocks=3, max_batch=2,
                            max_prefill_tokens=16, kv_dtype=a.kv_dtype)
    assert eng.k_cache.dtype == np.int8 and eng.k_scale.shape == (1, 3, 4, 1) and eng.v_scale.dtype == np.float32
    assert serve_loop.parse_args([]).kv_dtype == "same"


def test_serve_loop_default_model(serve_loop):
    """The default model shape (2 layers, GQA 8/2, D=64, bf16, 16-token blocks) with fewer requests."""
    s, elapsed = _run(serve_loop, ["--requests", "12", "--max-new-tokens", "24", "--max-prompt", "100",
                                   "--check", "--check-steps", "4"])
    assert elapsed < 20
    _assert_clean_finish(s, 12)
    assert s["check_ok"], s["check"]
    assert s["check"]["decode_checked"] == 2 * 4


def test_blocks_returned_under_preemption(serve_loop):
    """A KV pool just big enough for one request: admissions, block growth, preemption and
    re-prefill all happen, and at the end every block is back on the free list."""
    argv = ["--requests", "8", "--max-new-tokens", "24", "--min-prompt", "8", "--max-prompt", "24",
            "--layers", "1", "--vocab", "64", "--arrival-rate", "0", "--block-size", "4",
            "--num-blocks", "16", "--dtype", "float32", "--seed", "1", "--check", "--check-steps", "40"]
    for kv_dtype in ("same", "int8"):   # int8: preempted requests are re-prefilled into codes + scales
        s, elapsed = _run(serve_loop, argv + ["--kv-dtype", kv_dtype])
        assert elapsed < 20
        _assert_clean_finish(s, 8)
        assert s["preemptions"] > 0, "the tight pool should have forced preemptions"
        assert s["peak_blocks_used"] == 16
        assert s["check_ok"], s["check"]


def test_steps_limit_releases_blocks(serve_loop):
    s, _ = _run(serve_loop, TINY + ["--steps", "3", "--arrival-rate", "0"])
    assert s["steps"] == 3 and s["unfinished"] > 0
    assert s["blocks_in_use_at_end"] > 0          # still held by running requests when cut short
    assert s["all_blocks_free"]                   # ...and released by the abort


def test_pool_too_small_is_an_error(serve_loop):
    with pytest.raises(SystemExit, match="cannot hold one request"):
        serve_loop.main(TINY + ["--num-blocks", "1"])


def test_allocator(serve_loop):
    a = serve_loop.BlockAllocator(4)
    got = [a.allocate() for _ in range(4)]
    assert sorted(got) == [0, 1, 2, 3] and a.num_free == 0
    with pytest.raises(serve_loop.OutOfBlocks):
        a.allocate()
    a.free(got[:2])
    assert a.num_free == 2 and not a.all_free()
    with pytest.raises(ValueError):
        a.free([got[0]])                          # double free
    a.free(got[2:])
    assert a.all_free() and a.peak_used == 4


def test_cli_subprocess():
    """The script runs standalone (not from the repo directory) and prints the summary."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, str(EXAMPLE)] + TINY + ["--check"], cwd=tempfile.gettempdir(),
                       capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    print(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr
    assert elapsed < 20
    for needle in ("requests completed: 6/6", "tok/s", "all returned", "PASS"):
        assert needle in p.stdout


BAD_ARGUMENTS = {
    "--head-dim 512": "--head-dim 512: must be even (rotary embeddings) and at most",
    "--head-dim 7": "must be even",
    "--dtype fp64": "unknown dtype 'fp64'",
    "--threads 0": "expected a positive integer",
    "--arrival-rate -1": "must be >= 0",
    "--kv-dtype int4": "invalid choice: 'int4'",
}


def test_bad_arguments_are_one_line_errors(serve_loop, capsys):
    for argv, message in BAD_ARGUMENTS.items():
        with pytest.raises(SystemExit, match="^2$"):
            serve_loop.parse_args(argv.split())
        assert message in capsys.readouterr().err, argv


def test_head_dim_above_the_limit_is_no_traceback():
    p = subprocess.run([sys.executable, str(EXAMPLE), "--head-dim", "512"], cwd=tempfile.gettempdir(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "at most" in p.stderr and "Traceback" not in p.stderr


def test_short_and_long_dtype_names(serve_loop):
    for short, long in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")):
        assert serve_loop.parse_args(["--dtype", short]).dtype == short
        assert serve_loop.parse_args(["--dtype", long]).dtype == short


@pytest.mark.parametrize("rate", [1e-300, 5e-324])
def test_arrival_rate_near_zero(serve_loop, rate):
    """A rate near 0 spaces arrivals beyond int64 (gaps of 1e300, or inf): steps are clipped to
    2^62 with no cast warning, the first request arrives at step 0, and the engine still serves
    every request (it jumps to the next arrival when idle)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reqs = serve_loop.make_requests(np.random.default_rng(0), 4, min_prompt=2, max_prompt=5,
                                        max_new_tokens=3, arrival_rate=rate, vocab=50)
        assert [r.arrival_step for r in reqs] == [0] + [2 ** 62] * 3
        s, _ = _run(serve_loop, TINY + ["--arrival-rate", str(rate)])
    _assert_clean_finish(s, 6)
