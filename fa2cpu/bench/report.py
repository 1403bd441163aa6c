"""What fa2cpu-bench prints and writes: the machine header, one table per mode, thread scaling,
footnotes, the summary, the JSON document (schema in the package docstring) and --plot: GFLOP/s
(decode: GB/s) against sequence length, and thread scaling, with matplotlib (optional: its file
name is checked before the sweep)."""
from __future__ import annotations

import datetime
import json
import math
import os

from .cases import MODES, TOLERANCES
from .machine import peak_instruction
from .sweep import Record, Sweep

JSON_SCHEMA = "fa2cpu-bench/2"   # /1 repeated the machine in every record


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


def format_peaks(sweep: Sweep, threads: list[int], dtypes: list[str]) -> str | None:
    """One entry per multiply-add instruction (one probe each), naming the rows it bounds."""
    serves: dict[str, list[str]] = {}
    for fam in dict.fromkeys(sweep.isas + [sweep.default_isa]):
        for dt in dtypes:
            serves.setdefault(peak_instruction(fam, dt), []).append(f"{fam} {dt}")
    parts = []
    for instruction, rows in serves.items():
        fam, dt = rows[0].split()
        vals = [sweep.probes.peak(fam, dt, t) for t in threads]
        if any(p is not None for p in vals):
            parts.append(f"{instruction} {'/'.join(_fmt(p, '.0f') or '?' for p in vals)} "
                         f"({', '.join(rows)})")
    if not parts:
        return None
    return f"Peak:     GFLOP/s at {'/'.join(map(str, threads))} threads: " + "; ".join(parts)


def format_header(machine: dict, sweep: Sweep, dtypes: list[str], plan: list[str]) -> str:
    v = machine["versions"]
    vers = [f"fa2cpu {v['fa2cpu']}", f"numpy {v['numpy']}",
            f"torch {v['torch']}" if v["torch"] else "torch not installed", f"Python {machine['python']}"]
    cpu = machine["cpu_model"]
    if machine["cpu_vendor"]:
        cpu += f" ({machine['cpu_vendor']} family {machine['cpu_family']} model {machine['cpu_model_id']})"
    cpu += f", {machine['logical_cpus']} usable CPUs"
    if machine["l3_bytes"]:
        cpu += f", L3 {machine['l3_bytes'] >> 20} MiB"
    counts = ", ".join(map(str, sweep.threads))
    lines = [
        "fa2cpu-bench: " + ", ".join(vers),
        f"CPU:      {cpu}",
        f"SIMD:     {' '.join(machine['cpu_flags']) or 'unknown'}",
        f"ISA:      usable {' > '.join(machine['isa_usable'])}; chosen {machine['isa_default']}; "
        f"benchmarked {', '.join(sweep.isas)}",
        f"Threads:  {counts}: a row with T threads runs fa2cpu with num_threads=T, torch with "
        f"torch.set_num_threads(T), NumPy's BLAS under a threadpoolctl limit of T",
    ]
    peaks = format_peaks(sweep, sweep.threads, dtypes)
    if peaks:
        lines.append(peaks)
    bws = machine["read_bandwidth"]
    if bws:
        lines.append("Memory:   read bandwidth " + ", ".join(
            f"{b['gbs']:.1f} GB/s ({b['threads']} thr)" for b in bws))
    busy = machine["busy_cpus_before"]
    if busy is not None and busy >= 0.25:
        lines.append(f"WARNING:  other processes kept {busy:.1f} of {machine['logical_cpus']} CPUs busy "
                     "just before this run: timings will be noisy")
    lines += [f"{'Sweep:' if i == 0 else '':10s}{line}" for i, line in enumerate(plan)]
    warm = (f"after {sweep.warmup} warm-up call(s) (at least 50 ms of them)" if sweep.warmup
            else "without warm-up calls")
    lines.append(f"Timing:   median of {sweep.repeat} samples {warm}, [min..max]; inputs uniform, seed {sweep.seed}")
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
    headers += ["GB/s", "%bw", "tok/s"] if decode else ["%peak"]
    headers += [f"vs {b}" for b in baselines] + ["max err", "check", "note"]
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
            row += ([_fmt(r.gbs, ".1f"), _fmt(r.pct_bw, ".0f", "%"), _fmt(r.tokens_per_s, ".0f")] if decode
                    else [_fmt(r.pct_peak, ".0f", "%")])
        else:
            row += [r.status, "", ""] + (["", "", ""] if decode else [""])
        row += [_fmt(r.speedup.get(b), ".2f", "x") for b in baselines]
        row += [_fmt(r.max_abs_err, ".1e"), r.check or "", notes.ref(r.note)]
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
    if any(r.error_ref for r in records):
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


