#!/usr/bin/env python3
"""Markdown tables from fa2cpu-bench JSON files (for bench/RESULTS.md and the README).

    python bench/tables.py bench/results/zen4/*.json

For each file: the machine, the command, then one table per mode with fa2cpu and baseline rows
(median time, GFLOP/s or GB/s, % of the measured peak or bandwidth, speedup over each baseline,
max error and check), and a thread-scaling table when the file holds several thread counts.
Needs only the standard library.
"""
import json
import sys
from collections import defaultdict

BASELINES = ("torch", "numpy")


def fmt(value, spec, suffix=""):
    return "" if value is None else f"{value:{spec}}{suffix}"


def fmt_ms(seconds):
    ms = seconds * 1e3
    digits = 0 if ms >= 100 else 1 if ms >= 10 else 2 if ms >= 1 else 3 if ms >= 0.01 else 5
    return f"{ms:.{digits}f}"


def shape(r):
    heads = f"{r['heads_q']}" if r["heads_q"] == r["heads_kv"] else f"{r['heads_q']}/{r['heads_kv']}"
    if r["seqlens"]:
        n = f"{min(r['seqlens'])}..{max(r['seqlens'])}"
    elif r["seqlen_q"] == r["seqlen_k"]:
        n = f"{r['seqlen_q']}"
    else:
        n = f"{r['seqlen_q']}/{r['seqlen_k']}"
    return f"B={r['batch']} H={heads} N={n} D={r['head_dim']}"


def label(r):
    return f"fa2cpu/{r['isa']}" if r["impl"] == "fa2cpu" else r["impl"]


def markdown(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def results_table(records, mode, baselines):
    decode = mode == "decode"
    headers = ["shape", "dtype", "causal", "threads", "impl", "median ms", "GFLOP/s"]
    headers += ["GB/s", "% read bw"] if decode else ["% peak"]
    headers += [f"vs {b}" for b in baselines] + ["max err", "check"]
    rows = []
    for r in records:
        row = [shape(r), r["dtype"], "yes" if r["causal"] else "no", str(r["threads"]), label(r)]
        if r["status"] == "ok":
            row += [fmt_ms(r["median_s"]), fmt(r["gflops"], ".1f")]
            row += [fmt(r["gbs"], ".1f"), fmt(r["pct_bw"], ".0f", "%")] if decode else [fmt(r["pct_peak"], ".0f", "%")]
        else:
            row += [f"{r['status']}: {r['note']}", ""] + (["", ""] if decode else [""])
        row += [fmt(r["speedup"].get(b), ".2f", "x") for b in baselines]
        row += [fmt(r["max_abs_err"], ".1e"), r["check"] or ""]
        rows.append(row)
    return markdown(headers, rows)


def scaling_table(records, threads):
    series = defaultdict(dict)
    for r in records:
        if r["status"] == "ok":
            key = (shape(r), r["mode"], r["dtype"], r["causal"], label(r))
            series[key][r["threads"]] = r
    headers = ["shape", "dtype", "causal", "impl"] + [f"{t} thr" for t in threads]
    rows = []
    for (shp, mode, dtype, causal, impl), by_t in series.items():
        unit = "gbs" if mode == "decode" else "gflops"
        base = by_t.get(threads[0])
        cells = []
        for t in threads:
            r = by_t.get(t)
            if r is None:
                cells.append("")
            elif base is None:
                cells.append(f"{r[unit]:.1f}")
            else:
                cells.append(f"{r[unit]:.1f} ({base['median_s'] / r['median_s']:.2f}x)")
        rows.append([shp, dtype, "yes" if causal else "no", impl] + cells)
    return markdown(headers, rows)


def describe(doc):
    m = doc["machine"]
    v = m["versions"]
    peaks = ", ".join(f"{p['family']} {p['dtype']} {p['threads']} thr {p['gflops']:.0f} GFLOP/s"
                      for p in m["peaks"])
    bw = ", ".join(f"{b['gbs']:.1f} GB/s ({b['threads']} thr)" for b in m["read_bandwidth"])
    lines = [f"Machine: {m['cpu_model']} ({m['logical_cpus']} CPUs), usable ISA families "
             f"{', '.join(m['isa_usable'])}; fa2cpu {v['fa2cpu']}, torch {v['torch']}, numpy {v['numpy']}.",
             f"Command: `fa2cpu-bench {' '.join(doc['argv'])}` ({doc['created']})."]
    if peaks:
        lines.append(f"Measured peaks: {peaks}.")
    if bw:
        lines.append(f"Measured read bandwidth: {bw}.")
    if m.get("busy_cpus_before") and m["busy_cpus_before"] >= 0.25:
        lines.append(f"**Warning:** other processes kept {m['busy_cpus_before']:.1f} CPUs busy at the start.")
    return "\n".join(lines)


def main(paths):
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        records = doc["records"]
        baselines = [b for b in BASELINES if any(r["impl"] == b for r in records)]
        print(f"### {path}\n\n{describe(doc)}\n")
        for mode in ("prefill", "decode", "varlen"):
            rows = [r for r in records if r["mode"] == mode]
            if rows:
                print(f"{mode}:\n\n{results_table(rows, mode, baselines)}\n")
        threads = sorted({r["threads"] for r in records})
        if len(threads) > 1:
            print(f"Thread scaling (GFLOP/s, decode GB/s; speedup over {threads[0]} thread(s)):\n\n"
                  f"{scaling_table(records, threads)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
