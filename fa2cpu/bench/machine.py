"""What the benchmark runs on: CPU model, SIMD flags, caches and memory from /proc and /sys, the
usable CPUs, and the extension's probes (peak GFLOP/s of each multiply-add instruction, read
bandwidth), measured once per run."""
from __future__ import annotations

import contextlib
import os
import platform
import time

import ml_dtypes
import numpy as np

import fa2cpu
from fa2cpu import _core

SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
              "amx_tile", "amx_bf16", "amx_int8")
PROBE_RUNS = 3   # peak and bandwidth probes report the best of this many runs

# The multiply-add instruction whose peak bounds a (family, dtype): families without bf16
# arithmetic convert while packing and run the FMA of their vector width (csrc: each family's
# peak()), so one probe serves several rows and is measured once.
_BF16_INSTRUCTION = {"amx": "AMX tdpbf16ps", "avx512bf16": "vdpbf16ps"}
_FMA = {"amx": "AVX-512 FMA", "avx512bf16": "AVX-512 FMA", "avx512": "AVX-512 FMA",
        "avx2": "AVX2 FMA", "generic": "scalar FMA"}


def peak_instruction(family: str, dtype: str) -> str:
    if dtype == "bf16" and family in _BF16_INSTRUCTION:
        return _BF16_INSTRUCTION[family]
    return _FMA[family]


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
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    return None


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), the most threads worth timing."""
    with contextlib.suppress(AttributeError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_threads() -> int:
    """OMP_NUM_THREADS when set (what fa2cpu itself would use), else the usable CPUs."""
    with contextlib.suppress(ValueError):
        n = int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0])
        if n >= 1:
            return n
    return usable_cpus()


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
    return usable_cpus() * (1 - (idle1 - idle0) / (total1 - total0))


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None off Linux."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return None


def _installed_version(package: str) -> str | None:
    """An installed distribution's version without importing it (torch's import takes seconds when
    it is not a baseline); None if absent."""
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info(torch) -> dict:
    """The machine header written once per JSON file (and printed above the tables)."""
    cpu = _cpuinfo()
    flags = cpu.get("flags", "").split()
    return {
        "cpu_model": cpu.get("model name") or platform.processor() or "unknown",
        "cpu_vendor": cpu.get("vendor_id"),
        "cpu_family": cpu.get("cpu family"),
        "cpu_model_id": cpu.get("model"),
        "logical_cpus": usable_cpus(),
        "l3_bytes": _l3_bytes(),
        "cpu_flags": [f for f in SIMD_FLAGS if f in flags],
        "isa_usable": list(fa2cpu.available_isas()),
        "isa_default": fa2cpu.get_isa(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {"fa2cpu": fa2cpu.__version__, "numpy": np.__version__,
                     "ml_dtypes": ml_dtypes.__version__,
                     "torch": torch.__version__ if torch is not None else _installed_version("torch")},
        "busy_cpus_before": busy_cpus(),
        "peaks": [],
        "read_bandwidth": [],
    }


class Probes:
    """Peak GFLOP/s per (instruction, threads) and read bandwidth per thread count, measured by
    the extension's probes once per run. Each is the best of PROBE_RUNS runs: a peak is what the
    machine can do, and another process stealing a core must not lower it (that would inflate
    every %peak)."""

    def __init__(self, machine: dict):
        self.machine = machine
        self.notes: list[str] = []
        self._peaks: dict[tuple[str, int], float | None] = {}
        self._bw: dict[int, float | None] = {}

    def peak(self, family: str, dtype: str, threads: int) -> float | None:
        instruction = peak_instruction(family, dtype)
        key = (instruction, threads)
        if key not in self._peaks:
            try:
                gflops = max(float(_core.peak_gflops(family, dtype, threads)) for _ in range(PROBE_RUNS))
            except (ValueError, RuntimeError) as e:
                self.note(f"peak probe failed for {family}/{dtype}: {e}")
                gflops = 0.0
            self._peaks[key] = gflops if gflops > 0 else None   # 0.0: the family cannot run here
            if gflops > 0:
                self.machine["peaks"].append({"instruction": instruction, "family": family,
                                              "dtype": dtype, "threads": threads, "gflops": gflops})
        return self._peaks[key]

    def bandwidth(self, threads: int) -> float | None:
        if threads not in self._bw:
            # Far larger than the last-level cache, so the probe measures DRAM.
            nbytes = max(256 << 20, 8 * (self.machine["l3_bytes"] or 64 << 20))
            try:
                gbs = max(float(_core.read_bandwidth_gbs(threads, nbytes)) for _ in range(PROBE_RUNS))
            except (ValueError, RuntimeError, MemoryError) as e:
                self.note(f"bandwidth probe failed: {e}")
                gbs = None
            if gbs is not None:
                self.machine["read_bandwidth"].append({"threads": threads, "nbytes": nbytes, "gbs": gbs})
            self._bw[threads] = gbs
        return self._bw[threads]

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