def dump_json(doc: dict) -> str:
    """The document with its machine once at the top and one record per line (small, diffable)."""
    head = {k: v for k, v in doc.items() if k != "records"}
    text = json.dumps(_json_safe(head), indent=1)[:-2]   # drop the closing "\n}"
    recs = ",\n  ".join(json.dumps(_json_safe(r)) for r in doc["records"])
    return text + f',\n "records": [\n  {recs}\n ]\n}}\n'


def write_json(path: str, records: list[Record], machine: dict, argv: list[str],
               interrupted: bool) -> None:
    doc = {"schema": JSON_SCHEMA,
           "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "argv": argv, "interrupted": interrupted, "machine": machine,
           "records": [r.to_json() for r in records]}
    with open(path, "w") as f:
        f.write(dump_json(doc))


# ---- --plot --------------------------------------------------------------------------------------

INSTALL_HINT = "pip install 'fa2cpu[bench]'"


class PlotError(Exception):
    """A plot that cannot be written (reported in one line)."""


def check_plot_path(path: str) -> None:
    """Fail before the sweep, not after it: matplotlib must import and know the file's format."""
    try:
        import matplotlib  # noqa: F401 -- first, so that a missing matplotlib is what fails
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise PlotError(f"needs matplotlib, which is not installed: {INSTALL_HINT}") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in formats:
        raise PlotError(f"unknown image format {ext or '(no extension)'!r}; matplotlib writes "
                        + ", ".join(sorted(formats)))


def _line_style(label: str) -> str:
    return "-" if label.startswith("fa2cpu") else "--"


def _log2_axis(ax, ticks: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def _series(r: Record) -> str:
    """A plotted line: the implementation, and a quantized cache's dtype (decode measures it beside
    the --dtype cache, at the same x values)."""
    return f"{r.label}, {r.case.kv_dtype} cache" if r.case.kv_dtype else r.label


def write_plot(path: str, records: list[Record], machine: dict) -> None:
    """GFLOP/s (decode: GB/s) against sequence length per implementation at the largest thread
    count, one panel per (mode, dtype, causal); a second row of panels with thread scaling (largest
    sequence length) when several thread counts were measured."""
    from matplotlib.figure import Figure

    ok = [r for r in records if r.ok]
    if not ok:
        raise PlotError("nothing was measured, so there is nothing to plot")
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
        for label in dict.fromkeys(_series(r) for r in rows):
            pts = sorted((r.case.x_value, rate(r)) for r in rows
                         if _series(r) == label and r.threads == thread_counts[-1])
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
            for label in dict.fromkeys(_series(r) for r in rows):
                pts = sorted((r.threads, rate(r)) for r in rows
                             if _series(r) == label and r.case.x_value == longest)
                ax.plot(*zip(*pts), marker="o", label=label, linestyle=_line_style(label))
            _log2_axis(ax, thread_counts)
            ax.set_xlabel("threads")
            ax.set_ylabel(unit)
            ax.set_title(f"{title}, N={longest}: thread scaling", fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"fa2cpu {machine['versions']['fa2cpu']} on {machine['cpu_model']}")
    fig.savefig(path, dpi=110)
