"""--plot: GFLOP/s (decode: GB/s) against sequence length, and thread scaling, with matplotlib
(an optional dependency: pip install 'fa2cpu[bench]'). The file name is checked before the sweep."""
from __future__ import annotations

import math
import os

from .cases import MODES
from .sweep import Record

INSTALL_HINT = "pip install 'fa2cpu[bench]'"


class PlotError(Exception):
    """A plot that cannot be written (reported in one line)."""


def check_plot_path(path: str) -> None:
    """Fail before the sweep, not after it: matplotlib must import and know the file's format."""
    try:
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
