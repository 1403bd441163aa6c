"""fa2cpu-bench: argument parsing, a tiny real run, JSON, plot, clean errors. Fast (tiny shapes)."""

import json
import math
import os
import subprocess
import tempfile
import sys

import numpy as np
import pytest

fa2cpu = pytest.importorskip("fa2cpu")
from fa2cpu import bench  # noqa: E402

# Small enough that the whole module stays well under the 30 s budget.
TINY = ["--seqlen", "48", "--heads", "2", "--batch", "1", "--head-dim", "32", "--threads", "1",
        "--repeat", "2", "--warmup", "0", "--quiet"]


def run_main(capsys, *args):
    code = bench.main(TINY + list(args))
    out, err = capsys.readouterr()
    return code, out, err


def run_cli(*args, timeout=120):
    """The real command line, in a fresh interpreter. It runs outside the source tree so that the
    installed package (with its compiled extension) is imported, not the checkout's sources."""
    return subprocess.run([sys.executable, "-m", "fa2cpu.bench", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=tempfile.gettempdir())


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------

def test_defaults():
    a = bench.parse_args([])
    assert a.mode == ["prefill", "decode"]
    assert a.dtype == ["fp32", "bf16"]
    assert a.causal == [False, True]
    assert a.threads == [bench.default_threads()]
    assert a.baselines == ["numpy", "torch"]
    assert a.isa == [fa2cpu.get_isa()]
    assert (a.repeat, a.warmup, a.json, a.plot, a.quiet) == (5, 1, None, None, False)


def test_default_sweep_shapes():
    cases = bench.build_cases(bench.parse_args([]))
    prefill = [c for c in cases if c.mode == "prefill"]
    decode = [c for c in cases if c.mode == "decode"]
    assert len(prefill) == 3 * 2 * 2            # seqlens x dtypes x causal
    assert {c.seqlen_q for c in prefill} == {512, 1024, 2048}
    assert all(c.seqlen_q == c.seqlen_k for c in prefill)
    assert len(decode) == 2 * 2                 # Nk ladder x dtypes, non-causal
    assert {c.seqlen_k for c in decode} == {2048, 8192}
    d = decode[0]
    assert (d.seqlen_q, d.seqlen_k, d.heads_q, d.heads_kv, d.causal) == (1, 2048, 32, 8, False)


def test_seqlen_without_mode_leaves_decode_alone():
    a = bench.parse_args(["--seqlen", "256"])
    cases = bench.build_cases(a)
    assert {c.seqlen_q for c in cases if c.mode == "prefill"} == {256}
    assert {c.seqlen_k for c in cases if c.mode == "decode"} == {2048, 8192}
    a = bench.parse_args(["--mode", "decode", "--seqlen", "256"])
    assert {c.seqlen_k for c in bench.build_cases(a)} == {256}


def test_dtype_long_and_short_names():
    a = bench.parse_args(["--dtype", "float32,bfloat16", "float16", "bf16"])
    assert a.dtype == ["fp32", "bf16", "fp16"]


def test_threads_capped_at_usable_cpus():
    cpus = bench.usable_cpus()
    a = bench.parse_args(["--threads", "1", str(cpus + 63)])
    assert a.threads == sorted({1, cpus})
    assert any("capped at" in n for n in a.notes)


def test_lists_spaces_commas_and_flags():
    a = bench.parse_args(["--dtype", "fp32,bf16", "fp16", "--seqlen", "64", "128,64", "--threads", "2,1",
                          "--causal", "--mode", "decode", "--baselines", "none", "--isa", "all"])
    assert a.dtype == ["fp32", "bf16", "fp16"]
    assert a.seqlen == [64, 128]
    assert a.threads == [1, 2]
    assert a.causal == [True]
    assert a.baselines == []
    assert a.isa == list(fa2cpu.available_isas())
    assert bench.parse_args(["--no-causal"]).causal == [False]


def test_option_overrides_and_gqa_default():
    a = bench.parse_args(["--mode", "prefill", "decode", "--heads", "16", "--seqlen", "100",
                          "--seqlen-k", "300"])
    cases = bench.build_cases(a)
    pre = [c for c in cases if c.mode == "prefill"][0]
    dec = [c for c in cases if c.mode == "decode"][0]
    assert (pre.heads_q, pre.heads_kv, pre.seqlen_q, pre.seqlen_k) == (16, 16, 100, 300)
    assert (dec.heads_q, dec.heads_kv, dec.seqlen_q, dec.seqlen_k) == (16, 4, 1, 300)


def test_help_documents_every_option_and_the_json_schema(capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for action in bench.make_parser()._actions:
        if action.help and action.dest not in ("help", "version"):
            assert "default" in action.help, action.option_strings
    assert "JSON output" in text and "max_abs_err" in text and "times_s" in text


@pytest.mark.parametrize("args, message", [
    (["--dtype", "fp64"], "unknown dtype 'fp64'"),
    (["--batch", "-1"], "positive integer"),
    (["--seqlen", "0"], "positive integer"),
    (["--heads", "0"], "positive integer"),
    (["--threads", "two"], "positive integer"),
    (["--warmup", "-3"], ">= 0"),
    (["--mode", "train"], "unknown mode"),
    (["--isa", "avx9"], "unknown isa"),
    (["--heads", "6", "--kv-heads", "4"], "must divide"),
    (["--baselines", "numpy", "none"], "cannot be combined"),
    (["--json", "/nonexistent-dir/out.json"], "cannot write into"),
    (["--budget-s", "-1"], ">= 0"),
    (["--head-dim", "257"], "head dims 1 to 256"),
    (["--json", ""], "empty file name"),
    (["--json", "/tmp"], "is a folder"),
    (["--json", "same.png", "--plot", "same.png"], "name the same file"),
])
def test_bad_arguments_exit_2_with_a_message(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_arguments_from_the_command_line_give_no_traceback():
    r = run_cli("--dtype", "fp64")
    assert r.returncode == 2
    assert "unknown dtype 'fp64'" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("--batch", "-4")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_unusable_isa_is_a_clean_error(capsys):
    missing = [i for i in fa2cpu.ISA_FAMILIES if i not in fa2cpu.available_isas()]
    if not missing:
        pytest.skip("every family is usable here")
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--isa", missing[0]])
    assert e.value.code == 2 and "not usable on this machine" in capsys.readouterr().err


def test_unknown_plot_format_fails_before_the_sweep(capsys):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--plot", "p.xyz"])
    assert e.value.code == 2 and "unknown image format 'xyz'" in capsys.readouterr().err


def test_missing_matplotlib_is_a_clean_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # makes `import matplotlib` fail
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--plot", "x.png"])
    assert e.value.code == 2
    assert "pip install 'fa2cpu[bench]'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Counting
# ---------------------------------------------------------------------------------------------

def test_visible_pairs_bottom_right():
    assert bench.visible_pairs(5, 5, False) == 25
    assert bench.visible_pairs(5, 5, True) == 15                 # n(n+1)/2
    assert bench.visible_pairs(2, 5, True) == 4 + 5              # rows see keys <= i + 3
    assert bench.visible_pairs(5, 2, True) == 0 + 0 + 0 + 1 + 2  # first rows see nothing
    assert bench.visible_pairs(1, 8192, True) == 8192


def test_flops_and_bytes():
    c = bench.Case("prefill", "bf16", True, 2, 8, 2, 64, 64, 128, 128)
    assert c.flops == 4 * 2 * 8 * 128 * (64 * 65 // 2)
    assert c.bytes == 2 * 2 * 64 * (8 * 256 + 2 * 256)
    v = bench.Case("varlen", "fp32", False, 2, 4, 4, 10, 10, 16, 16, (5, 15))
    assert v.flops == 4 * 4 * 16 * (25 + 225)


# ---------------------------------------------------------------------------------------------
# Real runs
# ---------------------------------------------------------------------------------------------

def test_tiny_run_prints_the_table(capsys):
    code, out, _ = run_main(capsys, "--mode", "prefill", "--dtype", "fp32", "bf16", "--baselines", "numpy")
    assert code == 0
    for column in ("shape", "impl", "median ms", "GFLOP/s", "%peak", "vs numpy", "max err", "check"):
        assert column in out
    label = f"fa2cpu/{fa2cpu.get_isa()}"
    rows = [line.split() for line in out.splitlines() if label in line.split() and "geometric" not in line]
    assert len(rows) == 4                       # 2 dtypes x causal/non-causal
    assert all(row[-1] == "ok" for row in rows)
    assert "FAIL" not in out


def test_command_line_prints_header_and_table():
    r = run_cli(*TINY[:-1], "--mode", "prefill", "--dtype", "fp32", "--no-causal", "--baselines", "numpy")
    assert r.returncode == 0, r.stderr
    assert "fa2cpu-bench: fa2cpu " in r.stdout and "CPU:" in r.stdout and "ISA:" in r.stdout
    assert "B=1 H=2 N=48 D=32" in r.stdout
    assert "Sweep:    prefill B=1 Hq=2 Hk=2 D=32, N = 48 (--seqlen)" in r.stdout
    assert "num_threads=T" in r.stdout and "num_threads=," not in r.stdout
    table = r.stdout[r.stdout.index("\nshape"):].splitlines()
    assert table[1].split()[-1] == "note"     # every column is named


def test_peak_line_probes_each_instruction_once():
    r = run_cli(*TINY[:-1], "--mode", "prefill", "--dtype", "fp32", "bf16", "fp16", "--no-causal",
                "--baselines", "none", "--isa", "all")
    assert r.returncode == 0, r.stderr
    peak = [line for line in r.stdout.splitlines() if line.startswith("Peak:")]
    assert len(peak) == 1
    if "avx512" in fa2cpu.available_isas():   # avx512 converts bf16/fp16: one FMA probe serves all
        fma = [part for part in peak[0].split(";") if "AVX-512 FMA" in part]
        assert len(fma) == 1 and "avx512 fp32" in fma[0] and "avx512 bf16" in fma[0]


def test_budget_leaves_out_longer_lengths_and_says_so(capsys):
    code, out, _ = run_main(capsys, "--mode", "prefill", "--seqlen", "32", "2048", "--dtype", "fp32",
                            "--no-causal", "--baselines", "none", "--budget-s", "0.001")
    assert code == 0
    assert "B=1 H=2 N=32 D=32" in out and "N=2048 D=32" not in out   # the first length always runs
    assert "--budget-s 0.001: left out prefill N=2048" in out


def test_json_has_the_documented_fields(tmp_path, capsys):
    path = tmp_path / "out.json"
    code, out, _ = run_main(capsys, "--mode", "prefill", "decode", "--dtype", "fp32", "--no-causal",
                            "--baselines", "numpy", "--json", str(path))
    assert code == 0 and str(path) in out
    doc = json.loads(path.read_text())
    assert doc["schema"] == "fa2cpu-bench/2" and doc["interrupted"] is False
    for key in ("cpu_model", "logical_cpus", "isa_usable", "isa_default", "versions", "peaks",
                "read_bandwidth"):
        assert key in doc["machine"]
    recs = doc["records"]
    assert {r["impl"] for r in recs} == {"numpy", "fa2cpu"}
    assert {r["mode"] for r in recs} == {"prefill", "decode"}
    fields = ("impl isa api mode dtype causal batch heads_q heads_kv seqlen_q seqlen_k head_dim "
              "head_dim_v seqlens threads status note warmup repeat calls_per_sample times_s median_s "
              "min_s max_s q1_s q3_s flops gflops peak_family peak_gflops pct_peak bytes gbs "
              "read_bw_gbs pct_bw max_abs_err error_ref check atol rtol speedup").split()
    for r in recs:
        assert set(fields) <= set(r), set(fields) - set(r)
        assert r["status"] == "ok" and len(r["times_s"]) == 2
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert math.isclose(r["gflops"], r["flops"] / r["median_s"] / 1e9)
        assert "machine" not in r                  # once per file, not per record
    fa = [r for r in recs if r["impl"] == "fa2cpu"]
    assert all(r["check"] == "ok" and r["error_ref"] == "numpy" and "numpy" in r["speedup"] for r in fa)
    decode = [r for r in fa if r["mode"] == "decode"][0]
    assert decode["seqlen_q"] == 1 and decode["gbs"] > 0


def test_plot_is_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plot.png"
    code, out, _ = run_main(capsys, "--mode", "prefill", "--seqlen", "32", "64", "--dtype", "fp32",
                            "--no-causal", "--threads", "1", "2", "--baselines", "none", "--no-check",
                            "--plot", str(path))
    assert code == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Thread scaling" in out


def test_wrong_answer_is_flagged(capsys, monkeypatch):
    real = fa2cpu.flash_attention

    def off_by_a_bit(*args, **kwargs):
        out = real(*args, **kwargs)
        return out + np.asarray(0.05, out.dtype)

    monkeypatch.setattr(fa2cpu, "flash_attention", off_by_a_bit)
    code, out, _ = run_main(capsys, "--mode", "prefill", "--dtype", "fp32", "--no-causal",
                            "--baselines", "numpy")
    assert code == 1
    assert "FAIL" in out and "CORRECTNESS CHECK FAILED" in out


def test_untimed_reference_when_no_baseline(tmp_path, capsys):
    path = tmp_path / "r.json"
    code, _, _ = run_main(capsys, "--mode", "prefill", "--dtype", "bf16", "--causal",
                          "--baselines", "none", "--json", str(path))
    assert code == 0
    (rec,) = json.loads(path.read_text())["records"]
    assert rec["error_ref"] == "reference" and rec["check"] == "ok"


def test_untimed_reference_runs_after_every_timed_call_of_its_case(capsys, monkeypatch):
    """The NumPy reference (its memory traffic, OpenBLAS's busy-waiting threads) never runs
    before or between the timed calls it checks; a wrong answer is still flagged."""
    events = []
    real_ref, real_fa = bench.sweep.reference_output, fa2cpu.flash_attention_with_kvcache

    def reference(case, x):
        events.append("reference")
        return real_ref(case, x)

    def off_by_a_bit(*args, **kwargs):
        events.append("fa2cpu")
        out = real_fa(*args, **kwargs)
        return out + np.asarray(0.05, out.dtype)

    monkeypatch.setattr(bench.sweep, "reference_output", reference)
    monkeypatch.setattr(bench.sweep, "SETTLE_AFTER_BLAS_S", 0.0)
    monkeypatch.setattr(fa2cpu, "flash_attention_with_kvcache", off_by_a_bit)
    code, out, _ = run_main(capsys, "--mode", "decode", "--seqlen-k", "100", "--heads", "4",
                            "--dtype", "bf16", "--kv-dtype", "int8", "--baselines", "none")
    assert code == 1 and "FAIL" in out
    # two cases (the float and the int8 cache), each: its timed calls, then one reference
    assert events.count("reference") == 2, events
    for case in " ".join(events).split("reference")[:-1]:
        assert case.split() and set(case.split()) == {"fa2cpu"}, events
    assert events[-1] == "reference"


def test_missing_torch_is_a_note_not_a_traceback(capsys, monkeypatch):
    monkeypatch.setattr(bench.peers, "import_torch", lambda: None)
    code, out, err = run_main(capsys, "--mode", "prefill", "--dtype", "fp32", "--no-causal",
                              "--baselines", "torch", "numpy")
    assert code == 0 and "Traceback" not in err
    assert "torch is not installed" in out and "vs torch" not in out


def test_torch_baseline_with_gqa_and_bottom_right_causal(capsys):
    pytest.importorskip("torch")
    code, out, _ = run_main(capsys, "--mode", "prefill", "--dtype", "fp32", "bf16", "--causal",
                            "--heads", "4", "--kv-heads", "2", "--seqlen-k", "80", "--baselines", "torch")
    assert code == 0, out
    assert "vs torch" in out and "explicit bottom-right causal mask" in out and "FAIL" not in out


def test_numpy_skipped_above_its_memory_limit(capsys):
    code, out, _ = run_main(capsys, "--mode", "prefill", "--dtype", "fp32", "--no-causal",
                            "--seqlen", "2048", "--baselines", "numpy", "--numpy-max-mib", "1")
    assert code == 0
    assert "skipped" in out and "numpy skipped" in out


def test_shape_too_big_for_memory_is_an_error_row_not_a_crash(capsys):
    code, out, _ = run_main(capsys, "--mode", "prefill", "--dtype", "fp32", "--no-causal",
                            "--batch", "64", "--heads", "64", "--seqlen", "300000", "--baselines", "none")
    assert code == 1
    assert "error" in out and "more than the memory available" in out


def test_varlen_mode(capsys):
    code, out, _ = run_main(capsys, "--mode", "varlen", "--batch", "3", "--dtype", "fp32",
                            "--baselines", "numpy")
    assert code == 0 and "N=24..72" in out and "FAIL" not in out


@pytest.mark.skipif(not os.environ.get("PATH"), reason="no PATH")
def test_console_script_matches_module():
    import shutil
    exe = shutil.which("fa2cpu-bench")
    if exe is None:
        pytest.skip("fa2cpu-bench is not installed as a console script here")
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and fa2cpu.__version__ in r.stdout


def test_quantized_kv_cache_rows(capsys, tmp_path):
    """--kv-dtype int8 fp8: decode rows for each quantized cache beside the float cache's, checked
    against the reference on the dequantized cache, bytes counting codes + scales, tokens/s."""
    path = tmp_path / "kv.json"
    code, out, _ = run_main(capsys, "--mode", "decode", "--seqlen-k", "300", "--heads", "8", "--dtype", "bf16",
                            "--kv-dtype", "int8,fp8", "--baselines", "torch", "--json", str(path))
    assert code == 0, out
    assert "tok/s" in out and "kv=int8" in out and "kv=fp8" in out and "no int8 KV cache" in out
    recs = [r for r in json.loads(path.read_text())["records"] if r["impl"] == "fa2cpu"]
    by_kv = {r["kv_dtype"]: r for r in recs}
    assert set(by_kv) == {None, "int8", "fp8"}
    for r in recs:
        assert r["check"] == "ok" and r["tokens_per_s"] > 0
    B, Hq, Hk, Nk, D = (by_kv[None][k] for k in ("batch", "heads_q", "heads_kv", "seqlen_k", "head_dim"))
    q_out = B * Hq * 2 * D * 2
    assert by_kv[None]["bytes"] == q_out + B * Nk * Hk * 2 * D * 2
    assert by_kv["int8"]["bytes"] == q_out + B * Nk * Hk * (2 * D + 8)


def test_plot_draws_a_quantized_cache_as_its_own_line(tmp_path, capsys, monkeypatch):
    """Decode rows of an int8 cache are measured at the same Nk as the float cache's: one line
    each, not one zigzag line."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes
    lines = []
    real = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **kw: lines.append((kw.get("label"), a[0])) or real(self, *a, **kw))
    code, _, _ = run_main(capsys, "--mode", "decode", "--seqlen", "64", "128", "--heads", "4", "--dtype", "fp32",
                          "--kv-dtype", "int8", "--threads", "1", "--baselines", "none", "--no-check",
                          "--plot", str(tmp_path / "p.png"))
    assert code == 0
    labels = [label for label, _ in lines]
    assert len(labels) == 2 and any("int8 cache" in label for label in labels), labels
    assert list(lines[0][1]) == list(lines[1][1]) and len(set(lines[0][1])) == len(lines[0][1]) >= 2


def test_output_closed_early_still_writes_the_json(tmp_path):
    """`fa2cpu-bench ... | head -2`: no BrokenPipeError traceback, the JSON still written."""
    path = tmp_path / "r.json"
    proc = subprocess.run(f"{sys.executable} -m fa2cpu.bench --mode decode --seqlen 64 --heads 4 --dtype fp32 "
                          f"--repeat 1 --warmup 0 --baselines none --json {path} | head -2",
                          shell=True, capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir())
    assert "Traceback" not in proc.stderr, proc.stderr
    assert json.loads(path.read_text())["records"]


def test_interrupt_before_the_sweep_exits_130_without_a_traceback(capsys, monkeypatch):
    def interrupted(torch):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench.cli, "machine_info", interrupted)   # Ctrl-C during the probes
    code, _, err = run_main(capsys, "--baselines", "none")
    assert code == 130 and "interrupted" in err


def test_read_bandwidth_probe_arguments_and_odd_sizes():
    """The denominator of every "% of read bandwidth": a positive finite rate for any thread
    count and buffer size (sizes that do not divide among the threads included), clear errors."""
    from fa2cpu import _core
    for threads, nbytes in ((1, 1), (2, 8 << 20), (3, (8 << 20) + 8 * 37), (5, 4096)):
        gbs = _core.read_bandwidth_gbs(threads, nbytes)
        assert math.isfinite(gbs) and gbs > 0, (threads, nbytes, gbs)
    with pytest.raises(ValueError, match="threads"):
        _core.read_bandwidth_gbs(0)
    with pytest.raises(ValueError, match="nbytes"):
        _core.read_bandwidth_gbs(1, 0)
