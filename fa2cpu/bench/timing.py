"""The one timing routine of fa2cpu's benchmarks (fa2cpu-bench and the scripts in bench/):
warm-up, then `repeat` timed samples, reported by their median."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

MIN_SAMPLE_S = 2e-3        # calls shorter than this are repeated inside one timed sample
MAX_CALLS_PER_SAMPLE = 1000
MIN_WARMUP_S = 0.05        # warm-up lasts at least this long (lazy page faults, thread wake-up,
                           # frequency ramp) even when `warmup` calls are done sooner


@dataclass
class Timing:
    times_s: list[float]       # seconds per call, one entry per sample
    calls_per_sample: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


def measure(call: Callable[[], object], warmup: int = 1, repeat: int = 5) -> tuple[Timing, object]:
    """Time `call`: at least `warmup` untimed calls lasting together >= MIN_WARMUP_S (none when
    warmup is 0), then `repeat` samples. A first timed call calibrates how many calls go in one
    sample (so each lasts >= MIN_SAMPLE_S); when one call is long enough it is the first sample.
    Returns the timing and the last call's result."""
    result = None
    t_start, done = time.perf_counter(), 0
    while done < warmup or (warmup and time.perf_counter() - t_start < MIN_WARMUP_S):
        result = call()
        done += 1
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


def median_time(call: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Median seconds per call of `call` (see measure)."""
    return measure(call, warmup, repeat)[0].median_s
