"""fa2cpu-bench: time fa2cpu attention against NumPy and PyTorch on this CPU.

Run ``fa2cpu-bench`` (or ``python -m fa2cpu.bench``; same program). With no arguments it runs a
default sweep (prefill at a few sequence lengths, fp32 and bf16, causal and not, plus a decode shape:
one query against a long KV cache) that takes well under a minute on two cores, and prints a table.
Every fa2cpu result is checked against a baseline's output, so a fast wrong answer shows.

Conventions
-----------
* FLOPs: ``2*(D + Dv)`` per visible (query, key) pair and query head, i.e. ``4*B*Hq*Nq*Nk*D`` when
  ``Dv == D``; causal masks are bottom-right aligned and only visible pairs are counted.
* Decode bytes: q, K and V read once plus the output written; GB/s is that over the median time, and
  %bw compares it with the read bandwidth measured in the same run.
* %peak compares GFLOP/s with the measured peak of the kernel family's multiply-add instruction for the
  dtype (fa2cpu rows: the family that ran; baselines: the family fa2cpu picks automatically).
* "vs torch" / "vs numpy": the baseline's median time over this row's (> 1: this row is faster),
  same shape and thread count. "max err": largest |out - ref| (check column: ok / FAIL).
* Threads: fa2cpu gets ``num_threads=``, torch ``torch.set_num_threads``, NumPy's BLAS a
  ``threadpoolctl`` limit; all the same count.

JSON output (--json FILE)
-------------------------
One document::

  {"schema": "fa2cpu-bench/1", "created": ISO-8601 UTC time, "argv": [...],
   "interrupted": bool, "machine": MACHINE, "records": [RECORD, ...]}

MACHINE: cpu_model, cpu_vendor, cpu_family, cpu_model_id, logical_cpus, l3_bytes, cpu_flags (SIMD
  subset of /proc/cpuinfo), isa_usable (best first), isa_default, python, platform,
  busy_cpus_before (CPUs that other processes kept busy just before the run),
  versions {fa2cpu, numpy, ml_dtypes, torch (null if absent)},
  peaks [{family, dtype, threads, gflops}], read_bandwidth [{threads, nbytes, gbs}].

RECORD (one per measurement, self-contained):
  impl            "fa2cpu" | "torch" | "numpy"
  isa             kernel family fa2cpu ran (null for baselines)
  api             the function timed
  mode            "prefill" | "decode" | "varlen"
  dtype           "fp32" | "bf16" | "fp16"
  causal          bool (bottom-right aligned)
  batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v   (int)
  seqlens         varlen: per-sequence lengths; otherwise null
  threads         int
  status          "ok" | "skipped" | "error";  note: why skipped / failed / fallbacks used
  warmup, repeat, calls_per_sample   (short calls are repeated inside one timed sample)
  times_s         per-call seconds, one per sample;  median_s, min_s, max_s, q1_s, q3_s
  flops, gflops, peak_family, peak_gflops, pct_peak
  bytes, gbs, read_bw_gbs, pct_bw
  max_abs_err     vs error_ref ("numpy" | "torch" | "reference" = untimed NumPy | null)
  check           "ok" | "FAIL" | "ref" (this row is the reference) | null;  atol, rtol
  speedup         {baseline: baseline median_s / this median_s} at the same shape and threads
  machine         MACHINE, repeated so a record stands alone
Times are seconds, rates GFLOP/s and GB/s (1e9). Unmeasured values are null.

Exit status: 0 success, 1 a correctness check failed, a measurement raised or an output file
could not be written, 2 bad arguments,
130 interrupted (the tables and JSON still hold what was measured).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import ml_dtypes
import numpy as np

import fa2cpu

# ---------------------------------------------------------------------------------------------
# Vocabulary and defaults (one table each)
# ---------------------------------------------------------------------------------------------

DTYPES = {"fp32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16),
          "fp16": np.dtype(np.float16)}
MODES = ("prefill", "decode", "varlen")
BASELINES = ("numpy", "torch")
ISA_FAMILIES = ("amx", "avx512bf16", "avx512", "avx2", "generic")

# Shapes of the default sweep per mode; an option given on the command line overrides them in every
# mode. The prefill default uses H=8 (not the H=32 of the README tables) to stay under a minute on
# two cores with both baselines.
MODE_DEFAULTS = {
    "prefill": {"batch": 1, "heads": 8, "seqlen": (512, 1024, 2048)},
    "decode": {"batch": 8, "heads": 32, "seqlen": (8192,)},
    "varlen": {"batch": 4, "heads": 8, "seqlen": (1024,)},
}
DEFAULT_MODES = ("prefill", "decode")
DEFAULT_DTYPES = ("fp32", "bf16")
DEFAULT_HEAD_DIM = 128
DECODE_GQA_GROUP = 4          # decode default: --kv-heads = --heads / 4 (GQA, as in Llama-style models)
DEFAULT_WARMUP = 1
DEFAULT_REPEAT = 5
DEFAULT_NUMPY_MAX_MIB = 1024  # the naive baseline materialises B*Hq*Nq*Nk fp32 scores

# (atol, rtol) of the correctness check, elementwise |out - ref| <= atol + rtol*|ref|. Loose on
# purpose: it catches wrong answers, not rounding differences between implementations.
TOLERANCES = {"fp32": (1e-4, 1e-3), "fp16": (2e-3, 1e-2), "bf16": (1e-2, 5e-2)}

# OpenBLAS worker threads busy-wait for ~0.1 s after a multi-threaded call; measured here, they
# halve the speed of whatever runs next on 2 cores. Pause that long after the NumPy baseline.
SETTLE_AFTER_BLAS_S = 0.2
MIN_SAMPLE_S = 2e-3           # calls shorter than this are repeated inside one timed sample
MAX_CALLS_PER_SAMPLE = 1000
REFERENCE_CHUNK_BYTES = 64 << 20   # score-matrix slice of the untimed chunked NumPy reference
PROBE_RUNS = 3                # peak and bandwidth probes report the best of this many runs
PROGRESS_AFTER_S = 2.0        # the progress line appears only once a sweep has run this long
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
              "amx_tile", "amx_bf16", "amx_int8")


class BenchError(Exception):
    """A problem reported to the user as one line (exit status 2), never as a traceback."""


# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------

def visible_pairs(nq: int, nk: int, causal: bool) -> int:
    """(query, key) pairs one head attends: all, or bottom-right causal (i sees j <= i + nk - nq)."""
    if not causal:
        return nq * nk
    rows = np.arange(nq, dtype=np.int64) + (nk - nq) + 1
    return int(np.clip(rows, 0, nk).sum())


@dataclass(frozen=True)
class Case:
    """One attention problem. Layout-free: each implementation gets it in its own natural layout."""
    mode: str
    dtype: str
    causal: bool
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    seqlens: tuple[int, ...] | None = None   # varlen: per-sequence lengths (q and k alike)

    @property
    def sequences(self) -> list[tuple[int, int]]:
        """(Nq, Nk) of every sequence in the batch."""
        if self.seqlens is not None:
            return [(n, n) for n in self.seqlens]
        return [(self.seqlen_q, self.seqlen_k)] * self.batch

    @property
    def flops(self) -> int:
        pairs = sum(visible_pairs(nq, nk, self.causal) for nq, nk in self.sequences)
        return 2 * (self.head_dim + self.head_dim_v) * self.heads_q * pairs

    @property
    def bytes(self) -> int:
        """Bytes of q, K, V read once and of the output written."""
        tq = sum(nq for nq, _ in self.sequences)
        tk = sum(nk for _, nk in self.sequences)
        elems = (tq * self.heads_q * (self.head_dim + self.head_dim_v)
                 + tk * self.heads_kv * (self.head_dim + self.head_dim_v))
        return elems * DTYPES[self.dtype].itemsize

    @property
    def score_bytes(self) -> int:
        """Largest fp32 score matrix the naive NumPy baseline materialises at once."""
        per_seq = max(nq * nk for nq, nk in self.sequences)
        count = 1 if self.seqlens is not None else self.batch
        return 4 * count * self.heads_q * per_seq

    @property
    def x_value(self) -> int:
        """The sequence length a plot puts on its x axis."""
        return self.seqlen_k if self.mode == "decode" else self.seqlen_q

    def label(self) -> str:
        heads = f"{self.heads_q}" if self.heads_q == self.heads_kv else f"{self.heads_q}/{self.heads_kv}"
        if self.seqlens is not None:
            n = f"{min(self.seqlens)}..{max(self.seqlens)}"
        elif self.seqlen_q == self.seqlen_k:
            n = f"{self.seqlen_q}"
        else:
            n = f"{self.seqlen_q}/{self.seqlen_k}"
        d = f"{self.head_dim}" if self.head_dim == self.head_dim_v else f"{self.head_dim}/{self.head_dim_v}"
        return f"B={self.batch} H={heads} N={n} D={d}"


def varlen_lengths(batch: int, seqlen: int) -> tuple[int, ...]:
    """Deterministic ragged batch: lengths spread evenly over [seqlen/2, 3*seqlen/2]."""
    if batch == 1:
        return (seqlen,)
    return tuple(max(1, round(seqlen * (0.5 + i / (batch - 1)))) for i in range(batch))


def build_cases(args: argparse.Namespace) -> list[Case]:
    cases = []
    for mode in args.mode:
        d = MODE_DEFAULTS[mode]
        batch = args.batch or d["batch"]
        heads = args.heads or d["heads"]
        if args.kv_heads:
            kv_heads = args.kv_heads
        elif mode == "decode" and heads % DECODE_GQA_GROUP == 0:
            kv_heads = heads // DECODE_GQA_GROUP
        else:
            kv_heads = heads
        seqlens = args.seqlen or d["seqlen"]
        if mode == "decode" and args.seqlen_k:
            seqlens = (args.seqlen_k,)
        causals = (False,) if mode == "decode" else args.causal   # Nq=1 bottom-right sees every key
        for dtype in args.dtype:
            for n in seqlens:
                for causal in causals:
                    if mode == "prefill":
                        nq, nk, lengths = n, args.seqlen_k or n, None
                    elif mode == "decode":
                        nq, nk, lengths = 1, n, None
                    else:
                        nq, nk, lengths = n, n, varlen_lengths(batch, n)
                    cases.append(Case(mode, dtype, causal, batch, heads, kv_heads, nq, nk,
                                      args.head_dim, args.head_dim, lengths))
    return cases


# ---------------------------------------------------------------------------------------------
# Machine description and probes
# ---------------------------------------------------------------------------------------------

def _cpuinfo() -> dict[str, str]:
    """Fields of the first processor in /proc/cpuinfo (empty off Linux)."""
    info: dict[str, str] = {}
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    return info


def _l3_bytes() -> int | None:
    path = "/sys/devices/system/cpu/cpu0/cache/index3/size"
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            text = f.read().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    return None


def busy_cpus(interval: float = 0.1) -> float | None:
    """CPUs kept busy by other processes over `interval` (this one sleeps meanwhile), from
    /proc/stat; None off Linux. A benchmark sharing its cores gives noisy numbers."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]   # total, idle + iowait
    try:
        total0, idle0 = sample()
        time.sleep(interval)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 == total0:
        return None
    return logical_cpus() * (1 - (idle1 - idle0) / (total1 - total0))


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None off Linux."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return None


