"""The fa2cpu-bench command line: options, their checks (exit status 2 with one line, never a
traceback), the plan of the sweep, and `main`."""
from __future__ import annotations

import argparse
import os
import sys
import time

import fa2cpu
from fa2cpu._checks import MAX_HEAD_DIM

from . import peers
from .cases import (DECODE_GQA_GROUP, DEFAULT_DTYPES, DEFAULT_HEAD_DIM, DEFAULT_MODES, DTYPE_LONG_NAMES,
                    KV_DTYPES, MODE_DEFAULTS, MODES, build_cases, dtype_name, mode_lengths, mode_shape)

KV_CHOICES = ("same",) + tuple(KV_DTYPES)
from .machine import Probes, default_threads, machine_info, usable_cpus
from .report import PlotError, check_plot_path, format_header, print_report, write_json, write_plot
from .sweep import Progress, Record, Sweep, add_speedups, budget_order, run_sweep

DEFAULT_WARMUP = 1
DEFAULT_REPEAT = 5
DEFAULT_NUMPY_MAX_MIB = 1024   # the naive baseline materialises B*Hq*Nq*Nk fp32 scores
# The default run (default shapes, both baselines) should end within a minute on 2 cores: the
# budget leaves room for the probes, torch's import and the last case's overrun of its estimate.
DEFAULT_BUDGET_S = 40.0


