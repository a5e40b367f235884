"""Where benchmarks put what they measured: JSON under bench/results/ and, with matplotlib, a PNG;
the summary tables they print last."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Callable, Sequence, TextIO

from strata.env import ENV
from strata.kernels import choices


def save(info: dict, out: str, draw: Callable[[Any, dict], None] | None) -> None:
    """Writes `info` to `out` (JSON), with the STRATA_* switches set (`strata_env`) and the kernel choices
    in force (`kernel_choices`: an engine with `quant_decode="dp4a"` measures another kernel than the
    default), and, when matplotlib is installed and `draw` is given, `draw(plt, info)` beside it."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({**info, "strata_env": ENV.set_in_environment(),
                   "kernel_choices": dataclasses.asdict(choices.current())}, f, indent=1)
    print(f"wrote {out}")
    if draw is None:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    draw(plt, info)
    png = out.replace(".json", ".png")
    plt.gcf().tight_layout()
    plt.savefig(png, dpi=120)
    plt.close("all")
    print(f"wrote {png}")


def summary_table(title: str, columns: Sequence[tuple[str, str, str]], rows: Sequence[dict]) -> Any:
    """A rich Table of `rows`, one column per (header, row key, format spec; "" for text) that some row has a
    value for (so arms that did not run, e.g. HF under --no-hf, leave no empty column)."""
    from rich.table import Table

    shown = [c for c in columns if any(r.get(c[1]) is not None for r in rows)]
    table = Table(title=title, title_justify="left")
    for header, _, spec in shown:
        table.add_column(header, justify="left" if not spec else "right")
    for r in rows:
        table.add_row(*("—" if r.get(key) is None else format(r[key], spec) for _, key, spec in shown))
    return table


def print_tables(tables: Sequence[Any], file: TextIO | None = None) -> None:
    """Prints the tables (to stdout by default). Off a terminal rich would fold them to 80 columns;
    they get the width they need instead, so logs keep one row per line."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(file=file or sys.stdout)
    if not console.is_terminal:
        unbounded = console.options.update_width(10_000)
        needed = max((Measurement.get(console, unbounded, t).maximum for t in tables), default=console.width)
        console = Console(file=file or sys.stdout, width=max(console.width, needed))
    for t in tables:
        console.print(t)