def logical_cpus() -> int:
    with contextlib.suppress(AttributeError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_threads() -> int:
    """OMP_NUM_THREADS when set (what fa2cpu itself would use), else the CPUs this process may use."""
    with contextlib.suppress(ValueError):
        n = int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0])
        if n >= 1:
            return n
    return logical_cpus()


def import_torch():
    """torch or None; importing it is slow, so only when the torch baseline is asked for."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def machine_info(torch) -> dict:
    cpu = _cpuinfo()
    flags = cpu.get("flags", "").split()
    return {
        "cpu_model": cpu.get("model name") or platform.processor() or "unknown",
        "cpu_vendor": cpu.get("vendor_id"),
        "cpu_family": cpu.get("cpu family"),
        "cpu_model_id": cpu.get("model"),
        "logical_cpus": logical_cpus(),
        "l3_bytes": _l3_bytes(),
        "cpu_flags": [f for f in SIMD_FLAGS if f in flags],
        "isa_usable": list(fa2cpu.available_isas()),
        "isa_default": fa2cpu.get_isa(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {"fa2cpu": fa2cpu.__version__, "numpy": np.__version__,
                     "ml_dtypes": ml_dtypes.__version__,
                     "torch": torch.__version__ if torch is not None else None},
        "busy_cpus_before": busy_cpus(),
        "peaks": [],
        "read_bandwidth": [],
    }


class Probes:
    """Peak GFLOP/s and read bandwidth measured by the extension's probes, cached for the run.
    Each is the best of PROBE_RUNS runs: a peak is what the machine can do, and another process
    stealing a core must not lower it (that would inflate every %peak)."""

    def __init__(self, machine: dict):
        self.machine = machine
        self.notes: list[str] = []
        self._peaks: dict[tuple[str, str, int], float | None] = {}
        self._bw: dict[int, float | None] = {}
        try:
            from fa2cpu import _core
        except ImportError:
            _core = None
        self._peak_fn = getattr(_core, "peak_gflops", None)
        self._bw_fn = getattr(_core, "read_bandwidth_gbs", None)

    def peak(self, family: str, dtype: str, threads: int) -> float | None:
        key = (family, dtype, threads)
        if key not in self._peaks:
            self._peaks[key] = self._measure_peak(family, dtype, threads)
            if self._peaks[key] is not None:
                self.machine["peaks"].append({"family": family, "dtype": dtype, "threads": threads,
                                              "gflops": self._peaks[key]})
        return self._peaks[key]

    def _measure_peak(self, family: str, dtype: str, threads: int) -> float | None:
        if self._peak_fn is None:
            self.note("this fa2cpu build has no peak probe (_core.peak_gflops): %peak not shown")
            return None
        try:
            gflops = max(float(self._peak_fn(family, dtype, threads)) for _ in range(PROBE_RUNS))
            return gflops if gflops > 0 else None   # 0.0: the family cannot run here
        except (ValueError, TypeError, RuntimeError) as e:
            if dtype == "fp16":   # families without fp16 arithmetic convert to fp32
                self.note("fp16 %peak is against the fp32 FMA peak (no fp16 probe)")
                return self._measure_peak(family, "fp32", threads)
            self.note(f"peak probe failed for {family}/{dtype}: {e}")
            return None

    def bandwidth(self, threads: int) -> float | None:
        if threads not in self._bw:
            self._bw[threads] = self._measure_bandwidth(threads)
        return self._bw[threads]

    def _measure_bandwidth(self, threads: int) -> float | None:
        if self._bw_fn is None:
            self.note("this fa2cpu build has no bandwidth probe (_core.read_bandwidth_gbs): %bw not shown")
            return None
        # Far larger than the last-level cache, so the probe measures DRAM.
        nbytes = max(256 << 20, 8 * (self.machine["l3_bytes"] or 64 << 20))
        try:
            gbs = max(float(self._bw_fn(threads, nbytes)) for _ in range(PROBE_RUNS))
        except (ValueError, RuntimeError, MemoryError) as e:
            self.note(f"bandwidth probe failed: {e}")
            return None
        self.machine["read_bandwidth"].append({"threads": threads, "nbytes": nbytes, "gbs": gbs})
        return gbs

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


# ---------------------------------------------------------------------------------------------
# Inputs and implementations
# ---------------------------------------------------------------------------------------------

@dataclass
class Inputs:
    """fa2cpu's natural layout: prefill bhsd, decode q (B,1,Hq,D) + caches (B,Nk,Hk,D),
    varlen packed (total, H, D) with cu_seqlens."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    cu_seqlens: np.ndarray | None = None
    bhsd: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None   # see baseline_problems


