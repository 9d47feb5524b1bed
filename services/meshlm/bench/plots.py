"""PNG plots of a concurrency sweep (`make bench-peers BENCH_ARGS=--sweep`).

`write_plots` draws two charts from the results kept per (server, concurrency): output tokens/s
and TTFT p50, each by concurrency, one line per server. The x axis is log2 with a tick at every
measured concurrency; the TTFT axis is log10 as well, since waiting time grows with the queue
by orders of magnitude. matplotlib runs on its Agg backend (files only, no display); it comes
with the bench extra, and a caller without it gets the ImportError of this module's import.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: render to files, never open a window

import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen
from matplotlib.ticker import FixedLocator, LogFormatter, NullLocator  # noqa: E402

from meshlm.bench.engine import Result  # noqa: E402

THROUGHPUT_PNG = "peers-throughput.png"
TTFT_PNG = "peers-ttft.png"


def write_plots(series: Mapping[str, Mapping[int, Result]], out_dir: Path,
                title: str) -> list[Path]:
    """Write the throughput and TTFT p50 charts into `out_dir` (made if missing) and return
    their paths. `series` maps a server's label to its results by concurrency; a server
    without a result at some concurrency (skipped, failed) has no point there. `title` heads
    both charts (the model and the thread count)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    concurrencies = sorted({c for by_c in series.values() for c in by_c})
    charts: list[tuple[str, str, Callable[[Result], float | None], bool]] = [
        (THROUGHPUT_PNG, "output tokens/s", lambda r: r.throughput, False),
        (TTFT_PNG, "TTFT p50 (ms, log scale)", lambda r: r.ttft_ms(50), True),
    ]
    paths = []
    for name, ylabel, value, log_y in charts:
        path = out_dir / name
        _chart(series, concurrencies, value, ylabel, log_y, title, path)
        paths.append(path)
    return paths


def _chart(series: Mapping[str, Mapping[int, Result]], concurrencies: list[int],
           value: Callable[[Result], float | None], ylabel: str, log_y: bool, title: str,
           path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    try:
        for label, by_c in series.items():
            points = [(c, v) for c in sorted(by_c) if (v := value(by_c[c])) is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(concurrencies))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(c) for c in concurrencies])
        if len(concurrencies) == 1:  # one tick: give the log axis some width around it
            ax.set_xlim(concurrencies[0] / 2, concurrencies[0] * 2)
        if log_y:  # ticks as plain numbers (200, 300), not 2 x 10^2
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(LogFormatter())
            ax.yaxis.set_minor_formatter(LogFormatter(minor_thresholds=(2, 0.5)))
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_title(textwrap.fill(title, 90), fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        ax.grid(True, which="minor", alpha=0.1)
        if ax.get_lines():
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
