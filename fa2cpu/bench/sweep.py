"""The sweep: run every case with every thread count, baseline and kernel family, check each
result, and keep within the time budget. Failures become rows, never exceptions."""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

import fa2cpu

from .cases import TOLERANCES, Case, make_inputs
from .machine import Probes, available_memory
from .peers import BASELINES, fa2cpu_runner, numpy_runner, reference_output, torch_runner
from .timing import measure

# OpenBLAS worker threads busy-wait for ~0.1 s after a multi-threaded call; measured here, they
# halve the speed of whatever runs next on 2 cores. Pause that long after the NumPy baseline.
SETTLE_AFTER_BLAS_S = 0.2
PROGRESS_AFTER_S = 2.0    # the progress line appears only once a sweep has run this long


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
    def tokens_per_s(self) -> float | None:
        """Decode: tokens generated per second (one per sequence per call)."""
        return self.case.batch / self.median_s if self.ok and self.case.mode == "decode" else None

    @property
    def pct_peak(self) -> float | None:
        return 100 * self.gflops / self.peak_gflops if self.ok and self.peak_gflops else None

    @property
    def pct_bw(self) -> float | None:
        return 100 * self.gbs / self.read_bw_gbs if self.ok and self.read_bw_gbs else None

    @classmethod
    def from_json(cls, rec: dict) -> "Record":
        """Inverse of to_json (derived values such as gflops are recomputed from the times)."""
        case = Case(**{f.name: rec.get(f.name, f.default) for f in dataclasses.fields(Case)})
        case = dataclasses.replace(case, seqlens=tuple(case.seqlens) if case.seqlens else None)
        own = {f.name: rec[f.name] for f in dataclasses.fields(cls) if f.name != "case"}
        return cls(case, **own)

    def to_json(self) -> dict:
        t = self.times_s
        q1, q3 = np.percentile(t, [25, 75]).tolist() if t else (None, None)
        atol, rtol = TOLERANCES[self.case.dtype]
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "case"}
        derived = {k: getattr(self, k) for k in ("median_s", "gflops", "pct_peak", "gbs", "pct_bw", "tokens_per_s")}
        return {**own, **dataclasses.asdict(self.case), **derived,
                "seqlens": list(self.case.seqlens) if self.case.seqlens else None,
                "min_s": min(t, default=None), "max_s": max(t, default=None), "q1_s": q1, "q3_s": q3,
                "flops": self.case.flops, "bytes": self.case.bytes, "atol": atol, "rtol": rtol}


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
    # fa2cpu's outputs waiting for the untimed NumPy reference (no baseline gave one): it is
    # computed once after every timing of the case, so that its memory traffic and OpenBLAS's
    # busy-waiting threads never run beside a timed call (before, an int8 decode row computed
    # right after the 1 GB dequantized reference spread 13-27 ms where it reads 13-14 without it).
    pending: list[tuple[Record, np.ndarray]] = []
    for threads in sweep.threads:
        makers = {"numpy": lambda: numpy_runner(case, x, threads, sweep.numpy_max_bytes),
                  "torch": lambda: torch_runner(case, x, threads, sweep.torch)}
        if case.kv_dtype:   # the baselines have no quantized cache: compare with the float cache's row
            makers = {name: (lambda name=name: f"{name} skipped: no {case.kv_dtype} KV cache; compare with the "
                                               f"{case.dtype} cache's row") for name in makers}
        for name in sweep.baselines:
            rec, out = run_one(sweep, case, name, threads, makers[name])
            if sweep.check and ref is None and out is not None:
                ref = (name, out)
            if sweep.check and out is not None:
                check_against(rec, out, ref)
            records.append(rec)
        for isa in sweep.isas:
            fa2cpu.set_isa(isa)
            rec, out = run_one(sweep, case, "fa2cpu", threads,
                               lambda: fa2cpu_runner(case, x, threads), isa=isa)
            if sweep.check and out is not None:
                if ref is None:
                    pending.append((rec, out))
                else:
                    check_against(rec, out, ref)
            records.append(rec)
    if pending:
        ref = ("reference", reference_output(case, x))
        time.sleep(SETTLE_AFTER_BLAS_S)   # before the next case's timings
        for rec, out in pending:
            check_against(rec, out, ref)


def budget_order(cases: list[Case], ladders: dict[str, tuple[int, ...]]) -> list[Case]:
    """Cases in the order a time budget runs them: the first rung of every mode's length ladder
    (so each mode gets measured), then the next rung of every mode, and so on."""
    def rung(c: Case) -> int:
        return ladders[c.mode].index(c.x_value) if c.x_value in ladders[c.mode] else 0
    return sorted(cases, key=rung)   # stable: table order within a rung


def predict_s(case: Case, spent: dict[Case, float]) -> float | None:
    """Seconds `case` will take, scaled by work from the slowest measured case of the same mode
    (same dtype when there is one); None when none of its mode has run yet."""
    same = [c for c in spent if c.mode == case.mode and c.dtype == case.dtype] or \
           [c for c in spent if c.mode == case.mode]
    return max((spent[c] * case.work / c.work for c in same), default=None)


def run_sweep(sweep: Sweep, cases: list[Case], budget_s: float, start: float, records: list[Record],
              trimmable=lambda case: True) -> list[Case]:
    """Run `cases` in order; with a budget, skip a trimmable case whose predicted time would end
    the run more than `budget_s` seconds after `start`. Returns the skipped cases."""
    spent: dict[Case, float] = {}
    skipped = []
    for case in cases:
        predicted = predict_s(case, spent) if budget_s and trimmable(case) else None
        if predicted is not None and time.perf_counter() - start + predicted > budget_s:
            skipped.append(case)
            continue
        t0 = time.perf_counter()
        run_case(sweep, case, records)
        spent[case] = time.perf_counter() - t0
    return skipped


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