def _uniform(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Unit-variance uniform values (much faster to draw than normals for GiB-sized caches)."""
    a = rng.random(shape, dtype=np.float32)
    a -= 0.5
    a *= 2 * math.sqrt(3.0)
    return a if dtype == np.float32 else a.astype(dtype)


def make_inputs(case: Case, seed: int) -> Inputs:
    rng = np.random.default_rng(seed)
    dt = DTYPES[case.dtype]
    b, hq, hk, d, dv = case.batch, case.heads_q, case.heads_kv, case.head_dim, case.head_dim_v
    if case.mode == "prefill":
        return Inputs(_uniform(rng, (b, hq, case.seqlen_q, d), dt),
                      _uniform(rng, (b, hk, case.seqlen_k, d), dt),
                      _uniform(rng, (b, hk, case.seqlen_k, dv), dt))
    if case.mode == "decode":
        return Inputs(_uniform(rng, (b, 1, hq, d), dt),
                      _uniform(rng, (b, case.seqlen_k, hk, d), dt),
                      _uniform(rng, (b, case.seqlen_k, hk, dv), dt))
    total = sum(case.seqlens)
    cu = np.concatenate([[0], np.cumsum(case.seqlens)]).astype(np.int32)
    return Inputs(_uniform(rng, (total, hq, d), dt), _uniform(rng, (total, hk, d), dt),
                  _uniform(rng, (total, hk, dv), dt), cu)


def bhsd_views(case: Case, x: Inputs) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The inputs as (q, k, v) bhsd arrays, one triple per independent attention problem."""
    if case.mode == "prefill":
        return [(x.q, x.k, x.v)]
    if case.mode == "decode":
        t = (0, 2, 1, 3)
        return [(x.q.transpose(t), x.k.transpose(t), x.v.transpose(t))]
    cu = x.cu_seqlens
    return [tuple(a[cu[i]:cu[i + 1]].transpose(1, 0, 2)[None] for a in (x.q, x.k, x.v))
            for i in range(case.batch)]


def baseline_problems(case: Case, x: Inputs) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The inputs as contiguous bhsd arrays, the layout NumPy and torch are fastest with (strided
    K/V views make NumPy's matmul ~30x slower). Copied once per case, outside any timing; prefill
    inputs are bhsd already and are not copied."""
    if x.bhsd is None:
        x.bhsd = [tuple(np.ascontiguousarray(a) for a in p) for p in bhsd_views(case, x)]
    return x.bhsd


def canonical(case: Case, outs: list[np.ndarray]) -> np.ndarray:
    """Join per-problem bhsd outputs into the canonical float32 layout used for comparisons:
    bhsd for prefill and decode, packed (total, Hq, Dv) for varlen."""
    if case.mode == "varlen":
        return np.concatenate([o[0].transpose(1, 0, 2) for o in outs]).astype(np.float32)
    return np.asarray(outs[0], dtype=np.float32)


def numpy_attention(q, k, v, causal: bool, scale: float, row_chunk: int | None = None) -> np.ndarray:
    """Naive attention in float32: materialised scores, softmax, P @ V. bhsd in and out;
    bottom-right causal; rows that see no key give 0. GQA: the G = Hq/Hk query heads of a group
    are stacked as rows of one matrix, so each K/V head is read once per matmul, never repeated."""
    b, hq, nq, d = q.shape
    hk, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hk
    q = q.astype(np.float32, copy=False).reshape(b, hk, g, nq, d)
    kt = np.swapaxes(k.astype(np.float32, copy=False), -1, -2)
    v = v.astype(np.float32, copy=False)
    out = np.empty((b, hk, g, nq, dv), np.float32)
    step = row_chunk or nq
    for r0 in range(0, nq, step):
        r1 = min(nq, r0 + step)
        rows = r1 - r0
        s = (q[..., r0:r1, :].reshape(b, hk, g * rows, d) @ kt).reshape(b, hk, g, rows, nk)
        s *= scale
        if causal:   # additive 0 / -inf bias, broadcast over batch and heads
            hidden = np.arange(nk)[None, :] > np.arange(r0, r1)[:, None] + (nk - nq)
            s += np.where(hidden, np.float32(-np.inf), np.float32(0))
        m = s.max(axis=-1, keepdims=True)
        m[~np.isfinite(m)] = 0.0
        s -= m
        np.exp(s, out=s)
        denom = s.sum(axis=-1, keepdims=True)
        denom[denom == 0] = 1.0
        o = (s.reshape(b, hk, g * rows, nk) @ v).reshape(b, hk, g, rows, dv)
        o /= denom
        out[..., r0:r1, :] = o
    return out.reshape(b, hq, nq, dv)


def reference_output(case: Case, x: Inputs) -> np.ndarray:
    """Untimed float32 reference, computed in row chunks so memory stays bounded."""
    scale = 1.0 / math.sqrt(case.head_dim)
    outs = []
    for q, k, v in baseline_problems(case, x):
        rows = max(1, REFERENCE_CHUNK_BYTES // (4 * q.shape[0] * q.shape[1] * k.shape[2]))
        outs.append(numpy_attention(q, k, v, case.causal, scale, row_chunk=rows))
    return canonical(case, outs)


@dataclass
class Runner:
    """A prepared implementation: `call` is what is timed; `result` turns its return value into
    the canonical float32 layout (untimed)."""
    call: Callable[[], object]
    result: Callable[[object], np.ndarray]
    api: str
    note: str = ""
    limits: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def fa2cpu_runner(case: Case, x: Inputs, threads: int) -> Runner:
    t = threads
    if case.mode == "prefill":
        return Runner(lambda: fa2cpu.flash_attention(x.q, x.k, x.v, causal=case.causal, num_threads=t),
                      lambda o: np.asarray(o, np.float32), "fa2cpu.flash_attention")
    if case.mode == "decode":
        to_bhsd = lambda o: np.asarray(o, np.float32).transpose(0, 2, 1, 3)  # noqa: E731
        if hasattr(fa2cpu, "flash_attention_with_kvcache"):
            return Runner(lambda: fa2cpu.flash_attention_with_kvcache(
                              x.q, x.k, x.v, causal=case.causal, num_threads=t),
                          to_bhsd, "fa2cpu.flash_attention_with_kvcache")
        return Runner(lambda: fa2cpu.flash_attention(x.q, x.k, x.v, causal=case.causal,
                                                     layout="bshd", num_threads=t),
                      to_bhsd, "fa2cpu.flash_attention",
                      "fa2cpu: flash_attention_with_kvcache missing in this build; "
                      "decode timed with flash_attention(layout='bshd')")
    n = max(case.seqlens)
    return Runner(lambda: fa2cpu.flash_attention_varlen(
                      x.q, x.k, x.v, x.cu_seqlens, x.cu_seqlens, max_seqlen_q=n, max_seqlen_k=n,
                      causal=case.causal, num_threads=t),
                  lambda o: np.asarray(o, np.float32), "fa2cpu.flash_attention_varlen")


def numpy_runner(case: Case, x: Inputs, threads: int, max_bytes: int) -> Runner | str:
    """The naive baseline, or the reason it is skipped."""
    if case.score_bytes > max_bytes:
        return (f"numpy skipped: its score matrix needs {case.score_bytes >> 20} MiB "
                f"(limit --numpy-max-mib {max_bytes >> 20})")
    from threadpoolctl import threadpool_limits
    scale = 1.0 / math.sqrt(case.head_dim)
    problems = baseline_problems(case, x)
    note = "" if case.dtype == "fp32" else "numpy computes in float32 (inputs upcast inside the timed call)"
    return Runner(lambda: [numpy_attention(q, k, v, case.causal, scale) for q, k, v in problems],
                  lambda outs: canonical(case, outs), "numpy naive (matmul, softmax, matmul)", note,
                  lambda: threadpool_limits(limits=threads, user_api="blas"))


def to_torch(torch, a: np.ndarray):
    """A torch tensor sharing a's memory and values (bf16 by bit pattern: no rounding)."""
    if a.dtype == DTYPES["bf16"]:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def torch_runner(case: Case, x: Inputs, threads: int, torch) -> Runner:
    """torch SDPA on contiguous bhsd tensors, its preferred layout (see baseline_problems)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kwargs = {"scale": 1.0 / math.sqrt(case.head_dim)}
    if case.heads_q != case.heads_kv:
        kwargs["enable_gqa"] = True
    note = ""
    problems = []
    for q, k, v in baseline_problems(case, x):
        tq, tk, tv = (to_torch(torch, a) for a in (q, k, v))
        kw = dict(kwargs)
        nq, nk = q.shape[2], k.shape[2]
        if case.causal and nq == nk:
            kw["is_causal"] = True
        elif case.causal:   # is_causal is top-left aligned when Nq != Nk: pass the bottom-right mask
            kw["attn_mask"] = torch.from_numpy(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq)
            note = "torch: explicit bottom-right causal mask (is_causal is top-left aligned when Nq != Nk)"
        problems.append((tq, tk, tv, kw))

    def call():
        with torch.inference_mode():
            return [sdpa(tq, tk, tv, **kw) for tq, tk, tv, kw in problems]

    def result(outs):
        return canonical(case, [o.float().numpy() for o in outs])

    @contextlib.contextmanager
    def limits():
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    api = "torch.nn.functional.scaled_dot_product_attention"
    return Runner(call, result, api if case.mode != "varlen" else api + " (loop over sequences)",
                  note, limits)


# ---------------------------------------------------------------------------------------------
# Timing and records
# ---------------------------------------------------------------------------------------------

@dataclass
class Timing:
    times_s: list[float]       # seconds per call, one entry per sample
    calls_per_sample: int


def measure(call: Callable[[], object], warmup: int, repeat: int) -> tuple[Timing, object]:
    """Median-ready samples of one call. A first call calibrates how many calls go in one sample
    (so each sample lasts >= MIN_SAMPLE_S); when one call is long enough it is the first sample."""
    result = None
    for _ in range(warmup):
        result = call()
    t0 = time.perf_counter()
    result = call()
    first = time.perf_counter() - t0
    if first >= MIN_SAMPLE_S:
        number, times = 1, [first]
    else:
        number, times = min(MAX_CALLS_PER_SAMPLE, math.ceil(MIN_SAMPLE_S / max(first, 1e-9))), []
    while len(times) < repeat:
        t0 = time.perf_counter()
        for _ in range(number):
            result = call()
        times.append((time.perf_counter() - t0) / number)
    return Timing(times, number), result


@dataclass
class Record:
    """One measurement (one table row, one JSON record)."""
    case: Case
    impl: str
    threads: int
    isa: str | None = None
    api: str = ""
    status: str = "ok"
    note: str = ""
    warmup: int = 0
    repeat: int = 0
    calls_per_sample: int = 0
    times_s: list[float] = field(default_factory=list)
    peak_family: str | None = None
    peak_gflops: float | None = None
    read_bw_gbs: float | None = None
    max_abs_err: float | None = None
    error_ref: str | None = None
    check: str | None = None
    speedup: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"fa2cpu/{self.isa}" if self.impl == "fa2cpu" else self.impl

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.times_s) if self.times_s else None

    @property
    def gflops(self) -> float | None:
        return self.case.flops / self.median_s / 1e9 if self.ok else None

    @property
    def gbs(self) -> float | None:
        return self.case.bytes / self.median_s / 1e9 if self.ok else None

    @property
    def pct_peak(self) -> float | None:
        return 100 * self.gflops / self.peak_gflops if self.ok and self.peak_gflops else None

    @property
    def pct_bw(self) -> float | None:
        return 100 * self.gbs / self.read_bw_gbs if self.ok and self.read_bw_gbs else None

    @classmethod
    def from_json(cls, rec: dict) -> "Record":
        """Inverse of to_json (derived values such as gflops are recomputed from the times)."""
        case = Case(**{f.name: rec[f.name] for f in dataclasses.fields(Case)})
        case = dataclasses.replace(case, seqlens=tuple(case.seqlens) if case.seqlens else None)
        own = {f.name: rec[f.name] for f in dataclasses.fields(cls) if f.name != "case"}
        return cls(case, **own)

    def to_json(self, machine: dict) -> dict:
        t = self.times_s
        q1, q3 = (np.percentile(t, [25, 75]).tolist() if t else (None, None))
        atol, rtol = TOLERANCES[self.case.dtype]
        rec = {"impl": self.impl, "isa": self.isa, "api": self.api}
        rec.update(dataclasses.asdict(self.case))
        rec["seqlens"] = list(self.case.seqlens) if self.case.seqlens else None
        rec.update({
            "threads": self.threads, "status": self.status, "note": self.note,
            "warmup": self.warmup, "repeat": self.repeat, "calls_per_sample": self.calls_per_sample,
            "times_s": t, "median_s": self.median_s, "min_s": min(t) if t else None,
            "max_s": max(t) if t else None, "q1_s": q1, "q3_s": q3,
            "flops": self.case.flops, "gflops": self.gflops, "peak_family": self.peak_family,
            "peak_gflops": self.peak_gflops, "pct_peak": self.pct_peak,
            "bytes": self.case.bytes, "gbs": self.gbs, "read_bw_gbs": self.read_bw_gbs,
            "pct_bw": self.pct_bw, "max_abs_err": self.max_abs_err, "error_ref": self.error_ref,
            "check": self.check, "atol": atol, "rtol": rtol, "speedup": self.speedup,
            "machine": machine,
        })
        return rec


def check_against(rec: Record, out: np.ndarray, ref: tuple[str, np.ndarray] | None) -> None:
    if ref is None:
        return
    name, expected = ref
    if out is expected:
        rec.error_ref, rec.check = name, "ref"
        return
    atol, rtol = TOLERANCES[rec.case.dtype]
    diff = np.abs(out - expected)
    rec.max_abs_err = float(np.max(diff)) if diff.size else 0.0
    rec.error_ref = name
    ok = diff.shape == expected.shape and bool(np.all(diff <= atol + rtol * np.abs(expected)))
    rec.check = "ok" if ok else "FAIL"


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------

class Progress:
    """One self-overwriting status line on stderr, shown only on a terminal and only once the
    sweep has run for PROGRESS_AFTER_S (short runs stay silent)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.enabled = enabled and sys.stderr.isatty()
        self.shown = False

    def step(self, what: str) -> None:
        elapsed = time.perf_counter() - self.start
        if self.enabled and elapsed >= PROGRESS_AFTER_S:
            line = f"[{self.done + 1}/{self.total} {elapsed:4.0f}s] {what}"
            sys.stderr.write("\r" + line[:110].ljust(110))
            sys.stderr.flush()
            self.shown = True
        self.done += 1

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\r" + " " * 110 + "\r")
            sys.stderr.flush()


@dataclass
class Sweep:
    """Everything the sweep needs besides the cases."""
    threads: list[int]
    isas: list[str]
    baselines: list[str]
    warmup: int
    repeat: int
    check: bool
    seed: int
    numpy_max_bytes: int
    torch: object
    probes: Probes
    default_isa: str
    progress: Progress


def run_one(sweep: Sweep, case: Case, impl: str, threads: int, make_runner,
            isa: str | None = None) -> tuple[Record, np.ndarray | None]:
    """Time one implementation on one case; failures become records, never exceptions."""
    rec = Record(case, impl, threads, isa=isa, warmup=sweep.warmup, repeat=sweep.repeat)
    rec.peak_family = isa or sweep.default_isa
    sweep.progress.step(f"{case.mode} {case.dtype} {'causal ' if case.causal else ''}"
                        f"{case.label()} {rec.label}, {threads} thr")
    try:
        runner = make_runner()
        if isinstance(runner, str):
            rec.status, rec.note = "skipped", runner
            return rec, None
        rec.api, rec.note = runner.api, runner.note
        with runner.limits():
            timing, raw = measure(runner.call, sweep.warmup, sweep.repeat)
        if impl == "numpy" and threads > 1:
            time.sleep(SETTLE_AFTER_BLAS_S)
        rec.times_s, rec.calls_per_sample = timing.times_s, timing.calls_per_sample
        out = runner.result(raw)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # noqa: BLE001 -- any failure of one measurement is reported in its row
        rec.status, rec.note = "error", f"{rec.label}: {type(e).__name__}: {e}"
        return rec, None
    rec.peak_gflops = sweep.probes.peak(rec.peak_family, case.dtype, threads)
    if case.mode == "decode":
        rec.read_bw_gbs = sweep.probes.bandwidth(threads)
    return rec, out


def run_case(sweep: Sweep, case: Case, records: list[Record]) -> None:
    """Measure one case with every thread count, baseline and family, appending to `records` as it
    goes (so an interrupted sweep keeps what it measured)."""
    # Inputs and output, plus the baselines' bhsd copies; refuse rather than meet the OOM killer.
    need, free = case.bytes * (2 if sweep.baselines else 1), available_memory()
    try:
        if free is not None and need > free:
            raise MemoryError
        x = make_inputs(case, sweep.seed)
    except MemoryError:
        note = (f"inputs of {case.label()} need about {need >> 20} MiB, more than the memory available"
                + (f" ({free >> 20} MiB)" if free is not None else ""))
        for threads in sweep.threads:
            for impl, isa in [(b, None) for b in sweep.baselines] + [("fa2cpu", i) for i in sweep.isas]:
                sweep.progress.step(note)
                records.append(Record(case, impl, threads, isa=isa, status="error", note=note))
        return
    ref: tuple[str, np.ndarray] | None = None
    for threads in sweep.threads:
        makers = {"numpy": lambda: numpy_runner(case, x, threads, sweep.numpy_max_bytes),
                  "torch": lambda: torch_runner(case, x, threads, sweep.torch)}
        for name in sweep.baselines:
            rec, out = run_one(sweep, case, name, threads, makers[name])
            if sweep.check and ref is None and out is not None:
                ref = (name, out)
            if sweep.check and out is not None:
                check_against(rec, out, ref)
            records.append(rec)
        if sweep.check and ref is None:
            ref = ("reference", reference_output(case, x))
        for isa in sweep.isas:
            fa2cpu.set_isa(isa)
            rec, out = run_one(sweep, case, "fa2cpu", threads,
                               lambda: fa2cpu_runner(case, x, threads), isa=isa)
            if sweep.check and out is not None:
                check_against(rec, out, ref)
            records.append(rec)


def add_speedups(records: list[Record]) -> None:
    """speedup[b] = baseline b's median / this median, same case and thread count."""
    base = {(r.case, r.threads, r.impl): r for r in records if r.impl in BASELINES and r.ok}
    for r in records:
        if not r.ok:
            continue
        for name in BASELINES:
            b = base.get((r.case, r.threads, name))
            if b is not None and b is not r:
                r.speedup[name] = b.median_s / r.median_s


# ---------------------------------------------------------------------------------------------
# Output: header, tables, JSON, plot
# ---------------------------------------------------------------------------------------------

def _fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    digits = 0 if ms >= 100 else 1 if ms >= 10 else 2 if ms >= 1 else 3 if ms >= 0.01 else 5
    return f"{ms:.{digits}f}"


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{suffix}"


def format_table(headers: list[str], rows: list[list[str]], left: int, markdown: bool = False) -> str:
    """Aligned plain text (columns before index `left` left-aligned text, the rest right-aligned
    numbers), or a Markdown table."""
    if markdown:
        align = ["---" if i < left else "--:" for i in range(len(headers))]
        return "\n".join("| " + " | ".join(cells) + " |" for cells in [headers, align] + rows)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_header(machine: dict, sweep: Sweep, threads: list[int], dtypes: list[str]) -> str:
    v = machine["versions"]
    vers = [f"fa2cpu {v['fa2cpu']}", f"numpy {v['numpy']}",
            f"torch {v['torch']}" if v["torch"] else "torch not installed", f"Python {machine['python']}"]
    cpu = machine["cpu_model"]
    if machine["cpu_vendor"]:
        cpu += f" ({machine['cpu_vendor']} family {machine['cpu_family']} model {machine['cpu_model_id']})"
    cpu += f", {machine['logical_cpus']} logical CPUs"
    if machine["l3_bytes"]:
        cpu += f", L3 {machine['l3_bytes'] >> 20} MiB"
    lines = [
        "fa2cpu-bench: " + ", ".join(vers),
        f"CPU:      {cpu}",
        f"SIMD:     {' '.join(machine['cpu_flags']) or 'unknown'}",
        f"ISA:      usable {' > '.join(machine['isa_usable'])}; chosen {machine['isa_default']}; "
        f"benchmarked {', '.join(sweep.isas)}",
        f"Threads:  {', '.join(map(str, threads))} (fa2cpu num_threads=, torch.set_num_threads, "
        f"NumPy BLAS via threadpoolctl)",
    ]
    peaks = []
    for fam in dict.fromkeys(sweep.isas + [sweep.default_isa]):
        for dt in dtypes:
            vals = [sweep.probes.peak(fam, dt, t) for t in threads]
            if any(p is not None for p in vals):
                peaks.append(f"{fam} {dt} " + "/".join(_fmt(p, ".0f") or "?" for p in vals))
    if peaks:
        lines.append(f"Peak:     GFLOP/s at {'/'.join(map(str, threads))} threads: " + "; ".join(peaks))
    bws = [bw for bw in machine["read_bandwidth"]]
    if bws:
        lines.append("Memory:   read bandwidth " + ", ".join(
            f"{b['gbs']:.1f} GB/s ({b['threads']} thr)" for b in bws))
    busy = machine["busy_cpus_before"]
    if busy is not None and busy >= 0.25:
        lines.append(f"WARNING:  other processes kept {busy:.1f} of {machine['logical_cpus']} CPUs busy "
                     "just before this run: timings will be noisy")
    lines.append(f"Timing:   median of {sweep.repeat} samples after {sweep.warmup} warm-up call(s), "
                 f"[min..max]; inputs uniform, seed {sweep.seed}")
    return "\n".join(lines)


class Notes:
    """Footnotes: each distinct text gets a number, rows refer to it as [n]."""

    def __init__(self):
        self.texts: list[str] = []

    def ref(self, text: str) -> str:
        if not text:
            return ""
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def format(self) -> str:
        return "\n".join(f"[{i + 1}] {t}" for i, t in enumerate(self.texts))


def format_results(records: list[Record], mode: str, baselines: list[str], several_threads: bool,
                   notes: Notes, markdown: bool = False) -> str:
    decode = mode == "decode"
    headers = ["shape", "dtype", "causal"] + (["thr"] if several_threads else []) + ["impl"]
    left = len(headers)
    headers += ["median ms", "[min..max]", "GFLOP/s"]
    headers += ["GB/s", "%bw"] if decode else ["%peak"]
    headers += [f"vs {b}" for b in baselines] + ["max err", "check", ""]
    rows, previous = [], None
    for r in records:
        group = (r.case, r.threads)
        first = group != previous
        previous = group
        c = r.case
        row = [c.label() if first else "", c.dtype if first else "",
               ("yes" if c.causal else "no") if first else ""]
        if several_threads:
            row.append(str(r.threads) if first else "")
        row.append(r.label)
        if r.ok:
            t = r.times_s
            row += [_fmt_ms(r.median_s), f"[{_fmt_ms(min(t))}..{_fmt_ms(max(t))}]", _fmt(r.gflops, ".1f")]
            row += [_fmt(r.gbs, ".1f"), _fmt(r.pct_bw, ".0f", "%")] if decode else [_fmt(r.pct_peak, ".0f", "%")]
        else:
            row += [r.status, "", ""] + (["", ""] if decode else [""])
        row += [_fmt(r.speedup.get(b), ".2f", "x") for b in baselines]
        row += [_fmt(r.max_abs_err, ".1e"), r.check or ""]
        row.append(notes.ref(r.note))
        rows.append(row)
    return format_table(headers, rows, left, markdown)


def format_scaling(records: list[Record], threads: list[int], markdown: bool = False) -> str:
    """Rate per thread count, with the speedup over the smallest count in brackets."""
    series: dict[tuple, dict[int, Record]] = {}
    for r in records:
        if r.ok:
            series.setdefault((r.case, r.label), {})[r.threads] = r
    headers = ["shape", "dtype", "causal", "impl"] + [f"{t} thr" for t in threads]
    rows = []
    for (case, label), by_t in series.items():
        rate = (lambda r: r.gbs) if case.mode == "decode" else (lambda r: r.gflops)
        base = by_t.get(threads[0])
        cells = []
        for t in threads:
            r = by_t.get(t)
            if r is None:
                cells.append("")
            elif base is None:
                cells.append(f"{rate(r):.1f}")
            else:
                cells.append(f"{rate(r):.1f} ({base.median_s / r.median_s:.2f}x)")
        rows.append([case.label(), case.dtype, "yes" if case.causal else "no", label] + cells)
    unit = "GB/s for decode, GFLOP/s otherwise"
    return (f"Thread scaling ({unit}; in brackets: speedup over {threads[0]} thread(s))\n"
            + ("\n" if markdown else "") + format_table(headers, rows, 4, markdown))


def format_summary(records: list[Record], baselines: list[str]) -> str:
    """Geometric-mean speedup of each fa2cpu family over each baseline, and failed checks."""
    lines = []
    for label in dict.fromkeys(r.label for r in records if r.impl == "fa2cpu"):
        for b in baselines:
            s = [r.speedup[b] for r in records if r.label == label and b in r.speedup]
            if s:
                gm = math.exp(sum(map(math.log, s)) / len(s))
                lines.append(f"{label} vs {b}: geometric mean {gm:.2f}x over {len(s)} rows "
                             f"(min {min(s):.2f}x, max {max(s):.2f}x)")
    bad = [r for r in records if r.check == "FAIL"]
    if bad:
        lines.append(f"CORRECTNESS CHECK FAILED in {len(bad)} row(s): see 'check' column")
    return "\n".join(lines)


def print_report(records: list[Record], baselines: list[str], extra_notes: list[str],
                 markdown: bool = False) -> None:
    """Results table per mode, thread scaling (when several counts), footnotes and summary."""
    notes = Notes()
    threads = sorted({r.threads for r in records})
    several = len(threads) > 1
    for mode in MODES:
        rows = [r for r in records if r.case.mode == mode]
        if not rows:
            continue
        what = {"prefill": "prefill (Nq = Nk unless --seqlen-k)",
                "decode": "decode (Nq = 1 against a KV cache of Nk tokens)",
                "varlen": "varlen (packed ragged batch)"}[mode]
        print(f"\n{what}" + ("\n" if markdown else ""))
        print(format_results(rows, mode, baselines, several, notes, markdown))
    if several:
        print()
        print(format_scaling(records, threads, markdown))
    refs = {r.error_ref for r in records if r.error_ref}
    if refs:
        notes.ref("max err: largest |out - ref| against the first baseline measured per shape "
                  "(numpy computes in float32 from the same rounded inputs); 'reference' = untimed "
                  "NumPy float32; check uses |out-ref| <= atol + rtol*|ref| with (atol, rtol) "
                  + ", ".join(f"{k} {v}" for k, v in TOLERANCES.items()))
    for text in extra_notes:
        notes.ref(text)
    if notes.texts:
        print("\n" + notes.format().replace("\n", "\n\n" if markdown else "\n"))
    summary = format_summary(records, baselines)
    if summary:
        print("\n" + summary.replace("\n", "\n\n" if markdown else "\n"))


def _json_safe(obj):
    """NaN and infinities are not JSON: write them as null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_json(path: str, records: list[Record], machine: dict, argv: list[str],
               interrupted: bool) -> None:
    doc = {"schema": "fa2cpu-bench/1",
           "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "argv": argv, "interrupted": interrupted, "machine": machine,
           "records": [r.to_json(machine) for r in records]}
    with open(path, "w") as f:
        json.dump(_json_safe(doc), f, indent=1)
        f.write("\n")


def _line_style(label: str) -> str:
    return "-" if label.startswith("fa2cpu") else "--"


def _log2_axis(ax, ticks: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def write_plot(path: str, records: list[Record], machine: dict) -> None:
    """GFLOP/s (decode: GB/s) against sequence length per implementation at the largest thread
    count, one panel per (mode, dtype, causal); a second row of panels with thread scaling (largest
    sequence length) when several thread counts were measured."""
    from matplotlib.figure import Figure

    ok = [r for r in records if r.ok]
    if not ok:
        raise BenchError("nothing was measured, so there is nothing to plot")
    groups = list(dict.fromkeys((r.case.mode, r.case.dtype, r.case.causal)
                                for r in sorted(ok, key=lambda r: MODES.index(r.case.mode))))
    thread_counts = sorted({r.threads for r in ok})
    ncols = min(3, len(groups))
    block = math.ceil(len(groups) / ncols)
    nrows = block * (2 if len(thread_counts) > 1 else 1)
    fig = Figure(figsize=(5.2 * ncols, 3.8 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for gi, (mode, dtype, causal) in enumerate(groups):
        rows = [r for r in ok if (r.case.mode, r.case.dtype, r.case.causal) == (mode, dtype, causal)]
        unit = "GB/s" if mode == "decode" else "GFLOP/s"
        rate = (lambda r: r.gbs) if mode == "decode" else (lambda r: r.gflops)
        title = f"{mode} {dtype}{' causal' if causal else ''}, {rows[0].case.label().split(' N=')[0]}"
        ax = axes[gi // ncols][gi % ncols]
        ax.set_visible(True)
        for label in dict.fromkeys(r.label for r in rows):
            pts = sorted((r.case.x_value, rate(r)) for r in rows
                         if r.label == label and r.threads == thread_counts[-1])
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label, linestyle=_line_style(label))
        _log2_axis(ax, sorted({r.case.x_value for r in rows}))
        ax.set_xlabel("Nk (KV cache length)" if mode == "decode" else "sequence length")
        ax.set_ylabel(f"{unit}, {thread_counts[-1]} threads")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        if len(thread_counts) > 1:
            ax = axes[block + gi // ncols][gi % ncols]
            ax.set_visible(True)
            longest = max(r.case.x_value for r in rows)
            for label in dict.fromkeys(r.label for r in rows):
                pts = sorted((r.threads, rate(r)) for r in rows
                             if r.label == label and r.case.x_value == longest)
                ax.plot(*zip(*pts), marker="o", label=label, linestyle=_line_style(label))
            _log2_axis(ax, thread_counts)
            ax.set_xlabel("threads")
            ax.set_ylabel(unit)
            ax.set_title(f"{title}, N={longest}: thread scaling", fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"fa2cpu {machine['versions']['fa2cpu']} on {machine['cpu_model']}")
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _list_of(item_type):
    """Values may also be comma-separated: --dtype fp32,bf16 is --dtype fp32 bf16."""
    def parse(text: str) -> list:
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"empty value {text!r}")
        return [item_type(p.strip()) for p in parts]
    return parse


def _choice(kind: str, choices: tuple[str, ...]):
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"unknown {kind} {text!r} (choose from {', '.join(choices)})")
        return text
    return parse


def make_parser() -> argparse.ArgumentParser:
    epilog = __doc__[__doc__.index("Conventions"):] if __doc__ else None
    p = argparse.ArgumentParser(
        prog="fa2cpu-bench",
        description="Benchmark fa2cpu attention against NumPy and PyTorch on this CPU.\n\nWith no "
                    "arguments: prefill at N=512,1024,2048 (B=1 H=8 D=128) and decode (B=8 Hq=32\n"
                    "Hk=8 Nk=8192 D=128), fp32 and bf16, causal and not, vs numpy and torch; under a minute "
                    "on 2 cores.",
        epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape = p.add_argument_group("shape (defaults depend on --mode; given values apply to every mode)")
    shape.add_argument("--mode", nargs="+", metavar="MODE", type=_list_of(_choice("mode", MODES)),
                       help="prefill: Nq = Nk; decode: Nq = 1 against a KV cache "
                            "(flash_attention_with_kvcache); varlen: packed ragged batch "
                            f"(flash_attention_varlen) (default: {' '.join(DEFAULT_MODES)})")
    shape.add_argument("--batch", type=_positive_int, metavar="B",
                       help="batch size B; varlen: number of sequences "
                            "(default: prefill 1, decode 8, varlen 4)")
    shape.add_argument("--heads", type=_positive_int, metavar="HQ",
                       help="query heads Hq (default: prefill 8, decode 32, varlen 8)")
    shape.add_argument("--kv-heads", type=_positive_int, metavar="HK",
                       help="key/value heads Hk, dividing Hq (default: prefill/varlen = Hq, "
                            f"decode = Hq/{DECODE_GQA_GROUP})")
    shape.add_argument("--seqlen", nargs="+", metavar="N", type=_list_of(_positive_int),
                       help="sequence lengths to sweep; decode: KV cache lengths Nk; varlen: mean "
                            "length, sequences spread over [N/2, 3N/2] "
                            "(default: prefill 512 1024 2048, decode 8192, varlen 1024)")
    shape.add_argument("--seqlen-k", type=_positive_int, metavar="NK",
                       help="key length Nk for prefill when it differs from Nq; decode: the cache "
                            "length (default: prefill Nk = Nq; decode from --seqlen)")
    shape.add_argument("--head-dim", type=_positive_int, metavar="D", default=DEFAULT_HEAD_DIM,
                       help="head dimension D (= Dv) (default: %(default)s)")
    what = p.add_argument_group("what to run")
    what.add_argument("--dtype", nargs="+", metavar="DTYPE", type=_list_of(_choice("dtype", tuple(DTYPES))),
                      help=f"input dtypes, from {', '.join(DTYPES)} (default: {' '.join(DEFAULT_DTYPES)})")
    causal = what.add_mutually_exclusive_group()
    causal.add_argument("--causal", dest="causal", action="store_const", const=[True],
                        help="only causal attention (bottom-right aligned) (default: both)")
    causal.add_argument("--no-causal", dest="causal", action="store_const", const=[False],
                        help="only non-causal attention (default: both; decode is always non-causal)")
    what.add_argument("--threads", nargs="+", metavar="T", type=_list_of(_positive_int),
                      help="thread counts; several print a scaling table "
                           f"(default: OMP_NUM_THREADS or the usable CPUs, here {default_threads()})")
    what.add_argument("--isa", nargs="+", metavar="FAMILY", type=_list_of(_choice("isa", ISA_FAMILIES + ("auto", "all"))),
                      help=f"fa2cpu kernel families, from {', '.join(ISA_FAMILIES)}; 'auto' = "
                           "the one fa2cpu picks, 'all' = every usable one (default: auto)")
    what.add_argument("--baselines", nargs="+", metavar="NAME", type=_list_of(_choice("baseline", BASELINES + ("none",))),
                      help="numpy: naive attention (skipped when its scores exceed --numpy-max-mib); "
                           "torch: SDPA, when importable; none (default: numpy torch)")
    what.add_argument("--numpy-max-mib", type=_positive_int, metavar="MIB", default=DEFAULT_NUMPY_MAX_MIB,
                      help="skip the NumPy baseline when its fp32 score matrix exceeds this many MiB "
                           "(default: %(default)s)")
    what.add_argument("--no-check", dest="check", action="store_false",
                      help="skip the correctness check (default: check every result against the "
                           "first baseline, or an untimed NumPy reference)")
    timing = p.add_argument_group("timing and output")
    timing.add_argument("--repeat", type=_positive_int, metavar="R", default=DEFAULT_REPEAT,
                        help="timed samples per measurement; the median is reported (default: %(default)s)")
    timing.add_argument("--warmup", type=_nonnegative_int, metavar="W", default=DEFAULT_WARMUP,
                        help="untimed calls before timing (default: %(default)s)")
    timing.add_argument("--seed", type=_nonnegative_int, metavar="S", default=0,
                        help="seed of the random inputs (default: %(default)s)")
    timing.add_argument("--json", metavar="FILE", help="write every measurement as JSON (schema below) "
                                                       "(default: none)")
    timing.add_argument("--plot", metavar="FILE.png",
                        help="write a plot; needs matplotlib: pip install 'fa2cpu[bench]' (default: none)")
    timing.add_argument("--quiet", action="store_true",
                        help="no machine header and no progress line; tables and notes only "
                             "(default: off)")
    p.add_argument("--version", action="version", version=f"fa2cpu {fa2cpu.__version__}")
    return p


def _flatten(values, default) -> list:
    if not values:
        return list(default)
    return list(dict.fromkeys(v for group in values for v in group))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate; errors exit with status 2 and a one-line message (argparse style)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    args.mode = _flatten(args.mode, DEFAULT_MODES)
    args.dtype = _flatten(args.dtype, DEFAULT_DTYPES)
    args.seqlen = _flatten(args.seqlen, ())
    args.threads = sorted(_flatten(args.threads, (default_threads(),)))
    args.causal = args.causal or [False, True]
    baselines = _flatten(args.baselines, BASELINES)
    if "none" in baselines and len(baselines) > 1:
        parser.error("--baselines: 'none' cannot be combined with other baselines")
    args.baselines = [b for b in baselines if b != "none"]
    if args.heads and args.kv_heads and args.heads % args.kv_heads:
        parser.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if args.kv_heads and not args.heads and any(MODE_DEFAULTS[m]["heads"] % args.kv_heads
                                                for m in args.mode):
        parser.error(f"--kv-heads {args.kv_heads} must divide the default --heads; give --heads too")
    if "varlen" in args.mode and args.seqlen_k:
        parser.error("--seqlen-k does not apply to --mode varlen (k lengths equal q lengths)")
    usable = list(fa2cpu.available_isas())
    isas = _flatten(args.isa, ("auto",))
    chosen = []
    for isa in isas:
        if isa == "all":
            chosen += usable
        elif isa == "auto":
            chosen.append(fa2cpu.get_isa())
        elif isa not in usable:
            parser.error(f"--isa {isa}: not usable on this machine (usable: {', '.join(usable)})")
        else:
            chosen.append(isa)
    args.isa = list(dict.fromkeys(chosen))
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.access(folder, os.W_OK):
            parser.error(f"{option} {path}: cannot write into {folder} (missing or read-only)")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib, which is not installed: pip install 'fa2cpu[bench]'")
    if "varlen" in args.mode and not hasattr(fa2cpu, "flash_attention_varlen"):
        parser.error("--mode varlen needs fa2cpu.flash_attention_varlen, which this fa2cpu build lacks")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch = import_torch() if "torch" in args.baselines else None
    machine = machine_info(torch)
    probes = Probes(machine)
    if "torch" in args.baselines and torch is None:
        args.baselines.remove("torch")
        probes.note("torch baseline skipped: torch is not installed (pip install torch)")
    if max(args.threads) > machine["logical_cpus"]:
        probes.note(f"more threads ({max(args.threads)}) than usable CPUs "
                    f"({machine['logical_cpus']}): timings oversubscribe the cores")
    cases = build_cases(args)
    default_isa = fa2cpu.get_isa()
    steps = len(cases) * len(args.threads) * (len(args.baselines) + len(args.isa))
    sweep = Sweep(args.threads, args.isa, args.baselines, args.warmup, args.repeat, args.check,
                  args.seed, args.numpy_max_mib << 20, torch, probes, default_isa,
                  Progress(steps, enabled=not args.quiet))
    if not args.quiet:
        if "decode" in args.mode:
            for t in args.threads:
                probes.bandwidth(t)
        print(format_header(machine, sweep, args.threads, args.dtype), flush=True)
    records: list[Record] = []
    interrupted = False
    try:
        for case in cases:
            run_case(sweep, case, records)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        sweep.progress.close()
        fa2cpu.set_isa(default_isa)
    add_speedups(records)
    print_report(records, args.baselines, probes.notes)
    argv_used = sys.argv[1:] if argv is None else list(argv)
    written = True
    if args.json:
        try:
            write_json(args.json, records, machine, argv_used, interrupted)
            print(f"\nwrote {len(records)} records to {args.json}")
        except OSError as e:
            print(f"fa2cpu-bench: cannot write {args.json}: {e}", file=sys.stderr)
            written = False
    if args.plot and records:
        try:
            write_plot(args.plot, records, machine)
            print(f"wrote plot to {args.plot}")
        except (BenchError, OSError) as e:
            print(f"fa2cpu-bench: no plot: {e}", file=sys.stderr)
            written = False
    if interrupted:
        print("fa2cpu-bench: interrupted; results above are partial", file=sys.stderr)
        return 130
    failed = any(r.check == "FAIL" or r.status == "error" for r in records)
    return 1 if failed or not written else 0


if __name__ == "__main__":
    sys.exit(main())