def at_least(kind, minimum, what: str):
    """argparse type: a `kind` (int, float) >= minimum; `what` names it in the error."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value >= minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return parse


positive_int = at_least(int, 1, "a positive integer")
_nonnegative_int = at_least(int, 0, "an integer >= 0")


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


def dtype_arg(text: str) -> str:
    """argparse type: a dtype in either spelling ('bf16' or 'bfloat16'), returned short."""
    try:
        return dtype_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def long_dtype_arg(text: str) -> str:
    """argparse type: a dtype in either spelling, returned long ('bfloat16': torch's name)."""
    return DTYPE_LONG_NAMES[dtype_arg(text)]


def make_parser() -> argparse.ArgumentParser:
    doc = sys.modules[__package__].__doc__ or ""
    defaults = {m: MODE_DEFAULTS[m] for m in MODES}
    dtypes = ", ".join(f"{s} ({long})" for s, long in DTYPE_LONG_NAMES.items())
    p = argparse.ArgumentParser(
        prog="fa2cpu-bench",
        description="Benchmark fa2cpu attention against NumPy and PyTorch on this CPU.\n\nWith no "
                    "arguments: prefill B=1 H=8 D=128 at N=512, then 1024 and 2048 while the time\n"
                    "budget lasts, and decode B=8 Hq=32 Hk=8 D=128 against Nk=2048, then 8192; fp32 "
                    "and bf16,\ncausal and not, vs numpy and torch; about a minute on 2 cores.",
        epilog=doc[doc.index("Conventions"):] if "Conventions" in doc else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    shape = p.add_argument_group("shape (defaults depend on --mode)")
    shape.add_argument("--mode", nargs="+", metavar="MODE", type=_list_of(_choice("mode", MODES)),
                       help="prefill: Nq = Nk; decode: Nq = 1 against a KV cache "
                            "(flash_attention_with_kvcache); varlen: packed ragged batch "
                            f"(flash_attention_varlen) (default: {' '.join(DEFAULT_MODES)})")
    shape.add_argument("--batch", type=positive_int, metavar="B",
                       help="batch size B; varlen: number of sequences (default: "
                            + ", ".join(f"{m} {d['batch']}" for m, d in defaults.items()) + ")")
    shape.add_argument("--heads", type=positive_int, metavar="HQ",
                       help="query heads Hq (default: "
                            + ", ".join(f"{m} {d['heads']}" for m, d in defaults.items()) + ")")
    shape.add_argument("--kv-heads", type=positive_int, metavar="HK",
                       help="key/value heads Hk, dividing Hq (default: prefill/varlen = Hq, "
                            f"decode = Hq/{DECODE_GQA_GROUP})")
    shape.add_argument("--seqlen", nargs="+", metavar="N", type=_list_of(positive_int),
                       help="sequence lengths to sweep, for the modes named by --mode (without "
                            "--mode: prefill only); decode: KV cache lengths Nk; varlen: mean length, "
                            "sequences spread over [N/2, 3N/2] (default: "
                            + ", ".join(f"{m} {' '.join(map(str, d['seqlen']))}" for m, d in defaults.items())
                            + ", longer ones while --budget-s lasts)")
    shape.add_argument("--seqlen-k", type=positive_int, metavar="NK",
                       help="key length Nk for prefill when it differs from Nq; decode: the cache "
                            "length (default: prefill Nk = Nq; decode from --seqlen)")
    shape.add_argument("--head-dim", type=positive_int, metavar="D", default=DEFAULT_HEAD_DIM,
                       help="head dimension D (= Dv) (default: %(default)s)")
    what = p.add_argument_group("what to run")
    what.add_argument("--dtype", nargs="+", metavar="DTYPE", type=_list_of(dtype_arg),
                      help=f"input dtypes, from {dtypes} (default: {' '.join(DEFAULT_DTYPES)})")
    what.add_argument("--kv-dtype", nargs="+", metavar="KV", type=_list_of(_choice("kv dtype", KV_CHOICES)),
                      help="decode KV cache: 'same' (the --dtype cache), 'int8', 'fp8' (float8_e4m3fn codes with "
                           "float32 scales per token and head); a quantized cache is measured beside the "
                           "--dtype cache, whose row is always kept for comparison (default: same)")
    causal = what.add_mutually_exclusive_group()
    causal.add_argument("--causal", dest="causal", action="store_const", const=[True],
                        help="only causal attention (bottom-right aligned) (default: both)")
    causal.add_argument("--no-causal", dest="causal", action="store_const", const=[False],
                        help="only non-causal attention (default: both; decode is always non-causal)")
    what.add_argument("--threads", nargs="+", metavar="T", type=_list_of(positive_int),
                      help="thread counts, capped at the CPUs this process may use; several print "
                           "a scaling table (default: OMP_NUM_THREADS or the usable CPUs, here "
                           f"{min(default_threads(), usable_cpus())})")
    families = fa2cpu.ISA_FAMILIES
    what.add_argument("--isa", nargs="+", metavar="FAMILY", type=_list_of(_choice("isa", families + ("auto", "all"))),
                      help=f"fa2cpu kernel families, from {', '.join(families)}; 'auto' = "
                           "the one fa2cpu picks, 'all' = every usable one (default: auto)")
    what.add_argument("--baselines", nargs="+", metavar="NAME",
                      type=_list_of(_choice("baseline", peers.BASELINES + ("none",))),
                      help="numpy: naive attention (skipped when its scores exceed --numpy-max-mib); "
                           "torch: SDPA, when importable; none (default: numpy torch)")
    what.add_argument("--numpy-max-mib", type=positive_int, metavar="MIB", default=DEFAULT_NUMPY_MAX_MIB,
                      help="skip the NumPy baseline when its fp32 score matrix exceeds this many MiB "
                           "(default: %(default)s)")
    what.add_argument("--no-check", dest="check", action="store_false",
                      help="skip the correctness check (default: check every result against the "
                           "first baseline, or an untimed NumPy reference)")
    timing = p.add_argument_group("timing and output")
    timing.add_argument("--budget-s", type=at_least(float, 0.0, "a number >= 0"), metavar="S",
                        help="leave out cases predicted (from the cases measured so far) to end the "
                             "run later than S seconds after its start; the first length of each "
                             "mode always runs; 0 = no limit (default: "
                             f"{DEFAULT_BUDGET_S:g} for the default lengths, no limit for --seqlen)")
    timing.add_argument("--repeat", type=positive_int, metavar="R", default=DEFAULT_REPEAT,
                        help="timed samples per measurement; the median is reported (default: %(default)s)")
    timing.add_argument("--warmup", type=_nonnegative_int, metavar="W", default=DEFAULT_WARMUP,
                        help="untimed calls before timing, lasting at least 50 ms when W > 0 "
                             "(default: %(default)s)")
    timing.add_argument("--seed", type=_nonnegative_int, metavar="S", default=0,
                        help="seed of the random inputs (default: %(default)s)")
    timing.add_argument("--json", metavar="FILE", help="write every measurement as JSON (schema below) "
                                                       "(default: none)")
    timing.add_argument("--plot", metavar="FILE.png",
                        help="write a plot (any format matplotlib writes: png, svg, pdf, ...); needs "
                             "matplotlib: pip install 'fa2cpu[bench]' (default: none)")
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
    """Parse and validate; errors exit with status 2 and a one-line message (argparse style).
    `notes` collects what the arguments were changed to (printed with the tables)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    args.notes = []
    args.mode_given = bool(args.mode)
    args.mode = _flatten(args.mode, DEFAULT_MODES)
    args.dtype = _flatten(args.dtype, DEFAULT_DTYPES)
    args.seqlen = _flatten(args.seqlen, ())
    args.kv_dtype = [None] + [k for k in _flatten(args.kv_dtype, ("same",)) if k != "same"]
    if len(args.kv_dtype) > 1 and "decode" not in args.mode:
        args.notes.append(f"--kv-dtype {' '.join(args.kv_dtype[1:])}: applies to decode only (not in --mode here)")
    given = bool(args.threads)
    threads = sorted(_flatten(args.threads, (default_threads(),)))
    cpus = usable_cpus()
    args.threads = sorted({min(t, cpus) for t in threads})
    if max(threads) > cpus:
        source = f"--threads {' '.join(map(str, threads))}" if given else f"{threads[0]} threads (OpenMP's default)"
        args.notes.append(f"{source}: capped at {cpus}, the CPUs this process may use (more threads would only "
                          "time oversubscription)")
    args.causal = args.causal or [False, True]
    baselines = _flatten(args.baselines, peers.BASELINES)
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
    chosen = []
    for isa in _flatten(args.isa, ("auto",)):
        if isa == "all":
            chosen += usable
        elif isa == "auto":
            chosen.append(fa2cpu.get_isa())
        elif isa not in usable:
            parser.error(f"--isa {isa}: not usable on this machine (usable: {', '.join(usable)})")
        else:
            chosen.append(isa)
    args.isa = list(dict.fromkeys(chosen))
    if args.head_dim > MAX_HEAD_DIM:
        parser.error(f"--head-dim {args.head_dim}: fa2cpu takes head dims 1 to {MAX_HEAD_DIM}")
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path is None:
            continue
        if not path.strip():
            parser.error(f"{option}: empty file name")
        if os.path.isdir(path):
            parser.error(f"{option} {path}: is a folder; give a file name")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.access(folder, os.W_OK):
            parser.error(f"{option} {path}: cannot write into {folder} (missing or read-only)")
    if args.json and args.plot and os.path.abspath(args.json) == os.path.abspath(args.plot):
        parser.error(f"--json and --plot name the same file {args.json}: the plot would overwrite the JSON")
    if args.plot:
        try:
            check_plot_path(args.plot)
        except PlotError as e:
            parser.error(f"--plot {args.plot}: {e}")
    return args


def sweep_plan(args) -> tuple[list[str], dict[str, tuple[int, ...]], set[str], float]:
    """What the sweep will run, in words (one line per mode), each mode's length ladder, the
    modes the budget may trim, and the budget (0: none)."""
    lines, ladders, trimmable = [], {}, set()
    budget = DEFAULT_BUDGET_S if args.budget_s is None else args.budget_s
    for mode in args.mode:
        ladder, source = mode_lengths(args, mode)
        ladders[mode] = ladder
        if args.budget_s is not None or source == "default":
            trimmable.add(mode)
        batch, heads, kv = mode_shape(args, mode)
        n = "Nk" if mode == "decode" else "N"
        text = (f"{mode} B={batch} Hq={heads} Hk={kv} D={args.head_dim}, "
                f"{n} = {', '.join(map(str, ladder))} ({source}")
        if mode in trimmable and budget and len(ladder) > 1:
            text += f"; beyond {n}={ladder[0]} only while --budget-s {budget:g} lasts"
        lines.append(text + ")")
        if mode == "decode" and args.seqlen and source == "default":
            args.notes.append("--seqlen applies to prefill here, not to decode (name decode in --mode "
                              "or use --seqlen-k to set the decode cache length)")
    if not any(m in trimmable for m in args.mode):
        budget = 0.0
    return lines, ladders, trimmable, budget


def _print(write) -> None:
    """Runs `write` (prints to stdout); if the reader has gone (`fa2cpu-bench | head`), later output
    goes nowhere and the run goes on: its --json and --plot files still get what was measured."""
    try:
        write()
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """The command: exit status 0, 1 (a failed check or error row, or output not written), 2 (bad
    arguments), 130 (interrupted; during the sweep with the partial results)."""
    try:
        return _run(argv)
    except KeyboardInterrupt:  # before the sweep (torch's import, the probes) or after it
        print("fa2cpu-bench: interrupted", file=sys.stderr)
        return 130


def _run(argv: list[str] | None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    torch = peers.import_torch() if "torch" in args.baselines else None
    machine = machine_info(torch)
    probes = Probes(machine)
    if "torch" in args.baselines and torch is None:
        args.baselines.remove("torch")
        probes.note("torch baseline skipped: torch is not installed (pip install torch)")
    plan, ladders, trimmable, budget = sweep_plan(args)
    for text in args.notes:   # printed under the plan and again among the footnotes
        probes.note(text)
        plan.append(f"note: {text}")
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
        _print(lambda: print(format_header(machine, sweep, args.dtype, plan), flush=True))
    records: list[Record] = []
    skipped = []
    interrupted = False
    try:
        if args.warmup:
            peers.warm_up(args.isa, args.dtype, args.threads, torch)
        order = budget_order(cases, ladders) if budget else cases
        skipped = run_sweep(sweep, order, budget, start, records,
                            trimmable=lambda c: c.mode in trimmable)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        sweep.progress.close()
        fa2cpu.set_isa(default_isa)
    records.sort(key=lambda r: cases.index(r.case))
    if skipped:
        left_out = ", ".join(f"{c.mode} {'Nk' if c.mode == 'decode' else 'N'}={c.x_value} {c.dtype}"
                             + " causal" * c.causal for c in sorted(skipped, key=cases.index))
        probes.note(f"--budget-s {budget:g}: left out {left_out}, predicted to run past the budget; "
                    "--budget-s 0 runs every length")
    add_speedups(records)
    _print(lambda: print_report(records, args.baselines, probes.notes))
    if not args.quiet:
        _print(lambda: print(f"\nfa2cpu-bench: {len(records)} rows in {time.perf_counter() - start:.0f} s", flush=True))
    argv_used = sys.argv[1:] if argv is None else list(argv)
    written = True
    if args.json:
        try:
            write_json(args.json, records, machine, argv_used, interrupted)
            _print(lambda: print(f"\nwrote {len(records)} records to {args.json}"))
        except OSError as e:
            print(f"fa2cpu-bench: cannot write {args.json}: {e}", file=sys.stderr)
            written = False
    if args.plot and records:
        try:
            write_plot(args.plot, records, machine)
            _print(lambda: print(f"wrote plot to {args.plot}"))
        except (PlotError, OSError) as e:
            print(f"fa2cpu-bench: no plot: {e}", file=sys.stderr)
            written = False
    if interrupted:
        print("fa2cpu-bench: interrupted; results above are partial", file=sys.stderr)
        return 130
    failed = any(r.check == "FAIL" or r.status == "error" for r in records)
    return 1 if failed or not written else 0
