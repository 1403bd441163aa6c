"""fa2cpu-bench: time fa2cpu attention against NumPy and PyTorch on this CPU.

Run ``fa2cpu-bench`` (or ``python -m fa2cpu.bench``; same program). With no arguments it runs a
default sweep (prefill at a ladder of sequence lengths, fp32 and bf16, causal and not, plus decode:
one query against a long KV cache) sized by a time budget (``--budget-s``) to end within about a
minute on two cores, and prints a table that says which shapes ran. Every fa2cpu result is checked
against a baseline's output, so a fast wrong answer shows.

Modules: cases (dtypes, modes, shapes, inputs), machine (/proc, probes), timing (the one timing
routine, also used by the scripts in bench/), peers (NumPy, torch, fa2cpu runners), sweep (runs,
checks, budget), report (tables, JSON, plots), cli (options, main).

Conventions
-----------
* FLOPs: ``2*(D + Dv)`` per visible (query, key) pair and query head, i.e. ``4*B*Hq*Nq*Nk*D`` when
  ``Dv == D``; causal masks are bottom-right aligned and only visible pairs are counted.
* Decode bytes: q, K and V read once plus the output written; GB/s is that over the median time, and
  %bw compares it with the read bandwidth measured in the same run. A quantized cache (--kv-dtype
  int8/fp8) counts the bytes actually read: 1-byte codes plus a float32 scale per token and kv head
  for K and for V. tok/s: tokens generated per second, B per call.
* %peak compares GFLOP/s with the measured peak of the multiply-add instruction the kernel family
  uses for the dtype (fa2cpu rows: the family that ran; baselines: the family fa2cpu picks
  automatically). Families that convert bf16 to fp32 share the FMA's peak: one probe per instruction.
* "vs torch" / "vs numpy": the baseline's median time over this row's (> 1: this row is faster),
  same shape and thread count. "max err": largest |out - ref| (check column: ok / FAIL).
* Threads: a row with T threads runs fa2cpu with ``num_threads=T``, torch with
  ``torch.set_num_threads(T)``, NumPy's BLAS under a ``threadpoolctl`` limit of T. T is capped at
  the CPUs this process may use (``os.sched_getaffinity``).

JSON output (--json FILE)
-------------------------
One document::

  {"schema": "fa2cpu-bench/2", "created": ISO-8601 UTC time, "argv": [...],
   "interrupted": bool, "machine": MACHINE, "records": [RECORD, ...]}

with the machine once per file and one record per line.

MACHINE: cpu_model, cpu_vendor, cpu_family, cpu_model_id, logical_cpus, l3_bytes, cpu_flags (SIMD
  subset of /proc/cpuinfo), isa_usable (best first), isa_default, python, platform,
  busy_cpus_before (CPUs that other processes kept busy just before the run),
  versions {fa2cpu, numpy, ml_dtypes, torch (null if absent)},
  peaks [{instruction, family, dtype, threads, gflops}], read_bandwidth [{threads, nbytes, gbs}].

RECORD (one per measurement):
  impl            "fa2cpu" | "torch" | "numpy"
  isa             kernel family fa2cpu ran (null for baselines)
  api             the function timed
  mode            "prefill" | "decode" | "varlen"
  dtype           "fp32" | "bf16" | "fp16"
  causal          bool (bottom-right aligned)
  batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v   (int)
  seqlens         varlen: per-sequence lengths; otherwise null
  kv_dtype        decode with a quantized cache: "int8" | "fp8"; otherwise null
  threads         int
  status          "ok" | "skipped" | "error";  note: why skipped / failed / fallbacks used
  warmup, repeat, calls_per_sample   (short calls are repeated inside one timed sample)
  times_s         per-call seconds, one per sample;  median_s, min_s, max_s, q1_s, q3_s
  flops, gflops, peak_family, peak_gflops, pct_peak
  bytes, gbs, read_bw_gbs, pct_bw, tokens_per_s (decode)
  max_abs_err     vs error_ref ("numpy" | "torch" | "reference" = untimed NumPy | null)
  check           "ok" | "FAIL" | "ref" (this row is the reference) | null;  atol, rtol
  speedup         {baseline: baseline median_s / this median_s} at the same shape and threads
Times are seconds, rates GFLOP/s and GB/s (1e9). Unmeasured values are null.

Exit status: 0 success, 1 a correctness check failed, a measurement raised or an output file
could not be written, 2 bad arguments,
130 interrupted (the tables and JSON still hold what was measured).
"""
from .cases import DTYPES, MODES, Case, build_cases, dtype_name, visible_pairs
from .cli import dtype_arg, long_dtype_arg, main, make_parser, parse_args, positive_int
from .machine import default_threads, usable_cpus
from .peers import BASELINES
from .report import print_report
from .sweep import Record
from .timing import Timing, measure, median_time

__all__ = ["BASELINES", "DTYPES", "MODES", "Case", "Record", "Timing", "build_cases", "default_threads",
           "dtype_arg", "dtype_name", "long_dtype_arg", "main", "make_parser", "measure", "median_time", "parse_args", "positive_int",
           "print_report", "usable_cpus", "visible_pairs"]
