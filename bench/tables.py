#!/usr/bin/env python3
"""Markdown tables from fa2cpu-bench JSON files (for bench/RESULTS.md and the README).

    python bench/tables.py bench/results/zen5_2core/*.json

For each file: the machine and the command, then the same tables fa2cpu-bench printed (one per
mode, thread scaling when several thread counts were measured, footnotes, geometric-mean summary)
rendered by fa2cpu.bench itself, as Markdown.
"""
import json
import sys

from fa2cpu.bench import BASELINES, Record, print_report


def describe(doc: dict) -> str:
    m = doc["machine"]
    v = m["versions"]
    lines = [f"Machine: {m['cpu_model']} ({m['logical_cpus']} CPUs), usable ISA families "
             f"{', '.join(m['isa_usable'])}; fa2cpu {v['fa2cpu']}, torch {v['torch']}, numpy {v['numpy']}.",
             f"Command: `fa2cpu-bench {' '.join(doc['argv'])}` ({doc['created']})."]
    if m["peaks"]:
        lines.append("Measured peaks (GFLOP/s): " + ", ".join(
            f"{p['family']} {p['dtype']} {p['threads']} thr {p['gflops']:.0f}" for p in m["peaks"]) + ".")
    if m["read_bandwidth"]:
        lines.append("Measured read bandwidth: " + ", ".join(
            f"{b['gbs']:.1f} GB/s ({b['threads']} thr)" for b in m["read_bandwidth"]) + ".")
    busy = m.get("busy_cpus_before")
    if busy is not None and busy >= 0.25:
        lines.append(f"**Warning:** other processes kept {busy:.1f} CPUs busy when the run started.")
    if doc["interrupted"]:
        lines.append("**Interrupted run: partial results.**")
    return "\n\n".join(lines)


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        records = [Record.from_json(r) for r in doc["records"]]
        baselines = [b for b in BASELINES if any(r.impl == b for r in records)]
        print(f"### {path}\n\n{describe(doc)}")
        print_report(records, baselines, [], markdown=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
